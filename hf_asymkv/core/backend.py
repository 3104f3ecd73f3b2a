"""The fused attention's backend for one call, and the translation of a layer's stored K/V into the kernels' plain
arguments (:mod:`hf_asymkv.kernels`): the only place where the core meets the attention kernels.

``HF_ASYMKV_ATTENTION_BACKEND`` (:mod:`hf_asymkv.kernels.backend`) picks ``torch`` (:func:`~.attention.fused_attention`),
``triton`` or ``native`` (the C kernel on CPU, :mod:`hf_asymkv.kernels.cpu_attention`); ``auto`` takes Triton for CUDA
tensors and the native kernel for CPU tensors when they can serve the call.
"""

from __future__ import annotations

import torch

from ..kernels import cpu_attention
from ..kernels.backend import choose_backend, requested_backend, use_native
from ..kernels.regions import ExactSegment, QuantizedRegion, StoredCodes, unsupported
from .kv_view import write_rows
from .packing import plane_widths
from .quant import storage_offset
from .rotation import hadamard_block

__all__ = ["kernel_regions", "native_fused_attention", "triton_fused_attention"]


def _stored(kv) -> StoredCodes:
    """The quantized part of a :class:`~hf_asymkv.core.kv_view.QuantizedKV` as the kernel reads it (the typed codes
    say how they were packed)."""
    codes = kv.codes
    wide = kv.wide
    return StoredCodes(codes.data, kv.scale, kv.zero, codes.bits, kv.spec.symmetric, codes.layout, codes.block_size,
                       kv.spec.rotated, None if wide is None else wide.bits, None if wide is None else wide.channels)


def _call_mask(attention_mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int,
               device: torch.device) -> torch.Tensor:
    """The call's mask as ``[B, 1|Hq, q, kv]`` (bool or additive), a causal bool one when transformers passed none."""
    if attention_mask is None:
        rows = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
        attention_mask = (torch.arange(kv_len, device=device)[None, :] <= rows)[None, None]
    mask = attention_mask[..., -kv_len:]
    return mask.expand(batch, *mask.shape[1:])


