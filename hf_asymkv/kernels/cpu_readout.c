/* One native pass per stored tensor: packed integer codes -> float32 K or V (hf_asymkv/kernels/cpu_readout.py).
 *
 * The torch read-out of a quantized region (hf_asymkv/core/quant.py `dequantize`, hf_asymkv/core/rotation.py
 * `dequantize_rotated`) makes four to six passes over the region: unpack the bit-planes into bytes, fold in the wide
 * channels' high bits, convert to float, scale (and shift), and for rotated values an int8 matmul by the Hadamard
 * signs. This file does all of it per block of tokens (32 rows, or one packed block) while the block's codes sit in a
 * small int16 buffer, with the same arithmetic and the same roundings, so its output equals torch's bit for bit
 * (tests/kernels/test_cpu_readout.py):
 *
 *   - codes: the token's integer codes (unpacked, the symmetric storage offset removed, wide high bits added);
 *   - plain:   out = code * scale             (symmetric)
 *              out = fma(code, scale, zero)   (a scale per channel: torch's addcmul is one fused multiply-add)
 *              out = code * scale + zero      (a scale per group of channels: torch's mul_ then add_)
 *              the product of a code of <= 8 bits and a half-precision scale is exact, so these differ only for
 *              float32 scales (wide-range metadata), where each matches what torch does;
 *   - rotated: out = (code S^T) * row_scale, then out[first column of each Hadamard block] += row_zero, where
 *              code S^T is exact (a fast Walsh-Hadamard transform, Sylvester order, per Hadamard block: in int16
 *              vector lanes where hb * max|code| < 2 ** 15, else in int32 one token at a time), and
 *              row_scale = scale / sqrt(block), row_zero = zero * sqrt(block) come from torch (rotation.py).
 *
 * Build with -ffp-contract=off: the compiler must fuse no multiply-add on its own, where torch rounds twice.
 *
 * Code layouts (hf_asymkv/core/packing.py):
 *   "tokens":   each block of `block_size` tokens is packed along its tokens, per bit-plane set of width w
 *               (3 = 2 + 1, 5 = 4 + 1, 6 = 4 + 2): r = block_size * w / 8 byte rows of D bytes; bits [j w, (j+1) w)
 *               of row i hold token i + j r; later plane sets are shifted above the earlier ones.
 *   "head_dim": one token per row of D * bits / 8 bytes; plane set w spans D * w / 8 bytes, whose byte i holds
 *               channel i + j * (D * w / 8) in bits [j w, (j+1) w). 8-bit codes are one byte per channel.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const uint8_t *codes;         /* [B, H, T, P] bytes, P = D * bits / 8; rows of a (b, h) are contiguous */
    int64_t codes_stride_b, codes_stride_h;
    float *out;                   /* [B, H, T, D] float32; rows of a (b, h) are contiguous */
    int64_t out_stride_b, out_stride_h;
    int64_t batch, heads, tokens, head_dim;
    int64_t bits;                 /* 1 to 8 */
    int64_t tokens_layout;        /* 1: "tokens", 0: "head_dim" */
    int64_t block_size;           /* tokens per packed block ("tokens" layout) and per wide-channel choice */
    int64_t signed_bytes;         /* 8-bit codes stored as int8 */
    int64_t offset;               /* subtracted from every code (symmetric sub-byte codes: 2 ** (bits - 1)) */
    const float *scale, *zero;    /* plain: [B, H, T / token_group, D / channel_group] contiguous; zero may be NULL */
    int64_t token_group, channel_group;
    const uint8_t *wide_bits;     /* [B, H, T, wide_bytes] contiguous, or NULL */
    const uint8_t *wide_channels; /* [B, H, T / block_size, wide_count] contiguous */
    int64_t wide_count, wide_bytes, wide_offset;
    const float *row_scale, *row_zero; /* rotated: [B, H, T] contiguous; row_zero may be NULL */
    int64_t hadamard;             /* rotated: Hadamard block size (a power of two dividing D); 0: plain */
    int64_t threads;
} asymkv_readout;

