/* Fused decode attention over the stored codes on CPU (hf_asymkv/kernels/cpu_attention.py).
 *
 * One call attends the query rows of every (batch, KV head) over a layer as stored: a quantized region (key and
 * value codes, block by block) and up to three exact parts (the sinks, the recent window, left-padded rows' exact
 * sinks that overlay positions of the region). Nothing of the history is decoded into memory: each block's codes are
 * unpacked into a block-sized scratch (L1/L2), scored, and mixed, then the next block overwrites it.
 *
 *   keys (one scale, and zero, per channel group per block):
 *       q . k = (q * s) . c + [q . z - offset * sum(q * s) - wide_offset * sum_wide(q * s)] + 2^bits sum_wide (q * s) h
 *       the bracket is one number per block and query row; the wide channels' high bits h are a masked sum per token;
 *   softmax: online, per block (running max m and sum l per row, the accumulators rescaled when m grows);
 *   values (one scale s_t and zero z_t per token and channel group):
 *       sum_t p_t (s_t c_t + z_t) = sum_t (p_t s_t) c_t + sum_t p_t z_t,
 *       rotated values (V H stored) are mixed as stored and the mixed rows rotated back once, at the end;
 *   exact parts: the same online softmax over float rows (float32, bfloat16 or float16), scale 1.
 *
 * The history is split across threads (OpenMP, `threads` of them): each (batch, KV head) into `splits` runs of whole
 * blocks; each run keeps its own (m, l, accumulators) and the runs are merged at the end (the split-KV of
 * flash-decoding). Per call the memory used is per thread one block of codes and the partial results: nothing grows
 * with the context.
 *
 * The layout of the codes is hf_asymkv/core/packing.py's; its plane widths come in `planes` (packing.plane_widths),
 * low bits first. "tokens": a block of `block_size` tokens holds, per plane set of width w, r = block_size * w / 8
 * byte rows of D bytes whose bits [j w, (j+1) w) are token i + j r of the block. "head_dim": one token per row, plane
 * set w spans D * w / 8 bytes whose bits [j w, (j+1) w) of byte i are channel i + j D w / 8. 8-bit codes: a byte each.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__FMA__)
#include <immintrin.h>
#endif

#define MAX_PLANES 3
#define MAX_HEAD_DIM 256
#define EXACT_CHUNK 32 /* exact tokens scored at a time */

enum { META_F32 = 0, META_F16 = 1, META_BF16 = 2 };  /* dtypes of scales, zeros and exact rows */
enum { MASK_NONE = 0, MASK_BOOL = 1, MASK_F32 = 2 }; /* no mask: causal (bottom-right) for several query tokens */

typedef struct {
    const uint8_t *codes; /* [B, H, N, P] bytes (P = D * bits / 8); the rows of a (b, h) are contiguous */
    int64_t codes_stride_b, codes_stride_h;
    int64_t bits, tokens_layout, signed_bytes, offset; /* offset: subtracted from every code (symmetric storage) */
    int64_t planes[MAX_PLANES], plane_count;
    const void *scale, *zero; /* [B, H, token groups, channel groups], the last two contiguous; zero may be NULL */
    int64_t meta_kind, meta_stride_b, meta_stride_h, channel_group;
    const uint8_t *wide_bits; /* [B, H, N, wide_bytes] or NULL; [B, H, N / block, wide_count] channels */
    int64_t wide_bits_stride_b, wide_bits_stride_h;
    const uint8_t *wide_channels;
    int64_t wide_channels_stride_b, wide_channels_stride_h;
    int64_t wide_count, wide_bytes, wide_offset;
} asymkv_codes;

typedef struct {
    const void *keys, *values; /* [B, H, n, D] of `dtype`; the rows of a (b, h) contiguous */
    int64_t keys_stride_b, keys_stride_h, values_stride_b, values_stride_h;
    int64_t dtype, tokens, column; /* token j sits at mask column `column + j` ... */
    const int64_t *positions;      /* ... or at positions[b, j] ([B, n], overlaid sinks), where valid[b, j] */
    const uint8_t *valid;
} asymkv_exact;

typedef struct {
    const void *query;  /* [B, Hq, q, D] of query_dtype, rows contiguous; Hq = H * n_rep: query head h * n_rep + rep */
    int64_t query_dtype, query_stride_b, query_stride_h, query_stride_q;
    double scaling;     /* multiplies the query */
    float *out;         /* [B, q, Hq, D] float32, contiguous */
    int64_t batch, heads, rows, q_len, n_rep, head_dim; /* rows R = n_rep * q_len per KV head, row r = rep * q_len + i */
    int64_t tokens, block_size, column; /* quantized tokens (whole blocks), tokens per block, mask column of the first */
    asymkv_codes keys, values;
    int64_t hadamard;                   /* values stored rotated by Hadamard blocks of this size; 0: plain */
    asymkv_exact exact[3];
    int64_t exact_count, overlay;       /* overlay: the exact part whose positions replace region tokens, or -1 */
    const void *mask;                   /* [B, 1 | Hq, q, kv] at column 0 of the layer; NULL: causal */
    int64_t mask_kind, mask_stride_b, mask_stride_h, mask_stride_q, kv_len;
    int64_t threads, splits;
} asymkv_attention;

typedef float v8sf __attribute__((vector_size(32)));
typedef int32_t v8si __attribute__((vector_size(32)));

#if defined(__AVX2__) && defined(__FMA__)
#define ASYMKV_AVX2 1 /* the hot loops below in AVX2 intrinsics; plain vector code elsewhere */
#endif

