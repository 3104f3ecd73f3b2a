"""Sub-byte code packing and :class:`PackedCodes`, the stored codes that know how they were packed.

Codes of 1 to 6 bits are stored ``bits / 8`` bytes per element, split into bit-planes whose widths divide 8
(:func:`plane_widths`: 3 = 2 + 1, 5 = 4 + 1, 6 = 4 + 2). Two layouts, recorded in :attr:`PackedCodes.layout`:

- ``"tokens"``: each block of ``block_size`` tokens is packed along the token axis. A block's codes
  ``[block_size, D]`` become ``[block_size * bits / 8, D]`` byte rows, stored in the block's
  ``[block_size, D * bits / 8]`` slot (the same bytes, row-major), so every bit-plane decodes into a run of
  whole token rows (``block_size * width / 8 * D`` contiguous elements) instead of a few channels of every
  token. The stored tensor keeps one row per token (``[B, H, T, D * bits / 8]``): slicing at block
  boundaries, batch reordering and growth work on rows as usual.
- ``"head_dim"``: codes are packed along the last axis (:func:`pack_bits`), one token per row. Used when the
  tokens are not whole blocks of a suitable size (``block_size`` 1, or not a multiple of
  ``8 // min(plane_widths(bits))``), and for 8-bit codes, which are stored one per byte as they are.

Packing decides the layout once (:func:`pack_codes`); everything that reads codes afterwards reads it from the
value, never from a token count.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

__all__ = [
    "CODE_LAYOUTS",
    "PackedCodes",
    "pack_bits",
    "pack_codes",
    "packs_tokens",
    "plane_widths",
    "unpack_bits",
    "unpack_codes",
]

CODE_LAYOUTS = ("tokens", "head_dim")
"""How the bytes of :class:`PackedCodes` run: along each block's tokens, or along ``head_dim``."""


def plane_widths(bits: int) -> tuple[int, ...]:
    """How ``bits``-wide codes are split for packing: widths that divide 8, low bits first (3 -> (2, 1))."""
    if not 1 <= bits <= 8:
        raise ValueError(f"codes must be 1 to 8 bits wide, got {bits}.")
    return tuple(w for w in (4, 2, 1) if bits & w) if 8 % bits else (bits,)


