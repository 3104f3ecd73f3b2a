"""Quantizing a cache's blocks in one launch: the Triton append kernel's format, what it serves, its backend switch
and its launcher (:mod:`.triton_append` holds the kernel).

``HF_ASYMKV_APPEND_BACKEND`` (read at every flush) picks who quantizes and packs a flushed block:

- ``auto`` (default): the kernel for CUDA tensors in eager code when Triton is installed and the format is served
  (keys with wide channels excepted until their compile time is measured on a GPU), the torch path otherwise (CPU tensors, compiled graphs: inductor fuses the torch path itself);
- ``triton``: the kernel, or an error saying why it cannot (CPU tensors run it under Triton's interpreter with
  ``TRITON_INTERPRET=1``: that is how it is tested without a GPU; in a compiled graph on a GPU it is the custom
  operator ``hf_asymkv::append_blocks``);
- ``torch``: the torch path (:func:`hf_asymkv.core.store.encode_blocks`).

This module imports neither Triton (only :func:`launch_append` does) nor the core: the core describes a spec as a
:class:`BlockFormat` (:mod:`hf_asymkv.core.append`).
"""

from __future__ import annotations

import dataclasses
import json
import math

import torch

from . import env_choice
from .once import computed_once

__all__ = ["APPEND_BACKENDS", "APPEND_ENV_VAR", "BlockFormat", "launch_append", "requested_append_backend", "unserved"]

APPEND_ENV_VAR = "HF_ASYMKV_APPEND_BACKEND"
APPEND_BACKENDS = ("auto", "triton", "torch")
_META = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_FP8 = {None: 0, "e4m3": 1, "e5m2": 2}


def requested_append_backend() -> str:
    """The backend ``HF_ASYMKV_APPEND_BACKEND`` names (``auto`` when unset or empty), read at every call.

    Raises:
        ValueError: a value outside :data:`APPEND_BACKENDS`.
    """
    return env_choice(APPEND_ENV_VAR, APPEND_BACKENDS, "an append backend")


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """How one tensor kind's blocks are stored, as plain numbers (the core's ``QuantSpec`` for one head_dim).

    Attributes:
        bits: code width (1 to 8); ``fp8``: ``"e4m3"`` or ``"e5m2"`` for float codes, else None.
        symmetric, qmax, offset: integer codes in ``[-qmax, qmax]`` (stored plus ``offset``) or ``[0, qmax]``.
        granularity: ``"channel"`` (a scale per channel per block), ``"token"`` (per token per ``group_size``
            channels) or ``"tensor"``; ``group_size``: channels sharing a scale (1 per channel).
        block_size: tokens quantized (and token-packed) as one unit.
        meta_dtype: the scales' and zeros' dtype.
        planes: bit-plane set widths of sub-byte codes (low first); ``tokens_layout``: packed along each block's
            tokens (else along head_dim).
        rotated: quantize ``x @ H`` (Walsh-Hadamard over head_dim).
        wide, wide_qmax, wide_offset: wide channels per block and their one-bit-wider code (0: none).
        two_means_steps: Lloyd steps of 1-bit codes.
    """

    bits: int
    fp8: str | None
    symmetric: bool
    qmax: float
    offset: int
    granularity: str
    group_size: int
    block_size: int
    meta_dtype: torch.dtype
    planes: tuple[int, ...]
    tokens_layout: bool
    rotated: bool = False
    wide: int = 0
    wide_qmax: float = 0.0
    wide_offset: int = 0
    two_means_steps: int = 0

    def to_json(self) -> str:
        """The format as a string (how the custom operator takes it)."""
        fields = dataclasses.asdict(self)
        fields["meta_dtype"] = str(self.meta_dtype).removeprefix("torch.")
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> BlockFormat:
        fields = json.loads(text)
        fields["meta_dtype"] = getattr(torch, fields["meta_dtype"])
        fields["planes"] = tuple(fields["planes"])
        return cls(**fields)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def unserved(fmt: BlockFormat, head_dim: int) -> str | None:
    """What of ``fmt`` (blocks of ``head_dim`` channels) the kernel does not serve, as a phrase; None when it serves
    it. Tiles are powers of two: other head_dims, block sizes and group sizes stay on the torch path."""
    if fmt.granularity == "tensor":
        return "'tensor' granularity (one scale across every head of a block)"
    if not (_power_of_two(head_dim) and 16 <= head_dim <= 256):
        return f"head_dim={head_dim} (the kernel takes powers of two from 16 to 256)"
    if not (_power_of_two(fmt.block_size) and 2 <= fmt.block_size <= 256):
        return f"blocks of {fmt.block_size} tokens (the kernel takes powers of two from 2 to 256)"
    if fmt.granularity == "token" and not _power_of_two(fmt.group_size):
        return f"groups of {fmt.group_size} channels (the kernel takes powers of two)"
    if fmt.meta_dtype not in _META:
        return f"{fmt.meta_dtype} scales"
    return None


