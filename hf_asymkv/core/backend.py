"""The fused attention's backend for one call, and the translation of a layer's stored K/V into the Triton
kernel's plain regions (:mod:`hf_asymkv.kernels`): the only place where the core meets the kernels.

``HF_ASYMKV_ATTENTION_BACKEND`` (:mod:`hf_asymkv.kernels.backend`) picks ``torch`` (:func:`~.attention.fused_attention`)
or ``triton``; ``auto`` takes Triton for CUDA tensors when it can serve the call.
"""

from __future__ import annotations

import torch

from ..kernels.backend import choose_backend, requested_backend
from ..kernels.regions import ExactSegment, QuantizedRegion, StoredCodes, unsupported
from .quant import packs_tokens

__all__ = ["kernel_regions", "triton_fused_attention"]


def _stored(kv) -> StoredCodes:
    """The quantized part of a :class:`~hf_asymkv.core.attention.QuantizedKV` as the kernel reads it."""
    spec = kv.spec
    layout = "tokens" if packs_tokens(spec.bits, kv.block_size, kv.codes.shape[2]) else "head_dim"
    return StoredCodes(kv.codes, kv.scale, kv.zero, spec.bits, spec.symmetric, layout, kv.block_size, spec.rotated)


def kernel_regions(key, value) -> tuple[QuantizedRegion, tuple[ExactSegment, ...]]:
    """``[prefix][codes][tail]`` of a layer's :class:`~hf_asymkv.core.attention.QuantizedKV` keys and values as one
    quantized region and its exact segments, at their mask columns."""
    ns, n = key.n_prefix, key.codes.shape[2]
    segments = [ExactSegment(key.prefix, value.prefix, 0)] if ns else []
    segments.append(ExactSegment(key.tail, value.tail, ns + n))
    return QuantizedRegion(_stored(key), _stored(value), start=ns), tuple(segments)


def triton_fused_attention(query: torch.Tensor, key, value, attention_mask: torch.Tensor | None, scaling: float,
                           refused: str | None) -> torch.Tensor | None:
    """The fused attention on the Triton kernel (``[B, q, Hq, D]``) when ``HF_ASYMKV_ATTENTION_BACKEND`` and the
    request say so, else None (the caller then takes the torch implementation).

    Args:
        query: ``[B, Hq, q, D]``; key, value: a layer's :class:`~hf_asymkv.core.attention.QuantizedKV`.
        refused: a feature of the call that no fused path serves (``"attention with sliding_window"``, ...), or None.

    Raises:
        ImportError, ValueError: ``HF_ASYMKV_ATTENTION_BACKEND=triton`` and the kernel cannot serve the call
            (see :func:`hf_asymkv.kernels.backend.choose_backend`), or an unknown backend name.
    """
    backend = requested_backend()
    if backend == "torch" or backend == "auto" and query.device.type != "cuda":  # the default CPU path stays as cheap
        return None
    region, segments = kernel_regions(key, value)
    if choose_backend(query.device, refused or unsupported(query, region, segments)) != "triton":
        return None
    from ..kernels import decode  # imports Triton

    kv_len = key.shape[2]
    mask = None if attention_mask is None else attention_mask[..., -kv_len:]
    return decode.launch_decode_attention(query, scaling, quantized=region, exact=segments, attention_mask=mask,
                                          kv_len=kv_len)
