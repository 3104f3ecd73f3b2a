"""Wide key channels: one more code bit for the channels that span most of each block's range.

Outlier-heavy keys (Qwen2's key-projection bias, the stress model of DESIGN.md) put most of a block's range in a
few channels of each head; their quantization step is what the attention scores feel. With
``key_wide_fraction=f`` (:class:`~hf_asymkv.core.quant.QuantSpec` ``wide_fraction``) each block of each KV head
stores its ``R = f * D`` channels of largest scale (the block's own ranges, no calibration) with ``bits + 1``-bit
codes:

- the low ``bits`` bits in the ordinary code planes (every reader of the codes reads them as they are);
- the high bit in a bit-plane of ``R`` bits per token (:class:`WideBits` ``bits``, ``[B, H, T, ceil(R / 8)]``);
- the chosen channels' indices per block (:class:`WideBits` ``channels``, ``[B, H, T // bs, R]`` uint8);
- the chosen channels' scale (and zero) made for the wider code (``qmax`` of ``bits + 1``).

A reader of the ordinary codes decodes ``s * low (+ z)`` (``s * (low - 2**(bits-1))`` symmetric); the wide
channels add ``s * (2**bits * high - offset)``, ``offset = 2**(bits-1)`` for symmetric codes and 0 otherwise
(:func:`wide_levels`), one scatter-add over ``R`` channels per token (:func:`add_wide_bits`), or one more partial
product in the fused attentions (:func:`wide_key_scores`). Cost per element: ``R / D`` bits (``f``, rounded up to
whole bytes per token) plus ``8 R / (bs D)`` for the indices (a quarter of the channels in 64-token blocks: 0.28
bits over int4's 4).

Measured with the format emulated (``scripts/studies/key_channel_bits_eval.py``,
``results/key_channel_bits/stress_qwen_eval.md``) and built (``results/presets/``, README "Presets").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .packing import pack_bits

__all__ = ["WideBits", "add_wide_bits", "choose_channels", "high_bits", "split_wide", "wide_key_scores", "wide_levels"]


@dataclass
class WideBits:
    """The extra bit of each block's wide channels.

    Attributes:
        bits: ``[B, H, T, ceil(R / 8)]`` uint8: the high code bit of token ``t``'s ``R`` wide channels, packed along
            the last axis as :func:`~hf_asymkv.core.packing.pack_bits` packs 1-bit codes (zero bits pad ``R`` to
            whole bytes).
        channels: ``[B, H, T // bs, R]`` uint8: each block's wide channels (ascending).
    """

    bits: torch.Tensor
    channels: torch.Tensor

    @property
    def count(self) -> int:
        return self.channels.shape[-1]

    def token_slice(self, start: int, stop: int, block_size: int) -> WideBits:
        """Tokens ``[start, stop)`` (block-aligned; views)."""
        return WideBits(self.bits[:, :, start:stop], self.channels[:, :, start // block_size : stop // block_size])

    def to(self, device) -> WideBits:
        return WideBits(self.bits.to(device), self.channels.to(device))


def choose_channels(scale: torch.Tensor, count: int) -> torch.Tensor:
    """Each block's ``count`` channels of largest scale: ``[B, H, N, D]`` -> ``[B, H, N, count]`` int64, ascending."""
    return scale.float().topk(count, dim=-1).indices.sort(dim=-1).values


def _spread(channels: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[B, H, N, R]`` -> ``[B, H, N * bs, R]`` (each block's channels for each of its tokens)."""
    b, h, n, r = channels.shape
    return channels[:, :, :, None, :].expand(b, h, n, block_size, r).reshape(b, h, n * block_size, r)


def split_wide(stored: torch.Tensor, channels: torch.Tensor, bits: int, block_size: int
               ) -> tuple[torch.Tensor, WideBits]:
    """Split unsigned ``bits + 1``-wide codes of the wide channels into ``bits``-wide codes and the high bits.

    Args:
        stored: ``[B, H, T, D]`` unsigned codes (offset applied) as float or integer: the wide channels' in
            ``[0, 2**(bits+1))``, the others' in ``[0, 2**bits)``.
        channels: ``[B, H, T // bs, R]`` the wide channels.

    Returns:
        ``(low [B, H, T, D] uint8, WideBits)``.
    """
    codes = stored.to(torch.uint8)
    high = codes.gather(-1, _spread(channels, block_size)) >> bits  # [B, H, T, R], 0 or 1
    padded = torch.nn.functional.pad(high, (0, -high.shape[-1] % 8))
    return codes & ((1 << bits) - 1), WideBits(pack_bits(padded, 1), channels.to(torch.uint8))


def high_bits(wide: WideBits) -> torch.Tensor:
    """The high bits as ``[B, H, T, R]`` uint8 (0 or 1): one broadcast shift over the packed bytes (bit ``j`` of
    byte ``i`` is slot ``i + j * bytes``, :func:`~hf_asymkv.core.packing.pack_bits`'s 1-bit layout)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=wide.bits.device)[:, None]
    return ((wide.bits[..., None, :] >> shifts) & 1).flatten(-2)[..., : wide.count]


def wide_levels(wide: WideBits, spec, dtype: torch.dtype) -> torch.Tensor:
    """What each wide channel's high bit adds, in units of its scale: ``[B, H, T, R]`` in ``dtype``,
    ``2**bits * high - offset`` (``offset`` = the symmetric storage offset ``2**(bits-1)``, else 0)."""
    levels = high_bits(wide).to(dtype).mul_(float(2**spec.bits))
    return levels.sub_(float(2 ** (spec.bits - 1))) if spec.symmetric else levels


def add_wide_bits(out: torch.Tensor, scale: torch.Tensor, wide: WideBits, spec) -> None:
    """Add the wide channels' high bits to dequantized ``out`` ``[B, H, T, D]`` in place.

    Args:
        scale: ``[B, H, T // bs, D]`` the scale that decoded ``out`` (in its dtype or float32).
    """
    b, h, t, d = out.shape
    bs = spec.block_size
    channels = wide.channels.long()
    step = scale.gather(-1, channels)[:, :, :, None, :]  # [B, H, N, 1, R]
    delta = wide_levels(wide, spec, step.dtype).view(b, h, t // bs, bs, -1).mul_(step)
    index = channels[:, :, :, None, :].expand(delta.shape)
    out.view(b, h, t // bs, bs, d).scatter_add_(-1, index, delta.to(out.dtype))


def wide_key_scores(q: torch.Tensor, scale: torch.Tensor, wide: WideBits, spec) -> torch.Tensor:
    """The wide channels' share of ``q . k``: ``[B, H, N, Q, bs]`` for ``q`` ``[B, H, Q, D]`` and the keys' scale
    ``[B, H, N, D]`` (in ``q``'s dtype); added to the scores of the ordinary codes."""
    b, h, nq, d = q.shape
    channels = wide.channels.long()
    n, r = channels.shape[2:]
    picked = q[:, :, None].expand(b, h, n, nq, d).gather(-1, channels[:, :, :, None, :].expand(b, h, n, nq, r))
    weighted = picked * scale.gather(-1, channels)[:, :, :, None, :]  # [B, H, N, Q, R]
    levels = wide_levels(wide, spec, q.dtype).view(b, h, n, -1, r)  # [B, H, N, bs, R]
    return weighted @ levels.transpose(-1, -2)
