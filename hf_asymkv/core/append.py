"""Where the core meets the append kernel (:mod:`hf_asymkv.kernels.append`): whether a flush runs it
(``HF_ASYMKV_APPEND_BACKEND``), a :class:`~hf_asymkv.core.quant.QuantSpec` as the kernel's format, and the kernel
path of the two places blocks are stored: the dynamic store's :meth:`~hf_asymkv.core.store.QuantizedBlocks.append`
and the static store's :meth:`~hf_asymkv.core.static_store.StaticTensorStore.store_blocks`.

On the kernel path a flush is one launch per tensor kind that writes codes, scales, zeros and wide channels straight
into the store's buffers, and no host synchronization: the non-finite elements are added to a counter on the device,
read when the layer's ``stats`` are (:func:`take_counts`). One difference from the dynamic torch path: that one
widens a store's metadata to float32 when a block's range would overflow float16 (a host check per flush); the
kernel path keeps the metadata dtype and saturates such groups (as the static store always does), counting them in
``stats()["saturated_metadata_groups"]``.
"""

from __future__ import annotations

import torch

from ..kernels.append import APPEND_ENV_VAR, BlockFormat, requested_append_backend, unserved
from ..kernels.backend import INSTALL_HINT, triton_problem, triton_version
from .packing import plane_widths
from .quant import TWO_MEANS_STEPS, QuantSpec, storage_offset

__all__ = ["block_format", "choose_kernel", "store_dynamic", "store_slots", "take_counts", "uses_kernel"]

COUNTERS = ("nonfinite_values", "saturated_metadata_groups")
"""What the kernel counts on the device, in the order of a store's ``counts`` tensor."""


def block_format(spec: QuantSpec, head_dim: int) -> BlockFormat:
    """``spec``'s blocks of ``head_dim`` channels as the kernel's :class:`~hf_asymkv.kernels.append.BlockFormat`."""
    wider = spec.bits + 1  # the wide channels' code (a symmetric one keeps its offset of half its range)
    return BlockFormat(
        bits=spec.bits, fp8=spec.fmt.removeprefix("fp8_") if spec.is_float else None, symmetric=spec.symmetric,
        qmax=spec.qmax, offset=storage_offset(spec), granularity=spec.granularity, group_size=spec.groups(head_dim)[1],
        block_size=spec.block_size, meta_dtype=spec.scale_dtype, planes=plane_widths(spec.bits),
        tokens_layout=spec.layout == "tokens", rotated=spec.rotated, wide=spec.wide_count(head_dim),
        wide_qmax=float(2 ** (wider - 1) - 1 if spec.symmetric else 2**wider - 1),
        wide_offset=2 ** (wider - 1) if spec.symmetric else 0, two_means_steps=TWO_MEANS_STEPS)


def uses_kernel(x: torch.Tensor, spec: QuantSpec) -> bool:
    """Whether the blocks ``x`` ``[B, H, m, D]`` of ``spec`` are quantized by the kernel (see
    :mod:`hf_asymkv.kernels.append` for ``HF_ASYMKV_APPEND_BACKEND``).

    Raises:
        ImportError, ValueError: as :func:`choose_kernel`.
    """
    backend = requested_append_backend()
    if backend == "torch" or backend == "auto" and x.device.type != "cuda":  # the CPU path stays as cheap as it was
        return False
    # The wide-channel variant (compact, tight, max keys) did not finish compiling for sm_90 in 45 minutes of ptxas
    # on this project's CPU machine (the [D, D] channel ranking at 16 warps); until its compile time is measured on
    # a GPU, auto keeps those blocks on the torch path (HF_ASYMKV_APPEND_BACKEND=triton still forces the kernel).
    if backend == "auto" and spec.wide_count(x.shape[-1]):
        return False
    return choose_kernel(backend, x.device, torch.compiler.is_compiling(),
                         unserved(block_format(spec, x.shape[-1]), x.shape[-1]), spec.fmt)


