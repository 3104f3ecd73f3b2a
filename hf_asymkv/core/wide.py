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
(:func:`wide_levels`): folded into the integer codes before anything reads them (:func:`add_wide_codes`, the dense
read-out and the CPU fused attention), or one more partial product where the codes are read straight from their
packed bytes (:func:`wide_key_scores`, the static cache's compiled attention; the Triton kernel's small product
per tile, :func:`~hf_asymkv.kernels.triton_codes._wide_scores`). Cost per element: ``R / D`` bits (``f``, rounded up to
whole bytes per token) plus ``8 R / (bs D)`` for the indices (a quarter of the channels in 64-token blocks: 0.28
bits over int4's 4).

Measured with the format emulated (``scripts/studies/key_channel_bits_eval.py``,
``results/key_channel_bits/stress_qwen_eval.md``) and built (``results/presets/``, README "Presets").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["WideBits", "add_wide_codes", "choose_channels", "high_bits", "split_wide", "wide_key_scores", "wide_levels"]


@dataclass
class WideBits:
    """The extra bit of each block's wide channels.

    Attributes:
        bits: ``[B, H, T, ceil(R / 8)]`` uint8: the high code bit of token ``t``'s ``R`` wide channels, slot ``j`` in
            bit ``j % 8`` of byte ``j // 8`` (zero bits pad ``R`` to whole bytes).
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
    """Each block's ``count`` channels of largest scale, equal scales taken lowest channel first: ``[B, H, N, D]``
    (positive scales, ``D <= 256``) -> ``[B, H, N, count]`` int64, ascending.

    ``topk`` alone breaks ties as its implementation happens to (differently on a CPU and a GPU), and scales rounded
    to bfloat16 tie often; so the ranking key is the scale's float32 bits (ordered as the values are, for positive
    floats) with the channel's rank in reverse as the low byte: no two keys are equal. The Triton append kernel ranks
    channels by the same rule."""
    d = scale.shape[-1]
    key = scale.float().view(torch.int32).long() * 256 + (255 - torch.arange(d, device=scale.device))
    return key.topk(count, dim=-1).indices.sort(dim=-1).values


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
    slots = padded.view(*padded.shape[:-1], -1, 8)  # [B, H, T, ceil(R / 8), 8]
    # bits OR-ed in one by one, not a uint8 sum of weighted bits: inductor's AVX2 code for a uint8 sum over 8 lanes
    # (torch 2.13, a Zen 3 CPU) added 24 to every byte, so a compiled flush stored other bits than an eager one
    packed = slots[..., 0].clone()  # [B, H, T, ceil(R / 8)]
    for j in range(1, 8):
        packed |= slots[..., j] << j
    return codes & ((1 << bits) - 1), WideBits(packed, channels.to(torch.uint8))


_BIT_TABLES: dict[torch.device, torch.Tensor] = {}
"""Process-wide, one entry per device, frozen once made: a table is never written in place, so two threads that build
it at once store equal tables (the last one stays)."""


def _bit_table(device: torch.device) -> torch.Tensor:
    """``[256, 8]`` uint8: the bits of each byte value, low bit first (kept per device, built inline in a graph)."""
    if torch.compiler.is_compiling() or device not in _BIT_TABLES:
        table = (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)).bitwise_and_(1)
        if torch.compiler.is_compiling():
            return table.to(torch.uint8)
        _BIT_TABLES[device] = table.to(torch.uint8)
    return _BIT_TABLES[device]


def high_bits(wide: WideBits) -> torch.Tensor:
    """The high bits as ``[B, H, T, R]`` uint8 (0 or 1): each packed byte's row of a 256 x 8 table of bits, one
    ``index_select`` (on CPU ~7x faster than a broadcast shift over every bit, and ~5x than advanced indexing)."""
    bits = wide.bits
    rows = _bit_table(bits.device).index_select(0, bits.reshape(-1).long())
    return rows.view(*bits.shape[:-1], -1)[..., : wide.count]


def wide_levels(wide: WideBits, spec, dtype: torch.dtype) -> torch.Tensor:
    """What each wide channel's high bit adds, in units of its scale: ``[B, H, T, R]`` in ``dtype`` (float, or the
    integer codes' uint8 / int8), ``2**bits * high - offset`` (``offset`` = the symmetric storage offset
    ``2**(bits-1)``, else 0)."""
    levels = high_bits(wide).to(dtype).mul_(2**spec.bits)
    return levels.sub_(2 ** (spec.bits - 1)) if spec.symmetric else levels


def add_wide_codes(ints: torch.Tensor, wide: WideBits, spec) -> torch.Tensor:
    """Fold the wide channels' high bits into integer codes, in place: ``ints`` ``[B, H, T, D]`` as
    :func:`~hf_asymkv.core.quant.integer_codes` gives them (uint8, or int8 with the symmetric offset removed) become
    the ``bits + 1``-wide codes of the wide channels (their scale and zero are the wider code's), so every later
    step (conversion, scale, zero, a matmul against the query) reads them as it reads any code. One byte-wide
    scatter-add over the ``R`` wide channels per token. Returns ``ints``."""
    b, h, t, d = ints.shape
    bs = spec.block_size
    high = wide_levels(wide, spec, ints.dtype).view(b, h, t // bs, bs, -1)
    index = wide.channels.long()[:, :, :, None, :].expand(high.shape)
    ints.view(b, h, t // bs, bs, d).scatter_add_(-1, index, high)
    return ints


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