static inline v8sf fma8(v8sf a, v8sf b, v8sf c) {
#ifdef ASYMKV_AVX2
    return (v8sf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

static inline v8sf splat(float x) { return (v8sf){x, x, x, x, x, x, x, x}; }

static inline v8sf load8(const float *p) {
    v8sf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8sf v) { memcpy(p, &v, sizeof v); }

static inline void store4(float *p, v8sf v) { memcpy(p, &v, 4 * sizeof(float)); } /* lanes 0-3 */

static inline v8sf select8(v8si which, v8sf a, v8sf b) { return (v8sf)((which & (v8si)a) | (~which & (v8si)b)); }

/* 8 codes (one byte each) as float32: signed (s8) or unsigned (u8) bytes */
static inline v8sf s8(const int8_t *p) {
#ifdef ASYMKV_AVX2
    return (v8sf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    v8sf f;
    for (int i = 0; i < 8; i++) f[i] = (float)p[i];
    return f;
#endif
}

static inline v8sf u8(const int8_t *p) {
#ifdef ASYMKV_AVX2
    return (v8sf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    v8sf f;
    for (int i = 0; i < 8; i++) f[i] = (float)((const uint8_t *)p)[i];
    return f;
#endif
}

/* (sum of a, sum of b, sum of c, sum of e): four dot products' partial sums reduced at once */
static inline v8sf reduce4(v8sf a, v8sf b, v8sf c, v8sf e) {
#ifdef ASYMKV_AVX2
    __m256 u = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a, (__m256)b), _mm256_hadd_ps((__m256)c, (__m256)e));
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    return (v8sf)_mm256_castps128_ps256(sum); /* lanes 0-3 */
#else
    v8sf out = splat(0.0f);
    for (int i = 0; i < 8; i++) {
        out[0] += a[i];
        out[1] += b[i];
        out[2] += c[i];
        out[3] += e[i];
    }
    return out;
#endif
}

static inline v8sf max8(v8sf a, v8sf b) { return select8(a > b, a, b); }

static inline float hsum8(v8sf v) {
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += v[i];
    return s;
}

static inline float hmax8(v8sf v) {
    float s = v[0];
    for (int i = 1; i < 8; i++) s = v[i] > s ? v[i] : s;
    return s;
}

/* exp(x) for 8 lanes: 2^n * e^f with |f| <= ln2 / 2, a degree-6 polynomial (about 2 ulp); exactly 0 below -87.3
 * (x = -inf among them), so masked tokens weigh nothing. */
static inline v8sf exp8(v8sf x) {
    const v8sf lo = splat(-87.3f), hi = splat(88.3f);
    v8si keep = x >= lo;
    x = select8(keep, x, lo);
    x = select8(x > hi, hi, x);
    v8sf n = x * splat(1.44269504088896341f); /* rounded to the nearest integer: + or - 0.5, then truncated */
    n = __builtin_convertvector(__builtin_convertvector(n + select8(n >= 0, splat(0.5f), splat(-0.5f)), v8si), v8sf);
    v8sf f = fma8(n, splat(-0.693359375f), x);
    f = fma8(n, splat(2.12194440e-4f), f);
    v8sf poly = splat(1.9875691500e-4f);
    poly = fma8(poly, f, splat(1.3981999507e-3f));
    poly = fma8(poly, f, splat(8.3334519073e-3f));
    poly = fma8(poly, f, splat(4.1665795894e-2f));
    poly = fma8(poly, f, splat(1.6666665459e-1f));
    poly = fma8(poly, f, splat(5.0000001201e-1f));
    poly = fma8(poly, f * f, f + splat(1.0f));
    v8si scale = (__builtin_convertvector(n, v8si) + 127) << 23;
    return (v8sf)((v8si)(poly * (v8sf)scale) & keep);
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
    if (exponent == 0x1F)
        bits = sign | 0x7F800000 | (mantissa << 13);
    else if (exponent)
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    else if (!mantissa)
        bits = sign;
    else { /* subnormal: normalize */
        exponent = 113;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float load_meta(const void *base, int64_t i, int64_t kind) {
    if (kind == META_F32)
        return ((const float *)base)[i];
    uint16_t h = ((const uint16_t *)base)[i];
    if (kind == META_F16)
        return half_to_float(h);
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* row[0:d] of an exact part as float32 */
static void load_row(const void *base, int64_t i, int64_t d, int64_t kind, float *restrict row) {
    if (kind == META_F32) {
        memcpy(row, (const float *)base + i * d, (size_t)d * sizeof(float));
        return;
    }
    for (int64_t c = 0; c < d; c++) row[c] = load_meta(base, i * d + c, kind);
}

/* ---------------------------------------------------------------------------------------------------- unpacking */

/* dst[e] = bits [s, s + w) of src[e] (the first plane set), or dst[e] |= them shifted up by `shift` (the later ones),
 * for n bytes: every shift is a constant of its case, so the loops stay in byte lanes (a variable shift would widen
 * each lane to 32 bits). Later plane sets start at bit 2, 4 or 6 (plane widths 4, 2, 1 summed low first). */
#define FIRST_CASE(S)                                                                                          \
    case S:                                                                                                     \
        for (int64_t e = 0; e < n; e++) dst[e] = (int8_t)((uint8_t)(src[e] >> S) & mask);                       \
        return;
#define OR_CASE(S, SHIFT)                                                                                      \
    case S * 8 + SHIFT:                                                                                         \
        for (int64_t e = 0; e < n; e++) dst[e] |= (int8_t)((uint8_t)(((uint8_t)(src[e] >> S) & mask) << SHIFT)); \
        return;
#define OR_CASES(SHIFT) OR_CASE(0, SHIFT) OR_CASE(1, SHIFT) OR_CASE(2, SHIFT) OR_CASE(3, SHIFT) OR_CASE(4, SHIFT) \
    OR_CASE(5, SHIFT) OR_CASE(6, SHIFT) OR_CASE(7, SHIFT)

static void decode_plane(const uint8_t *restrict src, int8_t *restrict dst, int64_t n, int s, int w, int shift,
                         int first) {
    uint8_t mask = (uint8_t)((1 << w) - 1);
    if (first)
        switch (s) {
            FIRST_CASE(0)
            FIRST_CASE(1)
            FIRST_CASE(2)
            FIRST_CASE(3)
            FIRST_CASE(4)
            FIRST_CASE(5)
            FIRST_CASE(6)
            FIRST_CASE(7)
        }
    switch (s * 8 + shift) {
        OR_CASES(2)
        OR_CASES(4)
        OR_CASES(6)
    }
    for (int64_t e = 0; e < n; e++) /* (no plane set starts elsewhere; kept for completeness) */
        dst[e] |= (int8_t)(((src[e] >> s) & mask) << shift);
}

/* The sub-byte codes of `count` tokens starting at `rows` (a whole block in the "tokens" layout) as int8 codes
 * [count, d], the storage offset removed. */
#ifdef ASYMKV_AVX2
/* bits [s, s + w) of 32 bytes, w given by `mask` ((1 << w) - 1 in every byte): 16-bit lanes shifted by a count from a
 * register, then the byte mask (the bits that cross from a lane's high byte land at or above bit 8 - s >= w). */
static inline __m256i bits32(const uint8_t *p, int s, __m256i mask) {
    return _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)p), _mm_cvtsi32_si128(s)), mask);
}

/* A token-packed block of one or two plane sets (every sub-byte width but 7 bits) decoded 32 bytes at a time: each
 * code byte written once, the second set's bits OR-ed in while in registers, the offset removed there too. Returns 0
 * (nothing done) for blocks whose planes are not whole multiples of 32 bytes, and for three plane sets. */
static int unpack_tokens_avx2(const asymkv_codes *c, const uint8_t *restrict rows, int64_t count, int64_t d,
                              int8_t *restrict out) {
    if (c->plane_count > 2)
        return 0;
    int w0 = (int)c->planes[0], w1 = c->plane_count == 2 ? (int)c->planes[1] : 0;
    int64_t r0 = count * w0 / 8, r1 = w1 ? count * w1 / 8 : r0; /* byte rows of a plane in each set */
    if (r1 * d % 32)
        return 0;
    const uint8_t *high = rows + r0 * d; /* the second set's rows; its plane j holds tokens [j r1, (j + 1) r1) */
    __m256i m0 = _mm256_set1_epi8((char)((1 << w0) - 1)), m1 = _mm256_set1_epi8((char)((1 << w1) - 1));
    __m256i offset = _mm256_set1_epi8((char)c->offset);
    __m128i up = _mm_cvtsi32_si128(w0);
    for (int64_t run = 0; run < count / r1; run++) { /* tokens [run r1, (run + 1) r1) */
        int64_t t0 = run * r1, plane = t0 / r0;
        const uint8_t *low = rows + (t0 % r0) * d;
        int8_t *o = out + t0 * d;
        for (int64_t e = 0; e < r1 * d; e += 32) {
            __m256i v = bits32(low + e, (int)(plane * w0), m0);
            if (w1)
                v = _mm256_or_si256(v, _mm256_sll_epi16(bits32(high + e, (int)(run * w1), m1), up));
            _mm256_storeu_si256((__m256i *)(o + e), _mm256_sub_epi8(v, offset));
        }
    }
    return 1;
}
#endif

static void unpack_codes(const asymkv_codes *c, const uint8_t *restrict rows, int64_t count, int64_t d,
                         int8_t *restrict out) {
    int64_t start = 0;
    int shift = 0;
#ifdef ASYMKV_AVX2
    if (c->tokens_layout && unpack_tokens_avx2(c, rows, count, d, out))
        return;
#endif
    if (c->tokens_layout) {
        for (int64_t k = 0; k < c->plane_count; k++) {
            int w = (int)c->planes[k];
            int64_t run = count * w / 8 * d; /* a plane: count * w / 8 whole token rows */
            for (int j = 0; j < 8 / w; j++)
                decode_plane(rows + start, out + j * run, run, j * w, w, shift, k == 0);
            start += run;
            shift += w;
        }
    } else {
        int64_t packed = d * c->bits / 8;
        for (int64_t t = 0; t < count; t++) {
            start = 0;
            shift = 0;
            for (int64_t k = 0; k < c->plane_count; k++) {
                int w = (int)c->planes[k];
                int64_t size = d * w / 8;
                for (int j = 0; j < 8 / w; j++)
                    decode_plane(rows + t * packed + start, out + t * d + j * size, size, j * w, w, shift, k == 0);
                start += size;
                shift += w;
            }
        }
    }
    if (c->offset)
        for (int64_t e = 0; e < count * d; e++) out[e] = (int8_t)(out[e] - c->offset);
}

/* Tokens [first, first + count) of (b, h): a pointer to their codes, one byte per code: the stored bytes of 8-bit
 * codes (`*unsigned_codes` set for uint8), else unpacked into `scratch`. */
static const int8_t *block_codes(const asymkv_codes *c, int64_t b, int64_t h, int64_t first, int64_t count, int64_t d,
                                 int8_t *scratch, int *unsigned_codes) {
    const uint8_t *rows = c->codes + b * c->codes_stride_b + h * c->codes_stride_h + first * (d * c->bits / 8);
    *unsigned_codes = 0;
    if (c->bits == 8) {
        *unsigned_codes = !c->signed_bytes;
        return (const int8_t *)rows;
    }
    unpack_codes(c, rows, count, d, scratch);
    return scratch;
}

/* n scales or zeros from `base` + i as float32 (half precision: F16C where the CPU has it) */
static void meta_to_float(const void *base, int64_t i, int64_t n, int64_t kind, float *restrict out) {
    if (kind == META_F32) {
        memcpy(out, (const float *)base + i, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *h = (const uint16_t *)base + i;
    int64_t e = 0;
#if defined(__F16C__)
    if (kind == META_F16)
        for (; e + 8 <= n; e += 8) _mm256_storeu_ps(out + e, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + e))));
#endif
    if (kind == META_BF16)
        for (; e < n; e++) {
            uint32_t bits = (uint32_t)h[e] << 16;
            memcpy(out + e, &bits, sizeof bits);
        }
    for (; e < n; e++) out[e] = half_to_float(h[e]);
}

