"""The fused CPU decode attention: softmax attention straight from the stored codes (``cpu_attention.c``).

The torch implementation of the fused attention (:func:`hf_asymkv.core.attention.fused_attention`, its twin) converts
the whole quantized region's codes to float32 at every step: as many bytes written and read again as a float32 copy of
the history. ``cpu_attention.c`` reads each block's codes once, scores them with the key scales folded into the query,
keeps an online softmax, mixes the value codes with the value scales folded into the weights, and rotates the mixed
rows back once; the history is split across threads and the runs merged at the end. Memory per call is a block of
codes per thread, whatever the context (the C file's header has the arithmetic).

It is built with the native read-out, as one library (:data:`~.cpu_readout.SOURCES`, compiled on first use), and serves
CPU tensors: codes of 1 to 8 bits (uint8/int8) in either packing, keys with scales per channel group per block (wide
channels too), values with a scale per token and group of a multiple of 8 channels (rotated or not), exact parts in
float32, bfloat16 or float16, a boolean or float32 mask (none: causal), head_dim a multiple of 8 up to 256.
:func:`problem` says in words what of a call it cannot serve. This module imports nothing from the core: the core
passes the layout's constants (plane widths, storage offset) that :mod:`hf_asymkv.core.packing` and
:mod:`hf_asymkv.core.quant` define.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from .cpu_readout import build_problem, native_library

__all__ = ["MAX_HEAD_DIM", "MAX_EXACT_PARTS", "ExactPart", "QuantizedPart", "decode_attention", "problem", "run_splits"]

MAX_HEAD_DIM = 256  # the C file's per-row buffers
MAX_EXACT_PARTS = 3  # sinks, window, left-padded rows' sinks
_META = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_MASKS = {None: 0, torch.bool: 1, torch.float32: 2}


@dataclass(frozen=True)
class QuantizedPart:
    """One quantized tensor (K or V) as stored: ``x ~ scale * (code - offset) + zero`` per group.

    Attributes:
        codes: ``[B, H, N, P]`` uint8 or int8 (8-bit symmetric); the last two dims contiguous.
        scale, zero: ``[B, H, N // token_group, D // channel_group]`` float32/float16/bfloat16 (zero None: symmetric),
            the last two dims contiguous; keys: one row per block, values: one row per token.
        bits: code width; planes: its bit-plane set widths, low bits first (``packing.plane_widths``).
        tokens_layout: packed along each block's tokens (else along head_dim, or 8-bit codes).
        offset: subtracted from every code (the symmetric storage offset of sub-byte codes).
        wide_bits, wide_channels: keys' wide channels ``[B, H, N, ceil(R / 8)]`` and ``[B, H, N // block, R]``, or None.
        wide_offset: subtracted once more from each wide channel's code.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int
    planes: tuple[int, ...]
    tokens_layout: bool
    offset: int = 0
    wide_bits: torch.Tensor | None = None
    wide_channels: torch.Tensor | None = None
    wide_offset: int = 0


@dataclass(frozen=True)
class ExactPart:
    """Exact K and V ``[B, H, n, D]`` at mask columns ``column + j``, or at ``positions[b, j]`` where ``valid[b, j]``
    (``[B, n]``: left-padded rows' sinks that replace positions of the quantized region)."""

    keys: torch.Tensor
    values: torch.Tensor
    column: int = 0
    positions: torch.Tensor | None = None
    valid: torch.Tensor | None = None


def _fields(*names: str) -> list[tuple[str, type]]:
    return [(name, ctypes.c_void_p if name.startswith("*") else ctypes.c_int64) for name in names]


class _Codes(ctypes.Structure):
    """Mirror of ``asymkv_codes`` (pointers and int64 only; names with ``*`` are pointers)."""

    _fields_ = [(n.lstrip("*"), t) for n, t in _fields(
        "*codes", "codes_stride_b", "codes_stride_h", "bits", "tokens_layout", "signed_bytes", "offset", "plane0",
        "plane1", "plane2", "plane_count", "*scale", "*zero", "meta_kind", "meta_stride_b", "meta_stride_h",
        "channel_group", "*wide_bits", "wide_bits_stride_b", "wide_bits_stride_h", "*wide_channels",
        "wide_channels_stride_b", "wide_channels_stride_h", "wide_count", "wide_bytes", "wide_offset")]


class _Exact(ctypes.Structure):
    """Mirror of ``asymkv_exact``."""

    _fields_ = [(n.lstrip("*"), t) for n, t in _fields(
        "*keys", "*values", "keys_stride_b", "keys_stride_h", "values_stride_b", "values_stride_h", "dtype", "tokens",
        "column", "*positions", "*valid")]


class _Attention(ctypes.Structure):
    """Mirror of ``asymkv_attention``."""

    _fields_ = ([(n.lstrip("*"), t) for n, t in _fields("*query", "query_dtype", "query_stride_b", "query_stride_h",
                                                          "query_stride_q")]
        + [("scaling", ctypes.c_double)]
        + [(n.lstrip("*"), t) for n, t in _fields(
            "*out", "batch", "heads", "rows", "q_len", "n_rep", "head_dim", "tokens", "block_size", "column")]
        + [("keys", _Codes), ("values", _Codes)] + _fields("hadamard")
        + [("exact", _Exact * MAX_EXACT_PARTS)]
        + [(n.lstrip("*"), t) for n, t in _fields(
            "exact_count", "overlay", "*mask", "mask_kind", "mask_stride_b", "mask_stride_h", "mask_stride_q", "kv_len",
            "threads", "splits")])


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Whether each ``[b, h]`` of ``t`` holds contiguous rows (a token slice of a larger buffer does)."""
    return t.stride(-1) == 1 and (t.shape[-2] <= 1 or t.stride(-2) == t.shape[-1])


def _quantized_problem(kind: str, part: QuantizedPart, head_dim: int, block: int) -> str | None:
    """What of one quantized tensor the C kernel cannot read, or None."""
    if part.codes.dtype not in (torch.uint8, torch.int8) or not 1 <= part.bits <= 8:
        return f"{kind} codes of dtype {part.codes.dtype} and {part.bits} bits (1- to 8-bit integer codes are served)"
    if part.scale.dtype not in _META or (part.zero is not None and part.zero.dtype != part.scale.dtype):
        return f"{kind} scales of dtype {part.scale.dtype}"
    if len(part.planes) > 3 or sum(part.planes) != part.bits:
        return f"{kind} bit-plane sets {part.planes} for {part.bits}-bit codes"
    tensors = [t for t in (part.codes, part.scale, part.zero, part.wide_bits, part.wide_channels) if t is not None]
    if not all(_rows_contiguous(t) for t in tensors):
        return f"{kind} parts whose rows are not contiguous"
    if part.zero is not None and part.zero.stride() != part.scale.stride():
        return f"{kind} zeros laid out unlike their scales"
    if part.tokens_layout and any(block * w % 8 for w in part.planes):
        return f"{kind} codes token-packed in blocks of {block}"
    if head_dim % part.scale.shape[-1]:
        return f"{kind} scales of {part.scale.shape[-1]} groups over head_dim {head_dim}"
    return None


def problem(query: torch.Tensor, keys: QuantizedPart, values: QuantizedPart, block: int,
            exact: list[ExactPart], mask: torch.Tensor | None) -> str | None:
    """Why :func:`decode_attention` cannot serve this call (a phrase naming the feature and the value), or None.

    Also None only when the native library builds (:func:`~.cpu_readout.build_problem` otherwise)."""
    d = query.shape[-1]
    tensors = [query, keys.codes, values.codes, *(t for e in exact for t in (e.keys, e.values))]
    if any(t.device.type != "cpu" for t in tensors):
        return "tensors not on the CPU"
    if d % 8 or d > MAX_HEAD_DIM:
        return f"head_dim {d} (a multiple of 8 up to {MAX_HEAD_DIM} is served)"
    if query.dtype not in _META or query.stride(-1) != 1:
        return f"a query of dtype {query.dtype} or whose rows are not contiguous"
    for kind, part in (("keys", keys), ("values", values)):
        why = _quantized_problem(kind, part, d, block)
        if why:
            return why
    if keys.scale.shape[2] * block != keys.codes.shape[2]:
        return f"key scales of {keys.scale.shape[2]} rows for {keys.codes.shape[2]} tokens in blocks of {block}"
    if values.scale.shape[2] != values.codes.shape[2] or (d // values.scale.shape[-1]) % 8:
        return f"value scales of shape {tuple(values.scale.shape)} (one per token and group of 8k channels is served)"
    if keys.wide_channels is not None and keys.wide_channels.shape[-1] > d:
        return f"{keys.wide_channels.shape[-1]} wide channels"
    if len(exact) > MAX_EXACT_PARTS:
        return f"{len(exact)} exact parts (at most {MAX_EXACT_PARTS})"
    for e in exact:
        if e.keys.dtype not in _META or e.values.dtype != e.keys.dtype or not (
                _rows_contiguous(e.keys) and _rows_contiguous(e.values)):
            return f"exact K/V of dtype {e.keys.dtype} or with rows that are not contiguous"
    if mask is not None and (mask.dtype not in _MASKS or mask.stride(-1) != 1):
        return f"a mask of dtype {mask.dtype} (bool or float32, contiguous columns, is served)"
    return build_problem()


def run_splits(batch: int, heads: int, blocks: int, threads: int) -> int:
    """Runs of whole blocks each (batch, KV head) is split into: about four per thread over all of them (so that the
    dynamic schedule keeps every thread busy to the end), at most one per block."""
    if threads <= 1:
        return 1
    return max(1, min(blocks, -(-4 * threads // (batch * heads))))


def _stride(t: torch.Tensor, dim: int) -> int:
    return 0 if t.shape[dim] == 1 else t.stride(dim)


def _codes(part: QuantizedPart, head_dim: int) -> _Codes:
    planes = (*part.planes, 0, 0, 0)[:3]
    wide_bits, wide_channels = part.wide_bits, part.wide_channels
    return _Codes(
        codes=part.codes.data_ptr(), codes_stride_b=part.codes.stride(0), codes_stride_h=part.codes.stride(1),
        bits=part.bits, tokens_layout=int(part.tokens_layout), signed_bytes=int(part.codes.dtype == torch.int8),
        offset=part.offset, plane0=planes[0], plane1=planes[1], plane2=planes[2], plane_count=len(part.planes),
        scale=part.scale.data_ptr(), zero=None if part.zero is None else part.zero.data_ptr(),
        meta_kind=_META[part.scale.dtype], meta_stride_b=part.scale.stride(0), meta_stride_h=part.scale.stride(1),
        channel_group=head_dim // part.scale.shape[-1],
        wide_bits=None if wide_bits is None else wide_bits.data_ptr(),
        wide_bits_stride_b=0 if wide_bits is None else wide_bits.stride(0),
        wide_bits_stride_h=0 if wide_bits is None else wide_bits.stride(1),
        wide_channels=None if wide_channels is None else wide_channels.data_ptr(),
        wide_channels_stride_b=0 if wide_channels is None else wide_channels.stride(0),
        wide_channels_stride_h=0 if wide_channels is None else wide_channels.stride(1),
        wide_count=0 if wide_channels is None else wide_channels.shape[-1],
        wide_bytes=0 if wide_bits is None else wide_bits.shape[-1], wide_offset=part.wide_offset)


def _exact(part: ExactPart) -> _Exact:
    return _Exact(keys=part.keys.data_ptr(), values=part.values.data_ptr(), keys_stride_b=part.keys.stride(0),
                  keys_stride_h=part.keys.stride(1), values_stride_b=part.values.stride(0),
                  values_stride_h=part.values.stride(1), dtype=_META[part.keys.dtype], tokens=part.keys.shape[2],
                  column=part.column, positions=None if part.positions is None else part.positions.data_ptr(),
                  valid=None if part.valid is None else part.valid.data_ptr())


def decode_attention(query: torch.Tensor, scaling: float, *, keys: QuantizedPart, values: QuantizedPart, block: int,
                     column: int, hadamard: int, exact: list[ExactPart], mask: torch.Tensor | None, kv_len: int
                     ) -> torch.Tensor:
    """Softmax attention of ``query`` over one layer as stored; call :func:`problem` first.

    Args:
        query: ``[B, Hq, q, D]`` float32, bfloat16 or float16 with contiguous rows (a transposed view is fine);
            ``Hq = H * n_rep``, query head ``h * n_rep + rep`` reads KV head ``h``. Scores are ``(query * scaling) . k``.
        keys, values: the quantized region (``N`` tokens, whole blocks of ``block``, possibly 0) at mask columns
            ``[column, column + N)``.
        hadamard: the values are stored rotated by Hadamard blocks of this size (0: plain); the output is rotated back.
        exact: the exact parts; one with ``positions`` overlays the region (its valid positions are dropped there).
        mask: ``[B | 1, 1 | Hq, q, kv_len]`` bool or float32 additive, column 0 at the layer's first token; None:
            causal.
        kv_len: tokens of the layer (mask columns).

    Returns:
        ``[B, q, Hq, D]`` float32 (the layout attention functions return).
    """
    b, hq, q_len, d = query.shape
    h = keys.codes.shape[1]
    out = torch.empty(b, q_len, hq, d)
    threads = torch.get_num_threads()
    tokens = keys.codes.shape[2]
    overlay = next((i for i, e in enumerate(exact) if e.positions is not None), -1)
    args = _Attention(
        query=query.data_ptr(), query_dtype=_META[query.dtype], query_stride_b=query.stride(0),
        query_stride_h=query.stride(1), query_stride_q=query.stride(2), scaling=scaling, out=out.data_ptr(), batch=b,
        heads=h, rows=hq // h * q_len, q_len=q_len, n_rep=hq // h, head_dim=d, tokens=tokens, block_size=block,
        column=column, keys=_codes(keys, d), values=_codes(values, d), hadamard=hadamard, exact_count=len(exact),
        overlay=overlay, mask=None if mask is None else mask.data_ptr(),
        mask_kind=_MASKS[None if mask is None else mask.dtype], mask_stride_b=0 if mask is None else _stride(mask, 0),
        mask_stride_h=0 if mask is None else _stride(mask, 1), mask_stride_q=0 if mask is None else _stride(mask, 2),
        kv_len=kv_len, threads=threads, splits=run_splits(b, h, tokens // block if block else 0, threads))
    for i, part in enumerate(exact):
        args.exact[i] = _exact(part)
    status = native_library().asymkv_attention_run(ctypes.byref(args))
    if status:
        raise (MemoryError if status == 2 else ValueError)(
            "the native decode attention " + ("ran out of memory." if status == 2 else
                                              "refused its arguments (a bug in its caller: please report it)."))
    return out
