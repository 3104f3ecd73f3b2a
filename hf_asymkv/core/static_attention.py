"""Attention over a static layer's codes, for ``attn_implementation="asymkv_sdpa"`` with a static cache.

A :class:`~hf_asymkv.core.static.StaticAsymKVLayer` hands transformers dense K/V of ``max_cache_len`` tokens: every
block slot decoded at every step. With the fused attention it hands a :class:`StaticQuantizedKV` instead, and
:func:`static_fused_attention` computes attention from what is stored, at fixed shapes (a compiled step stays one
graph, whatever the length):

- scores: ``q . k`` for the exact sinks and window, and for every block slot ``(q s) . c + q . z`` (the keys'
  scales per block and channel folded into the query), written, when compiled, as a broadcast product and a sum
  rather than a matmul, so that the compiler fuses the unpacking and the conversion into one reduction that reads
  the codes once (eagerly: the codes converted once, then batched matmuls);
- one softmax over four segments, each with the attention mask of the positions it holds: the exact sinks, the
  block slots (those at or past the layer's boundary hold no stored block yet and left-padded rows' sinks have
  exact copies: both masked out), the exact window with this update's tokens (positions ``boundary + i``) and the
  padded rows' exact sinks; positions no token fills are hidden by the mask;
- values: ``sum (p s) c + sum p z`` over the block slots (the values' per-token scales folded into the softmax
  weights), the same way; rotated values are mixed as stored and only the ``[B, H, R, D]`` output is rotated back;
  the exact parts by matmul.

Nothing dense of ``max_cache_len`` tokens is built for K or V when compiled; the scores and weights are
``[B, H, n_rep * q, sinks + slots + window (+ sinks)]``, about eager attention's ``max_cache_len``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_view import HEADWISE_MASKING_REFUSED, mask_bias
from .packing import PackedCodes, plane_widths, unpack_codes
from .quant import integer_codes
from .wide import WideBits, wide_key_scores

__all__ = ["StaticQuantizedKV", "causal_mask", "static_fused_attention"]


@dataclass
class StaticQuantizedKV:
    """One static layer's K or V after an update, as stored (what :func:`static_fused_attention` reads).

    Attributes:
        store: the layer's :class:`~hf_asymkv.core.static_store.StaticTensorStore` (sinks ``[B, H, S, D]``, codes of
            ``NB * bs`` slots, scales, zeros, padded rows' sink overlay).
        tokens: ``[B, H, W + n, D]`` exact window followed by this update's tokens (slot ``i`` is the token at
            ``boundary + i``; slots past the filled length hold filler).
        boundary: 0-d, the first position not held by a stored block.
        start: 0-d, the filled length before this update (this update's tokens are at ``start ...``).
        max_len: positions of the read-out (``max_cache_len``).
    """

    store: object
    tokens: torch.Tensor
    boundary: torch.Tensor
    start: torch.Tensor
    max_len: int

    @property
    def shape(self) -> torch.Size:
        b, h, _, d = self.tokens.shape
        return torch.Size((b, h, self.max_len, d))

    @property
    def dtype(self) -> torch.dtype:
        return self.tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def __setitem__(self, index, value) -> None:
        """Refused, as :meth:`~hf_asymkv.core.kv_view.QuantizedKV.__setitem__`: the codes are what is stored."""
        raise ValueError(f"StaticQuantizedKV cannot be written to: {HEADWISE_MASKING_REFUSED}.")

    def dense(self) -> torch.Tensor:
        """``[B, H, max_len, D]``: the static layer's dense read-out (what attention gets without the fused path)."""
        return self.store.read(self.tokens, self.boundary, self.max_len)


def _grouped_codes(store, dtype: torch.dtype) -> torch.Tensor:
    """The slots' code values before scale and zero, as ``[B, H, NB', tg, D // cg, cg]`` in ``dtype``
    (``(tg, cg) = spec.groups(D)``, ``NB' = slots // tg``)."""
    spec = store.spec
    data = store.codes
    if spec.is_float or spec.bits >= 8:
        ints = data
    else:
        ints = integer_codes(PackedCodes(data, spec.bits, spec.layout, spec.block_size), spec)
    b, h, slots, d = ints.shape[0], ints.shape[1], ints.shape[2], store.head_dim
    tg, cg = spec.groups(d)
    return ints.to(dtype).view(b, h, slots // tg, tg, d // cg, cg)


def _meta(meta: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Scales or zeros ``[B, H, NB', D // cg]`` -> ``[B, H, NB', 1, D // cg, 1]`` in ``dtype`` (broadcast over the
    group's tokens and channels)."""
    return None if meta is None else meta.to(dtype)[:, :, :, None, :, None]


def _expand_channels(meta: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[..., D // cg]`` -> ``[..., D]`` (one value per channel)."""
    return meta if meta.shape[-1] == head_dim else meta.repeat_interleave(head_dim // meta.shape[-1], dim=-1)


def _code_parts(store, dtype: torch.dtype) -> list[tuple[float, torch.Tensor]]:
    """The slots' integer codes as ``[(factor, part)]`` with ``part`` ``[B, H, NB, k, r, D]`` in ``dtype`` and
    ``k * r = block_size``: token ``j * r + i`` of block ``n`` has code ``sum(factor * part[..., n, j, i, :])``
    (before the storage offset of symmetric sub-byte codes).

    Token-packed codes give one part per bit-plane set, read straight from the packed bytes with a broadcast shift
    (nothing unpacked into a buffer of its own: the compiler inlines it into the reduction that reads it); other
    codes one part ``[B, H, NB, 1, block_size, D]``.
    """
    spec = store.spec
    b, h, slots, _ = store.codes.shape
    bs, d = spec.block_size, store.head_dim
    nb = slots // bs
    if spec.is_float or spec.bits >= 8 or spec.layout != "tokens":
        ints = store.codes
        if not (spec.is_float or spec.bits >= 8):
            ints = unpack_codes(PackedCodes(ints, spec.bits, spec.layout, bs))
        return [(1.0, ints.to(dtype).view(b, h, nb, 1, bs, d))]
    rows = store.codes.view(b, h, nb, bs * spec.bits // 8, d)
    parts, start, shift = [], 0, 0
    for width in plane_widths(spec.bits):
        r = bs * width // 8
        shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=rows.device).view(-1, 1, 1)
        plane = (rows[:, :, :, None, start : start + r] >> shifts) & ((1 << width) - 1)  # [B, H, NB, 8 / width, r, D]
        parts.append((float(1 << shift), plane.to(dtype)))
        start, shift = start + r, shift + width
    return parts


def _offset(spec) -> float:
    """Storage offset of symmetric sub-byte codes (stored as code + offset so that they pack unsigned), else 0."""
    return float(2 ** (spec.bits - 1)) if spec.symmetric and not spec.is_float and spec.bits < 8 else 0.0


def _slot_scores(q: torch.Tensor, store) -> torch.Tensor:
    """``q . k`` for every block slot: ``[B, H, R, slots]`` for ``q`` ``[B, H, R, D]``.

    Scales per block and channel (the keys' granularity) fold into the query, ``q . (s c + z) = (q s) . c + q . z``:
    the codes are only converted and multiplied once per query row, in one reduction the compiler fuses.
    """
    spec = store.spec
    b, h, r, d = q.shape
    if spec.token_group != spec.block_size:  # per-token key scales (an ablation): scale each code
        return _generic_scores(q, store)
    qs = q[:, :, :, None, :] * _expand_channels(store.scales.to(q.dtype), d)[:, :, None]  # [B, H, R, NB, D]
    nb = qs.shape[3]
    if torch.compiler.is_compiling():  # one fused reduction per part, reading the codes
        scores = sum(factor * (qs[:, :, :, :, None, None, :] * part[:, :, None]).sum(-1).view(b, h, r, nb, -1)
                     for factor, part in _code_parts(store, q.dtype))  # [B, H, R, NB, block_size]
    else:  # eagerly: the parts converted once, one batched matmul per block
        per_block = qs.transpose(2, 3)  # [B, H, NB, R, D]
        scores = sum(factor * (per_block @ part.reshape(b, h, nb, -1, d).transpose(-1, -2)).transpose(2, 3)
                     for factor, part in _code_parts(store, q.dtype))
    if store.wide_bits is not None:  # the wide channels' high bits: [B, H, NB, R, bs] -> [B, H, R, NB, bs]
        wide = WideBits(store.wide_bits, store.wide_channels)
        scores = scores + wide_key_scores(q, store.scales.to(q.dtype), wide, spec).transpose(2, 3)
    per_block = None
    if store.zeros is not None:
        per_block = (q[:, :, :, None, :] * _expand_channels(store.zeros.to(q.dtype), d)[:, :, None]).sum(-1)
    if offset := _offset(spec):
        shifted = -offset * qs.sum(-1)
        per_block = shifted if per_block is None else per_block + shifted
    if per_block is not None:
        scores = scores + per_block[..., None]
    return scores.reshape(b, h, r, -1)


def _slot_mix(p: torch.Tensor, store) -> torch.Tensor:
    """``p @ V`` over every block slot: ``[B, H, R, D]`` for weights ``p`` ``[B, H, R, slots]`` (in the stored space:
    rotated codes give the rotated mix).

    Scales per token (the values' granularity, in groups of ``cg`` channels) fold into the weights,
    ``sum_t p_t (s_t c_t + z_t) = sum_t (p_t s_t) c_t + sum_t p_t z_t``.
    """
    spec = store.spec
    b, h, r, slots = p.shape
    d = store.head_dim
    if spec.token_group != 1:  # scales per block (a baseline's values): scale each code
        return _generic_mix(p, store)
    groups = store.scales.shape[-1]
    cg = d // groups
    ws = p[..., None] * store.scales.to(p.dtype)[:, :, None]  # [B, H, R, slots, G]
    out = 0.0
    for factor, part in _code_parts(store, p.dtype):
        if torch.compiler.is_compiling():  # one fused reduction per part, reading the codes
            nb, k, rows = part.shape[2:5]
            weights = ws.view(b, h, r, nb, k, rows, groups, 1)
            codes = part.view(b, h, 1, nb, k, rows, groups, cg)
            mixed = (weights * codes).sum(dim=(3, 4, 5))  # [B, H, R, G, cg]
        else:  # eagerly: the part converted once, one matmul per group
            codes = part.reshape(b, h, slots, groups, cg).transpose(2, 3)  # [B, H, G, slots, cg]
            mixed = (ws.permute(0, 1, 4, 2, 3) @ codes).transpose(2, 3)  # [B, H, R, G, cg]
        out = out + factor * mixed
    per_group = None
    if store.zeros is not None:
        per_group = (p[..., None] * store.zeros.to(p.dtype)[:, :, None]).sum(3)  # [B, H, R, G]
    if offset := _offset(spec):
        shifted = -offset * ws.sum(3)
        per_group = shifted if per_group is None else per_group + shifted
    if per_group is not None:
        out = out + per_group[..., None]
    return out.reshape(b, h, r, d)


def _generic_scores(q: torch.Tensor, store) -> torch.Tensor:
    """``q . (s c + z)`` with the scale applied to each code (any granularity): ``[B, H, R, slots]``."""
    codes = _grouped_codes(store, q.dtype)  # [B, H, NB', tg, G, cg]
    keys = codes * _meta(store.scales, q.dtype)
    if store.zeros is not None:
        keys = keys + _meta(store.zeros, q.dtype)
    b, h, r, d = q.shape
    nb, tg, g, cg = codes.shape[2:]
    qg = q.view(b, h, r, 1, 1, g, cg)
    return (qg * keys[:, :, None]).sum(dim=(-2, -1)).view(b, h, r, nb * tg)


def _generic_mix(p: torch.Tensor, store) -> torch.Tensor:
    """``p @ (s c + z)`` with the scale applied to each code (any granularity): ``[B, H, R, D]``."""
    codes = _grouped_codes(store, p.dtype)
    values = codes * _meta(store.scales, p.dtype)
    if store.zeros is not None:
        values = values + _meta(store.zeros, p.dtype)
    b, h, r, _ = p.shape
    nb, tg, g, cg = codes.shape[2:]
    pg = p.view(b, h, r, nb, tg, 1, 1)
    return (pg * values[:, :, None]).sum(dim=(3, 4)).view(b, h, r, g * cg)


def causal_mask(start: torch.Tensor, q_len: int, max_len: int) -> torch.Tensor:
    """``[1, 1, q, max_len]`` bool: query ``i`` (at position ``start + i``) sees positions up to its own."""
    rows = start + torch.arange(q_len, device=start.device)
    return (torch.arange(max_len, device=start.device)[None, :] <= rows[:, None])[None, None]


def static_fused_attention(query: torch.Tensor, key: StaticQuantizedKV, value: StaticQuantizedKV,
                           attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Softmax attention of ``query`` ``[B, Hq, q, D]`` over a static layer's stored K/V; returns ``[B, q, Hq, D_v]``.

    Grouped-query heads are packed (``Hq = H * n_rep``, ``R = n_rep * q`` rows per K/V head). Scores and softmax
    run in float32 for half-precision inputs. ``attention_mask`` (bool or additive, ``[B or 1, 1 or Hq, q,
    max_len]``) as transformers builds it for a static cache; without one, causal from ``key.start``.

    The softmax runs over four segments, each with the mask of the positions it holds: the sinks (positions
    ``[0, S)``), the block slots (``[S, S + slots)``, those at or past the boundary and padded rows' sinks masked
    out), the window (``boundary + i``) and padded rows' exact sinks (``anchor + j`` inside ``[S, boundary)``).
    """
    b, hq, q_len, d = query.shape
    ks, vs = key.store, value.store
    h = key.tokens.shape[1]
    n_rep = hq // h
    r = n_rep * q_len
    work = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    q = (query.to(work) * scaling).reshape(b, h, r, d)
    ns, slots, max_len = ks.sink_count, ks.codes.shape[2], key.max_len
    device, w = query.device, key.tokens.shape[2]
    if attention_mask is None:
        attention_mask = causal_mask(key.start, q_len, max_len)
    bias = mask_bias(attention_mask, b, h, n_rep, q_len, max_len, work, device).expand(b, h, r, max_len)
    blocked = torch.tensor(float("-inf"), dtype=work, device=device)

    def masked(scores: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Scores of tokens at ``positions`` (``[P]`` or ``[B, P]``) with their mask, -inf where not ``valid``."""
        index = positions.clamp(0, max_len - 1)
        if index.dim() == 1:
            held = bias.index_select(-1, index)
        else:
            held = bias.gather(-1, index[:, None, None, :].expand(b, h, r, index.shape[-1]))
        return torch.where(valid if valid.dim() == 1 else valid[:, None, None, :], scores + held, blocked)

    segments, mixes = [], []  # scores per segment; how each segment's weights mix its values
    if ns:
        segments.append(q @ ks.sinks.to(work).transpose(-1, -2) + bias[..., :ns])
        mixes.append(lambda p: p @ vs.sinks.to(work))
    overlay, padded = ks.overlay, bool(ns) and ks.overlay.tokens is not None
    if padded:  # each row's exact sinks that lie inside the stored blocks [S, boundary)
        positions = overlay.anchors[:, None] + torch.arange(overlay.count, device=device)  # [B, S]
        inside = (positions >= ns) & (positions < key.boundary)
    if slots:
        position = torch.arange(ns, ns + slots, device=device)
        stored = position < key.boundary  # slots at or past the boundary hold no block yet: the window has them
        if padded:
            row_sink = (position[None, :] >= overlay.anchors[:, None]) & (position[None, :] < positions[:, -1:] + 1)
            stored = stored & ~row_sink  # [B, slots]
        scores = _slot_scores(q @ ks.rotation.to(work) if ks.spec.rotated else q, ks)  # (q H) . (k H)
        segments.append(masked(scores, position, stored))

        def mix_slots(p: torch.Tensor) -> torch.Tensor:
            mixed = _slot_mix(p, vs)
            return mixed @ vs.rotation.to(work).T if vs.spec.rotated else mixed  # (p @ V H) H^T
        mixes.append(mix_slots)
    held = key.boundary + torch.arange(w, device=device)  # position of each window slot
    segments.append(masked(q @ key.tokens.to(work).transpose(-1, -2), held, held < max_len))
    mixes.append(lambda p: p @ value.tokens.to(work))
    if padded:
        segments.append(masked(q @ overlay.tokens.to(work).transpose(-1, -2), positions, inside))
        mixes.append(lambda p: p @ vs.overlay.tokens.to(work))
    sizes = [s.shape[-1] for s in segments]
    p = torch.cat(segments, dim=-1).softmax(dim=-1)
    out = sum(mix(part) for mix, part in zip(mixes, p.split(sizes, dim=-1)))
    dv = out.shape[-1]
    return out.view(b, h, n_rep, q_len, dv).reshape(b, hq, q_len, dv).transpose(1, 2).to(query.dtype).contiguous()