/* ---------------------------------------------------------------------------------------------------- state */

typedef struct { /* one run's online softmax: rows R, head_dim D */
    float *m, *l;   /* [R] running max and sum */
    float *quant;   /* [R, D] values mixed from codes (rotated values: as stored) */
    float *exact;   /* [R, D] values mixed from exact rows */
} run_state;

typedef struct { /* per-thread scratch, sized by the block, never by the context */
    int8_t *key_codes, *value_codes; /* [block, D] unpacked sub-byte codes */
    float *query;                    /* [R, D] this (b, h)'s query rows, scaled, float32 */
    float *qs, *bias;                /* [R, D], [R] */
    float *scores;                   /* [R, max(block, EXACT_CHUNK)] */
    float *weights;                  /* [R, block] value weights p * s of one channel group */
    float *value_scale, *value_zero; /* [block, groups] */
    float *row;                      /* [D] */
} scratch;

/* The mask column `column` of query row r of (b, h) as an additive bias (0, -inf or the float mask's value). */
static inline float mask_at(const asymkv_attention *p, int64_t b, int64_t h, int64_t r, int64_t column) {
    int64_t i = r % p->q_len;
    if (!p->mask)
        return column <= p->kv_len - p->q_len + i ? 0.0f : -INFINITY;
    int64_t head = h * p->n_rep + r / p->q_len;
    int64_t at = b * p->mask_stride_b + head * p->mask_stride_h + i * p->mask_stride_q + column;
    if (p->mask_kind == MASK_BOOL)
        return ((const uint8_t *)p->mask)[at] ? 0.0f : -INFINITY;
    return ((const float *)p->mask)[at];
}