def choose_kernel(backend: str, device: torch.device, compiling: bool, problem: str | None, what: str) -> bool:
    """The kernel (True) or the torch path for blocks on ``device`` that the kernel cannot serve for ``problem`` (a
    phrase, None when it can), under ``backend`` (``auto``: the kernel on CUDA in eager code when it can; ``triton``:
    the kernel or an error; ``torch``). ``what``: the blocks' format, for the error message.

    Raises:
        ImportError: ``triton`` and Triton is not installed.
        ValueError: ``triton`` and the kernel cannot serve the blocks (the message says why).
    """
    if backend == "torch" or backend == "auto" and (device.type != "cuda" or compiling):
        return False
    problem = triton_problem(device) or problem
    if problem is None and compiling and device.type != "cuda":
        problem = "a compiled graph on CPU tensors (the interpreter runs eagerly only)"
    if backend == "auto":
        return problem is None
    if problem is not None:
        error = ImportError if triton_version() is None else ValueError
        hint = f" ({INSTALL_HINT})" if triton_version() is None else ""
        raise error(f"{APPEND_ENV_VAR}=triton cannot quantize these {what} blocks: {problem}{hint}. Unset it (or "
                    "set 'auto') to fall back to the torch path.")
    return True


def store_dynamic(blocks, x: torch.Tensor, scale: torch.Tensor | None) -> None:
    """:meth:`~hf_asymkv.core.store.QuantizedBlocks.append` on the kernel: grow ``blocks``' buffers by the rows of
    ``x`` ``[B, H, m, D]`` (m a multiple of the block size) and have one launch write them; ``scale`` as there."""
    spec = blocks.spec
    b, h, m, d = x.shape
    fmt = block_format(spec, d)
    tg, cg = spec.groups(d)
    bs, growth, step = spec.block_size, blocks.growth, blocks.max_step

    def rows(buf, n: int, width: int, dtype: torch.dtype, multiple: int, max_step: int) -> torch.Tensor:
        return buf.extend(n, x.new_empty(b, h, 0, width, dtype=dtype), growth, multiple, max_step)

    meta_step = max(1, step // tg)  # as the torch path grows them: max_step rows of codes per growth
    codes = rows(blocks.codes, m, spec.packed_dim(d), spec.code_dtype, bs, step)
    scales = rows(blocks.scales, m // tg, d // cg, spec.scale_dtype, 1, meta_step)
    zeros = None if spec.symmetric else rows(blocks.zeros, m // tg, d // cg, spec.scale_dtype, 1, meta_step)
    wide_bits = wide_channels = None
    if fmt.wide:
        wide_bits = rows(blocks.wide_bits, m, -(-fmt.wide // 8), torch.uint8, bs, step)
        wide_channels = rows(blocks.wide_channels, m // bs, fmt.wide, torch.uint8, 1, max(1, step // bs))
    # counted into fresh zeros and added by assignment: an interrupted flush leaves the store's counters as they were
    # (hf_asymkv.core.rollback); a small add per flush, not per step
    counts = torch.zeros(len(COUNTERS), dtype=torch.long, device=x.device)
    from ..kernels.append import launch_append

    launch_append(x, fmt, codes=codes, scales=scales, zeros=zeros, counts=counts, wide_bits=wide_bits,
                  wide_channels=wide_channels, calibrated=scale)
    blocks.device_counts = counts if blocks.device_counts is None else blocks.device_counts + counts


def store_slots(store, x: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, scale: torch.Tensor | None
                ) -> torch.Tensor:
    """:meth:`~hf_asymkv.core.static_store.StaticTensorStore.store_blocks` on the kernel: quantize the blocks of ``x``
    ``[B, H, F * bs, D]`` and write block ``f`` into slot ``targets[f]`` where ``valid[f]``, one launch.

    Returns:
        the number of non-finite elements stored (0-d, on the device).
    """
    counts = torch.zeros(len(COUNTERS), dtype=torch.long, device=x.device)
    from ..kernels.append import launch_append

    launch_append(x, block_format(store.spec, x.shape[-1]), codes=store.codes, scales=store.scales, zeros=store.zeros,
                  counts=counts, wide_bits=store.wide_bits, wide_channels=store.wide_channels, calibrated=scale,
                  slots=targets, valid=valid)
    return counts[0]


def take_counts(blocks) -> dict[str, int]:
    """What the kernel counted in a dynamic store's blocks since the last call (read from the device: a host sync, so
    only when statistics are asked for), its counters then zeroed. Empty when the kernel never ran there."""
    counts = blocks.device_counts
    if counts is None:
        return {}
    values = counts.tolist()
    counts.zero_()
    return {name: n for name, n in zip(COUNTERS, values) if n}