def packs_tokens(bits: int, block_size: int, tokens: int | None = None) -> bool:
    """Whether :func:`pack_codes` packs ``bits``-wide codes of ``tokens`` tokens along the token axis.

    Yes for sub-byte codes in blocks of ``block_size`` > 1 tokens that every bit-plane divides (a multiple of
    ``8 // min(plane_widths(bits))``: 2 for 4 bits, 4 for 2 and 6 bits, 8 for 1, 3 and 5 bits) when ``tokens`` is
    a whole number of blocks (or not given); otherwise codes pack along ``head_dim`` (:func:`pack_bits`).
    """
    if bits >= 8 or block_size < 2 or block_size % (8 // min(plane_widths(bits))):
        return False
    return tokens is None or tokens % block_size == 0


@dataclass(frozen=True)
class PackedCodes:
    """Stored codes of one tensor kind, with how they were packed (optimum-quanto's ``PackedTensor`` idea).

    Attributes:
        data: ``[B, H, T, P]`` with ``P = D * bits / 8`` (uint8 for sub-byte codes; int8, uint8 or float8 codes
            for 8-bit formats, one per byte).
        bits: code width, 2 to 8.
        layout: one of :data:`CODE_LAYOUTS` (see the module docstring); 8-bit codes are ``"head_dim"``.
        block_size: tokens per packed block (the unit of the ``"tokens"`` layout).

    Raises:
        ValueError: an unknown layout, or a ``"tokens"`` layout that cannot hold these codes (8-bit codes, a
            block the bit-planes do not divide, or ``T`` not a whole number of blocks).
    """

    data: torch.Tensor
    bits: int
    layout: str
    block_size: int = 1

    def __post_init__(self) -> None:
        if self.layout not in CODE_LAYOUTS:
            raise ValueError(f"layout must be one of {list(CODE_LAYOUTS)}, got {self.layout!r}.")
        if self.layout == "tokens" and not packs_tokens(self.bits, self.block_size, self.data.shape[2]):
            raise ValueError(f"{self.bits}-bit codes of {self.data.shape[2]} tokens cannot be packed along tokens in "
                             f"blocks of {self.block_size} (sub-byte codes, whole blocks, and a block every bit-plane "
                             "divides are needed).")

    @property
    def tokens(self) -> int:
        return self.data.shape[2]

    @property
    def head_dim(self) -> int:
        width = self.data.shape[-1]
        return width if self.bits >= 8 else width * 8 // self.bits

    @property
    def device(self) -> torch.device:
        return self.data.device

    def with_data(self, data: torch.Tensor) -> PackedCodes:
        """The same layout over other rows of the same kind (a moved, reordered or selected batch)."""
        return replace(self, data=data)

    def token_slice(self, start: int, stop: int) -> PackedCodes:
        """Tokens ``[start, stop)`` (a view). Token-packed codes can only be cut at block boundaries.

        Raises:
            ValueError: a ``"tokens"`` layout and a bound that is not a multiple of ``block_size``.
        """
        if self.layout == "tokens" and (start % self.block_size or stop % self.block_size):
            raise ValueError(f"codes packed along tokens in blocks of {self.block_size} can only be sliced at block "
                             f"boundaries, got tokens [{start}, {stop}).")
        return replace(self, data=self.data[:, :, start:stop])


def pack_codes(codes: torch.Tensor, bits: int, block_size: int = 1) -> PackedCodes:
    """Pack unsigned codes ``[B, H, T, D]`` (uint8, ``< 2**bits``) into ``[B, H, T, D * bits // 8]`` bytes.

    Token packing when :func:`packs_tokens` says so for ``T``: each block's ``[block_size, D]`` codes are
    packed along the token axis with :func:`pack_bits` into ``[block_size * bits // 8, D]`` byte rows, stored in
    the block's ``[block_size, D * bits // 8]`` slot (same bytes, row-major). Byte row ``i`` of plane ``j`` of a
    plane set of width ``w`` holds token ``i + j * block_size * w // 8`` of the block. Otherwise
    :func:`pack_bits` along ``head_dim``. 8-bit codes (any dtype) are kept as they are.
    """
    if bits >= 8:
        return PackedCodes(codes, bits, "head_dim", block_size)
    b, h, t, d = codes.shape
    if not packs_tokens(bits, block_size, t):
        return PackedCodes(pack_bits(codes, bits), bits, "head_dim", block_size)
    tokens_last = codes.reshape(b, h, t // block_size, block_size, d).transpose(-1, -2)  # [B, H, nb, D, bs]
    packed = pack_bits(tokens_last, bits).transpose(-1, -2)  # [B, H, nb, bs * bits // 8, D]
    return PackedCodes(packed.contiguous().view(b, h, t, d * bits // 8), bits, "tokens", block_size)


def unpack_codes(packed: PackedCodes) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: a new ``[B, H, T, D]`` tensor (uint8 for sub-byte codes).

    Token-packed blocks decode plane set by plane set (:func:`plane_widths`), each plane into a run of whole token
    rows of every block (``block_size * w // 8 * D`` contiguous elements), high plane sets OR-ed in with their
    shift (:func:`_split_planes`). Every operation works on bytes; callers convert once.
    """
    if packed.bits >= 8:
        return packed.data.clone()
    if packed.layout == "head_dim":
        return unpack_bits(packed.data, packed.bits)
    b, h, t, _ = packed.data.shape
    bits, block_size, d = packed.bits, packed.block_size, packed.head_dim
    nb = t // block_size
    rows = packed.data.reshape(b, h, nb, block_size * bits // 8, d)  # a view for block-aligned slices of a buffer
    if torch.compiler.is_compiling():  # a graph takes no `out=` into views; the compiler fuses this form anyway
        return _unpack_token_planes(rows, bits, block_size).view(b, h, t, d)
    out = torch.empty(b, h, nb, block_size, d, dtype=torch.uint8, device=packed.device)
    start, shift = 0, 0
    for width in plane_widths(bits):
        r = block_size * width // 8  # byte rows of the plane set; its plane j holds the block's tokens [j*r, (j+1)*r)
        planes = out.view(b, h, nb, 8 // width, r, d)
        _split_planes(rows[:, :, :, None, start : start + r], width, shift, planes)
        start, shift = start + r, shift + width
    return out.view(b, h, t, d)


def _split_planes(part: torch.Tensor, width: int, shift: int, planes: torch.Tensor) -> None:
    """Decode token-packed byte rows ``part`` ``[B, H, nb, 1, r, D]`` into ``planes`` ``[B, H, nb, 8 // width, r, D]``:
    plane ``j`` takes bits ``[j * width, (j + 1) * width)`` of each byte to bits ``[shift, shift + width)`` of the
    code. The first plane set (``shift`` 0) writes ``planes``, later ones are OR-ed in.

    Four or eight planes per byte are split by one broadcast shift (on a CPU 1.4-2x faster than a shift-and-mask per
    plane, each a dispatch and a strided write); nibbles by their two ops, which beat the broadcast.
    """
    mask = (1 << width) - 1
    if width == 4 and shift == 0:
        torch.bitwise_and(part[:, :, :, 0], mask, out=planes[:, :, :, 0])
        torch.bitwise_right_shift(part[:, :, :, 0], 4, out=planes[:, :, :, 1])
        return
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=part.device).view(-1, 1, 1)
    if shift == 0:
        torch.bitwise_right_shift(part, shifts, out=planes)
        planes &= mask
    else:
        planes |= (part >> shifts).bitwise_and_(mask).bitwise_left_shift_(shift)


def _unpack_token_planes(rows: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    """:func:`unpack_codes` of token-packed blocks without in-place writes: ``[B, H, nb, block_size * bits / 8, D]``
    byte rows -> ``[B, H, nb, block_size, D]`` codes (the same bytes, for compiled graphs)."""
    b, h, nb, _, d = rows.shape
    codes, start, shift = None, 0, 0
    for width in plane_widths(bits):
        r, mask = block_size * width // 8, (1 << width) - 1
        part = rows[:, :, :, None, start : start + r]  # [B, H, nb, 1, r, D]
        shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=rows.device).view(-1, 1, 1)
        # one broadcast shift, not a concatenation of planes: the compiler inlines it into what reads the codes
        plane = ((part >> shifts) & mask).reshape(b, h, nb, block_size, d)
        codes = plane if codes is None else codes | (plane << shift)
        start, shift = start + r, shift + width
    return codes


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``bits``-wide codes (``uint8`` in ``[0, 2**bits)``) along the last axis, in bit-planes.

    For widths that divide 8 (1, 2, 4), with ``P = D * bits // 8``, byte ``i`` holds
    element ``i + j*P`` in bits ``[j*bits, (j+1)*bits)``: plane ``j`` (channels ``[j*P, (j+1)*P)``) is one shift-and-mask away from a
    contiguous slice, so decoding writes each plane into a contiguous slice of the output instead of
    interleaving nibbles. Other widths are split into such parts (:func:`plane_widths`, e.g. 3 = 2 + 1: the low
    2 bits of every code packed 4 per byte, then the high bit packed 8 per byte), concatenated along the last
    axis: still exactly ``D * bits / 8`` bytes.

    Args:
        codes: ``[..., D]`` uint8 with ``D`` a multiple of ``8 // min(plane_widths(bits))``.

    Returns:
        ``[..., D * bits // 8]`` uint8.
    """
    widths = plane_widths(bits)
    if len(widths) > 1:
        parts, shift = [], 0
        for w in widths:
            part = (codes >> shift) if shift else codes
            parts.append(pack_bits(part & ((1 << w) - 1), w))
            shift += w
        return torch.cat(parts, dim=-1)
    per_byte = 8 // bits
    planes = codes.reshape(*codes.shape[:-1], per_byte, codes.shape[-1] // per_byte)
    out = planes[..., 0, :].clone()
    for j in range(1, per_byte):
        out |= planes[..., j, :] << (j * bits)
    return out


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``[..., P]`` uint8 -> ``[..., P * 8 // bits]`` uint8."""
    widths = plane_widths(bits)
    if len(widths) > 1:
        head_dim = packed.shape[-1] * 8 // bits
        out, start, shift = None, 0, 0
        for w in widths:
            size = head_dim * w // 8
            part = unpack_bits(packed[..., start : start + size], w)
            out = part if out is None else out.bitwise_or_(part << shift)
            start, shift = start + size, shift + w
        return out
    mask = (1 << bits) - 1
    return torch.cat([(packed >> (j * bits)) & mask for j in range(8 // bits)], dim=-1)
