"""`QuantizedKV`: one layer's K or V as stored, the view a layer hands the fused attention.

Along the token axis a quantized layer holds ``[prefix (exact)][quantized codes][tail (exact)]``, the same for
every row; left-padded rows add a :class:`SinkOverlayView`: exact copies of their first real tokens that lie in
the quantized region (:mod:`hf_asymkv.core.sinks`), which replace those positions. :class:`QuantizedKV` carries
the parts as they are stored (the codes as :class:`~hf_asymkv.core.packing.PackedCodes`, which know their
layout), so that an attention kernel can read the codes without a dense copy; :meth:`QuantizedKV.dense` is the
reference read-out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .packing import PackedCodes
from .quant import QuantSpec, dequantize
from .rotation import dequantize_rotated
from .wide import WideBits

__all__ = ["HEADWISE_MASKING_REFUSED", "QuantizedKV", "SinkOverlayView", "mask_bias", "write_rows"]

HEADWISE_MASKING_REFUSED = (
    "head-wise presses (kvpress's AdaKVPress, CriticalAdaKVPress, DuoAttentionPress, KVzipPress and others that set "
    "`masked_key_indices` on attention modules) mask keys by writing fake keys into the dense K attention receives; "
    "attn_implementation='asymkv_sdpa' hands attention the stored codes instead. Use attn_implementation='sdpa' (or "
    "'eager') with such presses: AsymKVCache then hands dense K/V, which they can mask")
"""Why the fused attention refuses head-wise kvpress masking (raised by it and by :meth:`QuantizedKV.__setitem__`)."""


def write_rows(out: torch.Tensor, dim: int, positions: torch.Tensor, valid: torch.Tensor,
               values: torch.Tensor | float) -> None:
    """Write ``values`` at ``positions`` along ``dim`` of ``out``, row by row, where ``valid``: one scatter.

    Args:
        out: ``[B, ...]`` tensor; ``dim`` is the token axis (2 for ``[B, H, T, D]``, 3 for scores ``[B, H, Q, T]``).
        positions: ``[B, S]`` consecutive positions per row (``anchor + j``); entries outside ``out`` must be invalid.
        valid: ``[B, S]`` which slots to write.
        values: a number, or ``out``-shaped but for ``S`` slots along ``dim`` (slot ``j`` for position ``anchor + j``).

    Invalid slots write back what ``out`` holds, and slots clamped onto the same position write the same value (the
    value is chosen by the position written, not by the slot), so the scatter is deterministic.
    """
    count = positions.shape[1]
    target = positions.clamp(0, out.shape[dim] - 1)
    slot = target - positions[:, :1]  # the slot whose position is written
    ok = (slot >= 0) & (slot < count)
    slot = slot.clamp(0, count - 1)
    ok &= valid.gather(1, slot)
    shape = list(out.shape)
    shape[dim] = count

    def spread(t: torch.Tensor) -> torch.Tensor:  # [B, S] -> out's shape with S slots along dim
        return t.view(t.shape[0], *([1] * (dim - 1)), count, *([1] * (out.dim() - dim - 1))).expand(shape)

    index = spread(target)
    new = values.gather(dim, spread(slot)) if isinstance(values, torch.Tensor) else values
    out.scatter_(dim, index, torch.where(spread(ok), new, out.gather(dim, index)))


def mask_bias(attention_mask: torch.Tensor | None, b: int, h: int, n_rep: int, q_len: int, kv_len: int,
               dtype: torch.dtype, device) -> torch.Tensor | None:
    """Additive ``[B, H, n_rep * q, kv]`` bias (0 / -inf) from a bool or float mask, or the causal one if None."""
    if attention_mask is None:
        if q_len == 1:
            return None
        rows = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
        attention_mask = (torch.arange(kv_len, device=device)[None, :] <= rows)[None, None]
    mask = attention_mask[..., -kv_len:]  # [B or 1, 1 or Hq, q, kv]
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))
    # one mask for all heads: repeat it for each of a KV head's n_rep query heads; per-head masks: group them
    heads = n_rep if mask.shape[1] == 1 else h * n_rep
    return mask.to(dtype).expand(b, heads, q_len, kv_len).reshape(b, -1, n_rep * q_len, kv_len)


@dataclass
class SinkOverlayView:
    """Exact sink tokens of left-padded rows over the quantized region (:class:`~hf_asymkv.core.sinks.SinkOverlay`).

    Attributes:
        tokens: ``[B, H, S, D]`` exact tokens; slot ``j`` of row ``b`` is the token at ``positions[b, j]``.
        positions: ``[B, S]`` absolute token positions (consecutive per row).
        valid: ``[B, S]`` slots that lie in the quantized region (the others are exact elsewhere, or not there yet).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor

    def to(self, device) -> SinkOverlayView:
        return SinkOverlayView(self.tokens.to(device), self.positions.to(device), self.valid.to(device))


