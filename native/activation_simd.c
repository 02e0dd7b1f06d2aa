/* AVX2 and AVX-512 loops of the activations (activation.h's arithmetic): per element
 * the same IEEE operations in the same order as activation.c's scalar twin, so the
 * bits are its bits; a tail runs under a mask (AVX-512) or through the twin (AVX2).
 * NOTE: `#pragma GCC target` per section (push/pop), never a global -m flag. */
#include <math.h>

#include "op_internal.h"
#include "activation.h"
#include "vector_exp.h"

#if OP_SIMD
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma")

static inline __m256 quick_gelu_avx2_v(__m256 x, __m256 alpha) {
    const __m256 t = _mm256_mul_ps(alpha, x);
    __m256 a = _mm256_or_ps(t, _mm256_set1_ps(-0.0f)); /* -|t| */
    a = _mm256_max_ps(_mm256_set1_ps(OP_SIGMOID_LO), a);  /* NaN: a */
    const __m256 e = exp_avx2(a), d = _mm256_add_ps(_mm256_set1_ps(1.0f), e);
    const __m256 pos = _mm256_cmp_ps(t, _mm256_setzero_ps(), _CMP_GE_OQ);
    return _mm256_mul_ps(x, _mm256_div_ps(_mm256_blendv_ps(e, _mm256_set1_ps(1.0f), pos), d));
}

static void quick_gelu_avx2(const float *x, float *y, size_t n, float alpha) {
    const __m256 va = _mm256_set1_ps(alpha);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, quick_gelu_avx2_v(_mm256_loadu_ps(x + i), va));
    if (i < n) {
        float in[8] = {0}, out[8];
        for (size_t j = i; j < n; j++) in[j - i] = x[j];
        _mm256_storeu_ps(out, quick_gelu_avx2_v(_mm256_loadu_ps(in), va));
        for (size_t j = i; j < n; j++) y[j] = out[j - i];
    }
}

const op_activation_table op_activation_avx2 = {OP_KERNEL_AVX2, quick_gelu_avx2};
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")

static inline __m512 quick_gelu_avx512_v(__m512 x, __m512 alpha) {
    const __m512 t = _mm512_mul_ps(alpha, x);
    __m512 a = _mm512_or_ps(t, _mm512_set1_ps(-0.0f)); /* -|t| */
    a = _mm512_max_ps(_mm512_set1_ps(OP_SIGMOID_LO), a);  /* NaN: a */
    const __m512 e = exp_avx512(a), d = _mm512_add_ps(_mm512_set1_ps(1.0f), e);
    const __mmask16 pos = _mm512_cmp_ps_mask(t, _mm512_setzero_ps(), _CMP_GE_OQ);
    return _mm512_mul_ps(x, _mm512_div_ps(_mm512_mask_blend_ps(pos, e, _mm512_set1_ps(1.0f)), d));
}

static void quick_gelu_avx512(const float *x, float *y, size_t n, float alpha) {
    const __m512 va = _mm512_set1_ps(alpha);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, quick_gelu_avx512_v(_mm512_loadu_ps(x + i), va));
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(y + i, m, quick_gelu_avx512_v(_mm512_maskz_loadu_ps(m, x + i), va));
    }
}

const op_activation_table op_activation_avx512 = {OP_KERNEL_AVX512, quick_gelu_avx512};
#pragma GCC pop_options
#endif