/* Adds the mask of columns [column, column + count) to scores [R, ld]; skips the work where a row sees every column. */
static void apply_mask(const asymkv_attention *p, int64_t b, int64_t h, int64_t column, int64_t count, float *scores,
                       int64_t ld) {
    for (int64_t r = 0; r < p->rows; r++) {
        int64_t i = r % p->q_len;
        if (!p->mask && column + count - 1 <= p->kv_len - p->q_len + i)
            continue; /* causal: all visible */
        if (p->mask && p->mask_kind == MASK_BOOL) {
            int64_t head = h * p->n_rep + r / p->q_len;
            const uint8_t *m = (const uint8_t *)p->mask + b * p->mask_stride_b + head * p->mask_stride_h +
                               i * p->mask_stride_q + column;
            int64_t t = 0;
            while (t < count && m[t]) t++;
            if (t == count)
                continue;
        }
        for (int64_t t = 0; t < count; t++) scores[r * ld + t] += mask_at(p, b, h, r, column + t);
    }
}

/* Folds scores [R, ld] of `count` tokens into the run: new maxima rescale the sums and accumulators; scores become
 * weights exp(s - m). Returns 0 when no row sees any of these tokens (nothing to mix). */
static int online_softmax(const asymkv_attention *p, run_state *s, float *scores, int64_t ld, int64_t count) {
    int64_t d = p->head_dim;
    int any = 0;
    for (int64_t r = 0; r < p->rows; r++) {
        float *row = scores + r * ld, top = -INFINITY;
        int64_t t = 0;
        if (count >= 8) {
            v8sf most = load8(row);
            for (t = 8; t + 8 <= count; t += 8) most = max8(most, load8(row + t));
            for (int i = 0; i < 8; i++) top = most[i] > top ? most[i] : top;
        }
        for (; t < count; t++) top = row[t] > top ? row[t] : top;
        if (top == -INFINITY) { /* nothing visible in this row: weights 0 */
            memset(row, 0, (size_t)count * sizeof(float));
            continue;
        }
        any = 1;
        if (top > s->m[r]) {
            float alpha = s->m[r] == -INFINITY ? 0.0f : expf(s->m[r] - top);
            s->m[r] = top;
            s->l[r] *= alpha;
            v8sf a = splat(alpha);
            for (int64_t c = 0; c < d; c += 8) {
                store8(s->quant + r * d + c, load8(s->quant + r * d + c) * a);
                store8(s->exact + r * d + c, load8(s->exact + r * d + c) * a);
            }
        }
        v8sf m = splat(s->m[r]), total = splat(0.0f);
        for (t = 0; t + 8 <= count; t += 8) {
            v8sf e = exp8(load8(row + t) - m);
            store8(row + t, e);
            total += e;
        }
        float sum = hsum8(total);
        for (; t < count; t++) {
            row[t] = row[t] == -INFINITY ? 0.0f : expf(row[t] - s->m[r]);
            sum += row[t];
        }
        s->l[r] += sum;
    }
    return any;
}

/* ---------------------------------------------------------------------------------------------------- blocks */

/* The query folded with block `blk`'s key scales (qs = q * s) and its per-row constant (bias: q . z, less the wide
 * channels' extra symmetric offset times their q * s). */
static void fold_key_block(const asymkv_attention *p, const float *q, int64_t b, int64_t h, int64_t blk, scratch *w) {
    const asymkv_codes *k = &p->keys;
    int64_t d = p->head_dim, cg = k->channel_group, groups = d / cg;
    int64_t meta = b * k->meta_stride_b + h * k->meta_stride_h + blk * groups;
    float scale[MAX_HEAD_DIM], zero[MAX_HEAD_DIM];
    meta_to_float(k->scale, meta, groups, k->meta_kind, scale);
    if (k->zero)
        meta_to_float(k->zero, meta, groups, k->meta_kind, zero);
    else
        memset(zero, 0, sizeof zero);
    for (int64_t c = d - 1; cg > 1 && c >= 0; c--) { /* one scale per group of channels: spread onto its channels */
        scale[c] = scale[c / cg];
        zero[c] = zero[c / cg];
    }
    const uint8_t *channels = k->wide_bits && k->wide_offset ? k->wide_channels + b * k->wide_channels_stride_b +
                                                                   h * k->wide_channels_stride_h + blk * k->wide_count
                                                             : 0;
    for (int64_t r = 0; r < p->rows; r++) {
        const float *qr = q + r * d;
        float *qs = w->qs + r * d, wide = 0.0f;
        v8sf dot = splat(0.0f);
        for (int64_t c = 0; c < d; c += 8) {
            v8sf x = load8(qr + c);
            store8(qs + c, x * load8(scale + c));
            if (k->zero)
                dot = fma8(x, load8(zero + c), dot);
        }
        for (int64_t j = 0; channels && j < k->wide_count; j++) wide += qs[channels[j]];
        w->bias[r] = hsum8(dot) - (float)k->wide_offset * wide;
    }
}

