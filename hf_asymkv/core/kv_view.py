"""`QuantizedKV`: one layer's K or V as stored, the view a layer hands the fused attention.

Along the token axis a quantized layer holds ``[prefix (exact)][quantized codes][tail (exact)]``.
:class:`QuantizedKV` carries those parts as they are stored (the codes as
:class:`~hf_asymkv.core.packing.PackedCodes`, which know their layout), so that an attention kernel can read the
codes without a dense copy; :meth:`QuantizedKV.dense` is the reference read-out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .packing import PackedCodes
from .quant import QuantSpec, dequantize
from .rotation import dequantize_rotated

__all__ = ["QuantizedKV"]


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
    """

    prefix: torch.Tensor | None
    codes: PackedCodes
    scale: torch.Tensor
    zero: torch.Tensor | None
    spec: QuantSpec
    tail: torch.Tensor

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

    def to(self, device: torch.device | str) -> QuantizedKV:
        """The same K or V on ``device`` (KV-sharing layers move what they borrow, e.g. Gemma4 in transformers
        5.13-5.22, which hands the source layer's read-out to the consumer layers)."""
        if torch.device(device) == self.device:
            return self

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return replace(self, prefix=move(self.prefix), codes=self.codes.with_data(self.codes.data.to(device)),
                       scale=move(self.scale), zero=move(self.zero), tail=move(self.tail))

    def dense(self) -> torch.Tensor:
        """``[B, H, seq, D]`` in the tail's dtype: the reference read-out (one vectorized decode)."""
        ns, n = self.n_prefix, self.n_quantized
        if ns == 0 and n == 0:
            return self.tail
        out = self.tail.new_empty(self.shape)
        if ns:
            out[:, :, :ns] = self.prefix
        if n:
            read = dequantize_rotated if self.spec.rotated else dequantize
            read(self.codes, self.scale, self.zero, self.spec, dtype=out.dtype, out=out[:, :, ns : ns + n])
        out[:, :, ns + n :] = self.tail
        return out