def launch_append(x: torch.Tensor, fmt: BlockFormat, *, codes: torch.Tensor, scales: torch.Tensor,
                  zeros: torch.Tensor | None, counts: torch.Tensor, wide_bits: torch.Tensor | None = None,
                  wide_channels: torch.Tensor | None = None, calibrated: torch.Tensor | None = None,
                  slots: torch.Tensor | None = None, valid: torch.Tensor | None = None, first_slot: int = 0) -> None:
    """Quantize the ``F = m // block_size`` blocks of ``x`` ``[B, H, m, D]`` and write them, one launch.

    Block ``f`` goes to slot ``slots[f]`` where ``valid[f]`` (a static store's targets; an invalid block writes
    nothing and counts nothing), or to slot ``first_slot + f`` (rows of a dynamic store's buffers). Slot ``s`` is
    rows ``[s * bs, (s + 1) * bs)`` of ``codes`` ``[B, H, *, D * bits / 8]`` (bytes, int8 or fp8: written as bytes;
    each block's rows contiguous) and ``wide_bits`` ``[B, H, *, ceil(R / 8)]``, rows ``[s * bs / tg, ...)`` of
    ``scales`` and ``zeros`` ``[B, H, *, D / group_size]`` (``tg`` = 1 for per-token groups, ``bs`` otherwise),
    row ``s`` of ``wide_channels`` ``[B, H, *, R]``. ``calibrated``: a symmetric scale ``[B, H, F, D]`` to use
    instead of the measured one. ``counts`` (int64 ``[2]``) gets the non-finite elements and the metadata groups that
    saturated added to it.

    Raises:
        ValueError: a format :func:`unserved` names, or buffers whose rows are not laid out as the kernel writes.
    """
    b, h, m, d = x.shape
    problem = unserved(fmt, d)
    if problem is None and (codes.stride(-1) != 1 or codes.stride(-2) != codes.shape[-1]):
        problem = "codes whose rows are not contiguous"
    if problem is None and fmt.wide and (wide_bits.stride(-1) != 1 or wide_channels.stride(-1) != 1):
        problem = "wide channels whose last axis is not contiguous"
    if problem is not None:
        raise ValueError(f"the append kernel cannot quantize these blocks: {problem}.")
    if torch.compiler.is_compiling():
        _custom_op()(x, codes, scales, zeros, counts, wide_bits, wide_channels, calibrated, slots, valid, first_slot,
                     fmt.to_json())
    else:
        from .triton_append import append_blocks_kernel

        _launch(append_blocks_kernel, x, fmt, codes, scales, zeros, counts, wide_bits, wide_channels, calibrated,
                slots, valid, first_slot, {"enable_fp_fusion": False})


def _launch(kernel, x, fmt, codes, scales, zeros, counts, wide_bits, wide_channels, calibrated, slots, valid,
            first_slot, options) -> None:
    b, h, m, d = x.shape
    bs = fmt.block_size
    finfo = torch.finfo(fmt.meta_dtype)
    unused = counts  # any tensor: a pointer the kernel does not read (its constexprs switch the part off)

    def strides(t: torch.Tensor | None, n: int) -> tuple:
        return (unused,) + (0,) * n if t is None else (t,) + t.stride()[:n]

    planes = fmt.planes + (0,)
    byte_codes = codes.view(torch.uint8)  # int8 and fp8 codes are written as their bytes
    kernel[(b * h, m // bs)](
        *strides(x, 4), *strides(calibrated, 4), *strides(byte_codes, 3), *strides(scales, 4), *strides(zeros, 4),
        *strides(wide_bits, 3), *strides(wide_channels, 3),
        unused if slots is None else slots, unused if valid is None else valid.view(torch.uint8), first_slot,
        counts, h,
        BS=bs, D=d, BITS=fmt.bits, FP8=_FP8[fmt.fp8], SYMMETRIC=fmt.symmetric, QMAX=fmt.qmax, OFFSET=fmt.offset,
        TOKEN_GROUPS=fmt.granularity == "token", CG=fmt.group_size, META=_META[fmt.meta_dtype], TINY=finfo.tiny,
        MAX=finfo.max, TOKENS_LAYOUT=fmt.tokens_layout, W0=planes[0], W1=planes[1], ROTATED=fmt.rotated,
        ROT_SCALE=1 / math.sqrt(d), CALIBRATED=calibrated is not None, STEPS=fmt.two_means_steps, WIDE=fmt.wide,
        WIDE_QMAX=fmt.wide_qmax, WIDE_OFFSET=fmt.wide_offset, SLOTS=slots is not None,
        num_warps=_warps(bs, d, fmt.wide), **options)


def _warps(block_size: int, head_dim: int, wide: int) -> int:
    """Warps per program: about 32 elements of the block (and of the wide channels' ``[D, D]`` ranking) per thread."""
    elements = max(block_size * head_dim, head_dim * head_dim if wide else 0)
    return max(4, min(16, elements // 1024))


@computed_once  # process-wide, guarded: two threads defining the operator at once would register it twice
def _custom_op():
    """``hf_asymkv::append_blocks``: the kernel as an operator a compiled graph keeps (defined on first use: it
    imports Triton)."""
    from torch.library import triton_op, wrap_triton

    from .triton_append import append_blocks_kernel

    @triton_op("hf_asymkv::append_blocks",
               mutates_args={"codes", "scales", "zeros", "counts", "wide_bits", "wide_channels"})
    def append_blocks(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                      counts: torch.Tensor, wide_bits: torch.Tensor | None, wide_channels: torch.Tensor | None,
                      calibrated: torch.Tensor | None, slots: torch.Tensor | None, valid: torch.Tensor | None,
                      first_slot: int, fmt: str) -> None:
        _launch(wrap_triton(append_blocks_kernel), x, BlockFormat.from_json(fmt), codes, scales, zeros, counts,
                wide_bits, wide_channels, calibrated, slots, valid, first_slot, {})

    return append_blocks