typedef int16_t v16hi __attribute__((vector_size(32)));
typedef float v16sf __attribute__((vector_size(64)));
typedef int16_t v32hi __attribute__((vector_size(64)));
typedef uint16_t v32hu __attribute__((vector_size(64)));

static int plane_widths(int bits, int widths[3]) {
    int n = 0;
    if (8 % bits == 0) {
        widths[0] = bits;
        return 1;
    }
    for (int w = 4; w >= 1; w >>= 1)
        if (bits & w) widths[n++] = w;
    return n;
}

/* dst[e] (=, or |= shifted by `shift`) bits [s, s + w) of src[e], for n bytes: the byte shift is a constant in each
 * case, so the loop stays in 8- and 16-bit lanes (a variable shift would widen every lane to 32 bits). */
#define PLANE_CASE(S)                                                                                          \
    case S:                                                                                                     \
        if (first)                                                                                              \
            for (int64_t e = 0; e < n; e++) dst[e] = (uint8_t)(src[e] >> S) & mask;                             \
        else                                                                                                    \
            for (int64_t e = 0; e < n; e++) dst[e] |= (int16_t)(((uint8_t)(src[e] >> S) & mask) << shift);      \
        break;

static void decode_plane(const uint8_t *restrict src, int16_t *restrict dst, int64_t n, int s, int w, int shift,
                         int first) {
    uint8_t mask = (uint8_t)((1 << w) - 1);
    switch (s) {
        PLANE_CASE(0)
        PLANE_CASE(1)
        PLANE_CASE(2)
        PLANE_CASE(3)
        PLANE_CASE(4)
        PLANE_CASE(5)
        PLANE_CASE(6)
        PLANE_CASE(7)
    }
}

/* The codes of a whole token-packed block (bytes at `block`, rows of d bytes) into code[block_size * d]: each plane
 * is one run of whole token rows, decoded by one flat loop. */
static void unpack_block(const uint8_t *restrict block, int64_t d, int bits, int64_t block_size,
                         int16_t *restrict code) {
    int widths[3];
    int n = plane_widths(bits, widths);
    int64_t start = 0;
    int shift = 0;
    for (int k = 0; k < n; k++) {
        int w = widths[k];
        int64_t run = block_size * w / 8 * d; /* a plane: r = block_size * w / 8 token rows */
        for (int j = 0; j < 8 / w; j++)
            decode_plane(block + start, code + j * run, run, j * w, w, shift, k == 0);
        start += run;
        shift += w;
    }
}

/* `count` consecutive token rows packed along head_dim (or 8-bit codes, one per byte) into code[count * d]. */
static void unpack_rows(const uint8_t *restrict rows, int64_t count, int64_t d, int bits, int signed_bytes,
                        int16_t *restrict code) {
    if (bits == 8) {
        if (signed_bytes)
            for (int64_t e = 0; e < count * d; e++) code[e] = (int8_t)rows[e];
        else
            for (int64_t e = 0; e < count * d; e++) code[e] = rows[e];
        return;
    }
    int widths[3];
    int n = plane_widths(bits, widths);
    int64_t packed = d * bits / 8;
    for (int64_t t = 0; t < count; t++) {
        const uint8_t *restrict row = rows + t * packed;
        int16_t *restrict out = code + t * d;
        int64_t start = 0;
        int shift = 0;
        for (int k = 0; k < n; k++) {
            int w = widths[k];
            int64_t size = d * w / 8;
            for (int j = 0; j < 8 / w; j++)
                decode_plane(row + start, out + j * size, size, j * w, w, shift, k == 0);
            start += size;
            shift += w;
        }
    }
}

