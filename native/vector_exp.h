/* The vector exp of the attention softmax (attention_simd.c) and the activations
 * (activation_simd.c), with a scalar twin that gives the same bits.
 *
 * exp(x) for x <= 0: n = round(x log2 e), r = x - n ln 2 (ln 2 in two parts), exp(r)
 * by Cephes' degree-6 polynomial (within ~1 ulp of expf), times 2^n. Arguments are
 * clamped to [-110, 0] (the clamps keep NaN): -inf and anything below ~-103.9 give 0;
 * results in expf's subnormal range are rounded once as expf's (2^n applied as
 * 2^(n + 64) then 2^-64 on AVX2, by scalef on AVX-512).
 *
 * op_exp_twin is the same sequence of IEEE operations one float at a time (fmaf,
 * nearbyintf in the default rounding mode, ldexpf): bit for bit the vector results
 * wherever those are normal floats (x >= -87); the activations keep their arguments
 * there. The softmax's scalar path uses libm's expf instead (attention.c).
 *
 * NOTE: the vector functions carry their own target attributes, so a file may include
 * this header outside its `#pragma GCC target` sections. */
#ifndef ONNX_PREP_VECTOR_EXP_H
#define ONNX_PREP_VECTOR_EXP_H
#include <math.h>

#define EXP_LO (-110.0f)
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO (-2.12194440e-4f)
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

static inline float op_exp_twin(float x) {
    x = x < EXP_LO ? EXP_LO : x; /* NaN: x */
    x = x > 0.0f ? 0.0f : x;
    const float n = nearbyintf(x * EXP_LOG2E);
    float r = fmaf(-n, EXP_LN2_HI, x);
    r = fmaf(-n, EXP_LN2_LO, r);
    float y = EXP_P0;
    y = fmaf(y, r, EXP_P1);
    y = fmaf(y, r, EXP_P2);
    y = fmaf(y, r, EXP_P3);
    y = fmaf(y, r, EXP_P4);
    y = fmaf(y, r, EXP_P5);
    y = fmaf(y, r * r, r) + 1.0f;
    return n == n ? ldexpf(y, (int)n) : n;
}

#if OP_SIMD
#include <immintrin.h>

__attribute__((target("avx2,fma"))) static inline __m256 exp_avx2(__m256 x) {
    x = _mm256_min_ps(_mm256_setzero_ps(), _mm256_max_ps(_mm256_set1_ps(EXP_LO), x));  /* NaN: x */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 y = _mm256_set1_ps(EXP_P0);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P1));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P2));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P3));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P4));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P5));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    /* n in [-159, 0]: 2^(n + 64) is a normal float; the product with 2^-64 rounds once. */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127 + 64)), 23);
    return _mm256_mul_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), _mm256_set1_ps(0x1p-64f));
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))) static inline __m512 exp_avx512(__m512 x) {
    x = _mm512_min_ps(_mm512_setzero_ps(), _mm512_max_ps(_mm512_set1_ps(EXP_LO), x));  /* NaN: x */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 y = _mm512_set1_ps(EXP_P0);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_P1));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_P2));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_P3));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_P4));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_P5));
    y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}
#endif
#endif