/* The wide channels' high bits folded into a block's int8 codes [count, d]: 2^bits added where a token's bit is set
 * (channels: the block's R wide channels, slot j; high: [count, bytes], slot j in bit j % 8 of byte j / 8). With AVX2
 * and up to 8 bytes of bits per token: per 32 channels one byte shuffle picks each channel's byte of the token's
 * bits, a mask its bit (channels that are not wide: none), and the levels are added where it is set. */
/* A token's `bytes` (1 to 8) bytes of wide bits as one little-endian word: fixed-size copies for the sizes head_dim
 * 64/128/256 with a quarter of the channels wide give (2, 4, 8 bytes), which compile to one load; a copy of a size
 * known only at run time is a library call per token, which cost as much as the rest of the block's scoring. */
static inline uint64_t token_bits(const uint8_t *p, int64_t bytes) {
    uint64_t word = 0;
    uint16_t w2;
    uint32_t w4;
    switch (bytes) {
    case 1: return p[0];
    case 2: memcpy(&w2, p, 2); return w2;
    case 4: memcpy(&w4, p, 4); return w4;
    case 8: memcpy(&word, p, 8); return word;
    default:
        for (int64_t i = 0; i < bytes; i++) word |= (uint64_t)p[i] << (8 * i);
        return word;
    }
}

static void add_wide_bits(const asymkv_codes *k, const uint8_t *restrict channels, const uint8_t *restrict high,
                          int64_t count, int64_t d, int8_t *restrict codes) {
    int64_t bytes = k->wide_bytes;
#ifdef ASYMKV_AVX2
    if (bytes <= 8 && d % 32 == 0) {
        uint8_t index[MAX_HEAD_DIM], bit[MAX_HEAD_DIM];
        memset(index, 0x80, (size_t)d); /* a shuffle index with its top bit set gives 0 */
        memset(bit, 0, (size_t)d);
        for (int64_t j = 0; j < k->wide_count; j++) {
            index[channels[j]] = (uint8_t)(j / 8);
            bit[channels[j]] = (uint8_t)(1 << (j % 8));
        }
        __m256i levels = _mm256_set1_epi8((char)(1 << k->bits)), zero = _mm256_setzero_si256();
        for (int64_t t = 0; t < count; t++) {
            __m256i token = _mm256_set1_epi64x((long long)token_bits(high + t * bytes, bytes));
            for (int64_t c = 0; c < d; c += 32) {
                __m256i picked = _mm256_shuffle_epi8(token, _mm256_loadu_si256((const __m256i *)(index + c)));
                __m256i set = _mm256_and_si256(picked, _mm256_loadu_si256((const __m256i *)(bit + c)));
                __m256i add = _mm256_andnot_si256(_mm256_cmpeq_epi8(set, zero), levels);
                __m256i *row = (__m256i *)(codes + t * d + c);
                _mm256_storeu_si256(row, _mm256_add_epi8(_mm256_loadu_si256(row), add));
            }
        }
        return;
    }
#endif
    for (int64_t t = 0; t < count; t++)
        for (int64_t j = 0; j < k->wide_count; j++)
            if ((high[t * bytes + j / 8] >> (j % 8)) & 1)
                codes[t * d + channels[j]] = (int8_t)(codes[t * d + channels[j]] + (1 << k->bits));
}

/* Scores of `count` tokens (count a multiple of 4) for ROWS (<= 3) query rows: 4 tokens x ROWS rows of partial dot
 * products in registers, each token's codes converted once per tile (CONV: s8 or u8).
 *   codes [count, d] bytes; qs [ROWS, d] (row stride d); bias [ROWS]; scores [ROWS, ld]. */
#define KEY_TILE(ROWS, CONV)                                                                                   \
    static void key_tile_##ROWS##_##CONV(const int8_t *restrict codes, int64_t d, int64_t count,              \
                                         const float *restrict qs, const float *restrict bias,                \
                                         float *restrict scores, int64_t ld) {                                  \
        for (int64_t t = 0; t < count; t += 4) {                                                                \
            const int8_t *k = codes + t * d;                                                                    \
            v8sf a[ROWS][4];                                                                                    \
            for (int i = 0; i < ROWS; i++)                                                                      \
                a[i][0] = a[i][1] = a[i][2] = a[i][3] = splat(0.0f);                                            \
            for (int64_t c = 0; c < d; c += 8) {                                                                \
                v8sf k0 = CONV(k + c), k1 = CONV(k + d + c), k2 = CONV(k + 2 * d + c), k3 = CONV(k + 3 * d + c); \
                for (int i = 0; i < ROWS; i++) {                                                                \
                    v8sf x = load8(qs + i * d + c);                                                             \
                    a[i][0] = fma8(x, k0, a[i][0]);                                                             \
                    a[i][1] = fma8(x, k1, a[i][1]);                                                             \
                    a[i][2] = fma8(x, k2, a[i][2]);                                                             \
                    a[i][3] = fma8(x, k3, a[i][3]);                                                             \
                }                                                                                               \
            }                                                                                                   \
            for (int i = 0; i < ROWS; i++)                                                                      \
                store4(scores + i * ld + t, reduce4(a[i][0], a[i][1], a[i][2], a[i][3]) + splat(bias[i]));      \
        }                                                                                                       \
    }
KEY_TILE(1, s8)
KEY_TILE(2, s8)
KEY_TILE(3, s8)
KEY_TILE(1, u8)
KEY_TILE(2, u8)
KEY_TILE(3, u8)

typedef void (*key_tile_fn)(const int8_t *, int64_t, int64_t, const float *, const float *, float *, int64_t);
static const key_tile_fn key_tiles[2][3] = {{key_tile_1_s8, key_tile_2_s8, key_tile_3_s8},
                                            {key_tile_1_u8, key_tile_2_u8, key_tile_3_u8}};