/* The wide channels' high bits of tokens [first, first + count) added to their codes (code[count * d]): each set bit
 * adds 2 ** bits, each wide channel loses the symmetric offset once more (wide_offset; 0 for asymmetric codes).
 *
 * Up to 31 wide channels and d a multiple of 32 (the presets: 16 of 64): per token, lane k of a 32-lane vector
 * gets slot k's bit times 2 ** bits (lane 31 stays 0), and one lane shuffle per 32 channels spreads the lanes onto
 * their channels (a block's channel -> slot index, 31 for the others); no branch on the bits. Otherwise a plain loop
 * over the slots. */
static void add_wide_bits(const asymkv_readout *p, int64_t b, int64_t h, int64_t first, int64_t count,
                          int16_t *restrict code) {
    int64_t d = p->head_dim, bs = p->block_size, r = p->wide_count, bh = b * p->heads + h;
    int16_t offset = (int16_t)p->wide_offset;
    int vector = r <= 31 && d % 32 == 0 && d <= 256;
    const uint8_t *channels = 0;
    v32hi slots[8]; /* per 32 channels: the slot each channel takes its addend from (31: none) */
    v32hu shifts, valid;
    for (int i = 0; i < 32; i++) {
        shifts[i] = (uint16_t)(i & 15);
        valid[i] = (uint16_t)(i < r ? 0xFFFF : 0);
    }
    for (int64_t t = first, block = -1; t < first + count; t++) {
        if (t / bs != block) {
            block = t / bs;
            channels = p->wide_channels + (bh * (p->tokens / bs) + block) * r;
            if (vector) {
                int16_t *slot = (int16_t *)slots;
                for (int64_t c = 0; c < d; c++) slot[c] = 31;
                for (int64_t k = 0; k < r; k++) slot[channels[k]] = (int16_t)k;
            }
        }
        const uint8_t *high = p->wide_bits + (bh * p->tokens + t) * p->wide_bytes;
        int16_t *row = code + (t - first) * d;
        if (offset)
            for (int64_t k = 0; k < r; k++) row[channels[k]] -= offset;
        if (vector) {
            uint32_t word = 0;
            for (int64_t i = 0; i < p->wide_bytes; i++) word |= (uint32_t)high[i] << (8 * i);
            v32hu bits;
            for (int i = 0; i < 32; i++) bits[i] = (uint16_t)(i < 16 ? word : word >> 16);
            v32hi add = (v32hi)((((bits >> shifts) & 1) << p->bits) & valid);
            for (int64_t c = 0; c < d; c += 32) {
                v32hi now;
                memcpy(&now, row + c, sizeof now);
                now += __builtin_shuffle(add, slots[c / 32]);
                memcpy(row + c, &now, sizeof now);
            }
        } else {
            for (int64_t k = 0; k < r; k++)
                row[channels[k]] += (int16_t)(((high[k >> 3] >> (k & 7)) & 1) << p->bits);
        }
    }
}

/* Tokens [first, first + count) of (b, h) as integer codes code[count * d]: unpacked, offset removed, wide high bits
 * added (a chunk is one whole block in the "tokens" layout). */
static void chunk_codes(const asymkv_readout *p, int64_t b, int64_t h, int64_t first, int64_t count,
                        int16_t *restrict code) {
    int64_t d = p->head_dim, bs = p->block_size, packed = d * p->bits / 8;
    const uint8_t *base = p->codes + b * p->codes_stride_b + h * p->codes_stride_h + first * packed;
    if (p->tokens_layout)
        unpack_block(base, d, (int)p->bits, bs, code);
    else
        unpack_rows(base, count, d, (int)p->bits, (int)p->signed_bytes, code);
    if (p->offset)
        for (int64_t e = 0; e < count * d; e++) code[e] -= (int16_t)p->offset;
    if (p->wide_bits)
        add_wide_bits(p, b, h, first, count, code);
}

