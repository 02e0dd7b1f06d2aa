/* The attention kernel's row primitives (attention.h) for AVX2 + FMA and AVX-512.
 *
 * Scores: a block of keys at a time (8 on AVX2, 16 on AVX-512), one accumulator
 * register per key over the head size, the accumulators then folded into one register
 * of the block's dot products (a transpose-and-add tree), scaled, masked and stored
 * with one vector op each; keys past n in the last block repeat key n - 1 and are not
 * stored. Softmax: a vector exp (below) over the row. Weighted sum: up to four vectors
 * of the output in registers, one pass over the keys per four vectors, one FMA per
 * element. Head-size tails run under masks, so any head size takes the vector path.
 * Row groups (four query rows over the same keys): each key block and value row is
 * loaded once and multiplied into all four rows' accumulators, with per (row, key) the
 * same operations in the same order as the single-row entries (the fold adds every
 * accumulator's lanes in the same tree, whichever lane it lands in).
 *
 * The vector exp is vector_exp.h's.
 *
 * NOTE: each ISA's code is enabled for its own section with `#pragma GCC target`
 * (push / pop), never a global -m flag. */
#include <math.h>
#include "attention.h"
#include "vector_exp.h"

#if OP_SIMD
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma")

static inline __m256i avx2_lanes(size_t left) {  /* lanes < left set */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left > 8 ? 8 : left)), lane);
}

/* The 8 sums of a[0..7] in one register, in order. */
static inline __m256 fold8_avx2(const __m256 a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static float scores_avx2(const float *q, const float *k, size_t h, size_t n, float scale, const float *mask,
                         float *scores) {
    const __m256 vscale = _mm256_set1_ps(scale);
    const __m256i tail = avx2_lanes(h % 8);
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (size_t i0 = 0; i0 < n; i0 += 8) {
        const float *kr[8];
        for (int r = 0; r < 8; r++) kr[r] = k + (i0 + (size_t)r < n ? i0 + (size_t)r : n - 1) * h;
        __m256 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
        size_t j = 0;
        for (; j + 8 <= h; j += 8) {
            const __m256 qv = _mm256_loadu_ps(q + j);
            for (int r = 0; r < 8; r++) acc[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[r] + j), acc[r]);
        }
        if (j < h) {
            const __m256 qv = _mm256_maskload_ps(q + j, tail);
            for (int r = 0; r < 8; r++) acc[r] = _mm256_fmadd_ps(qv, _mm256_maskload_ps(kr[r] + j, tail), acc[r]);
        }
        const __m256i valid = avx2_lanes(n - i0);
        __m256 s = _mm256_mul_ps(vscale, fold8_avx2(acc));
        if (mask) s = _mm256_add_ps(s, _mm256_maskload_ps(mask + i0, valid));
        _mm256_maskstore_ps(scores + i0, valid, s);
        s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, _mm256_castsi256_ps(valid));
        mx = _mm256_max_ps(s, mx);  /* a NaN score: mx kept */
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static float softmax_avx2(float *scores, size_t n, float max) {
    const __m256 vmax = _mm256_set1_ps(max);
    __m256 sum = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(scores + i), vmax));
        _mm256_storeu_ps(scores + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (i < n) {
        const __m256i valid = avx2_lanes(n - i);
        const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_maskload_ps(scores + i, valid), vmax));
        _mm256_maskstore_ps(scores + i, valid, e);
        sum = _mm256_add_ps(sum, _mm256_and_ps(e, _mm256_castsi256_ps(valid)));
    }
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* A row group's scores, 2 keys at a time: accumulator 2 L + s holds row L's product with
 * key s, so the fold leaves them in lanes 2 L, 2 L + 1 (the same accumulation and fold
 * per (row, key) as scores_avx2: the same bits). */
