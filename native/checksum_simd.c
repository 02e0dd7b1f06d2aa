/* AVX2 and AVX-512 stripe loops of XXH3-64 (checksum.h's stripe contract). Per 64-bit
 * lane the same integer operations as checksum.c's scalar twin: the accumulators stay
 * in registers for the whole run of stripes, one 512-bit register or two 256-bit ones.
 * NOTE: `#pragma GCC target` per section (push/pop), never a global -m flag. */
#include "checksum.h"

#if OP_SIMD
#include <immintrin.h>

#define PREFETCH_AHEAD 8192 /* bytes ahead of the loads: 512 -> 8192 took a 512 MiB buffer from DRAM 23.8 -> 27.1 GB/s (AVX-512) and 27.5 -> 34.1 (AVX2) on the 2-vCPU AMD EPYC */
/* 32-bit lane moves within each 128 bits: the high half of each 64-bit lane to its low
 * half, and the two 64-bit lanes swapped */
#define HI_TO_LO _MM_SHUFFLE(0, 3, 0, 1)
#define SWAP64 _MM_SHUFFLE(1, 0, 3, 2)

#pragma GCC push_options
#pragma GCC target("avx2")

/* acc += swap64(d) + lo32(d ^ k) * hi32(d ^ k), per 64-bit lane */
static inline __m256i acc_avx2(__m256i acc, __m256i d, __m256i k) {
    const __m256i dk = _mm256_xor_si256(d, k);
    const __m256i prod = _mm256_mul_epu32(dk, _mm256_shuffle_epi32(dk, HI_TO_LO));
    return _mm256_add_epi64(prod, _mm256_add_epi64(acc, _mm256_shuffle_epi32(d, SWAP64)));
}

/* acc = ((acc ^ (acc >> 47)) ^ k) * PRIME32_1, the 64-bit product from two 32x32 ones */
static inline __m256i scramble_avx2(__m256i acc, __m256i k, __m256i prime) {
    const __m256i dk = _mm256_xor_si256(_mm256_xor_si256(acc, _mm256_srli_epi64(acc, 47)), k);
    const __m256i lo = _mm256_mul_epu32(dk, prime);
    const __m256i hi = _mm256_mul_epu32(_mm256_shuffle_epi32(dk, HI_TO_LO), prime);
    return _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
}

static void stripes_avx2(uint64_t acc[8], const uint8_t *p, size_t n, uint32_t *in_block) {
    const uint8_t *K = op_xxh3_secret;
    const __m256i prime = _mm256_set1_epi32((int)OP_XXH3_PRIME32_1);
    const __m256i s0 = _mm256_loadu_si256((const __m256i *)(K + OP_XXH3_SCRAMBLE_AT));
    const __m256i s1 = _mm256_loadu_si256((const __m256i *)(K + OP_XXH3_SCRAMBLE_AT + 32));
    __m256i a0 = _mm256_loadu_si256((const __m256i *)acc);
    __m256i a1 = _mm256_loadu_si256((const __m256i *)(acc + 4));
    uint32_t j = *in_block;
#define STRIPE_AVX2(q, k)                                                                          \
    do {                                                                                           \
        __builtin_prefetch((q) + PREFETCH_AHEAD);                                                  \
        a0 = acc_avx2(a0, _mm256_loadu_si256((const __m256i *)(q)),                               \
                      _mm256_loadu_si256((const __m256i *)(k)));                                  \
        a1 = acc_avx2(a1, _mm256_loadu_si256((const __m256i *)((q) + 32)),                        \
                      _mm256_loadu_si256((const __m256i *)((k) + 32)));                           \
    } while (0)
    for (; n && j; n--, p += OP_XXH3_STRIPE) { /* the rest of a block begun before */
        STRIPE_AVX2(p, K + 8 * j);
        if (++j == OP_XXH3_BLOCK_STRIPES) {
            a0 = scramble_avx2(a0, s0, prime);
            a1 = scramble_avx2(a1, s1, prime);
            j = 0;
        }
    }
    /* whole blocks: each stripe's secret offset a constant, the loop unrolled */
    for (; n >= OP_XXH3_BLOCK_STRIPES; n -= OP_XXH3_BLOCK_STRIPES, p += OP_XXH3_BLOCK_STRIPES * OP_XXH3_STRIPE) {
#pragma GCC unroll 16
        for (uint32_t s = 0; s < OP_XXH3_BLOCK_STRIPES; s++) STRIPE_AVX2(p + s * OP_XXH3_STRIPE, K + 8 * s);
        a0 = scramble_avx2(a0, s0, prime);
        a1 = scramble_avx2(a1, s1, prime);
    }
    for (; n; n--, p += OP_XXH3_STRIPE, j++) STRIPE_AVX2(p, K + 8 * j); /* a block begun: j stays < 16 */
#undef STRIPE_AVX2
    _mm256_storeu_si256((__m256i *)acc, a0);
    _mm256_storeu_si256((__m256i *)(acc + 4), a1);
    *in_block = j;
    op_ran(OP_KERNEL_AVX2);
}

