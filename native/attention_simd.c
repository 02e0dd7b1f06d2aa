/* The attention kernel's vector primitives (attention.h) for AVX2 + FMA and AVX-512:
 * dot products with four independent accumulators, the weighted sum as one FMA per
 * element. Each ISA's code is enabled for its own section with `#pragma GCC target`
 * (push / pop), never a global -m flag. Head sizes need not be a multiple of the
 * vector width: the tails run the scalar loop. */
#include "attention.h"

#if OP_SIMD
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include <immintrin.h>

static float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static float dot_avx2(const float *a, const float *b, size_t n) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    size_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int r = 0; r < 4; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * r), _mm256_loadu_ps(b + i + 8 * r), acc[r]);
    for (; i + 8 <= n; i += 8) acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc[0]);
    float s = hsum256(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static void axpy_avx2(float *y, float a, const float *x, size_t n) {
    const __m256 va = _mm256_set1_ps(a);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

const op_attn_table op_attn_avx2 = {dot_avx2, axpy_avx2, OP_KERNEL_AVX2};
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")

static float dot_avx512(const float *a, const float *b, size_t n) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    size_t i = 0;
    for (; i + 64 <= n; i += 64)
        for (int r = 0; r < 4; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16 * r), _mm512_loadu_ps(b + i + 16 * r), acc[r]);
    for (; i + 16 <= n; i += 16) acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc[0]);
    if (i < n) {  /* the tail under a mask */
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        acc[1] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc[1]);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

static void axpy_avx512(float *y, float a, const float *x, size_t n) {
    const __m512 va = _mm512_set1_ps(a);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
    }
}

const op_attn_table op_attn_avx512 = {dot_avx512, axpy_avx512, OP_KERNEL_AVX512};
#pragma GCC pop_options
#endif
