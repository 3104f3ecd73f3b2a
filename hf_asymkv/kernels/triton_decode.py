"""Triton kernels of the decode attention over stored codes (flash-decoding, split-KV); see :mod:`.decode`.

Two kernels:

- :func:`partial_attention_kernel`: one program per (batch row, KV head, split). A split is a run of tiles of one
  region: the quantized region (codes, read as stored) or one of up to two exact segments (model-dtype K/V). The
  program holds the query rows of every query head that shares its KV head, for every query position (``R =
  n_rep * q_len`` rows), runs an online softmax over its tiles and writes an unnormalized partial output with its
  row max and sum.
- :func:`merge_partials_kernel`: one program per (query row, chunk of channels) merges the splits and writes
  ``[B, q, Hq, D]``. A quantized split of rotated values rotates its own output back before writing it (a fast
  Walsh-Hadamard transform in registers), so that the merge only sums.

The quantized region takes :func:`~.triton_codes.fast_split` when its formats allow (every preset's: tiles of one key
block, codes turned into operands by bit operations, see :mod:`.triton_codes`), else the generic
:func:`_quant_split` below (fp8 keys, codes packed along head_dim, several value groups per token, head_dims that
are not a power of two).

Scores live in the log2 domain (the query is pre-multiplied by ``scaling * log2(e)``, masks by ``log2(e)``) so
that the softmax uses ``exp2``. Everything accumulates in float32; matrix products take operands in ``DOT``
(the model dtype on a GPU, float32 under the interpreter, whose bf16 dot is not supported).

Quantized keys (one scale per channel per block, so one per tile): ``q . (s * c + z) = (q * s) . c + q . z``,
the scale folded into the query and the zero term one number per tile and row; keys with wide channels
(:mod:`hf_asymkv.core.wide`) get their high bits added to the tile's codes first. Quantized values with one
scale and zero per token: ``sum_t p_t (s_t c_t + z_t) = (p * s) . C + sum_t p_t z_t``; other value groupings
(several groups per token, per-block scales) are scaled in registers, tile by tile. No dense copy of a block
is ever written to memory.

Sub-byte codes are unpacked in registers from the layout :func:`hf_asymkv.core.quant.pack_codes` writes
(restated here so that this file depends on no core module): codes are split into bit-plane sets of widths
``(W0, W1)`` (3 = 2 + 1, 5 = 4 + 1, 6 = 4 + 2, else one set). Token-packed blocks of ``PB`` tokens: the block's
bytes are ``[PB * bits / 8, D]`` rows; set ``w`` spans ``PB * w / 8`` rows from its start row, and byte row
``i`` holds token ``i + j * PB * w / 8`` of the block in bits ``[j * w, (j + 1) * w)``. Head-dim packing (regions
that are not token-packed): set ``w`` spans ``D * w / 8`` columns from its start column, and byte ``i`` holds
channel ``i + j * D * w / 8`` in bits ``[j * w, (j + 1) * w)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_codes import fast_split, mask_bias, mma

__all__ = ["merge_partials_kernel", "partial_attention_kernel"]

# Code kinds (constexpr KIND): integer codes loaded as their dtype, fp8 bytes decoded by hand (portable to GPUs
# without native fp8 conversions), or bit-plane packed sub-byte codes.
INT8, FP8_E4M3, FP8_E5M2, PACKED_TOKENS, PACKED_HEAD_DIM = 0, 1, 2, 3, 4
MASK_NONE, MASK_BOOL, MASK_ADDITIVE, MASK_CAUSAL = 0, 1, 2, 3
LOG2E = 1.4426950408889634


@triton.jit
def _plane(ptr, tok, ch, s_t, s_d, valid, HEAD_DIM: tl.constexpr, W: tl.constexpr, START: tl.constexpr,
           TOKEN_PACKED: tl.constexpr, PB: tl.constexpr):
    """The ``W``-bit plane-set field of each (token, channel) element, as int32 in ``[0, 2**W)``."""
    if TOKEN_PACKED:
        rows: tl.constexpr = PB * W // 8
        tb = tok % PB
        # a block's bytes are contiguous [PB * bits / 8, D] rows (s_d == 1, s_t == D * bits / 8)
        addr = (tok - tb) * s_t + (START + tb % rows) * HEAD_DIM + ch
        j = tb // rows
    else:
        cols: tl.constexpr = HEAD_DIM * W // 8
        addr = tok * s_t + (START + ch % cols) * s_d
        j = ch // cols
    byte = tl.load(ptr + addr, mask=valid, other=0).to(tl.int32)
    return (byte >> (j * W)) & ((1 << W) - 1)


@triton.jit
def _fp8(byte, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr, SUBNORMAL_STEP: tl.constexpr):
    """float32 value of fp8 bytes (int32 in [0, 256)): E4M3 (fn) or E5M2, normals and subnormals, by bit ops
    (``SUBNORMAL_STEP`` = ``2 ** (1 - bias - MAN_BITS)``, the value of mantissa 1 at exponent 0)."""
    bias: tl.constexpr = (1 << (EXP_BITS - 1)) - 1
    e = (byte >> MAN_BITS) & ((1 << EXP_BITS) - 1)
    m = byte & ((1 << MAN_BITS) - 1)
    normal = (((e + 127 - bias) << 23) | (m << (23 - MAN_BITS))).to(tl.float32, bitcast=True)
    value = tl.where(e == 0, m.to(tl.float32) * SUBNORMAL_STEP, normal)
    return tl.where((byte & 128) != 0, -value, value)


@triton.jit
def _codes(ptr, tok, ch, s_t, s_d, valid, HEAD_DIM: tl.constexpr, KIND: tl.constexpr, W0: tl.constexpr,
           W1: tl.constexpr, OFFSET: tl.constexpr, PB: tl.constexpr):
    """Code values (before scale and zero) of the elements at ``tok`` x ``ch`` (broadcast shapes), float32."""
    if KIND == 0:  # int8 / uint8 codes: the pointer's dtype carries the sign
        return tl.load(ptr + tok * s_t + ch * s_d, mask=valid, other=0).to(tl.float32)
    elif KIND == 1:
        return _fp8(tl.load(ptr + tok * s_t + ch * s_d, mask=valid, other=0).to(tl.int32), 4, 3, 0.001953125)
    elif KIND == 2:
        return _fp8(tl.load(ptr + tok * s_t + ch * s_d, mask=valid, other=0).to(tl.int32), 5, 2, 1.52587890625e-05)
    else:
        token_packed: tl.constexpr = KIND == 3
        code = _plane(ptr, tok, ch, s_t, s_d, valid, HEAD_DIM, W0, 0, token_packed, PB)
        if W1 > 0:
            start: tl.constexpr = (PB if token_packed else HEAD_DIM) * W0 // 8
            code = code | (_plane(ptr, tok, ch, s_t, s_d, valid, HEAD_DIM, W1, start, token_packed, PB) << W0)
        return (code - OFFSET).to(tl.float32)


@triton.jit
def _product(a, b, DOT: tl.constexpr):
    """``a @ b`` (float32 result), see :func:`~.triton_codes.mma`."""
    return mma(a, b, tl.zeros([a.shape[0], b.shape[1]], tl.float32), DOT)


@triton.jit
def _softmax_step(scores, m_i, l_i):
    """One online-softmax step: returns ``(p, alpha, m_new, l_new)``; the caller adds ``p @ V`` to ``acc *
    alpha``. Rows with nothing visible so far keep max -inf and contribute 0."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _exact_split(q, k_ptr, sk_b, sk_h, sk_t, sk_d, v_ptr, sv_b, sv_h, sv_t, sv_d, mask_ptr, sm_b, sm_h, sm_q, sm_k,
                 n, col0, t_start, t_stop, b, h, heads, qpos, rows_ok, q_len, kv_len, HEAD_DIM: tl.constexpr,
                 D_PAD: tl.constexpr, R_PAD: tl.constexpr, TILE: tl.constexpr, MASK: tl.constexpr,
                 DOT: tl.constexpr):
    """Online softmax over exact tokens ``[t_start, t_stop)`` of one segment: ``(acc, m, l)``."""
    ch = tl.arange(0, D_PAD)
    ch_ok = ch < HEAD_DIM
    m_i = tl.full([R_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([R_PAD], tl.float32)
    acc = tl.zeros([R_PAD, D_PAD], tl.float32)
    k_base = k_ptr + b * sk_b + h * sk_h
    v_base = v_ptr + b * sv_b + h * sv_h
    for t0 in range(t_start, t_stop, TILE):
        tok = t0 + tl.arange(0, TILE)
        tok_ok = tok < n
        kt = tl.load(k_base + tok[None, :] * sk_t + ch[:, None] * sk_d, mask=ch_ok[:, None] & tok_ok[None, :],
                     other=0.0)
        scores = _product(q, kt, DOT)
        valid = rows_ok[:, None] & tok_ok[None, :]
        scores += mask_bias(mask_ptr, sm_b, sm_h, sm_q, sm_k, b, heads[:, None], qpos[:, None],
                             col0 + tok[None, :], valid, q_len, kv_len, MASK)
        p, alpha, m_i, l_i = _softmax_step(scores, m_i, l_i)
        v = tl.load(v_base + tok[:, None] * sv_t + ch[None, :] * sv_d, mask=tok_ok[:, None] & ch_ok[None, :],
                    other=0.0)
        acc = mma(p, v, acc * alpha[:, None], DOT)
    return acc, m_i, l_i


@triton.jit
def _wide_codes(kw_base, skw_t, skw_p, kwc_base, skwc_n, skwc_r, t0, tok, ch, TG: tl.constexpr, WIDE: tl.constexpr,
                WIDE_PAD: tl.constexpr, WIDE_BYTES: tl.constexpr, STEP: tl.constexpr, OFFSET: tl.constexpr):
    """What the high bits of the tile's wide channels add to its codes, ``[D, T]`` (0 for the other channels): the
    block's ``WIDE`` channel indices, each channel's slot among them, and the slot's bit of each token (bit ``j % 8``
    of byte ``j // 8``), as ``STEP * bit - OFFSET`` (see :mod:`hf_asymkv.core.wide`)."""
    slot = tl.arange(0, WIDE_PAD)
    chosen = tl.load(kwc_base + (t0 // TG) * skwc_n + slot * skwc_r, mask=slot < WIDE, other=0).to(tl.int32)
    chosen = tl.where(slot < WIDE, chosen, -1)
    position = tl.sum(tl.where(chosen[None, :] == ch[:, None], slot[None, :] + 1, 0), 1) - 1  # [D], -1: not wide
    wide = position >= 0
    at = tl.maximum(position, 0)
    byte = tl.load(kw_base + tok[None, :] * skw_t + (at // 8)[:, None] * skw_p, mask=wide[:, None],
                   other=0).to(tl.int32)
    bit = (byte >> (at % 8)[:, None]) & 1
    return tl.where(wide[:, None], bit.to(tl.float32) * STEP - OFFSET, 0.0)


@triton.jit
def _key_scores(q, kc_base, skc_t, skc_d, ks_base, kz_base, sks_t, sks_d, kw_base, skw_t, skw_p, kwc_base, skwc_n,
                skwc_r, t0, tok, ch, ch_ok,
                HEAD_DIM: tl.constexpr, DOT: tl.constexpr, KIND: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr,
                OFFSET: tl.constexpr, PB: tl.constexpr, TG: tl.constexpr, CG: tl.constexpr, ZERO: tl.constexpr,
                WIDE: tl.constexpr, WIDE_PAD: tl.constexpr, WIDE_BYTES: tl.constexpr):
    """Scores ``[R, T]`` of a tile inside one key scale group: ``(q * s) . c + q . z``, the wide channels' high bits
    added to their codes first."""
    kt = _codes(kc_base, tok[None, :], ch[:, None], skc_t, skc_d, ch_ok[:, None], HEAD_DIM, KIND, W0, W1, OFFSET, PB)
    if WIDE > 0:
        kt += _wide_codes(kw_base, skw_t, skw_p, kwc_base, skwc_n, skwc_r, t0, tok, ch, TG, WIDE, WIDE_PAD,
                          WIDE_BYTES, 1 << (W0 + W1), OFFSET)
    meta = (t0 // TG) * sks_t + (ch // CG) * sks_d
    scale = tl.load(ks_base + meta, mask=ch_ok, other=0.0).to(tl.float32)
    scores = _product(q * scale[None, :], kt, DOT)
    if ZERO:
        zero = tl.load(kz_base + meta, mask=ch_ok, other=0.0).to(tl.float32)
        scores += tl.sum(q * zero[None, :], 1)[:, None]
    return scores


@triton.jit
def _value_mix(p, vc_base, svc_t, svc_d, vs_base, vz_base, svs_t, svs_d, tok, ch, ch_ok,
               HEAD_DIM: tl.constexpr, DOT: tl.constexpr, KIND: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr,
               OFFSET: tl.constexpr, PB: tl.constexpr, TG: tl.constexpr, CG: tl.constexpr, ZERO: tl.constexpr):
    """``p @ V`` ``[R, D]`` of a tile of quantized values."""
    codes = _codes(vc_base, tok[:, None], ch[None, :], svc_t, svc_d, ch_ok[None, :], HEAD_DIM, KIND, W0, W1, OFFSET,
                   PB)
    if TG == 1 and CG == HEAD_DIM:  # one scale (and zero) per token: fold them into the weights
        scale = tl.load(vs_base + tok * svs_t).to(tl.float32)
        mixed = _product(p * scale[None, :], codes, DOT)
        if ZERO:
            mixed += tl.sum(p * tl.load(vz_base + tok * svs_t).to(tl.float32)[None, :], 1)[:, None]
        return mixed
    meta = (tok[:, None] // TG) * svs_t + (ch[None, :] // CG) * svs_d  # several groups: scale the tile
    values = codes * tl.load(vs_base + meta, mask=ch_ok[None, :], other=0.0).to(tl.float32)
    if ZERO:
        values += tl.load(vz_base + meta, mask=ch_ok[None, :], other=0.0).to(tl.float32)
    return _product(p, values, DOT)


@triton.jit
def _quant_split(q, kc_ptr, skc_b, skc_h, skc_t, skc_d, ks_ptr, kz_ptr, sks_b, sks_h, sks_t, sks_d,
                 vc_ptr, svc_b, svc_h, svc_t, svc_d, vs_ptr, vz_ptr, svs_b, svs_h, svs_t, svs_d,
                 kw_ptr, skw_b, skw_h, skw_t, skw_p, kwc_ptr, skwc_b, skwc_h, skwc_n, skwc_r,
                 mask_ptr, sm_b, sm_h, sm_q, sm_k, col0, t_start, t_stop, b, h, heads, qpos, rows_ok, q_len, kv_len,
                 HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, R_PAD: tl.constexpr, TILE: tl.constexpr,
                 MASK: tl.constexpr, DOT: tl.constexpr,
                 K_KIND: tl.constexpr, K_W0: tl.constexpr, K_W1: tl.constexpr, K_OFFSET: tl.constexpr,
                 K_PB: tl.constexpr, K_TG: tl.constexpr, K_CG: tl.constexpr, K_ZERO: tl.constexpr,
                 V_KIND: tl.constexpr, V_W0: tl.constexpr, V_W1: tl.constexpr, V_OFFSET: tl.constexpr,
                 V_PB: tl.constexpr, V_TG: tl.constexpr, V_CG: tl.constexpr, V_ZERO: tl.constexpr,
                 K_WIDE: tl.constexpr, K_WIDE_PAD: tl.constexpr, K_WIDE_BYTES: tl.constexpr):
    """Online softmax over quantized tokens ``[t_start, t_stop)`` (whole tiles): ``(acc, m, l)``."""
    ch = tl.arange(0, D_PAD)
    ch_ok = ch < HEAD_DIM
    m_i = tl.full([R_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([R_PAD], tl.float32)
    acc = tl.zeros([R_PAD, D_PAD], tl.float32)
    kc_base, vc_base = kc_ptr + b * skc_b + h * skc_h, vc_ptr + b * svc_b + h * svc_h
    ks_base, kz_base = ks_ptr + b * sks_b + h * sks_h, kz_ptr + b * sks_b + h * sks_h
    vs_base, vz_base = vs_ptr + b * svs_b + h * svs_h, vz_ptr + b * svs_b + h * svs_h
    kw_base, kwc_base = kw_ptr + b * skw_b + h * skw_h, kwc_ptr + b * skwc_b + h * skwc_h
    for t0 in range(t_start, t_stop, TILE):
        tok = t0 + tl.arange(0, TILE)
        scores = _key_scores(q, kc_base, skc_t, skc_d, ks_base, kz_base, sks_t, sks_d, kw_base, skw_t, skw_p,
                             kwc_base, skwc_n, skwc_r, t0, tok, ch, ch_ok, HEAD_DIM, DOT, K_KIND, K_W0, K_W1,
                             K_OFFSET, K_PB, K_TG, K_CG, K_ZERO, K_WIDE, K_WIDE_PAD, K_WIDE_BYTES)
        valid = rows_ok[:, None] & (tok[None, :] >= 0)
        scores += mask_bias(mask_ptr, sm_b, sm_h, sm_q, sm_k, b, heads[:, None], qpos[:, None],
                             col0 + tok[None, :], valid, q_len, kv_len, MASK)
        p, alpha, m_i, l_i = _softmax_step(scores, m_i, l_i)
        mixed = _value_mix(p, vc_base, svc_t, svc_d, vs_base, vz_base, svs_t, svs_d, tok, ch, ch_ok, HEAD_DIM, DOT,
                           V_KIND, V_W0, V_W1, V_OFFSET, V_PB, V_TG, V_CG, V_ZERO)
        acc = acc * alpha[:, None] + mixed
    return acc, m_i, l_i


# token counts, columns and split counts change at every step: specializing on them (== 1, % 16) would compile
# a new variant for each pattern
@triton.jit(do_not_specialize=["q_n", "q_col", "q_splits", "a_n", "a_col", "a_splits", "b_n", "b_col",
                               "tiles_per_split", "n_splits", "q_len", "kv_len"])
def partial_attention_kernel(
    q_ptr, sq_b, sq_h, sq_q, sq_d, acc_ptr, m_ptr, l_ptr,
    # the quantized region: key and value codes, scales and zeros (zeros share their scales' strides), its mask
    kc_ptr, skc_b, skc_h, skc_t, skc_d, ks_ptr, kz_ptr, sks_b, sks_h, sks_t, sks_d,
    vc_ptr, svc_b, svc_h, svc_t, svc_d, vs_ptr, vz_ptr, svs_b, svs_h, svs_t, svs_d,
    # the keys' wide channels (hf_asymkv.core.wide): high bits [B, H, N, WIDE_BYTES], indices [B, H, N // TG, WIDE]
    kw_ptr, skw_b, skw_h, skw_t, skw_p, kwc_ptr, skwc_b, skwc_h, skwc_n, skwc_r,
    qm_ptr, sqm_b, sqm_h, sqm_q, sqm_k, q_n, q_col, q_fill_ptr, q_splits,
    # exact segments 1 and 2: keys, values, mask
    ak_ptr, sak_b, sak_h, sak_t, sak_d, av_ptr, sav_b, sav_h, sav_t, sav_d, am_ptr, sam_b, sam_h, sam_q, sam_k,
    a_n, a_col, a_splits,
    bk_ptr, sbk_b, sbk_h, sbk_t, sbk_d, bv_ptr, sbv_b, sbv_h, sbv_t, sbv_d, bm_ptr, sbm_b, sbm_h, sbm_q, sbm_k,
    b_n, b_col,
    tiles_per_split, n_splits, heads_kv, n_rep, q_len, kv_len, qk_scale, unrotate_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, R_PAD: tl.constexpr, TILE: tl.constexpr, DOT: tl.constexpr,
    HAS_QUANT: tl.constexpr, N_EXACT: tl.constexpr, Q_FILL: tl.constexpr, Q_MASK: tl.constexpr, A_MASK: tl.constexpr,
    B_MASK: tl.constexpr,
    K_KIND: tl.constexpr, K_W0: tl.constexpr, K_W1: tl.constexpr, K_OFFSET: tl.constexpr, K_PB: tl.constexpr,
    K_TG: tl.constexpr, K_CG: tl.constexpr, K_ZERO: tl.constexpr,
    V_KIND: tl.constexpr, V_W0: tl.constexpr, V_W1: tl.constexpr, V_OFFSET: tl.constexpr, V_PB: tl.constexpr,
    V_TG: tl.constexpr, V_CG: tl.constexpr, V_ZERO: tl.constexpr,
    K_WIDE: tl.constexpr, K_WIDE_PAD: tl.constexpr, K_WIDE_BYTES: tl.constexpr, K_WIDE_LOAD: tl.constexpr,
    FAST: tl.constexpr, ASM: tl.constexpr, QDOT: tl.constexpr, K_FLIP: tl.constexpr, V_FLIP: tl.constexpr,
    ROTATED: tl.constexpr, LOG2_BLOCK: tl.constexpr, K_LEFT: tl.constexpr, V_LEFT: tl.constexpr,
):
    """Grid ``(B * heads_kv, n_splits)``: splits ``[0, q_splits)`` cover the quantized region, the next
    ``a_splits`` exact segment 1, the rest exact segment 2. Writes ``acc`` ``[B * H, n_splits, R, D]`` and
    ``m``, ``l`` ``[B * H, n_splits, R]`` (float32, ``R = n_rep * q_len``). With ``Q_FILL`` the quantized region's
    splits stop at the count ``q_fill_ptr`` holds (rounded up to a tile; a split past it writes an empty partial,
    max -inf, which the merge weighs 0). With ``FAST`` the quantized region takes
    :func:`~.triton_codes.fast_split` (``K_*``/``V_*`` offsets and flips as it reads them), else
    :func:`_quant_split`. With ``ROTATED`` a quantized split's output, mixed from values stored as ``V H``, is rotated
    back before it is written, ``acc H^T`` with ``H = S * unrotate_scale``: every partial is then in the model's
    basis and the merge only sums."""
    pid_bh, pid_s = tl.program_id(0), tl.program_id(1)
    b, h = (pid_bh // heads_kv).to(tl.int64), (pid_bh % heads_kv).to(tl.int64)  # offsets may pass 2**31
    r = tl.arange(0, R_PAD)
    ch = tl.arange(0, D_PAD)
    rows = n_rep * q_len
    rows_ok = r < rows
    qpos, heads = r % q_len, h * n_rep + r // q_len
    q_rows = q_ptr + b * sq_b + heads * sq_h + qpos * sq_q  # each row's first element
    q = tl.load(q_rows[:, None] + ch[None, :] * sq_d, mask=rows_ok[:, None] & (ch[None, :] < HEAD_DIM),
                other=0.0).to(tl.float32) * qk_scale
    span = tiles_per_split * TILE
    acc = tl.zeros([R_PAD, D_PAD], tl.float32)
    m_i = tl.full([R_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([R_PAD], tl.float32)
    if pid_s < q_splits:
        if HAS_QUANT:
            start = pid_s * span
            stop = tl.minimum(start + span, q_n)
            if Q_FILL:  # stored tokens only (a static cache's filled slots), whole tiles: later splits read nothing
                # (whole key blocks where a tile holds two: fast_split weighs 0 a tile's second block past the stop)
                GRAIN: tl.constexpr = K_TG if FAST and TILE == 2 * K_TG else TILE
                filled = tl.load(q_fill_ptr).to(tl.int32)
                stop = tl.minimum(stop, (filled + GRAIN - 1) // GRAIN * GRAIN)
            if FAST:
                acc, m_i, l_i = fast_split(
                    q, kc_ptr + b * skc_b + h * skc_h, skc_t, ks_ptr + b * sks_b + h * sks_h,
                    kz_ptr + b * sks_b + h * sks_h, sks_t, sks_d, vc_ptr + b * svc_b + h * svc_h, svc_t,
                    vs_ptr + b * svs_b + h * svs_h, vz_ptr + b * svs_b + h * svs_h, svs_t, svs_d,
                    kw_ptr + b * skw_b + h * skw_h, skw_t, skw_p, kwc_ptr + b * skwc_b + h * skwc_h, skwc_n, skwc_r,
                    qm_ptr, sqm_b, sqm_h, sqm_q, sqm_k, q_col, start, stop, b, heads, qpos, rows_ok, q_len, kv_len,
                    q_rows, sq_d, qk_scale,
                    HEAD_DIM, R_PAD, TILE, Q_MASK, QDOT, ASM,
                    K_KIND == 3, K_FLIP, K_W0, K_W1, K_PB, K_TG, K_CG, K_ZERO, K_OFFSET,
                    V_KIND == 3, V_FLIP, V_W0, V_W1, V_PB, V_CG, V_ZERO, V_OFFSET, K_WIDE, K_WIDE_PAD, K_WIDE_LOAD,
                    K_LEFT, V_LEFT)
            else:
                acc, m_i, l_i = _quant_split(
                    q, kc_ptr, skc_b, skc_h, skc_t, skc_d, ks_ptr, kz_ptr, sks_b, sks_h, sks_t, sks_d,
                    vc_ptr, svc_b, svc_h, svc_t, svc_d, vs_ptr, vz_ptr, svs_b, svs_h, svs_t, svs_d,
                    kw_ptr, skw_b, skw_h, skw_t, skw_p, kwc_ptr, skwc_b, skwc_h, skwc_n, skwc_r,
                    qm_ptr, sqm_b, sqm_h, sqm_q, sqm_k, q_col, start, stop, b, h, heads, qpos, rows_ok, q_len,
                    kv_len, HEAD_DIM, D_PAD, R_PAD, TILE, Q_MASK, DOT,
                    K_KIND, K_W0, K_W1, K_OFFSET, K_PB, K_TG, K_CG, K_ZERO,
                    V_KIND, V_W0, V_W1, V_OFFSET, V_PB, V_TG, V_CG, V_ZERO, K_WIDE, K_WIDE_PAD, K_WIDE_BYTES)
            if ROTATED:
                acc = _unrotate(acc, ch, LOG2_BLOCK) * unrotate_scale
    elif pid_s < q_splits + a_splits:
        if N_EXACT >= 1:
            start = (pid_s - q_splits) * span
            acc, m_i, l_i = _exact_split(
                q, ak_ptr, sak_b, sak_h, sak_t, sak_d, av_ptr, sav_b, sav_h, sav_t, sav_d,
                am_ptr, sam_b, sam_h, sam_q, sam_k, a_n, a_col, start, tl.minimum(start + span, a_n), b, h, heads,
                qpos, rows_ok, q_len, kv_len, HEAD_DIM, D_PAD, R_PAD, TILE, A_MASK, DOT)
    else:
        if N_EXACT >= 2:
            start = (pid_s - q_splits - a_splits) * span
            acc, m_i, l_i = _exact_split(
                q, bk_ptr, sbk_b, sbk_h, sbk_t, sbk_d, bv_ptr, sbv_b, sbv_h, sbv_t, sbv_d,
                bm_ptr, sbm_b, sbm_h, sbm_q, sbm_k, b_n, b_col, start, tl.minimum(start + span, b_n), b, h, heads,
                qpos, rows_ok, q_len, kv_len, HEAD_DIM, D_PAD, R_PAD, TILE, B_MASK, DOT)
    row_index = (pid_bh * n_splits + pid_s) * rows + r
    tl.store(m_ptr + row_index, m_i, mask=rows_ok)
    tl.store(l_ptr + row_index, l_i, mask=rows_ok)
    tl.store(acc_ptr + row_index[:, None] * HEAD_DIM + ch[None, :], acc,
             mask=rows_ok[:, None] & (ch[None, :] < HEAD_DIM))


@triton.jit
def _unrotate(x, ch, LOG2_BLOCK: tl.constexpr):
    """``x @ S`` for the unnormalized Sylvester-Hadamard matrix ``S`` of blocks of ``2**LOG2_BLOCK`` channels, by
    butterflies in registers: channel ``i`` meets ``i ^ 2**stage`` at each stage."""
    cols = ch[None, :] + tl.zeros(x.shape, tl.int32)
    for stage in tl.static_range(LOG2_BLOCK):
        partner = tl.gather(x, cols ^ (1 << stage), axis=1)
        x = tl.where((cols & (1 << stage)) == 0, x + partner, partner - x)
    return x


@triton.jit(do_not_specialize=["n_splits", "q_len"])
def merge_partials_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, so_b, so_q, so_h, so_d, n_splits, heads_kv, n_rep, q_len,
                          HEAD_DIM: tl.constexpr, S_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Grid ``(B * heads_kv * R, cdiv(HEAD_DIM, CHUNK))``: one program per query row and ``CHUNK`` channels merges
    that row's splits of :func:`partial_attention_kernel` (all ``S_PAD >= n_splits`` of them at once, no loop) into
    ``out`` ``[B, q, Hq, D]``. Rows that see no token are written as 0."""
    pid, pid_c = tl.program_id(0), tl.program_id(1)
    rows = n_rep * q_len
    bh, r = pid // rows, pid % rows
    b, h = (bh // heads_kv).to(tl.int64), bh % heads_kv
    s = tl.arange(0, S_PAD)
    s_ok = s < n_splits
    c = pid_c * CHUNK + tl.arange(0, CHUNK)
    c_ok = c < HEAD_DIM
    row_index = (bh * n_splits + s) * rows + r
    m_s = tl.load(m_ptr + row_index, mask=s_ok, other=float("-inf"))
    l_s = tl.load(l_ptr + row_index, mask=s_ok, other=0.0)
    m = tl.max(m_s, 0)
    weight = tl.exp2(m_s - tl.where(m == float("-inf"), 0.0, m))
    total = tl.sum(l_s * weight, 0)
    acc = tl.load(acc_ptr + row_index[:, None] * HEAD_DIM + c[None, :], mask=s_ok[:, None] & c_ok[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    qpos, head = r % q_len, h * n_rep + r // q_len
    tl.store(out_ptr + b * so_b + qpos * so_q + head * so_h + c * so_d, out.to(out_ptr.dtype.element_ty), mask=c_ok)
