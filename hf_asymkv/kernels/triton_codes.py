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
two plane sets (3 = 2 + 1, 5 = 4 + 1, 6 = 4 + 2 bits) are joined into one operand, ``1024 + code``, by shifts and
masks per token (:func:`_joined_operand`): one product, not one per plane set. 8-bit codes are their own
field (int8 codes flipped to offset binary by ``^ 0x80``), except int8 keys with fp16 operands: they go to the
tensor cores as loaded, in int8 products against the query written as two int8 digits (:func:`_int8_key_scores`).

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
JOIN_ASM = tl.constexpr(
    "{ .reg .b32 a, t; shf.r.wrap.b32 a, $2, $2, $4; shf.r.wrap.b32 t, $3, $3, $5; lop3.b32 a, a, t, $6, 0xe4; "
    "and.b32 a, a, $7; prmt.b32 $0, a, 0x64646464, 0x5140; prmt.b32 $1, a, 0x64646464, 0x7362; }")
"""Four bytes of two plane sets at a time (``$2``: the low set's bytes, ``$3``: the high set's, ``$4``/``$5``: the
rotations, ``$6``: the low set's field mask, ``$7``: the code's mask): rotate the low set's bytes right by its field's
bit position and the high set's so that its field lands just above (``shf.r.wrap``: the amount is taken mod 32, so the
first byte's rotation serves all four: the four bytes must be one token's, see :func:`_joined_operand`), take the low
field's bits from the first and the rest from the second (lop3 LUT 0xe4: ``c ? a : b``), clear the bits above the
code, and place each byte under a 0x64 high byte (prmt): two registers of two fp16 ``1024 + code``."""
COLUMN_SUM_ELEMENTS = tl.constexpr(1024)
"""Rows x tokens up to which a tile's row sums are kept per token column (:func:`_row_sum_step`): 4 query rows (GQA 4,
one token) of a 128-token tile, 8 per thread at 4 warps for the sums together; more rows take registers, not
instructions."""