/* Scores [R, ld] of the `count` tokens of key block `blk` (tokens [first, first + count)). */
static void key_block_scores(const asymkv_attention *p, const float *q, int64_t b, int64_t h, int64_t blk,
                             int64_t first, int64_t count, scratch *w, float *scores, int64_t ld) {
    const asymkv_codes *k = &p->keys;
    int64_t d = p->head_dim, tiled = count / 4 * 4;
    int unsigned_codes;
    fold_key_block(p, q, b, h, blk, w);
    const int8_t *codes = block_codes(k, b, h, first, count, d, w->key_codes, &unsigned_codes);
    if (k->wide_bits) /* (sub-byte codes only: they are in the scratch) */
        add_wide_bits(k, k->wide_channels + b * k->wide_channels_stride_b + h * k->wide_channels_stride_h +
                             blk * k->wide_count,
                      k->wide_bits + b * k->wide_bits_stride_b + h * k->wide_bits_stride_h + first * k->wide_bytes,
                      count, d, w->key_codes);
    for (int64_t r = 0; r < p->rows; r += 3) {
        int64_t n = p->rows - r < 3 ? p->rows - r : 3;
        key_tiles[unsigned_codes][n - 1](codes, d, tiled, w->qs + r * d, w->bias + r, scores + r * ld, ld);
    }
    for (int64_t t = tiled; t < count; t++) /* blocks of a few tokens (not a multiple of 4) */
        for (int64_t r = 0; r < p->rows; r++) {
            float sum = w->bias[r];
            for (int64_t c = 0; c < d; c++)
                sum += w->qs[r * d + c] * (unsigned_codes ? (float)((const uint8_t *)codes)[t * d + c]
                                                          : (float)codes[t * d + c]);
            scores[r * ld + t] = sum;
        }
}

/* acc[ROWS][8 * LANES] += sum over tokens of weights[row][t] * codes[t][0 : 8 * LANES]: the value mix of ROWS query
 * rows over one tile of channels, the accumulators held in registers (CONV: s8 or u8 codes). */
#define MIX_TILE(ROWS, LANES, CONV)                                                                            \
    static void mix_##ROWS##_##LANES##_##CONV(const int8_t *restrict codes, int64_t d, int64_t count,          \
                                              const float *restrict weights, int64_t ld, float *restrict acc) { \
        v8sf a[ROWS][LANES];                                                                                    \
        for (int i = 0; i < ROWS; i++)                                                                          \
            for (int l = 0; l < LANES; l++) a[i][l] = load8(acc + i * d + 8 * l);                               \
        for (int64_t t = 0; t < count; t++) {                                                                   \
            v8sf x[ROWS];                                                                                       \
            for (int i = 0; i < ROWS; i++) x[i] = splat(weights[i * ld + t]);                                   \
            for (int l = 0; l < LANES; l++) {                                                                   \
                v8sf c = CONV(codes + t * d + 8 * l);                                                           \
                for (int i = 0; i < ROWS; i++) a[i][l] = fma8(x[i], c, a[i][l]);                                \
            }                                                                                                   \
        }                                                                                                       \
        for (int i = 0; i < ROWS; i++)                                                                          \
            for (int l = 0; l < LANES; l++) store8(acc + i * d + 8 * l, a[i][l]);                               \
    }
#define MIX_TILES(CONV) MIX_TILE(1, 1, CONV) MIX_TILE(2, 1, CONV) MIX_TILE(3, 1, CONV) MIX_TILE(1, 4, CONV) \
    MIX_TILE(2, 4, CONV) MIX_TILE(3, 4, CONV)
MIX_TILES(s8)
MIX_TILES(u8)

typedef void (*mix_fn)(const int8_t *, int64_t, int64_t, const float *, int64_t, float *);
static const mix_fn mix_tiles[2][2][3] = { /* [unsigned codes][32 channels][rows - 1] */
    {{mix_1_1_s8, mix_2_1_s8, mix_3_1_s8}, {mix_1_4_s8, mix_2_4_s8, mix_3_4_s8}},
    {{mix_1_1_u8, mix_2_1_u8, mix_3_1_u8}, {mix_1_4_u8, mix_2_4_u8, mix_3_4_u8}}};

/* The weights p_t s_t of one channel group (scale, zero: [count, groups] from the group's column), and its zero term
 * sum_t p_t z_t added to the group's `cg` accumulators `acc`. */
static void group_weights(const float *restrict probs, const float *restrict scale, const float *restrict zero,
                          int64_t groups, int64_t count, float *restrict weights, float *restrict acc, int64_t cg) {
    v8sf zsum = splat(0.0f);
    int64_t t = 0;
    if (groups == 1)
        for (; t + 8 <= count; t += 8) {
            v8sf pt = load8(probs + t);
            store8(weights + t, pt * load8(scale + t));
            if (zero)
                zsum = fma8(pt, load8(zero + t), zsum);
        }
    float total = hsum8(zsum);
    for (; t < count; t++) {
        weights[t] = probs[t] * scale[t * groups];
        if (zero)
            total += probs[t] * zero[t * groups];
    }
    if (total != 0.0f)
        for (int64_t c = 0; c < cg; c++) acc[c] += total;
}

/* Value codes of tokens [first, first + count) mixed with the softmax weights p [R, ld] into s->quant: per channel
 * group, weights p * s_t and the zero term sum_t p_t z_t, then tiles of up to 4 rows x 16 channels. */
