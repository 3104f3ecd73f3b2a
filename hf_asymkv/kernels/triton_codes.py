"""The decode attention's fast path over stored codes (issue 37): codes become matrix-product operands by bit
operations, so that a tile issues few instructions per byte it reads.

**Magic-number conversion.** A code field ``f`` (at most 8 bits, at its bit position in its byte) ORed into the low
byte of the fp16 constant ``0x6400`` (1024.0, whose mantissa step is 1) reads as ``1024 + f``: no integer-to-float
conversion is issued (those run at a quarter of the integer rate, or less). :func:`magic_fp16` does it for each
byte, plainly (integer ops on 16-bit lanes, then a bitcast: what the interpreter tests run) or, with ``ASM``, by one
``lop3`` and two ``prmt`` per four bytes (:data:`MAGIC_ASM`, the same arithmetic; tests/kernels/test_magic_asm.py
runs the PTX against the plain form). The 1024 is removed once per tile on the product's other side: a row sum of
the query (keys) or of the weights (values), taken over the operand exactly as rounded for the product.

**Fields in place.** A token-packed block of ``PB`` tokens stores a plane set of width ``W`` as ``PB * W / 8`` byte
rows; token ``t`` of the block sits in row ``t % rows`` at bit ``W * (t // rows)``. A tile gathers, for each of its
tokens, that byte (a byte shared by ``8 / W`` tokens is loaded that many times: the loads hit the cache, and each
load instruction moves 16 bytes) and masks the field where it lies, so the operand holds ``1024 + f * 2**shift``;
the factor ``2**-shift`` is one number per token, folded into the scores (keys) or the weights (values). Codes of
two plane sets (3 = 2 + 1, 5 = 4 + 1, 6 = 4 + 2 bits) take one product per plane set. 8-bit codes are their own
field (int8 codes flipped to offset binary by ``^ 0x80``).

**One tile per key block.** A tile holds the tokens of one key scale group (or a power-of-two part of it): the
per-channel scale is folded into the query once per tile, ``(q * s) . c``, and the wide channels of compact keys
(:mod:`hf_asymkv.core.wide`) are one small product per tile, their query columns gathered once.

Values carry one scale and zero per token: ``sum_t p_t (s_t c_t + z_t)`` is ``w . X`` with ``w = p * s * 2**-shift``
(rounded to the operand dtype), minus ``1024 * sum(w)``, plus ``sum_t p_t (z_t - offset * s_t)``: a per-row number
kept beside the accumulator and added once at the end.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["MAGIC_ASM", "fast_split", "magic_fp16", "mask_bias", "mma"]

MAGIC_ASM = tl.constexpr(
    "{ .reg .b32 t; lop3.b32 t, $2, $3, $4, 0x6a; prmt.b32 $0, t, 0x64646464, 0x5140; "
    "prmt.b32 $1, t, 0x64646464, 0x7362; }")
"""Four bytes at a time: ``t = (codes & mask) ^ flip`` (lop3 LUT 0x6a), then bytes 0, 1 and 2, 3 of ``t`` each under a
0x64 high byte (prmt): two registers of two fp16 ``1024 + t_i``. Equal to the plain form of :func:`magic_fp16` when
``flip & ~mask == 0``."""
MAGIC_SUB_ASM = tl.constexpr(
    "{ .reg .b32 t; lop3.b32 t, $2, $3, $4, 0x6a; prmt.b32 $0, t, 0x64646464, 0x5140; "
    "prmt.b32 $1, t, 0x64646464, 0x7362; sub.f16x2 $0, $0, $5; sub.f16x2 $1, $1, $6; }")
""":data:`MAGIC_ASM`, then the magic constant (or more) taken off in fp16 pairs: exact small integers."""
MAGIC = tl.constexpr(1024.0)  # the fp16 constant 0x6400


@triton.jit
def magic_fp16(codes, mask, flip, ASM: tl.constexpr, PURE: tl.constexpr = True):
    """fp16 ``1024 + ((codes & mask) ^ flip)`` of uint8 ``codes`` (``mask``, ``flip``: uint8, broadcast to ``codes``;
    ``flip`` within ``mask``). ``PURE=False`` marks the conversion as having effects (it has none): the compiler then
    sizes the product's operand fragments for 16-bit data, not for the 8-bit bytes behind them (see
    :func:`_field_operand`)."""
    if ASM:
        return tl.inline_asm_elementwise(MAGIC_ASM, "=r,=r,r,r,r", [codes, mask, flip], dtype=tl.float16,
                                         is_pure=PURE, pack=4)
    return (((codes & mask) ^ flip).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)


@triton.jit
def exact_fp16(codes, mask, flip, offset, ASM: tl.constexpr):
    """:func:`magic_fp16` minus ``offset`` (an fp16 tensor, broadcast), in fp16: ``((codes & mask) ^ flip) + 1024 -
    offset``, exact for the integers involved."""
    if ASM:
        return tl.inline_asm_elementwise(MAGIC_SUB_ASM, "=r,=r,r,r,r,r,r", [codes, mask, flip, offset],
                                         dtype=tl.float16, is_pure=True, pack=4)
    return magic_fp16(codes, mask, flip, False) - offset


@triton.jit
def _pow2(exponent):
    """``2.0 ** exponent`` (float32) of an integer tensor in [-126, 127], by placing it in the exponent field."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _field_operand(base, tb0, order, s_t, cols, S: tl.constexpr, SL: tl.constexpr, TILE: tl.constexpr,
                   ASM: tl.constexpr, WIDTH: tl.constexpr, START: tl.constexpr, PB: tl.constexpr,
                   HEAD_DIM: tl.constexpr, FLIP: tl.constexpr, PACKED: tl.constexpr, EXACT: tl.constexpr = False,
                   PURE: tl.constexpr = True):
    """``(operand [N, C] fp16, shift [N])`` of the tile's tokens ``order`` (``[N]``, from the tile's first; slice
    ``S`` of ``SL`` tokens, ``order == S * SL + [0, SL)``, or ``S < 0``: any order): each token's ``WIDTH``-bit field of
    one plane set (or its 8-bit code), as ``1024 + field * 2**shift``. ``base``: the block's first byte (token-packed;
    ``tb0`` the tile's first token in it) or the tile's first token's row (8-bit, ``s_t`` its row stride); ``cols``:
    the channels.

    A slice inside one field of a block that is the tile (``PB == TILE``, ``SL`` at most the plane set's byte rows)
    reads whole byte rows under one constant mask: the compiler then converts the bytes where the product reads them,
    with no float copy of the tile through shared memory. Otherwise each token's byte is gathered and masked where
    its field lies."""
    if PACKED:
        rows: tl.constexpr = PB * WIDTH // 8
        if S >= 0 and PB == TILE and SL <= rows:
            row0: tl.constexpr = S * SL % rows
            SHIFT: tl.constexpr = S * SL // rows * WIDTH
            codes = tl.load(base + (START + row0 + tl.arange(0, SL))[:, None] * HEAD_DIM + cols[None, :])
            mask = tl.full([1, 1], ((1 << WIDTH) - 1) << SHIFT, tl.uint8)
            return magic_fp16(codes, mask, tl.zeros_like(mask), ASM), tl.full([SL], SHIFT, tl.int32)
        tb = tb0 + order
        shift = (tb // rows) * WIDTH
        codes = tl.load(base + (START + tb % rows)[:, None] * HEAD_DIM + cols[None, :])
        mask = (((1 << WIDTH) - 1) << shift).to(tl.uint8)[:, None]
        return magic_fp16(codes, mask, tl.zeros_like(mask), ASM, PURE), shift
    codes = tl.load(base + order[:, None] * s_t + cols[None, :]).to(tl.uint8, bitcast=True)
    flip = tl.full([1, 1], FLIP, tl.uint8)
    if EXACT:
        offset = tl.full([1, 1], 1024.0 + FLIP, tl.float16)
        return exact_fp16(codes, tl.full([1, 1], 255, tl.uint8), flip, offset, ASM), tl.zeros_like(order)
    return magic_fp16(codes, tl.full([1, 1], 255, tl.uint8), flip, ASM), tl.zeros_like(order)


@triton.jit
def mma(a, b, acc, DOT: tl.constexpr):
    """``acc + a @ b`` with operands in ``DOT`` and a float32 result (exact float32 products for float32 operands)."""
    if DOT == tl.float32:
        return tl.dot(a.to(DOT), b.to(DOT), acc, input_precision="ieee")
    return tl.dot(a.to(DOT), b.to(DOT), acc)


@triton.jit
def _dot(a, b, QDOT: tl.constexpr):
    return mma(a, b, tl.zeros([a.shape[0], b.shape[1]], tl.float32), QDOT)


@triton.jit
def _scores(qs, x, QDOT: tl.constexpr, LEFT: tl.constexpr):
    """``qs @ x^T`` ``[R, T]`` (float32) for query rows ``qs`` ``[R, C]`` and code operands ``x`` ``[T, C]``; with
    ``LEFT`` computed as ``(x @ qs^T)^T``: the codes on the product's M side."""
    if LEFT:
        return tl.trans(_dot(x, tl.trans(qs), QDOT))
    return _dot(qs, tl.trans(x), QDOT)


@triton.jit
def _mix(w, x, acc, QDOT: tl.constexpr, LEFT: tl.constexpr):
    """``acc + w @ x`` ``[R, D]`` for weights ``w`` ``[R, T]`` and code operands ``x`` ``[T, D]``; with ``LEFT``
    computed as ``(x^T @ w^T + acc^T)^T``."""
    if LEFT:
        return tl.trans(mma(tl.trans(x), tl.trans(w), tl.trans(acc), QDOT))
    return mma(w, x, acc, QDOT)


@triton.jit
def mask_bias(mask_ptr, sm_b, sm_h, sm_q, sm_k, b, head, qpos, col, valid, q_len, kv_len, MODE: tl.constexpr):
    """Additive log2-domain bias ``[R, T]`` of the mask at (row's query head and position, column); -inf where
    ``valid`` is false. Modes: 0 none, 1 bool, 2 additive, 3 causal (bottom-right aligned)."""
    if MODE == 0:
        bias = tl.zeros(valid.shape, tl.float32)
    elif MODE == 3:  # causal, bottom-right aligned: query i sees columns <= kv_len - q_len + i
        bias = tl.where(col <= kv_len - q_len + qpos, 0.0, float("-inf"))
    else:
        ptrs = mask_ptr + b * sm_b + head * sm_h + qpos * sm_q + col * sm_k
        m = tl.load(ptrs, mask=valid, other=0)
        if MODE == 1:
            bias = tl.where(m != 0, 0.0, float("-inf"))
        else:
            # clamped first: a dtype's lowest value (transformers' eager masks) would overflow to -inf times log2(e)
            bias = tl.maximum(m.to(tl.float32), -1.0e38) * 1.4426950408889634
    return tl.where(valid, bias, float("-inf"))


@triton.jit
def _key_scores(qs, sq, kc_base, tb0, order, ch, s_t, S: tl.constexpr, SL: tl.constexpr, TILE: tl.constexpr,
                ASM: tl.constexpr, QDOT: tl.constexpr, HEAD_DIM: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr,
                PB: tl.constexpr, FLIP: tl.constexpr, PACKED: tl.constexpr, LEFT: tl.constexpr):
    """``sum_c qs[r, c] * code[t, c]`` ``[R, SL]`` for the stored (unsigned) codes of slice ``S`` of the tile (8-bit
    codes: the flipped code's offset taken off in the operand); ``sq`` the row sums of ``qs`` as rounded for the
    product."""
    if not PACKED:  # 8-bit codes: exact operands (the flipped code's offset taken off in fp16), no row sum needed
        x, shift = _field_operand(kc_base, tb0, order, s_t, ch, S, SL, TILE, ASM, 8, 0, 1, HEAD_DIM, FLIP, False, True)
        return _scores(qs, x, QDOT, LEFT)
    x, shift = _field_operand(kc_base, tb0, order, s_t, ch, S, SL, TILE, ASM, W0, 0, PB, HEAD_DIM, 0, True)
    scores = (_scores(qs, x, QDOT, LEFT) - MAGIC * sq[:, None]) * _pow2(-shift)[None, :]
    if W1 > 0:
        start: tl.constexpr = PB * W0 // 8
        x, shift = _field_operand(kc_base, tb0, order, s_t, ch, S, SL, TILE, ASM, W1, start, PB, HEAD_DIM, 0, True)
        scores += (_scores(qs, x, QDOT, LEFT) - MAGIC * sq[:, None]) * _pow2(W0 - shift)[None, :]
    return scores


@triton.jit
def _wide_query(qs32, kwc_base, skwc_n, skwc_r, t0, QDOT: tl.constexpr, TG: tl.constexpr, BITS: tl.constexpr,
                WIDE: tl.constexpr, WIDE_PAD: tl.constexpr, SYMMETRIC: tl.constexpr):
    """``(qw [R, WIDE_PAD], row constant [R])`` of the block's wide channels, once per tile: the query's columns at
    the ``WIDE`` chosen channels (padded to ``WIDE_PAD`` >= 16), slot ``j``'s scaled by ``2**(BITS - j % 8)`` (its
    bit is bit ``j % 8`` of byte ``j // 8``), rounded to ``QDOT``; and what every token's scores owe the rows, the
    magic constant's share ``-1024 * sum(qw)`` (and ``-2**(BITS - 1) * sum(q)`` for symmetric codes)."""
    slot = tl.arange(0, WIDE_PAD)
    used = slot < WIDE
    chosen = tl.load(kwc_base + (t0 // TG) * skwc_n + slot * skwc_r, mask=used, other=0).to(tl.int32)
    picked = tl.gather(qs32, tl.broadcast_to(chosen[None, :], [qs32.shape[0], WIDE_PAD]), axis=1)
    picked = tl.where(used[None, :], picked, 0.0)
    qw = (picked * _pow2(BITS - slot % 8)[None, :]).to(QDOT)
    const = tl.sum(qw.to(tl.float32), 1) * -MAGIC
    if SYMMETRIC:
        const += -(2.0 ** (BITS - 1)) * tl.sum(picked, 1)
    return qw, const


@triton.jit
def _wide_scores(qw, kw_base, skw_t, skw_p, tok, ASM: tl.constexpr, QDOT: tl.constexpr, WIDE: tl.constexpr,
                 WIDE_PAD: tl.constexpr):
    """What the wide channels' high bits of tokens ``tok`` add to their scores ``[R, T]`` (less the row constant of
    :func:`_wide_query`): one product over the slots."""
    slot = tl.arange(0, WIDE_PAD)
    used = slot < WIDE
    codes = tl.load(kw_base + tok[:, None] * skw_t + (slot // 8)[None, :] * skw_p, mask=used[None, :], other=0)
    bit = (1 << (slot % 8)).to(tl.uint8)[None, :]
    return _dot(qw, tl.trans(magic_fp16(codes, bit, tl.zeros_like(bit), ASM)), QDOT)


@triton.jit
def _value_products(p, acc, vc_base, tb0, order, ch, svc_t, vs, TILE: tl.constexpr,
                    ASM: tl.constexpr, QDOT: tl.constexpr, HEAD_DIM: tl.constexpr, W0: tl.constexpr,
                    W1: tl.constexpr, PB: tl.constexpr, FLIP: tl.constexpr, PACKED: tl.constexpr, LEFT: tl.constexpr):
    """``(acc + w . X, the rounded weights' magic share)`` for the value codes of the tile's tokens ``order`` (weights
    ``p`` ``[R, T]``, scales ``vs`` ``[T]``, in that order): ``w = p * scale * 2**-shift`` per plane set (rounded to ``QDOT``), ``X`` the
    plane set's ``1024 + field * 2**shift``. Returns the new accumulator and ``-1024 * w`` ``[R, SL]`` summed over plane
    sets (the caller sums it over tokens with the row's other per-token terms: one reduction across the tile's warps,
    not one per term)."""
    x, shift = _field_operand(vc_base, tb0, order, svc_t, ch, -1, TILE, TILE, ASM, W0 if PACKED else 8, 0, PB, HEAD_DIM,
                              FLIP, PACKED, False, False)
    weights = p * vs[None, :]
    if PACKED:
        w = (weights * _pow2(-shift)[None, :]).to(QDOT)
    else:
        w = weights.to(QDOT)
    acc = _mix(w, x, acc, QDOT, LEFT)
    magic = w.to(tl.float32)
    if W1 > 0:
        start: tl.constexpr = PB * W0 // 8
        x, shift = _field_operand(vc_base, tb0, order, svc_t, ch, -1, TILE, TILE, ASM, W1, start, PB, HEAD_DIM, 0, True,
                                  False, False)
        w = (weights * _pow2(W0 - shift)[None, :]).to(QDOT)
        acc = _mix(w, x, acc, QDOT, LEFT)
        magic += w.to(tl.float32)
    return acc, magic * -MAGIC  # the tensor first: under the interpreter, constexpr * tensor stays a constexpr


@triton.jit
def _fold_max(parts, SLICES: tl.constexpr):
    """Elementwise maximum of the tuple's ``SLICES`` tensors: a row max over all of them is then one reduction."""
    out = parts[0]
    for s in tl.static_range(1, SLICES):
        out = tl.maximum(out, parts[s])
    return out


@triton.jit
def _interleave(parts, SLICES: tl.constexpr):
    """The tuple's ``SLICES`` (1, 2 or 4) tensors ``[R, SL]`` as one ``[R, SLICES * SL]``, element ``k`` of a row from
    slice ``k % SLICES`` at ``k // SLICES`` (:func:`_interleaved_order`): joined in registers, no data moves."""
    if SLICES == 1:
        out = parts[0]
    elif SLICES == 2:
        out = tl.reshape(tl.join(parts[0], parts[1]), [parts[0].shape[0], 2 * parts[0].shape[1]])
    else:
        both = tl.join(tl.join(parts[0], parts[2]), tl.join(parts[1], parts[3]))
        out = tl.reshape(both, [parts[0].shape[0], 4 * parts[0].shape[1]])
    return out


@triton.jit
def _interleaved_order(SLICES: tl.constexpr, SL: tl.constexpr):
    """``[SLICES * SL]``: the tile's token at each position of :func:`_interleave`'s rows."""
    k = tl.arange(0, SLICES * SL)
    return (k % SLICES) * SL + k // SLICES


@triton.jit
def fast_split(q, kc_base, skc_t, ks_base, kz_base, sks_t, sks_d, vc_base, svc_t, vs_base, vz_base, svs_t,
               kw_base, skw_t, skw_p, kwc_base, skwc_n, skwc_r, mask_ptr, sm_b, sm_h, sm_q, sm_k,
               col0, t_start, t_stop, b, heads, qpos, rows_ok, q_len, kv_len,
               HEAD_DIM: tl.constexpr, R_PAD: tl.constexpr, TILE: tl.constexpr, MASK: tl.constexpr,
               QDOT: tl.constexpr, ASM: tl.constexpr,
               K_PACKED: tl.constexpr, K_FLIP: tl.constexpr, K_W0: tl.constexpr, K_W1: tl.constexpr,
               K_PB: tl.constexpr, K_TG: tl.constexpr, K_CG: tl.constexpr, K_ZERO: tl.constexpr,
               K_OFFSET: tl.constexpr, V_PACKED: tl.constexpr, V_FLIP: tl.constexpr, V_W0: tl.constexpr,
               V_W1: tl.constexpr, V_PB: tl.constexpr, V_ZERO: tl.constexpr, V_OFFSET: tl.constexpr,
               K_WIDE: tl.constexpr, K_WIDE_PAD: tl.constexpr, K_LEFT: tl.constexpr, V_LEFT: tl.constexpr,
               SLICES: tl.constexpr):
    """Online softmax over quantized tokens ``[t_start, t_stop)`` (whole tiles, ``TILE`` dividing the key scale group
    ``K_TG`` and the packing blocks): ``(acc [R, D], m [R], l [R])`` (the values' per-row constant already added).

    A tile is read in ``SLICES`` slices of ``TILE / SLICES`` tokens, each its own products (see
    :func:`_field_operand`: a slice inside one field of every plane set converts its codes where the product reads
    them); the softmax steps that reduce over tokens (row max, sums) run once per tile, over the slices folded
    elementwise. Code offsets (``K_OFFSET``, ``V_OFFSET``): what to subtract from the stored unsigned code to get the
    code the scale multiplies (128 for flipped int8 codes, ``2**(bits - 1)`` for symmetric sub-byte codes, else 0).
    ``K_LEFT`` and ``V_LEFT`` put the codes on the left of their products (:func:`_scores`, :func:`_mix`): the same
    sums, laid out differently by the compiler. The launcher picks slices and sides per format
    (``hf_asymkv.kernels.decode.fast_slices``, ``codes_left``)."""
    SL: tl.constexpr = TILE // SLICES
    ch = tl.arange(0, HEAD_DIM)
    tok = tl.arange(0, SL)
    order = _interleaved_order(SLICES, SL)  # the values' token order: the slices' weights interleaved
    m_i = tl.full([R_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([R_PAD], tl.float32)
    z_i = tl.zeros([R_PAD], tl.float32)  # the values' per-row constant, beside acc
    acc = tl.zeros([R_PAD, HEAD_DIM], tl.float32)
    q_dot = q.to(QDOT)  # the scale multiplies in the operand dtype (fp16 pairs on a GPU): one rounding less to pay
    for t0 in range(t_start, t_stop, TILE):
        meta = (t0 // K_TG) * sks_t + (ch // K_CG) * sks_d
        qs = q_dot * tl.load(ks_base + meta).to(QDOT)[None, :]
        if K_PACKED:
            sq = tl.sum(qs.to(tl.float32), 1)
            const = -K_OFFSET * sq  # the true scores are scores + const
        else:
            sq = tl.zeros([R_PAD], tl.float32)  # 8-bit codes are exact operands: nothing to take off
            const = tl.zeros([R_PAD], tl.float32)
        k_base = kc_base + (t0 - t0 % K_PB) * skc_t  # 8-bit codes: K_PB is 1
        if K_ZERO:
            const += tl.sum(q * tl.load(kz_base + meta).to(tl.float32)[None, :], 1)
        if K_WIDE > 0:
            qw, wide_const = _wide_query(qs.to(tl.float32), kwc_base, skwc_n, skwc_r, t0, QDOT, K_TG, K_W0 + K_W1,
                                         K_WIDE, K_WIDE_PAD, K_OFFSET > 0)
            const += wide_const
        scores = ()
        for s in tl.static_range(SLICES):
            part = _key_scores(qs, sq, k_base, t0 % K_PB, s * SL + tok, ch, skc_t, s, SL, TILE, ASM, QDOT, HEAD_DIM,
                               K_W0 if K_PACKED else 8, K_W1, K_PB, K_FLIP, K_PACKED, K_LEFT)
            if K_WIDE > 0:
                part += _wide_scores(qw, kw_base, skw_t, skw_p, t0 + s * SL + tok, ASM, QDOT, K_WIDE, K_WIDE_PAD)
            if MASK != 0:
                valid = rows_ok[:, None] & (tok >= 0)[None, :]
                part += mask_bias(mask_ptr, sm_b, sm_h, sm_q, sm_k, b, heads[:, None], qpos[:, None],
                                  col0 + t0 + s * SL + tok[None, :], valid, q_len, kv_len, MASK)
            scores = scores + (part,)
        m_new = tl.maximum(m_i, tl.max(_fold_max(scores, SLICES), 1) + const)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(_interleave(scores, SLICES) - (m_safe - const)[:, None])  # [R, TILE], tokens in `order`
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        vs = tl.load(vs_base + (t0 + order) * svs_t).to(tl.float32)
        if V_PACKED:
            acc, magic = _value_products(p, acc * alpha[:, None], vc_base + (t0 - t0 % V_PB) * svc_t, t0 % V_PB, order,
                                         ch, svc_t, vs, TILE, ASM, QDOT, HEAD_DIM, V_W0, V_W1, V_PB, 0, True, V_LEFT)
        else:
            acc, magic = _value_products(p, acc * alpha[:, None], vc_base + t0 * svc_t, 0, order, ch, svc_t, vs, TILE,
                                         ASM, QDOT, HEAD_DIM, 8, 0, 1, V_FLIP, False, V_LEFT)
        zero = -V_OFFSET * vs
        if V_ZERO:
            zero += tl.load(vz_base + (t0 + order) * svs_t).to(tl.float32)
        z_i = z_i * alpha + tl.sum(magic + p * zero[None, :], 1)
    return acc + z_i[:, None], m_i, l_i