static void scores_rows_avx2(const float *const q[], const float *k, size_t h, size_t n, float scale,
                             const float *const mask[], float *const scores[], float max[]) {
    const __m256 vscale = _mm256_set1_ps(scale);
    const __m256i tail = avx2_lanes(h % 8);
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (size_t i0 = 0; i0 < n; i0 += 2) {
        const int pair = i0 + 1 < n;
        const float *k0 = k + i0 * h, *k1 = pair ? k0 + h : k0;
        __m256 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
        size_t j = 0;
        for (; j + 8 <= h; j += 8) {
            const __m256 kv0 = _mm256_loadu_ps(k0 + j), kv1 = _mm256_loadu_ps(k1 + j);
            for (int L = 0; L < 4; L++) {
                const __m256 qv = _mm256_loadu_ps(q[L] + j);
                acc[2 * L] = _mm256_fmadd_ps(qv, kv0, acc[2 * L]);
                acc[2 * L + 1] = _mm256_fmadd_ps(qv, kv1, acc[2 * L + 1]);
            }
        }
        if (j < h) {
            const __m256 kv0 = _mm256_maskload_ps(k0 + j, tail), kv1 = _mm256_maskload_ps(k1 + j, tail);
            for (int L = 0; L < 4; L++) {
                const __m256 qv = _mm256_maskload_ps(q[L] + j, tail);
                acc[2 * L] = _mm256_fmadd_ps(qv, kv0, acc[2 * L]);
                acc[2 * L + 1] = _mm256_fmadd_ps(qv, kv1, acc[2 * L + 1]);
            }
        }
        float sc[8];
        _mm256_storeu_ps(sc, _mm256_mul_ps(vscale, fold8_avx2(acc)));
        for (int L = 0; L < 4; L++) {
            for (int s = 0; s <= pair; s++) {
                const float x = mask ? sc[2 * L + s] + mask[L][i0 + (size_t)s] : sc[2 * L + s];
                scores[L][i0 + (size_t)s] = x;
                sc[2 * L + s] = x;
            }
            if (!pair) sc[2 * L + 1] = -INFINITY;
        }
        mx = _mm256_max_ps(_mm256_loadu_ps(sc), mx);  /* a NaN score: mx kept */
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(mx, _mm256_permute_ps(mx, 0xB1)));
    for (int L = 0; L < 4; L++) max[L] = lanes[2 * L];
}

/* Rows o[r][j0 .. j0 + 8 nv) of `rows` output rows (the last vector's lanes under `tail`)
 * over every key: one load of each value vector for all rows, one FMA per element. */
static inline __attribute__((always_inline)) void wsum_block_avx2(float *const o[], const float *const p[],
                                                                  const float w[], int rows, const float *v,
                                                                  size_t h, size_t n, size_t j0, int nv,
                                                                  __m256i tail) {
    __m256 acc[4][4];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < nv; c++) acc[r][c] = _mm256_setzero_ps();
    for (size_t i = 0; i < n; i++) {
        const float *vi = v + i * h + j0;
        __m256 x[4];
        for (int c = 0; c < nv; c++) x[c] = c == nv - 1 ? _mm256_maskload_ps(vi + 8 * c, tail) : _mm256_loadu_ps(vi + 8 * c);
        for (int r = 0; r < rows; r++) {
            const __m256 a = _mm256_set1_ps(p[r][i] * w[r]);
            for (int c = 0; c < nv; c++) acc[r][c] = _mm256_fmadd_ps(a, x[c], acc[r][c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < nv; c++) {
            if (c == nv - 1)
                _mm256_maskstore_ps(o[r] + j0 + 8 * c, tail, acc[r][c]);
            else
                _mm256_storeu_ps(o[r] + j0 + 8 * c, acc[r][c]);
        }
}

/* `rows` output rows (1, or 4 for a row group) in passes of up to four vectors for one
 * row (32 floats), two for four rows (16: the accumulators stay in registers). */
static inline __attribute__((always_inline)) void wsum_avx2(float *const o[], const float *const p[],
                                                            const float w[], int rows, const float *v, size_t h,
                                                            size_t n) {
    const int most = rows == 1 ? 4 : 2;
    for (size_t j0 = 0; j0 < h; j0 += 8 * (size_t)most) {
        const size_t left = h - j0;
        const int nv = left >= 8 * (size_t)most ? most : (int)((left + 7) / 8);
        const __m256i tail = avx2_lanes(left - 8 * (size_t)(nv - 1));
        switch (nv) {
        case 4: wsum_block_avx2(o, p, w, rows, v, h, n, j0, 4, tail); break;
        case 3: wsum_block_avx2(o, p, w, rows, v, h, n, j0, 3, tail); break;
        case 2: wsum_block_avx2(o, p, w, rows, v, h, n, j0, 2, tail); break;
        default: wsum_block_avx2(o, p, w, rows, v, h, n, j0, 1, tail); break;
        }
    }
}

static void weighted_sum_avx2(float *o, const float *p, float w, const float *v, size_t h, size_t n) {
    wsum_avx2(&o, &p, &w, 1, v, h, n);
}

static void weighted_sum_rows_avx2(float *const o[], const float *const p[], const float w[], const float *v,
                                   size_t h, size_t n) {
    wsum_avx2(o, p, w, 4, v, h, n);
}

const op_attn_table op_attn_avx2 = {scores_avx2, softmax_avx2, weighted_sum_avx2, scores_rows_avx2,
                                    weighted_sum_rows_avx2, OP_KERNEL_AVX2};
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")

static inline __mmask16 avx512_lanes(size_t left) { return (__mmask16)(left >= 16 ? 0xFFFFu : (1u << left) - 1u); }

/* Accumulator r of a 16-key block holds key kt(r) (a 4 x 4 transpose), so that the fold
 * below leaves key i's sum in lane i. */
static inline int kt(int r) { return (r % 4) * 4 + r / 4; }

/* Lane 4 L + s of the result: the sum of a[4 s + L]. */
static inline __m512 fold16_avx512(const __m512 a[16]) {
    __m512 x[8], y[4], z[2];
    for (int r = 0; r < 8; r++)
        x[r] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * r], a[2 * r + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * r], a[2 * r + 1], 0xEE));
    for (int r = 0; r < 4; r++)
        y[r] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * r], x[2 * r + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * r], x[2 * r + 1], 0xDD));
    for (int r = 0; r < 2; r++)
        z[r] = _mm512_add_ps(_mm512_unpacklo_ps(y[2 * r], y[2 * r + 1]), _mm512_unpackhi_ps(y[2 * r], y[2 * r + 1]));
    const __m512d z0 = _mm512_castps_pd(z[0]), z1 = _mm512_castps_pd(z[1]);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(z0, z1)), _mm512_castpd_ps(_mm512_unpackhi_pd(z0, z1)));
}

