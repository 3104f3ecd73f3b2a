"""The static layer's attention on the Triton decode kernel: what ``hf_asymkv::static_attention`` runs on a GPU.

:mod:`.static_op` registers :func:`kernel_static_attention` as the operator's CUDA implementation. It hands the
kernel's public launcher (:func:`hf_asymkv.kernels.decode.launch_decode_attention`) what a static step holds, at the
step's fixed shapes (so that ``generate``'s CUDA graphs replay it), as one quantized region and two exact segments,
each with its own mask slice built on the device from the 0-d boundary and filled length (nothing read on the host):

- exact: the sinks (positions ``[0, S)``) joined with left-padded rows' exact sinks (each row's ``anchor + j`` where
  that lies inside the stored blocks ``[S, boundary)``, blocked elsewhere);
- quantized: every block slot (position ``S + i``), blocked at or past the boundary and where a padded row's exact
  sinks stand in;
- exact: the window and this step's tokens (position ``boundary + i``), blocked past ``max_cache_len``.

This is :func:`~hf_asymkv.core.static_attention.static_fused_attention`'s segmentation: the same softmax over the
same positions. The quantized region's filled length (``boundary - S``, a 0-d tensor) goes to the kernel as a device
pointer (``QuantizedRegion.filled``): its programs stop there (rounded up to a tile, which the mask covers), so a
step reads the stored blocks, not every preallocated slot, and a CUDA graph replays it as the cache fills. The grid
is still sized for every slot (shapes are fixed for the graph): programs past the filled length exit at once.

Calls the kernel cannot serve (rotated keys, formats it does not read; :func:`~hf_asymkv.kernels.regions.unsupported`
says which), or ``HF_ASYMKV_ATTENTION_BACKEND=torch``, return None: the operator then runs the torch implementation.
"""

from __future__ import annotations

import torch

from ..kernels.backend import choose_backend, requested_backend
from ..kernels.regions import ExactSegment, QuantizedRegion, StoredCodes, unsupported
from .static_attention import causal_mask

__all__ = ["kernel_static_attention", "static_regions"]


def _stored(parts) -> StoredCodes:
    """A static store's codes (:class:`~hf_asymkv.core.static_op.StoredParts`) as the kernel reads them."""
    spec = parts.spec
    return StoredCodes(parts.codes, parts.scales, parts.zeros, spec.bits, spec.symmetric, spec.layout, spec.block_size,
                       spec.rotated, parts.wide_bits, parts.wide_channels)


def static_regions(attention_mask: torch.Tensor | None, boundary: torch.Tensor, start: torch.Tensor, max_len: int,
                   q_len: int, key_tokens: torch.Tensor, value_tokens: torch.Tensor, key, value
                   ) -> tuple[QuantizedRegion | None, tuple[ExactSegment, ...]]:
    """One static layer's stored K/V as the kernel's regions, each with its mask slice (see the module docstring).

    Args:
        attention_mask: ``[B|1, 1|Hq, q, max_len]`` bool (True attends) or additive, or None (causal from ``start``).
        boundary, start: 0-d long, the first position no stored block holds and the filled length before the step.
        key_tokens, value_tokens: ``[B, H, W + q, D]``, the window followed by the step's tokens.
        key, value: the stores' :class:`~hf_asymkv.core.static_op.StoredParts`.
    """
    full = causal_mask(start, q_len, max_len) if attention_mask is None else attention_mask
    b, device = key_tokens.shape[0], key_tokens.device
    full = full.expand(b, *full.shape[1:])
    blocked = False if full.dtype == torch.bool else float("-inf")  # a Python scalar: no host-to-device copy, which
    # a CUDA graph being captured would refuse
    ns, slots = key.sink_count, key.codes.shape[2]
    segments, region = [], None
    padded = bool(ns) and key.overlay.tokens is not None  # preallocated with the sinks: every row has its slots
    if ns and not padded:
        segments.append(ExactSegment(key.sinks, value.sinks, mask=full[..., :ns]))
    if padded:
        positions = key.overlay.anchors[:, None] + torch.arange(ns, device=device)  # [B, S]
        inside = (positions >= ns) & (positions < boundary)
        index = positions.clamp(0, max_len - 1)[:, None, None, :].expand(*full.shape[:3], ns)
        overlaid = full.gather(3, index).masked_fill(~inside[:, None, None, :], blocked)
        segments.append(ExactSegment(torch.cat([key.sinks, key.overlay.tokens], 2),
                                     torch.cat([value.sinks, value.overlay.tokens], 2),
                                     mask=torch.cat([full[..., :ns], overlaid], 3)))
    if slots:
        position = torch.arange(ns, ns + slots, device=device)
        stored = (position < boundary)[None, :]  # [1, slots]: at or past the boundary no block is stored yet
        if padded:
            row_sink = (position[None, :] >= key.overlay.anchors[:, None]) & (position[None, :] <= positions[:, -1:])
            stored = stored & ~row_sink  # [B, slots]
        mask = full[..., ns : ns + slots].masked_fill(~stored[:, None, None, :], blocked)
        filled = (boundary - ns).clamp(0, slots)  # 0-d, on the device: the kernel stops its splits there
        region = QuantizedRegion(_stored(key), _stored(value), start=ns, mask=mask, filled=filled)
    held = boundary + torch.arange(key_tokens.shape[2], device=device)  # the window slots' positions
    window_mask = full.index_select(3, held.clamp(max=max_len - 1)).masked_fill(held >= max_len, blocked)
    segments.append(ExactSegment(key_tokens, value_tokens, mask=window_mask))
    return region, tuple(segments)


def kernel_static_attention(query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float,
                            boundary: torch.Tensor, start: torch.Tensor, max_len: int, key_tokens: torch.Tensor,
                            value_tokens: torch.Tensor, key, value) -> torch.Tensor | None:
    """Softmax attention of ``query`` ``[B, Hq, q, D]`` over one static layer on the Triton kernel: ``[B, q, Hq, D]``,
    or None when ``HF_ASYMKV_ATTENTION_BACKEND`` or the request keeps it on the torch path (arguments as
    :func:`~hf_asymkv.core.static_op.static_attention` takes them, ``key``/``value`` rebuilt as
    :class:`~hf_asymkv.core.static_op.StoredParts`).

    Raises:
        ImportError, ValueError: ``HF_ASYMKV_ATTENTION_BACKEND=triton`` and the kernel cannot serve the call
            (:func:`hf_asymkv.kernels.backend.choose_backend`).
    """
    if requested_backend() == "torch":  # before any mask is built
        return None
    q_len = query.shape[2]
    region, segments = static_regions(attention_mask, boundary, start, max_len, q_len, key_tokens, value_tokens, key,
                                      value)
    if choose_backend(query.device, unsupported(query, region, segments)) != "triton":
        return None
    from ..kernels import decode  # imports Triton

    return decode.launch_decode_attention(query, scaling, quantized=region, exact=segments, kv_len=max_len)
