/* AVX2 and AVX-512 loops of row normalization (norm.h's lane contract: 16 lane sums,
 * AVX2 as two 8-lane halves, AVX-512 as one register; chunks past n read as zeros by
 * masked loads). Per lane the same operations in the same order as norm.c's scalar
 * twin, so results are bit-identical to it; the element-wise passes (add, apply)
 * finish their tail with the scalar expression.
 * NOTE: `#pragma GCC target` per section (push/pop), never a global -m flag. */
#include "op_internal.h"
#include "norm.h"

#if OP_SIMD
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma")

static inline __m256i avx2_tail_mask(size_t left) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left > 8 ? 8 : left)), lane);
}

/* The 8 lanes of half h (0 or 1) of the chunk at v + i, zeros past n. */
static inline __m256 avx2_chunk(const float *v, size_t i, size_t n, int h, __m256i *mask) {
    const size_t at = i + 8u * (size_t)h;
    if (at + 8 <= n) {
        *mask = _mm256_set1_epi32(-1);
        return _mm256_loadu_ps(v + at);
    }
    *mask = avx2_tail_mask(at < n ? n - at : 0);
    return at < n ? _mm256_maskload_ps(v + at, *mask) : _mm256_setzero_ps();
}

static void add_avx2(const float *x, const float *skip, const float *bias, float *out, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        if (skip) v = _mm256_add_ps(v, _mm256_loadu_ps(skip + i));
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + i));
        _mm256_storeu_ps(out + i, v);
    }
    for (; i < n; i++) {
        float v = skip ? x[i] + skip[i] : x[i];
        out[i] = bias ? v + bias[i] : v;
    }
}

static void sums_avx2(const float *v, size_t n, float mean, float sd[OP_NORM_LANES],
                      float ss[OP_NORM_LANES]) {
    const __m256 mu = _mm256_set1_ps(mean);
    __m256 q0 = _mm256_setzero_ps(), q1 = q0, d0 = q0, d1 = q0;
    __m256i m0, m1;
    for (size_t i = 0; i < n; i += OP_NORM_LANES) {
        const __m256 a = avx2_chunk(v, i, n, 0, &m0), b = avx2_chunk(v, i, n, 1, &m1);
        const __m256 da = _mm256_and_ps(_mm256_sub_ps(a, mu), _mm256_castsi256_ps(m0));
        const __m256 db = _mm256_and_ps(_mm256_sub_ps(b, mu), _mm256_castsi256_ps(m1));
        d0 = _mm256_add_ps(d0, da);
        d1 = _mm256_add_ps(d1, db);
        q0 = _mm256_fmadd_ps(da, da, q0);
        q1 = _mm256_fmadd_ps(db, db, q1);
    }
    _mm256_storeu_ps(sd, d0);
    _mm256_storeu_ps(sd + 8, d1);
    _mm256_storeu_ps(ss, q0);
    _mm256_storeu_ps(ss + 8, q1);
}

static void apply_avx2(const float *v, size_t n, float mean, float inv, const float *gamma,
                       const float *beta, float *y) {
    const __m256 mu = _mm256_set1_ps(mean), iv = _mm256_set1_ps(inv);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 t = _mm256_mul_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(v + i), mu), iv),
                                 _mm256_loadu_ps(gamma + i));
        if (beta) t = _mm256_add_ps(t, _mm256_loadu_ps(beta + i));
        _mm256_storeu_ps(y + i, t);
    }
    for (; i < n; i++) {
        const float t = ((v[i] - mean) * inv) * gamma[i];
        y[i] = beta ? t + beta[i] : t;
    }
}

const op_norm_table op_norm_avx2 = {OP_KERNEL_AVX2, add_avx2, sums_avx2, apply_avx2};

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")

static inline __mmask16 avx512_mask(size_t i, size_t n) {
    return n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
}

static void add_avx512(const float *x, const float *skip, const float *bias, float *out, size_t n) {
    for (size_t i = 0; i < n; i += 16) {
        const __mmask16 k = avx512_mask(i, n);
        __m512 v = _mm512_maskz_loadu_ps(k, x + i);
        if (skip) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, skip + i));
        if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, bias + i));
        _mm512_mask_storeu_ps(out + i, k, v);
    }
}

static void sums_avx512(const float *v, size_t n, float mean, float sd[OP_NORM_LANES],
                        float ss[OP_NORM_LANES]) {
    const __m512 mu = _mm512_set1_ps(mean);
    __m512 qa = _mm512_setzero_ps(), da = qa;
    for (size_t i = 0; i < n; i += 16) {
        const __mmask16 k = avx512_mask(i, n);
        const __m512 d = _mm512_maskz_sub_ps(k, _mm512_maskz_loadu_ps(k, v + i), mu);
        da = _mm512_add_ps(da, d);
        qa = _mm512_fmadd_ps(d, d, qa);
    }
    _mm512_storeu_ps(sd, da);
    _mm512_storeu_ps(ss, qa);
}

static void apply_avx512(const float *v, size_t n, float mean, float inv, const float *gamma,
                         const float *beta, float *y) {
    const __m512 mu = _mm512_set1_ps(mean), iv = _mm512_set1_ps(inv);
    for (size_t i = 0; i < n; i += 16) {
        const __mmask16 k = avx512_mask(i, n);
        __m512 t = _mm512_mul_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, v + i), mu), iv),
                                 _mm512_maskz_loadu_ps(k, gamma + i));
        if (beta) t = _mm512_add_ps(t, _mm512_maskz_loadu_ps(k, beta + i));
        _mm512_mask_storeu_ps(y + i, k, t);
    }
}

const op_norm_table op_norm_avx512 = {OP_KERNEL_AVX512, add_avx512, sums_avx512, apply_avx512};

#pragma GCC pop_options
#endif