static float scores_avx512(const float *q, const float *k, size_t h, size_t n, float scale, const float *mask,
                           float *scores) {
    const __m512 vscale = _mm512_set1_ps(scale);
    const __mmask16 tail = avx512_lanes(h % 16);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (size_t i0 = 0; i0 < n; i0 += 16) {
        const float *kr[16];
        for (int r = 0; r < 16; r++) {
            const size_t i = i0 + (size_t)kt(r);
            kr[r] = k + (i < n ? i : n - 1) * h;
        }
        __m512 acc[16];
        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
        size_t j = 0;
        for (; j + 16 <= h; j += 16) {
            const __m512 qv = _mm512_loadu_ps(q + j);
            for (int r = 0; r < 16; r++) acc[r] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kr[r] + j), acc[r]);
        }
        if (j < h) {
            const __m512 qv = _mm512_maskz_loadu_ps(tail, q + j);
            for (int r = 0; r < 16; r++) acc[r] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(tail, kr[r] + j), acc[r]);
        }
        const __mmask16 valid = avx512_lanes(n - i0);
        __m512 s = _mm512_mul_ps(vscale, fold16_avx512(acc));
        if (mask) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(valid, mask + i0));
        _mm512_mask_storeu_ps(scores + i0, valid, s);
        mx = _mm512_mask_max_ps(mx, valid, s, mx);  /* a NaN score: mx kept */
    }
    return _mm512_reduce_max_ps(mx);
}

static float softmax_avx512(float *scores, size_t n, float max) {
    const __m512 vmax = _mm512_set1_ps(max);
    __m512 sum = _mm512_setzero_ps();
    for (size_t i = 0; i < n; i += 16) {
        const __mmask16 valid = avx512_lanes(n - i);
        const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, scores + i), vmax));
        _mm512_mask_storeu_ps(scores + i, valid, e);
        sum = _mm512_mask_add_ps(sum, valid, sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* A row group's scores, 4 keys at a time: accumulator 4 s + L holds row L's product with
 * key s, so that the fold leaves row L's four scores in 128-bit lane L (the same
 * accumulation and fold per (row, key) as scores_avx512: the same bits). */