static void write_plain(const asymkv_readout *p, int64_t b, int64_t h, int64_t first, int64_t count,
                        const int16_t *restrict code, float *restrict out) {
    int64_t d = p->head_dim, cg = p->channel_group, groups = d / cg, tg = p->token_group;
    for (int64_t t = first; t < first + count; t++) {
        int64_t row = ((b * p->heads + h) * (p->tokens / tg) + t / tg) * groups;
        const float *restrict s = p->scale + row;
        const float *restrict z = p->zero ? p->zero + row : 0;
        const int16_t *restrict c16 = code + (t - first) * d;
        float *restrict o = out + t * d;
        if (cg == 1 && z) /* torch's addcmul: one fused multiply-add (the same as two roundings for half scales) */
            for (int64_t c = 0; c < d; c++) o[c] = fmaf((float)c16[c], s[c], z[c]);
        else if (cg == 1)
            for (int64_t c = 0; c < d; c++) o[c] = (float)c16[c] * s[c];
        else if (z)
            for (int64_t c = 0; c < d; c++) o[c] = (float)c16[c] * s[c / cg] + z[c / cg];
        else
            for (int64_t c = 0; c < d; c++) o[c] = (float)c16[c] * s[c / cg];
    }
}

/* Butterflies of distance h < 32 inside one vector of 32 lanes: lane i gets x[i] + x[i ^ h] where bit h of i is 0,
 * x[i ^ h] - x[i] where it is 1 (the Sylvester order): a shuffle, then the lanes with bit h negate their own value
 * ((x ^ m) - m, m = -1 there) before the add. */
#define LANES(f)                                                                                                \
    {f(0),  f(1),  f(2),  f(3),  f(4),  f(5),  f(6),  f(7),  f(8),  f(9),  f(10), f(11), f(12), f(13), f(14), f(15), \
     f(16), f(17), f(18), f(19), f(20), f(21), f(22), f(23), f(24), f(25), f(26), f(27), f(28), f(29), f(30), f(31)}