static void value_block_mix(const asymkv_attention *p, int64_t b, int64_t h, int64_t first, int64_t count,
                            const float *probs, int64_t ld, scratch *w, run_state *s) {
    const asymkv_codes *v = &p->values;
    int64_t d = p->head_dim, cg = v->channel_group, groups = d / cg, rows = p->rows;
    int unsigned_codes;
    const int8_t *codes = block_codes(v, b, h, first, count, d, w->value_codes, &unsigned_codes);
    int64_t meta = b * v->meta_stride_b + h * v->meta_stride_h + first * groups;
    meta_to_float(v->scale, meta, count * groups, v->meta_kind, w->value_scale);
    if (v->zero)
        meta_to_float(v->zero, meta, count * groups, v->meta_kind, w->value_zero);
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t r = 0; r < rows; r++)
            group_weights(probs + r * ld, w->value_scale + g, v->zero ? w->value_zero + g : 0, groups, count,
                          w->weights + r * count, s->quant + r * d + g * cg, cg);
        for (int64_t r = 0; r < rows; r += 3) {
            int64_t n = rows - r < 3 ? rows - r : 3;
            for (int64_t c = g * cg; c < (g + 1) * cg;) { /* tiles of 32 channels, then of 8 */
                int wide = c + 32 <= (g + 1) * cg;
                mix_tiles[unsigned_codes][wide][n - 1](codes + c, d, count, w->weights + r * count, count,
                                                       s->quant + r * d + c);
                c += wide ? 32 : 8;
            }
        }
    }
}

/* -inf at the region's positions that an overlaid exact sink replaces, in scores [R, ld] of tokens [first, +count). */
static void mask_overlaid(const asymkv_attention *p, int64_t b, int64_t first, int64_t count, float *scores,
                          int64_t ld) {
    const asymkv_exact *o = &p->exact[p->overlay];
    for (int64_t j = 0; j < o->tokens; j++) {
        int64_t t = o->positions[b * o->tokens + j] - p->column - first;
        if (o->valid[b * o->tokens + j] && t >= 0 && t < count)
            for (int64_t r = 0; r < p->rows; r++) scores[r * ld + t] = -INFINITY;
    }
}

static void quantized_run(const asymkv_attention *p, const float *q, int64_t b, int64_t h, int64_t first_block,
                          int64_t end_block, scratch *w, run_state *s) {
    int64_t bs = p->block_size, ld = bs;
    for (int64_t blk = first_block; blk < end_block; blk++) {
        int64_t first = blk * bs;
        key_block_scores(p, q, b, h, blk, first, bs, w, w->scores, ld);
        apply_mask(p, b, h, p->column + first, bs, w->scores, ld);
        if (p->overlay >= 0)
            mask_overlaid(p, b, first, bs, w->scores, ld);
        if (online_softmax(p, s, w->scores, ld, bs))
            value_block_mix(p, b, h, first, bs, w->scores, ld, w, s);
    }
}