#pragma GCC pop_options

const op_xxh3_table op_xxh3_avx2 = {OP_KERNEL_AVX2, stripes_avx2};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

static inline __m512i acc_avx512(__m512i acc, __m512i d, __m512i k) {
    const __m512i dk = _mm512_xor_si512(d, k);
    const __m512i prod = _mm512_mul_epu32(dk, _mm512_shuffle_epi32(dk, (_MM_PERM_ENUM)HI_TO_LO));
    return _mm512_add_epi64(prod, _mm512_add_epi64(acc, _mm512_shuffle_epi32(d, (_MM_PERM_ENUM)SWAP64)));
}

static inline __m512i scramble_avx512(__m512i acc, __m512i k, __m512i prime) {
    const __m512i dk = _mm512_xor_si512(_mm512_xor_si512(acc, _mm512_srli_epi64(acc, 47)), k);
    const __m512i lo = _mm512_mul_epu32(dk, prime);
    const __m512i hi = _mm512_mul_epu32(_mm512_shuffle_epi32(dk, (_MM_PERM_ENUM)HI_TO_LO), prime);
    return _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
}

static void stripes_avx512(uint64_t acc[8], const uint8_t *p, size_t n, uint32_t *in_block) {
    const uint8_t *K = op_xxh3_secret;
    const __m512i prime = _mm512_set1_epi32((int)OP_XXH3_PRIME32_1);
    const __m512i sk = _mm512_loadu_si512(K + OP_XXH3_SCRAMBLE_AT);
    __m512i a = _mm512_loadu_si512(acc);
    uint32_t j = *in_block;
#define STRIPE_AVX512(q, k)                                                                        \
    do {                                                                                           \
        __builtin_prefetch((q) + PREFETCH_AHEAD);                                                  \
        a = acc_avx512(a, _mm512_loadu_si512(q), _mm512_loadu_si512(k));                           \
    } while (0)
    for (; n && j; n--, p += OP_XXH3_STRIPE) { /* the rest of a block begun before */
        STRIPE_AVX512(p, K + 8 * j);
        if (++j == OP_XXH3_BLOCK_STRIPES) {
            a = scramble_avx512(a, sk, prime);
            j = 0;
        }
    }
    /* whole blocks: each stripe's secret offset a constant, the loop unrolled */
    for (; n >= OP_XXH3_BLOCK_STRIPES; n -= OP_XXH3_BLOCK_STRIPES, p += OP_XXH3_BLOCK_STRIPES * OP_XXH3_STRIPE) {
#pragma GCC unroll 16
        for (uint32_t s = 0; s < OP_XXH3_BLOCK_STRIPES; s++) STRIPE_AVX512(p + s * OP_XXH3_STRIPE, K + 8 * s);
        a = scramble_avx512(a, sk, prime);
    }
    for (; n; n--, p += OP_XXH3_STRIPE, j++) STRIPE_AVX512(p, K + 8 * j); /* a block begun: j stays < 16 */
#undef STRIPE_AVX512
    _mm512_storeu_si512(acc, a);
    *in_block = j;
    op_ran(OP_KERNEL_AVX512);
}

#pragma GCC pop_options

const op_xxh3_table op_xxh3_avx512 = {OP_KERNEL_AVX512, stripes_avx512};

#endif