#define BUTTERFLY(x, H)                                                                                         \
    do {                                                                                                        \
        const v32hi partner_ = LANES(PARTNER_##H), negate_ = LANES(NEGATE_##H);                                 \
        x = __builtin_shuffle(x, partner_) + ((x ^ negate_) - negate_);                                         \
    } while (0)
#define PARTNER_1(i) ((i) ^ 1)
#define PARTNER_2(i) ((i) ^ 2)
#define PARTNER_4(i) ((i) ^ 4)
#define PARTNER_8(i) ((i) ^ 8)
#define PARTNER_16(i) ((i) ^ 16)
#define NEGATE_1(i) (-(((i) >> 0) & 1))
#define NEGATE_2(i) (-(((i) >> 1) & 1))
#define NEGATE_4(i) (-(((i) >> 2) & 1))
#define NEGATE_8(i) (-(((i) >> 3) & 1))
#define NEGATE_16(i) (-(((i) >> 4) & 1))

/* code S^T in place for `count` token rows of d codes, Hadamard blocks of hb (32 <= hb, 32 | d), 32 lanes of int16
 * (one AVX-512 register): exact when hb * max|code| < 2 ** 15 (the caller checks). */
static void walsh_hadamard_16(int16_t *restrict code, int64_t count, int64_t d, int64_t hb) {
    int64_t vectors = count * d / 32;
    v32hi *v = (v32hi *)code;
    for (int64_t i = 0; i < vectors; i++) {
        v32hi x = v[i];
        BUTTERFLY(x, 1);
        BUTTERFLY(x, 2);
        BUTTERFLY(x, 4);
        BUTTERFLY(x, 8);
        BUTTERFLY(x, 16);
        v[i] = x;
    }
    for (int64_t h = 1; h < hb / 32; h <<= 1) /* distances of whole vectors */
        for (int64_t i = 0; i < vectors; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                v32hi a = v[j], c = v[j + h];
                v[j] = a + c;
                v[j + h] = a - c;
            }
}

/* The same in int32, one token at a time (any hb that divides d). */
static void walsh_hadamard_32(int32_t *code, int64_t d, int64_t hb) {
    for (int64_t base = 0; base < d; base += hb)
        for (int64_t h = 1; h < hb; h <<= 1)
            for (int64_t i = base; i < base + hb; i += 2 * h)
                for (int64_t j = i; j < i + h; j++) {
                    int32_t a = code[j], c = code[j + h];
                    code[j] = a + c;
                    code[j + h] = a - c;
                }
}

static void write_rotated(const asymkv_readout *p, int64_t b, int64_t h, int64_t first, int64_t count,
                          int16_t *restrict code, float *restrict out) {
    int64_t d = p->head_dim, hb = p->hadamard, bh = b * p->heads + h;
    int fits16 = hb >= 32 && d % 32 == 0 && hb * ((1 << p->bits) - 1) < 32768;
    if (fits16)
        walsh_hadamard_16(code, count, d, hb);
    for (int64_t t = first; t < first + count; t++) {
        float s = p->row_scale[bh * p->tokens + t], *restrict o = out + t * d;
        float z = p->row_zero ? p->row_zero[bh * p->tokens + t] : 0.0f;
        int16_t *restrict row = code + (t - first) * d;
        if (fits16) { /* the zero is added in the register, to the rounded product, as torch adds it */
            for (int64_t c = 0; c < d; c += 16) {
                v16sf f = __builtin_convertvector(*(v16hi *)(row + c), v16sf) * s;
                if (p->row_zero && (c & (hb - 1)) == 0)
                    f[0] += z;
                memcpy(o + c, &f, sizeof f);
            }
        } else {
            int32_t wide[4096];
            for (int64_t c = 0; c < d; c++) wide[c] = row[c];
            walsh_hadamard_32(wide, d, hb);
            for (int64_t c = 0; c < d; c++) o[c] = (float)wide[c] * s;
            if (p->row_zero)
                for (int64_t c = 0; c < d; c += hb) o[c] += z;
        }
    }
}

/* Returns 0, or 1 for arguments this file cannot read (the caller checks them first; this is a last guard). */
int asymkv_readout_run(const asymkv_readout *p) {
    int64_t d = p->head_dim;
    if (p->bits < 1 || p->bits > 8 || d < 1 || d > 4096 || (p->tokens_layout && p->tokens % p->block_size) ||
        (p->hadamard && (p->hadamard & (p->hadamard - 1) || d % p->hadamard)) ||
        (!p->hadamard && (p->token_group < 1 || p->channel_group < 1 || d % p->channel_group ||
                          p->tokens % p->token_group)))
        return 1;
    /* work units: whole blocks for token-packed codes (each plane a run of whole rows), else 32 rows */
    int64_t chunk = p->tokens_layout ? p->block_size : 32;
    int64_t chunks = (p->tokens + chunk - 1) / chunk, units = p->batch * p->heads * chunks;
    int threads = (int)p->threads;
    if (threads < 1 || p->batch * p->heads * p->tokens * d < 32768) threads = 1;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        int16_t *code = aligned_alloc(64, (size_t)((chunk * d * 2 + 63) / 64 * 64));
        if (!code)
            failed = 1;
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            if (!code)
                continue;
            int64_t bh = u / chunks, b = bh / p->heads, h = bh % p->heads;
            int64_t first = (u % chunks) * chunk, count = first + chunk < p->tokens ? chunk : p->tokens - first;
            float *rows = p->out + b * p->out_stride_b + h * p->out_stride_h;
            chunk_codes(p, b, h, first, count, code);
            if (p->hadamard)
                write_rotated(p, b, h, first, count, code, rows);
            else
                write_plain(p, b, h, first, count, code, rows);
        }
        free(code);
    }
    return failed ? 2 : 0;
}