@triton.jit
def magic_fp16(codes, mask, flip, ASM: tl.constexpr, PURE: tl.constexpr = True):
    """fp16 ``1024 + ((codes & mask) ^ flip)`` of uint8 ``codes`` (``mask``, ``flip``: uint8, broadcast to ``codes``;
    ``flip`` within ``mask``). ``PURE=False`` marks the conversion as having effects (it has none): the compiler then
    sizes the product's operand fragments for the 16-bit data it returns, not for the bytes behind it (see
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
def _plane_bytes(base, tb, cols, WIDTH: tl.constexpr, START: tl.constexpr, PB: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BITS: tl.constexpr):
    """``(bytes [T, C], bit position [T])``: for each of the tile's tokens ``tb`` (in the block), the byte of the
    ``WIDTH``-bit plane set starting at row ``START`` of a token-packed block (``base``: its first byte) that holds the
    token's field, and where the field lies in it (``rows = PB * WIDTH / 8`` rows per set, token ``t`` in row
    ``t % rows`` at bit ``WIDTH * (t // rows)``). A tile longer than a block (``lean``'s two 32-token blocks) reads
    consecutive blocks of ``PB * BITS / 8`` rows each (``BITS``: the codes' width, all plane sets), ``tb`` counted
    from the first one's start."""
    rows: tl.constexpr = PB * WIDTH // 8
    if tb.shape[0] > PB:
        within = tb % PB
        row = (tb // PB) * (PB * BITS // 8) + START + within % rows
        return tl.load(base + row[:, None] * HEAD_DIM + cols[None, :]), (within // rows) * WIDTH
    shift = (tb // rows) * WIDTH
    return tl.load(base + (START + tb % rows)[:, None] * HEAD_DIM + cols[None, :]), shift


@triton.jit
def _joined_operand(base, tb, cols, ASM: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, PB: tl.constexpr,
                    HEAD_DIM: tl.constexpr):
    """``1024 + code`` ``[T, C]`` (fp16) of codes stored as two plane sets of widths ``W0`` (low bits) and ``W1``,
    token-packed in blocks of ``PB`` tokens (``base``: the block's first byte; ``tb``: the tile's tokens in the block;
    ``cols``: the channels): for each token, its byte of each set (:func:`_plane_bytes`), each field shifted down to
    its place in the code and the two joined.
    One operand and one product where a product per plane set cost a second conversion of the same count, a second
    pass through shared memory and a rescaling per token (``quality``'s values: 164 fewer instructions per warp and
    tile, kernel_report.md).

    With ``ASM`` each group of four bytes is rotated by one amount (:data:`JOIN_ASM`), which is right when the four
    are one token's channels: Triton packs four consecutive elements of a thread, and the loads here give each thread
    16 consecutive channels of a token (``sass.joined_groups_by_token`` checks the compiled layout, the kernel report
    flags any other)."""
    low, s0 = _plane_bytes(base, tb, cols, W0, 0, PB, HEAD_DIM, W0 + W1)
    high, s1 = _plane_bytes(base, tb, cols, W1, PB * W0 // 8, PB, HEAD_DIM, W0 + W1)
    if ASM:
        # impure, as magic_fp16's: the fp16 it returns is what the products' fragments are sized for
        shape: tl.constexpr = low.shape
        return tl.inline_asm_elementwise(
            JOIN_ASM, "=r,=r,r,r,r,r,r,r",
            [low, high, tl.broadcast_to(s0.to(tl.uint8)[:, None], shape),
             tl.broadcast_to(((s1 - W0) & 31).to(tl.uint8)[:, None], shape),
             tl.full(shape, (1 << W0) - 1, tl.uint8), tl.full(shape, (1 << (W0 + W1)) - 1, tl.uint8)],
            dtype=tl.float16, is_pure=False, pack=4)
    code = ((low.to(tl.int32) >> s0[:, None]) & ((1 << W0) - 1)) | (
        ((high.to(tl.int32) >> s1[:, None]) & ((1 << W1) - 1)) << W0)
    return (code | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _field_operand(base, tb, cols, s_t, ASM: tl.constexpr, WIDTH: tl.constexpr, PB: tl.constexpr,
                   HEAD_DIM: tl.constexpr, FLIP: tl.constexpr, PACKED: tl.constexpr, EXACT: tl.constexpr = False):
    """``(operand [T, C] fp16, shift [T])``: each token's ``WIDTH``-bit field of one plane set (or its 8-bit code),
    as ``1024 + field * 2**shift``. ``base``: the block's first byte (token-packed) or the tile's first token's row;
    ``tb``: the tile's tokens, in the block (packed) or from ``base`` (8-bit); ``cols``: the channels."""
    if PACKED:  # a block of one plane set
        codes, shift = _plane_bytes(base, tb, cols, WIDTH, 0, PB, HEAD_DIM, WIDTH)
        mask = (((1 << WIDTH) - 1) << shift).to(tl.uint8)[:, None]
        # impure: Triton sizes a product's operand fragments by the narrowest load behind the operand (here bytes, 4
        # per thread along the product's inner axis); the fp16 it returns then reaches the tensor cores through
        # shared memory in 16-bit fragments, not reshuffled by register moves every tile (kernel_report.md)
        return magic_fp16(codes, mask, tl.zeros_like(mask), ASM, False), shift
    codes = tl.load(base + tb[:, None] * s_t + cols[None, :]).to(tl.uint8, bitcast=True)
    flip = tl.full([1, 1], FLIP, tl.uint8)
    if EXACT:
        offset = tl.full([1, 1], 1024.0 + FLIP, tl.float16)
        return exact_fp16(codes, tl.full([1, 1], 255, tl.uint8), flip, offset, ASM), tl.zeros_like(tb)
    return magic_fp16(codes, tl.full([1, 1], 255, tl.uint8), flip, ASM), tl.zeros_like(tb)


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
def _int8_key_scores(qs, codes, LEFT: tl.constexpr):
    """``qs @ codes^T`` ``[R, T]`` (float32) for int8 key codes ``[T, C]`` (signed, as stored) by int8 products: the
    codes reach the tensor cores as loaded, with no conversion. Each query row becomes two int8 digits of a
    fixed-point number, ``qs ~ step * (hi + lo / 254)`` with ``step = max|qs| / 127`` (rounding error at most
    ``step / 508``, about 2**-15 of the row's largest element; fp16 operands round each element to 2**-11 of
    itself), and the scores are ``step * (hi . c + (lo . c) / 254)``, exact in int32."""
    q32 = qs.to(tl.float32)
    amax = tl.max(tl.abs(q32), 1)
    used = amax > 0
    step = tl.where(used, amax * (1.0 / 127.0), 1.0)
    inv = tl.where(used, tl.fdiv(tl.full(amax.shape, 127.0, tl.float32), amax, ieee_rounding=False), 1.0)
    u = q32 * inv[:, None]  # within [-127, 127] up to the approximate reciprocal's rounding
    hi = tl.floor(u + 0.5)
    lo = tl.floor((u - hi) * 254.0 + 0.5)  # |u - hi| <= 0.5 (a hair more): |lo| <= 127
    if LEFT:
        s_hi = tl.trans(tl.dot(codes, tl.trans(hi.to(tl.int8))))
        s_lo = tl.trans(tl.dot(codes, tl.trans(lo.to(tl.int8))))
    else:
        s_hi = tl.dot(hi.to(tl.int8), tl.trans(codes))
        s_lo = tl.dot(lo.to(tl.int8), tl.trans(codes))
    return (s_hi.to(tl.float32) + s_lo.to(tl.float32) * (1.0 / 254.0)) * step[:, None]


@triton.jit
def _key_scores(qs, sq, kc_base, tb, ch, s_t, ASM: tl.constexpr, QDOT: tl.constexpr, HEAD_DIM: tl.constexpr,
                W0: tl.constexpr, W1: tl.constexpr, PB: tl.constexpr, FLIP: tl.constexpr, PACKED: tl.constexpr,
                LEFT: tl.constexpr):
    """``sum_c qs[r, c] * code[t, c]`` ``[R, T]`` for the stored (unsigned) codes of the tile's tokens (8-bit codes
    and two joined plane sets: plus ``1024 * sq``, one number per row that the caller removes); ``sq`` the row sums
    of ``qs`` as rounded for the product (used for one plane set, whose magic number's share is scaled per token)."""
    if not PACKED:  # float32 operands or uint8 codes (signed int8 codes: _int8_key_scores): exact fp operands
        x, shift = _field_operand(kc_base, tb, ch, s_t, ASM, 8, PB, HEAD_DIM, FLIP, False, True)
        return _scores(qs, x, QDOT, LEFT)
    if W1 > 0:  # two plane sets joined into one operand (no shift to undo): plus 1024 * sq, as 8-bit codes
        return _scores(qs, _joined_operand(kc_base, tb, ch, ASM, W0, W1, PB, HEAD_DIM), QDOT, LEFT)
    x, shift = _field_operand(kc_base, tb, ch, s_t, ASM, W0, PB, HEAD_DIM, FLIP, PACKED)
    return (_scores(qs, x, QDOT, LEFT) - MAGIC * sq[:, None]) * _pow2(-shift)[None, :]


@triton.jit
def _two_block_scores(q2, q2_dot, ks_base, kz_base, meta, sks_t, past, kc_base, tb, ch, ASM: tl.constexpr,
                      QDOT: tl.constexpr, HEAD_DIM: tl.constexpr, W0: tl.constexpr, PB: tl.constexpr,
                      TG: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr, LEFT: tl.constexpr):
    """The true scores ``[R, T]`` of a tile of two key blocks of ``TG`` tokens, codes of one plane set of ``W0`` bits
    (``lean``'s 32-token blocks in 64-token tiles: the per-tile work on the query, the softmax's row steps and the
    loop's own, spread over twice the bytes).

    ``q2`` ``[2 R, C]`` holds each query row twice, rows ``2 r`` and ``2 r + 1``: row ``2 r + i`` takes block ``i``'s
    scales (``meta``: the first block's offsets ``[C]``, ``sks_t`` to the second's), one product against both
    blocks' codes, and each token keeps its own block's row: in the product's result the two are one thread's pair
    of columns, so the choice moves no data. Where the split ends after the first block (``past`` true) the
    second block's tokens read the first's bytes (``tb``) and scales and its rows' constant is -inf: they take no
    weight."""
    odd = tl.arange(0, q2.shape[0]) % 2
    blk = odd[:, None] * tl.where(past, 0, sks_t)
    qs = q2_dot * tl.load(ks_base + meta[None, :] + blk).to(QDOT)
    sq = tl.sum(qs.to(tl.float32), 1)
    const = -OFFSET * sq  # taken after the field's shift is undone, with the zeros
    if ZERO:
        const += tl.sum(q2 * tl.load(kz_base + meta[None, :] + blk).to(tl.float32), 1)
    const = tl.where((odd == 1) & past, float("-inf"), const)
    both = _key_scores(qs, sq, kc_base, tb, ch, 0, ASM, QDOT, HEAD_DIM, W0, 0, PB, 0, True, LEFT) + const[:, None]
    first, later = tl.split(tl.permute(tl.reshape(both, [q2.shape[0] // 2, 2, tb.shape[0]]), [0, 2, 1]))
    return tl.where((tl.arange(0, tb.shape[0]) < TG)[None, :], first, later)


@triton.jit
def _wide_scores(qs32, q_rows, sq_d, qk_scale, rows_ok, ks_blk, sks_d, kw_base, skw_t, skw_p, kwc_base, skwc_n,
                 skwc_r, t0, tok, ASM: tl.constexpr, QDOT: tl.constexpr, TG: tl.constexpr, CG: tl.constexpr,
                 BITS: tl.constexpr, WIDE: tl.constexpr, WIDE_PAD: tl.constexpr, SYMMETRIC: tl.constexpr,
                 LOAD: tl.constexpr, LEFT: tl.constexpr):
    """``(scores [R, T], row constant [R])``: what the block's wide channels' high bits add to the scores,
    ``sum_j qs[r, ch_j] * (2**BITS * high[t, j] - offset)`` (``offset`` ``2**(BITS - 1)`` for symmetric codes), as
    a product and a number per row for the caller's row constant (the magic number's share and the offset). One
    product over the ``WIDE`` slots (padded to ``WIDE_PAD`` >= 16), on the side ``LEFT`` puts the keys' own product
    (:func:`_scores`); slot ``j``'s bit is bit ``j % 8`` of byte ``j // 8``, and its ``2**(j % 8)`` is folded into the
    query's columns.

    The columns ``qs[:, ch_j]`` (``qs``: the query times the block's key scales, rounded to ``QDOT``; ``qs32`` its
    float32 copy ``[R, D]``) are gathered from registers, or with ``LOAD`` made again from memory: the query's
    columns (``q_rows`` ``[R]``: each row's first element, ``sq_d`` apart; ``qk_scale`` as the caller applied it;
    rows not ``rows_ok`` read 0) times the scales of the chosen channels (``ks_blk``: the block's first, ``sks_d``
    apart per group of ``CG`` channels), rounded as ``qs`` is: the same numbers. A gather across a warp's
    lanes costs shuffles and selects for every column (56 warp instructions per tile in ``compact``'s loop at head_dim
    128, more at 256); two loads that hit the cache cost fewer, where the registers they hold allow
    (:func:`~hf_asymkv.kernels.decode.wide_query_loads`)."""
    slot = tl.arange(0, WIDE_PAD)
    used = slot < WIDE
    chosen = tl.load(kwc_base + (t0 // TG) * skwc_n + slot * skwc_r, mask=used, other=0).to(tl.int32)
    if LOAD:
        q = tl.load(q_rows[:, None] + chosen[None, :] * sq_d, mask=rows_ok[:, None] & used[None, :], other=0.0)
        scale = tl.load(ks_blk + (chosen // CG) * sks_d, mask=used, other=0.0).to(QDOT)
        picked = ((q.to(tl.float32) * qk_scale).to(QDOT) * scale[None, :]).to(tl.float32)
    else:
        picked = tl.gather(qs32, tl.broadcast_to(chosen[None, :], [qs32.shape[0], WIDE_PAD]), axis=1)
        picked = tl.where(used[None, :], picked, 0.0)
    qw = (picked * _pow2(BITS - slot % 8)[None, :]).to(QDOT)
    codes = tl.load(kw_base + tok[:, None] * skw_t + (slot // 8)[None, :] * skw_p, mask=used[None, :], other=0)
    bit = (1 << (slot % 8)).to(tl.uint8)[None, :]
    x = magic_fp16(codes, bit, tl.zeros_like(bit), ASM, False)  # impure: 16-bit fragments (see _field_operand)
    const = tl.sum(qw.to(tl.float32), 1) * -MAGIC
    if SYMMETRIC:
        const += -(2.0 ** (BITS - 1)) * tl.sum(picked, 1)
    return _scores(qw, x, QDOT, LEFT), const


@triton.jit
def _value_products(p, acc, vc_base, tb, ch, svc_t, vs, ASM: tl.constexpr, QDOT: tl.constexpr, HEAD_DIM: tl.constexpr,
               W0: tl.constexpr, W1: tl.constexpr, PB: tl.constexpr, FLIP: tl.constexpr, PACKED: tl.constexpr,
               LEFT: tl.constexpr):
    """``(acc + w . X, the rounded weights' magic share)`` for the tile's value codes: ``w = p * scale * 2**-shift``
    (rounded to ``QDOT``), ``X`` the codes' ``1024 + field * 2**shift`` (one plane set, the field in place) or ``1024 +
    code`` (two plane sets joined, no shift). Returns the new accumulator and ``-1024 * w`` ``[R, T]`` (the caller
    keeps it per token with the row's other per-token terms, and sums over tokens after the loop)."""
    if PACKED and W1 > 0:  # two plane sets: joined into one operand (no shift to fold into the weights)
        x = _joined_operand(vc_base, tb, ch, ASM, W0, W1, PB, HEAD_DIM)
    else:
        x, shift = _field_operand(vc_base, tb, ch, svc_t, ASM, W0 if PACKED else 8, PB, HEAD_DIM, FLIP, PACKED)
        if PACKED:  # 2**-shift into the per-token scales, [T], not into the weights, [R, T]: the same (exact) products
            vs = vs * _pow2(-shift)
    w = (p * vs[None, :]).to(QDOT)
    # the tensor first: under the interpreter, constexpr * tensor stays a constexpr
    return _mix(w, x, acc, QDOT, LEFT), w.to(tl.float32) * -MAGIC


@triton.jit
def _row_sum_step(total, alpha, terms):
    """A running per-row sum over tokens, rescaled by the online softmax's ``alpha`` ``[R]``, plus the tile's ``terms``
    ``[R, T]``. ``total`` ``[R, T]``: kept per token column and summed over the tile once, after the loop
    (:func:`_row_total`); a sum over tokens each step crosses the tile's warps (shuffles, shared memory, a barrier),
    50-80 instructions per warp and tile for the two such sums. ``total`` ``[R]`` (more than
    :data:`COLUMN_SUM_ELEMENTS` rows x tokens, where the columns would cost registers): summed every step."""
    if len(total.shape) == 2:
        total = total * alpha[:, None] + terms
    else:
        total = total * alpha + tl.sum(terms, 1)
    return total


@triton.jit
def _row_total(total):
    """``[R]``: a :func:`_row_sum_step` total summed over its token columns (if it has them)."""
    if len(total.shape) == 2:
        total = tl.sum(total, 1)
    return total


@triton.jit
def _value_group(p, alpha, acc, z_t, vc_base, svc_t, vs_base, vz_base, svs_t, t0, tok, ch, ASM: tl.constexpr,
                 QDOT: tl.constexpr, HEAD_DIM: tl.constexpr, PACKED: tl.constexpr, FLIP: tl.constexpr,
                 W0: tl.constexpr, W1: tl.constexpr, PB: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr,
                 LEFT: tl.constexpr):
    """One value group's step: ``(acc * alpha + w . X, z_t * alpha + the tile's share)`` for weights ``p`` ``[R, T]``,
    the group's channels ``ch`` ``[C]`` (its accumulator ``[R, C]``; its per-row constant ``z_t``, kept as
    :func:`_row_sum_step` keeps it), its scales and zeros at ``vs_base``/``vz_base`` (one per token)."""
    vs = tl.load(vs_base + (t0 + tok) * svs_t).to(tl.float32)
    if PACKED:
        acc, magic = _value_products(p, acc * alpha[:, None], vc_base + (t0 - t0 % PB) * svc_t, t0 % PB + tok, ch,
                                     svc_t, vs, ASM, QDOT, HEAD_DIM, W0, W1, PB, 0, True, LEFT)
    else:
        acc, magic = _value_products(p, acc * alpha[:, None], vc_base + t0 * svc_t, tok, ch, svc_t, vs, ASM, QDOT,
                                     HEAD_DIM, 8, 0, 1, FLIP, False, LEFT)
    zero = -OFFSET * vs
    if ZERO:
        zero += tl.load(vz_base + (t0 + tok) * svs_t).to(tl.float32)
    return acc, _row_sum_step(z_t, alpha, magic + p * zero[None, :])


@triton.jit
def fast_split(q, kc_base, skc_t, ks_base, kz_base, sks_t, sks_d, vc_base, svc_t, vs_base, vz_base, svs_t, svs_d,
               kw_base, skw_t, skw_p, kwc_base, skwc_n, skwc_r, mask_ptr, sm_b, sm_h, sm_q, sm_k,
               col0, t_start, t_stop, b, heads, qpos, rows_ok, q_len, kv_len, q_rows, sq_d, qk_scale,
               HEAD_DIM: tl.constexpr, R_PAD: tl.constexpr, TILE: tl.constexpr, MASK: tl.constexpr,
               QDOT: tl.constexpr, ASM: tl.constexpr,
               K_PACKED: tl.constexpr, K_FLIP: tl.constexpr, K_W0: tl.constexpr, K_W1: tl.constexpr,
               K_PB: tl.constexpr, K_TG: tl.constexpr, K_CG: tl.constexpr, K_ZERO: tl.constexpr,
               K_OFFSET: tl.constexpr, V_PACKED: tl.constexpr, V_FLIP: tl.constexpr, V_W0: tl.constexpr,
               V_W1: tl.constexpr, V_PB: tl.constexpr, V_CG: tl.constexpr, V_ZERO: tl.constexpr,
               V_OFFSET: tl.constexpr, K_WIDE: tl.constexpr, K_WIDE_PAD: tl.constexpr, K_WIDE_LOAD: tl.constexpr,
               K_LEFT: tl.constexpr, V_LEFT: tl.constexpr):
    """Online softmax over quantized tokens ``[t_start, t_stop)`` (whole tiles, ``TILE`` dividing the key scale group
    ``K_TG`` and the packing blocks): ``(acc [R, D], m [R], l [R])`` (the values' per-row constant already added).

    ``q_rows`` ``[R]`` (each query row's first element in memory), ``sq_d`` and ``qk_scale`` (the factor ``q``
    carries) let a tile make its wide key channels' query columns again from memory (``K_WIDE_LOAD``,
    :func:`_wide_scores`).

    Code offsets (``K_OFFSET``, ``V_OFFSET``): what to subtract from the stored unsigned code to get the code the scale
    multiplies (128 for flipped int8 codes, ``2**(bits - 1)`` for symmetric sub-byte codes, else 0). ``K_LEFT`` and
    ``V_LEFT`` put the codes on the left of their products (:func:`_scores`, :func:`_mix`): the same sums, laid out
    differently by the compiler; the launcher picks them per format (``hf_asymkv.kernels.decode.codes_left``).

    Values carry one scale (and zero) per token and group of ``V_CG`` channels: the whole head (``V_CG ==
    HEAD_DIM``) or its two halves (head_dim 256 with the default 128-channel groups). Two groups take one product
    each, into accumulators of their own (:func:`_value_group`), joined once at the end."""
    GROUPS: tl.constexpr = HEAD_DIM // V_CG
    tl.static_assert(GROUPS == 1 or GROUPS == 2, "one or two value groups per token")
    ch = tl.arange(0, HEAD_DIM)
    vch = tl.arange(0, V_CG)  # the first value group's channels
    tok = tl.arange(0, TILE)
    m_i = tl.full([R_PAD], float("-inf"), tl.float32)
    # the softmax sum and the values' per-row constant: kept per token column for few rows (_row_sum_step)
    SUM_SHAPE: tl.constexpr = [R_PAD, TILE] if R_PAD * TILE <= COLUMN_SUM_ELEMENTS else [R_PAD]
    l_t = tl.zeros(SUM_SHAPE, tl.float32)
    z_t = tl.zeros(SUM_SHAPE, tl.float32)  # the values' per-row constant, beside acc (the first group's)
    acc = tl.zeros([R_PAD, V_CG], tl.float32)  # the first value group's channels (all of them for one group)
    z_hi = tl.zeros(SUM_SHAPE, tl.float32)  # the second group's (unused for one group)
    acc_hi = tl.zeros([R_PAD, V_CG], tl.float32)
    q_dot = q.to(QDOT)  # the scale multiplies in the operand dtype (fp16 pairs on a GPU): one rounding less to pay
    # signed int8 keys (stored as int8: FLIP 0x80) with half-precision operands go to int8 products as loaded; their
    # addresses are made once and advanced a tile per step: computed per tile from the base, they cost the loop about
    # 80 integer instructions per warp (sign extensions and 64-bit adds the compiler did not hoist; kernel_report.md)
    INT8_KEYS: tl.constexpr = (not K_PACKED) and QDOT != tl.float32 and K_FLIP != 0
    k_ptrs = kc_base + (t_start + tok)[:, None] * skc_t + ch[None, :]
    # a tile of two key blocks (_two_block_scores): each query row twice
    TWO: tl.constexpr = TILE == 2 * K_TG
    tl.static_assert(TILE <= K_TG or (TWO and K_PACKED and K_W1 == 0 and K_WIDE == 0), "tiles of one key block")
    if TWO:
        q2 = tl.reshape(tl.broadcast_to(q[:, None, :], [R_PAD, 2, HEAD_DIM]), [2 * R_PAD, HEAD_DIM])
        q2_dot = q2.to(QDOT)  # built by tl.join instead, the product's operand fragments took register moves
    for t0 in range(t_start, t_stop, TILE):
        if TWO:
            # splits start on whole tiles; one may end after its last tile's first block: the tokens of the
            # second (and their values) are then read from the first (in range) and weighed 0
            past = t0 + K_TG >= t_stop
            tok_rd = tok - (tok // K_TG) * (K_TG * past.to(tl.int32))
            live = t0 + tok < t_stop  # for a mask's loads
            scores = _two_block_scores(q2, q2_dot, ks_base, kz_base, (t0 // K_TG) * sks_t + (ch // K_CG) * sks_d,
                                       sks_t, past, kc_base + t0 * skc_t, tok_rd, ch, ASM, QDOT, HEAD_DIM, K_W0,
                                       K_PB, K_TG, K_ZERO, K_OFFSET, K_LEFT)
            const = tl.zeros([R_PAD], tl.float32)
        else:
            tok_rd = tok
            live = tok >= 0
            meta = (t0 // K_TG) * sks_t + (ch // K_CG) * sks_d
            qs = q_dot * tl.load(ks_base + meta).to(QDOT)[None, :]
            # the true scores are scores + const, a number per row
            if K_PACKED and K_W1 > 0:
                # joined codes (_joined_operand) carry no shift: the magic number's share, the codes' offset and the
                # zeros are all one number per row, taken in one sum over the channels
                sq = tl.zeros([R_PAD], tl.float32)  # unused
                terms = qs.to(tl.float32) * -(K_OFFSET + MAGIC)
                if K_ZERO:
                    terms += q * tl.load(kz_base + meta).to(tl.float32)[None, :]
                const = tl.sum(terms, 1)
            else:
                if K_PACKED:
                    sq = tl.sum(qs.to(tl.float32), 1)
                    const = -K_OFFSET * sq
                else:
                    sq = tl.zeros([R_PAD], tl.float32)  # 8-bit codes are exact operands: nothing to take off
                    const = tl.zeros([R_PAD], tl.float32)
                if K_ZERO:
                    const += tl.sum(q * tl.load(kz_base + meta).to(tl.float32)[None, :], 1)
            if K_PACKED:
                scores = _key_scores(qs, sq, kc_base + (t0 - t0 % K_PB) * skc_t, t0 % K_PB + tok, ch, skc_t, ASM, QDOT,
                                     HEAD_DIM, K_W0, K_W1, K_PB, 0, True, K_LEFT)
            elif INT8_KEYS:
                scores = _int8_key_scores(qs, tl.load(k_ptrs), K_LEFT)
                k_ptrs += TILE * skc_t
            else:
                scores = _key_scores(qs, sq, kc_base + t0 * skc_t, tok, ch, skc_t, ASM, QDOT, HEAD_DIM, 8, 0, 1, K_FLIP,
                                     False, K_LEFT)
        if K_WIDE > 0:
            wide, wide_const = _wide_scores(qs.to(tl.float32), q_rows, sq_d, qk_scale, rows_ok,
                                            ks_base + (t0 // K_TG) * sks_t, sks_d, kw_base, skw_t, skw_p, kwc_base,
                                            skwc_n, skwc_r, t0, t0 + tok, ASM, QDOT, K_TG, K_CG, K_W0 + K_W1, K_WIDE,
                                            K_WIDE_PAD, K_OFFSET > 0, K_WIDE_LOAD, K_LEFT)
            scores += wide
            const += wide_const
        if MASK != 0:
            valid = rows_ok[:, None] & live[None, :]
            scores += mask_bias(mask_ptr, sm_b, sm_h, sm_q, sm_k, b, heads[:, None], qpos[:, None],
                                col0 + t0 + tok[None, :], valid, q_len, kv_len, MASK)
        m_new = tl.maximum(m_i, tl.max(scores, 1) + const)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - (m_safe - const)[:, None])
        l_t = _row_sum_step(l_t, alpha, p)
        m_i = m_new
        acc, z_t = _value_group(p, alpha, acc, z_t, vc_base, svc_t, vs_base, vz_base, svs_t, t0, tok_rd, vch, ASM, QDOT,
                                HEAD_DIM, V_PACKED, V_FLIP, V_W0, V_W1, V_PB, V_ZERO, V_OFFSET, V_LEFT)
        if GROUPS == 2:
            acc_hi, z_hi = _value_group(p, alpha, acc_hi, z_hi, vc_base, svc_t, vs_base + svs_d, vz_base + svs_d,
                                        svs_t, t0, tok_rd, vch + V_CG, ASM, QDOT, HEAD_DIM, V_PACKED, V_FLIP, V_W0, V_W1,
                                        V_PB, V_ZERO, V_OFFSET, V_LEFT)
    acc += _row_total(z_t)[:, None]
    if GROUPS == 2:  # [R, 2, D / 2] -> [R, D]: the halves side by side
        acc = tl.reshape(tl.permute(tl.join(acc, acc_hi + _row_total(z_hi)[:, None]), [0, 2, 1]), [R_PAD, HEAD_DIM])
    return acc, m_i, _row_total(l_t)
