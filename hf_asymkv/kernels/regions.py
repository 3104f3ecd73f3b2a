"""What the decode kernel reads, as plain tensors and a few numbers: no Triton import, no core import.

A call attends one query over a key/value sequence made of *regions*: at most one :class:`QuantizedRegion`
(K and V codes as the cache stores them, :class:`StoredCodes`) and any number of :class:`ExactSegment` (K/V in
a float dtype). Each region says where its tokens sit along the attention mask's key axis (``start``), or
brings its own mask slice; token order does not matter otherwise (softmax is a sum). That is enough to serve
``[sinks][blocks][window]`` as stored now, and an exact sink overlay (blocks quantized from token 0, exact
copies of the first real tokens kept aside): mask the overlaid positions out of the quantized region's mask
and pass the sinks as a segment with their own mask slice.

:func:`unsupported` says, in words, what of a request the kernel cannot serve (None when it can), so that a
caller can fall back or raise before any kernel is compiled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LAYOUTS", "MAX_EXACT_SEGMENTS", "MAX_HEAD_DIM", "MAX_QUERY_ROWS", "MIN_TILE", "ExactSegment", "QuantizedRegion",
           "StoredCodes", "plane_sets", "tile_tokens", "unsupported"]

LAYOUTS = ("tokens", "head_dim")
"""How sub-byte codes are packed: along tokens, block by block (what the cache stores), or along head_dim."""
MAX_HEAD_DIM = 256
MAX_EXACT_SEGMENTS = 2
"""Exact segments one call takes (one kernel launch reads them all beside the quantized region)."""
MAX_QUERY_ROWS = 128
"""Query rows one program holds: query heads per KV head x query tokens (GQA 8 x 16 tokens)."""
MIN_TILE = 16
"""Tokens per tile at least (a GPU matrix-product operand needs 16); key scale groups must be a multiple."""
MAX_TILE = 64
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class StoredCodes:
    """One quantized tensor (K or V) of a layer, as stored: ``x ~ scale * code + zero`` per group.

    Attributes:
        codes: ``[B, H, N, P]``: int8 (symmetric 8-bit), uint8 (asymmetric 8-bit, or packed sub-byte codes,
            ``P = D * bits / 8``) or a float8 dtype (E4M3 ``fn`` or E5M2).
        scale: ``[B, H, N // token_group, D // channel_group]`` (any float dtype); ``token_group`` and
            ``channel_group`` follow from the shapes.
        zero: like ``scale`` (asymmetric codes), or None.
        bits: code width, 2 to 8.
        symmetric: sub-byte symmetric codes are stored with an offset of ``2**(bits - 1)``.
        layout: for sub-byte codes, one of :data:`LAYOUTS`.
        block_size: tokens per token-packed block (``layout="tokens"``).
        rotated: the codes hold ``x @ H`` (orthonormal block-Hadamard along ``head_dim``); values only.
        wide_bits, wide_channels: keys with wide channels (:mod:`hf_asymkv.core.wide`): the high code bits
            ``[B, H, N, ceil(R / 8)]`` and each block's channels ``[B, H, N // block_size, R]`` (uint8), else None.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int
    symmetric: bool
    layout: str = "tokens"
    block_size: int = 1
    rotated: bool = False
    wide_bits: torch.Tensor | None = None
    wide_channels: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return self.codes.shape[2]

    @property
    def head_dim(self) -> int:
        width = self.codes.shape[-1]
        return width if self.bits == 8 else width * 8 // self.bits

    @property
    def token_group(self) -> int:
        return self.tokens // max(1, self.scale.shape[2])

    @property
    def channel_group(self) -> int:
        return self.head_dim // max(1, self.scale.shape[-1])


@dataclass(frozen=True)
class QuantizedRegion:
    """Quantized K and V of the same ``N`` tokens; mask columns ``[start, start + N)`` unless ``mask`` is given
    (``[B|1, 1|Hq, q, N]``, bool or additive).

    ``filled``: a 0-d integer tensor on the codes' device, how many of the ``N`` tokens are stored (a static cache's
    preallocated slots); the kernel reads none past it, rounded up to its tile (the mask must still block the rest
    of that tile). Read on the device only: a CUDA graph replays the launch as the count grows. None: all ``N``."""

    keys: StoredCodes
    values: StoredCodes
    start: int = 0
    mask: torch.Tensor | None = None
    filled: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return self.keys.tokens


@dataclass(frozen=True)
class ExactSegment:
    """Exact K and V ``[B, H, n, D]``; mask columns ``[start, start + n)`` unless ``mask`` is given."""

    keys: torch.Tensor
    values: torch.Tensor
    start: int = 0
    mask: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return self.keys.shape[2]


def plane_sets(bits: int) -> tuple[int, ...]:
    """Widths of the bit-plane sets sub-byte codes are packed in, low bits first (3 -> (2, 1), 6 -> (4, 2)): the
    layout of :func:`hf_asymkv.core.quant.plane_widths`, restated so that the kernels need no core import."""
    return tuple(w for w in (4, 2, 1) if bits & w) if 8 % bits else (bits,)


def tile_tokens(region: QuantizedRegion | None, limit: int = MAX_TILE) -> int:
    """Tokens per tile: at most ``limit``, inside one key scale group (the largest power of two dividing it), so
    that each tile folds one key scale into the query."""
    if region is None:
        return limit
    group = region.keys.token_group
    return min(limit, group & -group)


def _codes_problem(kind: str, stored: StoredCodes, head_dim: int) -> str | None:
    if stored.codes.dtype in _FP8:
        return None if stored.bits == 8 and stored.symmetric else f"{kind}: fp8 codes must be 8-bit symmetric"
    if stored.codes.dtype not in (torch.int8, torch.uint8):
        return f"{kind} codes of dtype {stored.codes.dtype} (int8, uint8 or float8 expected)"
    if stored.bits != 8 and len(plane_sets(stored.bits)) > 2:
        return f"{kind} codes of {stored.bits} bits (1 to 6 and 8 are served)"
    if stored.bits < 8 and stored.layout not in LAYOUTS:
        return f"{kind} codes packed along {stored.layout!r} (one of {list(LAYOUTS)} expected)"
    if stored.bits < 8 and stored.layout == "tokens":
        if stored.codes.stride()[2:] != (stored.codes.shape[-1], 1):
            return f"{kind} token-packed codes whose blocks are not contiguous (strides {stored.codes.stride()})"
        size = stored.block_size
        if size < 1 or stored.tokens % size or any(size * w % 8 for w in plane_sets(stored.bits)):
            return f"{kind} codes token-packed in blocks of {size} tokens for {stored.tokens} {stored.bits}-bit tokens"
    if stored.bits < 8 and stored.layout == "head_dim" and any(head_dim * w % 8 for w in plane_sets(stored.bits)):
        return f"{kind} {stored.bits}-bit codes packed along head_dim {head_dim}"
    if stored.head_dim != head_dim or stored.scale.shape[:2] != stored.codes.shape[:2]:
        return f"{kind} codes of head_dim {stored.head_dim} beside a query of head_dim {head_dim}"
    if stored.token_group * stored.scale.shape[2] != stored.tokens or head_dim % stored.scale.shape[-1]:
        return f"{kind} scales of shape {tuple(stored.scale.shape)} for codes {tuple(stored.codes.shape)}"
    if stored.zero is not None and (stored.zero.shape != stored.scale.shape or stored.zero.stride() != stored.scale.stride()):
        return f"{kind} zeros laid out unlike their scales"
    return None


def unsupported(query: torch.Tensor, region: QuantizedRegion | None, segments: tuple[ExactSegment, ...] = ()
                ) -> str | None:
    """Why the kernel cannot serve this call (a phrase naming the feature and the value), or None if it can.

    Args:
        query: ``[B, Hq, q, D]``.
        region, segments: what :func:`hf_asymkv.kernels.decode.decode_attention` would get.
    """
    b, hq, q_len, head_dim = query.shape
    region = region if region is not None and region.tokens else None  # an empty region is no region
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"a query of dtype {query.dtype}"
    if head_dim > MAX_HEAD_DIM or head_dim < 1:
        return f"head_dim {head_dim} (at most {MAX_HEAD_DIM})"
    kv_heads = region.keys.codes.shape[1] if region is not None else segments[0].keys.shape[1] if segments else hq
    if hq % kv_heads:
        return f"{hq} query heads over {kv_heads} KV heads"
    if hq // kv_heads * q_len > MAX_QUERY_ROWS:
        return f"{hq // kv_heads} query heads per KV head x {q_len} query tokens (at most {MAX_QUERY_ROWS} rows)"
    if len(segments) > MAX_EXACT_SEGMENTS:
        return f"{len(segments)} exact segments (at most {MAX_EXACT_SEGMENTS})"
    for seg in segments:
        if seg.keys.shape != seg.values.shape or seg.keys.shape[-1] != head_dim:
            return f"exact K/V of shapes {tuple(seg.keys.shape)} and {tuple(seg.values.shape)}"
    if region is None:
        return None
    for kind, stored in (("keys", region.keys), ("values", region.values)):
        problem = _codes_problem(kind, stored, head_dim)
        if problem:
            return problem
    if region.keys.rotated:
        return "rotated keys"
    if region.keys.token_group % MIN_TILE or region.keys.channel_group not in (1, head_dim):
        return (f"key scales shared by {region.keys.token_group} tokens x {region.keys.channel_group} channels "
                f"(a multiple of {MIN_TILE} tokens, per channel or per head, is served)")
    if region.values.tokens != region.tokens:
        return f"{region.tokens} quantized keys beside {region.values.tokens} values"
    return None