static void scores_rows_avx512(const float *const q[], const float *k, size_t h, size_t n, float scale,
                               const float *const mask[], float *const scores[], float max[]) {
    const __m512 vscale = _mm512_set1_ps(scale);
    const __mmask16 tail = avx512_lanes(h % 16);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (size_t i0 = 0; i0 < n; i0 += 4) {
        const float *kr[4];
        for (int s = 0; s < 4; s++) kr[s] = k + (i0 + (size_t)s < n ? i0 + (size_t)s : n - 1) * h;
        __m512 acc[16];
        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
        size_t j = 0;
        for (; j + 16 <= h; j += 16) {
            __m512 kv[4];
            for (int s = 0; s < 4; s++) kv[s] = _mm512_loadu_ps(kr[s] + j);
            for (int L = 0; L < 4; L++) {
                const __m512 qv = _mm512_loadu_ps(q[L] + j);
                for (int s = 0; s < 4; s++) acc[4 * s + L] = _mm512_fmadd_ps(qv, kv[s], acc[4 * s + L]);
            }
        }
        if (j < h) {
            __m512 kv[4];
            for (int s = 0; s < 4; s++) kv[s] = _mm512_maskz_loadu_ps(tail, kr[s] + j);
            for (int L = 0; L < 4; L++) {
                const __m512 qv = _mm512_maskz_loadu_ps(tail, q[L] + j);
                for (int s = 0; s < 4; s++) acc[4 * s + L] = _mm512_fmadd_ps(qv, kv[s], acc[4 * s + L]);
            }
        }
        const __mmask8 valid = (__mmask8)(n - i0 >= 4 ? 0xF : (1u << (n - i0)) - 1u);
        __m512 sc = _mm512_mul_ps(vscale, fold16_avx512(acc));
        if (mask) {
            __m512 mv = _mm512_setzero_ps();
            mv = _mm512_insertf32x4(mv, _mm_maskz_loadu_ps(valid, mask[0] + i0), 0);
            mv = _mm512_insertf32x4(mv, _mm_maskz_loadu_ps(valid, mask[1] + i0), 1);
            mv = _mm512_insertf32x4(mv, _mm_maskz_loadu_ps(valid, mask[2] + i0), 2);
            mv = _mm512_insertf32x4(mv, _mm_maskz_loadu_ps(valid, mask[3] + i0), 3);
            sc = _mm512_add_ps(sc, mv);
        }
        _mm_mask_storeu_ps(scores[0] + i0, valid, _mm512_extractf32x4_ps(sc, 0));
        _mm_mask_storeu_ps(scores[1] + i0, valid, _mm512_extractf32x4_ps(sc, 1));
        _mm_mask_storeu_ps(scores[2] + i0, valid, _mm512_extractf32x4_ps(sc, 2));
        _mm_mask_storeu_ps(scores[3] + i0, valid, _mm512_extractf32x4_ps(sc, 3));
        const __mmask16 v16 = (__mmask16)(valid * 0x1111u);
        mx = _mm512_mask_max_ps(mx, v16, sc, mx);  /* a NaN score: mx kept */
    }
    /* Row L's max: the max of 128-bit lane L. */
    __m512 m = _mm512_max_ps(mx, _mm512_permute_ps(mx, 0x4E));
    m = _mm512_max_ps(m, _mm512_permute_ps(m, 0xB1));
    float lanes[16];
    _mm512_storeu_ps(lanes, m);
    for (int L = 0; L < 4; L++) max[L] = lanes[4 * L];
}

/* Rows o[r][j0 .. j0 + 16 nv) of `rows` output rows (the last vector's lanes under
 * `tail`) over every key: one load of each value vector for all rows, one FMA per element. */
static inline __attribute__((always_inline)) void wsum_block_avx512(float *const o[], const float *const p[],
                                                                    const float w[], int rows, const float *v,
                                                                    size_t h, size_t n, size_t j0, int nv,
                                                                    __mmask16 tail) {
    __m512 acc[4][4];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < nv; c++) acc[r][c] = _mm512_setzero_ps();
    for (size_t i = 0; i < n; i++) {
        const float *vi = v + i * h + j0;
        __m512 x[4];
        for (int c = 0; c < nv; c++) x[c] = _mm512_maskz_loadu_ps(c == nv - 1 ? tail : 0xFFFF, vi + 16 * c);
        for (int r = 0; r < rows; r++) {
            const __m512 a = _mm512_set1_ps(p[r][i] * w[r]);
            for (int c = 0; c < nv; c++) acc[r][c] = _mm512_fmadd_ps(a, x[c], acc[r][c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < nv; c++) _mm512_mask_storeu_ps(o[r] + j0 + 16 * c, c == nv - 1 ? tail : 0xFFFF, acc[r][c]);
}

/* `rows` output rows (1, or 4 for a row group) in passes of up to four vectors (64
 * floats; four rows' 16 accumulators stay in registers). */
static inline __attribute__((always_inline)) void wsum_avx512(float *const o[], const float *const p[],
                                                              const float w[], int rows, const float *v, size_t h,
                                                              size_t n) {
    for (size_t j0 = 0; j0 < h; j0 += 64) {
        const size_t left = h - j0;
        const int nv = left >= 64 ? 4 : (int)((left + 15) / 16);
        const __mmask16 tail = avx512_lanes(left - 16 * (size_t)(nv - 1));
        switch (nv) {
        case 4: wsum_block_avx512(o, p, w, rows, v, h, n, j0, 4, tail); break;
        case 3: wsum_block_avx512(o, p, w, rows, v, h, n, j0, 3, tail); break;
        case 2: wsum_block_avx512(o, p, w, rows, v, h, n, j0, 2, tail); break;
        default: wsum_block_avx512(o, p, w, rows, v, h, n, j0, 1, tail); break;
        }
    }
}

static void weighted_sum_avx512(float *o, const float *p, float w, const float *v, size_t h, size_t n) {
    wsum_avx512(&o, &p, &w, 1, v, h, n);
}

static void weighted_sum_rows_avx512(float *const o[], const float *const p[], const float w[], const float *v,
                                     size_t h, size_t n) {
    wsum_avx512(o, p, w, 4, v, h, n);
}

const op_attn_table op_attn_avx512 = {scores_avx512, softmax_avx512, weighted_sum_avx512, scores_rows_avx512,
                                      weighted_sum_rows_avx512, OP_KERNEL_AVX512};
#pragma GCC pop_options
#endif