@dataclass
class QuantizedKV:
    """One layer's K or V as stored: ``[prefix (exact)][quantized codes][tail (exact)]`` along the token axis.

    Attributes:
        prefix: ``[B, H, ns, D]`` exact sink tokens, or None.
        codes: the quantized region's codes, data ``[B, H, N, packed_dim]`` (N a multiple of
            ``spec.block_size``, possibly 0).
        scale, zero: ``[B, H, N // tg, D // cg]`` with ``(tg, cg) = spec.groups(D)`` (zero None for symmetric
            specs).
        spec: how the codes were made (``spec.rotated``: the codes hold ``x @ H``; ``spec.block_size``: tokens per
            block).
        tail: ``[B, H, m, D]`` exact recent tokens (those quantized in this very call included).
        overlay: exact tokens of left-padded rows' sinks that replace positions of the quantized region, or None.
        wide: the high code bits of each block's wide channels (a spec with ``wide_fraction``), else None.
    """

    prefix: torch.Tensor | None
    codes: PackedCodes
    scale: torch.Tensor
    zero: torch.Tensor | None
    spec: QuantSpec
    tail: torch.Tensor
    overlay: SinkOverlayView | None = None
    wide: WideBits | None = None

    @property
    def n_prefix(self) -> int:
        return 0 if self.prefix is None else self.prefix.shape[2]

    @property
    def n_quantized(self) -> int:
        return self.codes.tokens

    @property
    def shape(self) -> torch.Size:
        b, h, m, d = self.tail.shape
        return torch.Size((b, h, self.n_prefix + self.n_quantized + m, d))

    @property
    def dtype(self) -> torch.dtype:
        return self.tail.dtype

    @property
    def device(self) -> torch.device:
        return self.tail.device

    def __setitem__(self, index, value) -> None:
        """Refused: the codes are what is stored. kvpress's attention patch writes fake keys into K this way for its
        head-wise presses (:data:`HEADWISE_MASKING_REFUSED`)."""
        raise ValueError(f"QuantizedKV cannot be written to: {HEADWISE_MASKING_REFUSED}.")

    def to(self, device: torch.device | str) -> QuantizedKV:
        """The same K or V on ``device`` (KV-sharing layers move what they borrow, e.g. Gemma4 in transformers
        5.13-5.22, which hands the source layer's read-out to the consumer layers)."""
        if torch.device(device) == self.device:
            return self

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return replace(self, prefix=move(self.prefix), codes=self.codes.with_data(self.codes.data.to(device)),
                       scale=move(self.scale), zero=move(self.zero), tail=move(self.tail),
                       overlay=None if self.overlay is None else self.overlay.to(device),
                       wide=None if self.wide is None else self.wide.to(device))

    def dense(self) -> torch.Tensor:
        """``[B, H, seq, D]`` in the tail's dtype: the reference read-out (one vectorized decode)."""
        ns, n = self.n_prefix, self.n_quantized
        if ns == 0 and n == 0:
            return self.tail
        out = self.tail.new_empty(self.shape)
        if ns:
            out[:, :, :ns] = self.prefix
        if n and self.spec.rotated:  # (a rotated spec has no wide channels)
            dequantize_rotated(self.codes, self.scale, self.zero, self.spec, dtype=out.dtype, out=out[:, :, ns : ns + n])
        elif n:
            dequantize(self.codes, self.scale, self.zero, self.spec, dtype=out.dtype, out=out[:, :, ns : ns + n],
                       wide=self.wide)
        out[:, :, ns + n :] = self.tail
        if self.overlay is not None:
            write_rows(out, 2, self.overlay.positions, self.overlay.valid, self.overlay.tokens)
        return out