def _overlay_masks(mask: torch.Tensor, overlay, ns: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(quantized region's mask [B, *, q, n], overlay's mask [B, *, q, S])``: the overlaid positions leave the
    quantized stream, and the overlay's exact tokens take their mask columns (slots outside the region: blocked)."""
    blocked = False if mask.dtype == torch.bool else float("-inf")
    quant_mask = mask[..., ns : ns + n].clone()
    write_rows(quant_mask, 3, overlay.positions - ns, overlay.valid, blocked)
    index = overlay.positions.clamp(0, mask.shape[-1] - 1)[:, None, None, :]
    sink_mask = mask.gather(3, index.expand(*mask.shape[:3], index.shape[-1]))
    sink_mask = sink_mask.masked_fill(~overlay.valid[:, None, None, :], blocked)
    return quant_mask, sink_mask


def kernel_regions(key, value, attention_mask: torch.Tensor | None = None, q_len: int = 1
                   ) -> tuple[QuantizedRegion, tuple[ExactSegment, ...]]:
    """``[prefix][codes][tail]`` of a layer's :class:`~hf_asymkv.core.kv_view.QuantizedKV` keys and values as one
    quantized region and its exact segments, at their mask columns.

    Left-padded rows' exact sinks (``key.overlay``) are served through masks: their positions are masked out of the
    quantized region, and they join the exact prefix as one segment with its own mask slice (``attention_mask``
    ``[B|1, 1|Hq, q_len, kv]``, or None for the causal mask), so the kernel reads at most two exact segments.
    """
    ns, n = key.n_prefix, key.n_quantized
    overlay = key.overlay if n else None
    tail = ExactSegment(key.tail, value.tail, ns + n)
    if overlay is None:
        segments = (ExactSegment(key.prefix, value.prefix, 0), tail) if ns else (tail,)
        return QuantizedRegion(_stored(key), _stored(value), start=ns), segments
    mask = _call_mask(attention_mask, key.tail.shape[0], q_len, key.shape[2], key.tail.device)
    quant_mask, sink_mask = _overlay_masks(mask, overlay, ns, n)
    exact_k, exact_v, exact_mask = overlay.tokens, value.overlay.tokens, sink_mask
    if ns:
        exact_k, exact_v = torch.cat([key.prefix, exact_k], 2), torch.cat([value.prefix, exact_v], 2)
        exact_mask = torch.cat([mask[..., :ns], sink_mask], 3)
    return (QuantizedRegion(_stored(key), _stored(value), mask=quant_mask),
            (ExactSegment(exact_k, exact_v, mask=exact_mask), ExactSegment(key.tail, value.tail, mask=mask[..., ns + n :])))


def triton_fused_attention(query: torch.Tensor, key, value, attention_mask: torch.Tensor | None, scaling: float,
                           refused: str | None) -> torch.Tensor | None:
    """The fused attention on the Triton kernel (``[B, q, Hq, D]``) when ``HF_ASYMKV_ATTENTION_BACKEND`` and the
    request say so, else None (the caller then takes the torch implementation).

    Args:
        query: ``[B, Hq, q, D]``; key, value: a layer's :class:`~hf_asymkv.core.kv_view.QuantizedKV`.
        refused: a feature of the call that no fused path serves (``"attention with sliding_window"``, ...), or None.

    Raises:
        ImportError, ValueError: ``HF_ASYMKV_ATTENTION_BACKEND=triton`` and the kernel cannot serve the call
            (see :func:`hf_asymkv.kernels.backend.choose_backend`), or an unknown backend name.
    """
    backend = requested_backend()
    if backend == "torch" or backend == "auto" and query.device.type != "cuda":  # the default CPU path stays as cheap
        return None
    region, segments = kernel_regions(key, value, attention_mask, query.shape[2])
    if choose_backend(query.device, refused or unsupported(query, region, segments)) != "triton":
        return None
    from ..kernels import decode  # imports Triton

    kv_len = key.shape[2]
    mask = None if attention_mask is None else attention_mask[..., -kv_len:]
    return decode.launch_decode_attention(query, scaling, quantized=region, exact=segments, attention_mask=mask,
                                          kv_len=kv_len)


def _native_part(kv) -> cpu_attention.QuantizedPart:
    """The quantized part of a :class:`~hf_asymkv.core.kv_view.QuantizedKV` with its layout's constants (plane widths,
    storage offset) for the native kernel."""
    spec, wide, offset = kv.spec, kv.wide, storage_offset(kv.spec)
    return cpu_attention.QuantizedPart(
        kv.codes.data, kv.scale, kv.zero, spec.bits, plane_widths(spec.bits), kv.codes.layout == "tokens", offset,
        None if wide is None else wide.bits, None if wide is None else wide.channels, offset if wide else 0)


def _native_refused(key, value) -> str | None:
    """What of a layer's storage the native kernel does not read (its own checks follow), or None."""
    if key.spec.is_float or key.spec.rotated:
        return f"{key.spec.fmt} keys" + (", rotated" if key.spec.rotated else "")
    if value.spec.granularity != "token":
        return f"values with scales per {value.spec.granularity!r}"
    blocks = {key.spec.block_size, value.spec.block_size, *(kv.codes.block_size for kv in (key, value)
                                                             if kv.codes.layout == "tokens")}
    return f"blocks of {sorted(blocks)} tokens" if len(blocks) > 1 else None


def _native_exact(key, value) -> list[cpu_attention.ExactPart]:
    """Sinks, window and left-padded rows' overlaid sinks as the native kernel's exact parts."""
    ns, n = key.n_prefix, key.n_quantized
    parts = [cpu_attention.ExactPart(key.prefix, value.prefix, 0)] if ns else []
    parts.append(cpu_attention.ExactPart(key.tail, value.tail, ns + n))
    overlay = key.overlay if n else None
    if overlay is not None:
        parts.append(cpu_attention.ExactPart(overlay.tokens, value.overlay.tokens, positions=overlay.positions.contiguous(),
                                             valid=overlay.valid.contiguous()))
    return parts


def native_fused_attention(query: torch.Tensor, key, value, attention_mask: torch.Tensor | None, scaling: float,
                           refused: str | None) -> torch.Tensor | None:
    """The fused attention on the native CPU kernel (``[B, q, Hq, D]``) when ``HF_ASYMKV_ATTENTION_BACKEND`` and the
    call say so, else None (the caller then takes the torch implementation). Arguments as
    :func:`triton_fused_attention`.

    Raises:
        ValueError: ``HF_ASYMKV_ATTENTION_BACKEND=native`` and the kernel cannot serve the call.
    """
    if requested_backend() not in ("auto", "native"):
        return None
    kv_len = key.shape[2]
    mask = None if attention_mask is None else attention_mask[..., -kv_len:]
    if mask is not None and mask.dtype not in (torch.bool, torch.float32):
        mask = mask.float()
    keys, values, exact = _native_part(key), _native_part(value), _native_exact(key, value)
    problem = refused or _native_refused(key, value)
    if problem is None:
        problem = cpu_attention.problem(query, keys, values, key.spec.block_size, exact, mask)
    if not use_native(query.device, problem):
        return None
    hadamard = hadamard_block(query.shape[-1]) if value.spec.rotated else 0
    out = cpu_attention.decode_attention(query, scaling, keys=keys, values=values, block=key.spec.block_size,
                                         column=key.n_prefix, hadamard=hadamard, exact=exact, mask=mask, kv_len=kv_len)
    return out if query.dtype == torch.float32 else out.to(query.dtype)