static void exact_run(const asymkv_attention *p, const float *q, int64_t b, int64_t h, const asymkv_exact *e,
                      scratch *w, run_state *s) {
    int64_t d = p->head_dim, ld = EXACT_CHUNK;
    const char *keys = (const char *)e->keys, *values = (const char *)e->values;
    int64_t size = e->dtype == META_F32 ? 4 : 2;
    keys += (b * e->keys_stride_b + h * e->keys_stride_h) * size;
    values += (b * e->values_stride_b + h * e->values_stride_h) * size;
    for (int64_t first = 0; first < e->tokens; first += EXACT_CHUNK) {
        int64_t count = e->tokens - first < EXACT_CHUNK ? e->tokens - first : EXACT_CHUNK;
        for (int64_t t = 0; t < count; t++) {
            load_row(keys, first + t, d, e->dtype, w->row);
            for (int64_t r = 0; r < p->rows; r++) {
                v8sf acc = splat(0.0f);
                for (int64_t c = 0; c < d; c += 8) acc = fma8(load8(q + r * d + c), load8(w->row + c), acc);
                w->scores[r * ld + t] = hsum8(acc);
            }
        }
        if (e->positions) { /* overlaid sinks: their own columns, invalid slots hidden */
            for (int64_t t = 0; t < count; t++) {
                int64_t slot = b * e->tokens + first + t, column = e->positions[slot];
                int ok = e->valid[slot] && column >= 0 && column < p->kv_len;
                for (int64_t r = 0; r < p->rows; r++)
                    w->scores[r * ld + t] += ok ? mask_at(p, b, h, r, column) : -INFINITY;
            }
        } else {
            apply_mask(p, b, h, e->column + first, count, w->scores, ld);
        }
        if (!online_softmax(p, s, w->scores, ld, count))
            continue;
        for (int64_t t = 0; t < count; t++) {
            load_row(values, first + t, d, e->dtype, w->row);
            for (int64_t r = 0; r < p->rows; r++) {
                v8sf a = splat(w->scores[r * ld + t]);
                for (int64_t c = 0; c < d; c += 8)
                    store8(s->exact + r * d + c, fma8(a, load8(w->row + c), load8(s->exact + r * d + c)));
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------------------- merge */

/* x H^T in place for one row (H: orthonormal Sylvester Hadamard blocks of hb, symmetric): butterflies, then 1/sqrt(hb). */
static void unrotate(float *x, int64_t d, int64_t hb) {
    for (int64_t base = 0; base < d; base += hb)
        for (int64_t step = 1; step < hb; step <<= 1)
            for (int64_t i = base; i < base + hb; i += 2 * step)
                for (int64_t j = i; j < i + step; j++) {
                    float a = x[j], c = x[j + step];
                    x[j] = a + c;
                    x[j + step] = a - c;
                }
    float norm = 1.0f / sqrtf((float)hb);
    for (int64_t c = 0; c < d; c++) x[c] *= norm;
}

/* The runs of (b, h) merged into out rows: rescaled to their common max, summed, rotated back, divided by the sum.
 * Rows that see no token get NaN, as a softmax over -inf scores does. */
static void merge_runs(const asymkv_attention *p, int64_t bh, float *partials, int64_t stride) {
    int64_t d = p->head_dim, rows = p->rows, splits = p->splits;
    float mixed[MAX_HEAD_DIM];
    for (int64_t r = 0; r < rows; r++) {
        float top = -INFINITY, total = 0.0f;
        for (int64_t k = 0; k < splits; k++) {
            float m = partials[(bh * splits + k) * stride + r];
            top = m > top ? m : top;
        }
        int64_t b = bh / p->heads, h = bh % p->heads, i = r % p->q_len, head = h * p->n_rep + r / p->q_len;
        float *out = p->out + ((b * p->q_len + i) * p->heads * p->n_rep + head) * d;
        memset(out, 0, (size_t)d * sizeof(float));
        memset(mixed, 0, sizeof mixed);
        for (int64_t k = 0; k < splits; k++) {
            float *part = partials + (bh * splits + k) * stride, m = part[r];
            if (m == -INFINITY)
                continue;
            float alpha = expf(m - top);
            total += alpha * part[rows + r];
            const float *quant = part + 2 * rows + r * d, *exact = part + 2 * rows + rows * d + r * d;
            for (int64_t c = 0; c < d; c++) {
                mixed[c] += alpha * quant[c];
                out[c] += alpha * exact[c];
            }
        }
        if (p->hadamard)
            unrotate(mixed, d, p->hadamard);
        float inv = total > 0.0f ? 1.0f / total : NAN;
        for (int64_t c = 0; c < d; c++) out[c] = (out[c] + mixed[c]) * inv;
    }
}

/* ---------------------------------------------------------------------------------------------------- entry */

/* The R query rows of (b, h) as float32, times `scaling`: row rep * q_len + i is query head h * n_rep + rep, token i. */
static void query_rows(const asymkv_attention *p, int64_t b, int64_t h, float *restrict rows) {
    int64_t d = p->head_dim, size = p->query_dtype == META_F32 ? 4 : 2;
    float scaling = (float)p->scaling;
    for (int64_t r = 0; r < p->rows; r++) {
        int64_t head = h * p->n_rep + r / p->q_len, i = r % p->q_len;
        int64_t at = b * p->query_stride_b + head * p->query_stride_h + i * p->query_stride_q;
        load_row((const char *)p->query + at * size, 0, d, p->query_dtype, rows + r * d);
        for (int64_t c = 0; c < d; c++) rows[r * d + c] *= scaling;
    }
}

static int scratch_alloc(const asymkv_attention *p, scratch *w) {
    int64_t d = p->head_dim, bs = p->block_size > 0 ? p->block_size : 1, rows = p->rows;
    int64_t ld = bs > EXACT_CHUNK ? bs : EXACT_CHUNK;
    int64_t groups = d / (p->values.channel_group > 0 ? p->values.channel_group : d);
    memset(w, 0, sizeof *w);
    w->key_codes = malloc((size_t)(bs * d));
    w->value_codes = malloc((size_t)(bs * d));
    w->query = malloc((size_t)(rows * d) * sizeof(float));
    w->qs = malloc((size_t)(rows * d) * sizeof(float));
    w->bias = malloc((size_t)rows * sizeof(float));
    w->scores = malloc((size_t)(rows * ld) * sizeof(float));
    w->weights = malloc((size_t)(rows * bs) * sizeof(float));
    w->value_scale = malloc((size_t)(bs * groups) * sizeof(float));
    w->value_zero = malloc((size_t)(bs * groups) * sizeof(float));
    w->row = malloc((size_t)d * sizeof(float));
    return w->key_codes && w->value_codes && w->query && w->qs && w->bias &&
           w->scores && w->weights && w->value_scale && w->value_zero && w->row;
}

static void scratch_free(scratch *w) {
    free(w->key_codes);
    free(w->value_codes);
    free(w->query);
    free(w->qs);
    free(w->bias);
    free(w->scores);
    free(w->weights);
    free(w->value_scale);
    free(w->value_zero);
    free(w->row);
}

static int arguments_bad(const asymkv_attention *p) {
    int64_t d = p->head_dim;
    if (d < 8 || d > MAX_HEAD_DIM || d % 8 || p->rows < 1 || p->q_len < 1 || p->rows % p->q_len || p->splits < 1 ||
        p->exact_count < 0 || p->exact_count > 3 || p->overlay >= p->exact_count)
        return 1;
    if (p->tokens && (p->block_size < 1 || p->tokens % p->block_size || p->keys.channel_group < 1 ||
                      d % p->keys.channel_group || p->values.channel_group % 8 || d % p->values.channel_group ||
                      (p->hadamard && (p->hadamard & (p->hadamard - 1) || d % p->hadamard)) ||
                      p->keys.wide_count > MAX_HEAD_DIM))
        return 1;
    return 0;
}

/* Returns 0, 1 for arguments this file cannot serve (the caller checks them first; a last guard), 2 when out of
 * memory. */
int asymkv_attention_run(const asymkv_attention *p) {
    if (arguments_bad(p))
        return 1;
    int64_t d = p->head_dim, rows = p->rows, units = p->batch * p->heads * p->splits;
    int64_t blocks = p->tokens / (p->block_size > 0 ? p->block_size : 1);
    int64_t stride = 2 * rows + 2 * rows * d; /* a run: m [R], l [R], quant [R, D], exact [R, D] */
    float *partials = malloc((size_t)(units * stride) * sizeof(float));
    if (!partials)
        return 2;
    int threads = (int)p->threads;
    if (threads < 1 || units == 1)
        threads = 1;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        scratch w;
        int ok = scratch_alloc(p, &w);
        if (!ok)
            failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; u++) {
            if (!ok)
                continue;
            int64_t bh = u / p->splits, split = u % p->splits, b = bh / p->heads, h = bh % p->heads;
            float *part = partials + u * stride;
            run_state s = {part, part + rows, part + 2 * rows, part + 2 * rows + rows * d};
            for (int64_t r = 0; r < rows; r++) {
                s.m[r] = -INFINITY;
                s.l[r] = 0.0f;
            }
            memset(s.quant, 0, (size_t)(2 * rows * d) * sizeof(float));
            const float *q = w.query;
            query_rows(p, b, h, w.query);
            int64_t first = blocks * split / p->splits, end = blocks * (split + 1) / p->splits;
            quantized_run(p, q, b, h, first, end, &w, &s);
            if (split == p->splits - 1)
                for (int64_t e = 0; e < p->exact_count; e++) exact_run(p, q, b, h, &p->exact[e], &w, &s);
        }
        scratch_free(&w);
    }
    if (!failed)
        for (int64_t bh = 0; bh < p->batch * p->heads; bh++) merge_runs(p, bh, partials, stride);
    free(partials);
    return failed ? 2 : 0;
}
