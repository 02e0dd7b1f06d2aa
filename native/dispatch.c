/* Kernel entry points: argument and header validation, A preprocessing shared
 * by every ISA, and the one place that maps an ISA to its kernel table.
 *
 * NOTE: A preprocessing (zero padding past K, per-block sums, int8 quantization
 * for accuracy level 4, level 0's block mantissas) is driven from here, in portable
 * C, so every ISA path is fed bit-identical operands, which is what lets the tests
 * demand bit-exact agreement between paths. Its per-element loops (the block scan,
 * the level-4 rounding, the level-0 digits) have vector versions in the ISA files,
 * hooked through op_kernel_table, each computing exactly the portable loop's values:
 * at decode, a call's preprocessing is a fixed cost against a GEMV of ~0.1 ms, and
 * the portable loops made it ~4 us of a 2048-deep level-4 call (~1 us now). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* clock_gettime, posix_memalign under -std=c11 */
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h> /* _mm_clflush, _mm_mfence: SSE2, every x86-64 */
#endif
#include "op_internal.h"

_Thread_local int op_last_kernel_code = OP_KERNEL_NONE;
int op_last_kernel(void) { return op_last_kernel_code; }

int op_weight_streaming_on = 1;
int op_gemv_panels = 2;
int op_set_gemv_panels(int panels) {
    return __atomic_exchange_n(&op_gemv_panels, panels >= 2 ? 2 : 1, __ATOMIC_RELAXED);
}
int op_set_amx(int on) { return __atomic_exchange_n(&op_amx_on, on ? 1 : 0, __ATOMIC_RELAXED); }
int op_set_weight_streaming(int on) {
    return __atomic_exchange_n(&op_weight_streaming_on, on ? 1 : 0, __ATOMIC_RELAXED);
}

static int64_t probe_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* One read of buf's lines, each line's eight words folded into the sum (the loads a
 * GEMV makes of its weights, with little work between them), the prefetch as
 * op_stream_block issues it when `stream`. The sum keeps the loads. */
static uint64_t probe_pass(const uint8_t *b, size_t bytes, int stream) {
    uint64_t s0 = 0, s1 = 0;
    for (size_t o = 0; o < bytes; o += 64) {
        if (stream) __builtin_prefetch(b + o + OP_STREAM_AHEAD, 0, 0);
        const uint64_t *w = (const uint64_t *)(b + o);
        s0 += w[0] ^ w[2] ^ w[4] ^ w[6];
        s1 += w[1] ^ w[3] ^ w[5] ^ w[7];
    }
    return s0 + s1;
}

int op_probe_weight_streaming(size_t bytes, int passes, int64_t *plain_ns, int64_t *stream_ns) {
#if defined(__x86_64__) || defined(__i386__)
    if (bytes < 64 || bytes % 64 || passes < 1 || !plain_ns || !stream_ns) return -1;
    /* the prefetch runs OP_STREAM_AHEAD past the last line, as a GEMV's does past its
     * panels: keep those addresses inside the allocation */
    const size_t total = bytes + OP_STREAM_AHEAD;
    void *mem = NULL;
    if (posix_memalign(&mem, 64, total)) return -1;
    uint8_t *b = mem;
    memset(b, 0x5a, total);
    volatile uint64_t sink = 0;
    int64_t best[2] = {INT64_MAX, INT64_MAX};
    for (int i = 0; i < 2 * passes; i++) {
        const int stream = i & 1;
        /* from memory, as a decode step's weights come: a model's weights outgrow the
         * caches, and a buffer small enough to probe quickly would not */
        for (size_t o = 0; o < total; o += 64) _mm_clflush(b + o);
        _mm_mfence();
        const int64_t t0 = probe_now_ns();
        sink += probe_pass(b, bytes, stream);
        const int64_t t = probe_now_ns() - t0;
        if (t < best[stream]) best[stream] = t;
    }
    (void)sink;
    free(mem);
    *plain_ns = best[0];
    *stream_ns = best[1];
    return 0;
#else
    (void)bytes; (void)passes; (void)plain_ns; (void)stream_ns;
    return -1;
#endif
}

/* NOTE: this maps an ISA to a table and writes nothing to op_last_kernel_code: the
 * tables' kernels record what ran, so a wrong entry here is visible to the tests. */
#if OP_SIMD
#define OP_VNNI_TABLE (&op_kernels_avx512_vnni)
#else
#define OP_VNNI_TABLE ((const op_kernel_table *)NULL)
#endif

static const op_kernel_table *kernels_for(int isa, int *status) {
    if (!op_isa_supported(isa)) {
        *status = OP_E_ISA;
        return NULL;
    }
    *status = OP_OK;
    switch (isa) {
#if OP_SIMD
    case OP_ISA_AVX2: return &op_kernels_avx2;
    case OP_ISA_AVX512:
        return op_cpu_has_avx512_vnni() ? &op_kernels_avx512_vnni : &op_kernels_avx512;
    case OP_ISA_AVX512_NOVNNI: return &op_kernels_avx512;
#endif
    default: return &op_kernels_scalar;
    }
}

/* Round to nearest, ties to even, for |x| < 2^22, identical to cvtps2dq under the
 * default rounding mode (adding and removing 1.5 * 2^23 leaves the rounded value). */
static inline float round_even(float x) {
    const float magic = 12582912.0f;
    float t = x + magic; /* no -ffast-math, so the compiler keeps both steps */
    return t - magic;
}

/* The portable block scan (op_kernel_table.block_amax): NaN never wins a compare,
 * so it is ignored; inf and NaN clear *finite. */
float op_block_amax_portable(const float *a, size_t n, int *finite) {
    float amax = 0.0f;
    for (size_t i = 0; i < n; i++) {
        float v = fabsf(a[i]);
        if (!(v <= 3.4028234663852886e38f)) *finite = 0; /* inf or NaN */
        amax = v > amax ? v : amax;
    }
    return amax;
}

/* The portable level-4 rounding (op_kernel_table.i8_round). */
int32_t op_i8_round_portable(const float *a, size_t n, float inv, int8_t *a8) {
    int32_t s = 0;
    for (size_t i = 0; i < n; i++) {
        float r = round_even(a[i] * inv);
        r = r > 127.0f ? 127.0f : (r < -128.0f ? -128.0f : r);
        a8[i] = (int8_t)r;
        s += (int32_t)r;
    }
    return s;
}

/* int8 quantization of one A row per block, as ONNX Runtime's MLAS does for
 * accuracy level 4: scale = max|a| / 127, a8 = round_even(a * (127 / max|a|)). NOTE: the
 * multiplier is 127 / max|a|, as MLAS computes it, not 1 / scale: the two differ in the last
 * bit for some max|a|, which moves exact halves (common where A is itself a dequantized
 * int4 row, e.g. a tied embedding through a unit-weight RMSNorm) to the other integer. A block
 * holding inf or NaN gets scale NaN and zero bytes, so its row's outputs are NaN
 * (as at level 0), never finite values made from an undefined conversion. */
static void quantize_row(const op_kernel_table *kt, const float *a, size_t K, uint32_t bs, uint32_t nb,
                         int8_t *a8, float *ascale, float *asum) {
    for (uint32_t b = 0; b < nb; b++) {
        size_t k0 = (size_t)b * bs, n = K - k0 < bs ? K - k0 : bs;
        int finite = 1;
        float amax = kt->block_amax(a + k0, n, &finite);
        if (!finite) {
            memset(a8 + k0, 0, bs);
            ascale[b] = NAN;
            asum[b] = 0.0f;
            continue;
        }
        float scale = amax / 127.0f;
        float inv = amax != 0.0f ? 127.0f / amax : 0.0f;
        int32_t s = kt->i8_round(a + k0, n, inv, a8 + k0);
        for (size_t i = n; i < bs; i++) a8[k0 + i] = 0;
        ascale[b] = scale;
        asum[b] = (float)s;
    }
}

/* Block floating point for accuracy level 0 (see op_internal.h): per block,
 * m_k = round_even(a_k / 2^e) with e chosen so max |m_k| lies in [2^22, 2^23) (one
 * step lower if it would exceed what three balanced base-256 digits hold), stored
 * as three signed bytes lo, mid, hi with m = hi * 65536 + mid * 256 + lo, in
 * 24-byte groups [lo k0..3][lo k4..7][mid k0..3][mid k4..7][hi k0..3][hi k4..7].
 * p2 = 2^e, msum = sum of m_k. Blocks whose max |a| is below FLT_MIN (zero or
 * denormal) are zero (flush to zero); a block holding inf or NaN gets p2 = NaN,
 * so its outputs are NaN. */
#define BFP_MAX_M 8355711 /* 127 * 65536 + 127 * 256 + 127 */

int64_t op_bfp_digits_portable(const float *a, size_t n, double inv, int8_t *dst) {
    int64_t sum = 0;
    for (size_t i = 0; i < n; i++) {
        /* exact scaling, then round half to even by adding and removing 1.5 * 2^52
         * (|x| < 2^23 here; no libm call in the per-element loop; without
         * -ffast-math the compiler must keep both steps) */
        double x = (double)a[i] * inv + 6755399441055744.0;
        int32_t m = (int32_t)(x - 6755399441055744.0);
        int32_t lo = ((m + 128) & 255) - 128, m1 = (m - lo) / 256;
        int32_t mid = ((m1 + 128) & 255) - 128, hi = (m1 - mid) / 256;
        size_t g = i / OP_GROUP_K, j = i % OP_GROUP_K;
        int8_t *grp = dst + g * 24 + (j >= 4 ? 4 : 0) + (j & 3);
        grp[0] = (int8_t)lo;
        grp[8] = (int8_t)mid;
        grp[16] = (int8_t)hi;
        sum += m;
    }
    return sum;
}

/* The block's exponent e from the bits of amax (normal, finite): amax / 2^e lies in
 * [2^22, 2^23), one step higher when that quotient would round (half to even) past
 * BFP_MAX_M. amax = S * 2^(E - 150) with S the 24-bit significand and E the biased
 * exponent, so e = E - 149 and the quotient is S / 2, which rounds past BFP_MAX_M
 * exactly when S >= 16711423. NOTE: bits, not frexpf / nearbyint / ldexp: those libm
 * calls were ~14% of a small level-0 call. Checked against them for every normal
 * float (2^31 - 2^24 values), with 2^-e and 2^e below. */
static inline int bfp_exponent(float amax) {
    uint32_t bits;
    memcpy(&bits, &amax, sizeof bits);
    return (int)(bits >> 23) - 149 + (((bits & 0x7FFFFFu) | 0x800000u) >= 16711423u);
}

/* 2^e exactly: as a double for e in [-1022, 1023], as a float for e in [-149, 127]
 * (a denormal below -126); bfp exponents span [-148, 106]. */
static inline double pow2_double(int e) {
    const uint64_t bits = (uint64_t)(1023 + e) << 52;
    double d;
    memcpy(&d, &bits, sizeof d);
    return d;
}
static inline float pow2_float(int e) {
    const uint32_t bits = e >= -126 ? (uint32_t)(e + 127) << 23 : 1u << (e + 149);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static void bfp_row(const op_kernel_table *kt, const float *a, size_t K, uint32_t bs, uint32_t nb,
                    int8_t *d24, float *p2, float *msum) {
    for (uint32_t b = 0; b < nb; b++) {
        size_t k0 = (size_t)b * bs, n = K - k0 < bs ? K - k0 : bs;
        int finite = 1;
        float amax = kt->block_amax(a + k0, n, &finite);
        int8_t *dst = d24 + k0 * 3;
        memset(dst, 0, (size_t)bs * 3);
        msum[b] = 0.0f;
        if (!finite) {
            p2[b] = NAN;
            continue;
        }
        if (!(amax >= 1.17549435e-38f)) { /* zero or denormal block */
            p2[b] = 0.0f;
            continue;
        }
        const int e = bfp_exponent(amax);
        int64_t sum = kt->bfp_digits(a + k0, n, pow2_double(-e), dst);
        p2[b] = pow2_float(e);
        msum[b] = (float)sum;
    }
}

/* Validation and A preprocessing of one matmul, once for all of its column ranges
 * (op_matmul_nbits: one range; op_batch_prepare: every chunk of a split, handoff.c).
 * On OP_OK, p->scratch holds the prepared A (free with op_mm_prep_release). */
int op_mm_prepare(op_mm_prep *p, int isa, const float *A, size_t M, size_t lda, const uint8_t *packed,
                  size_t packed_size, const float *bias, float *Y, size_t ldy, int accuracy_level) {
    memset(p, 0, sizeof *p);
    int st = op_packed_header_read(packed, packed_size, OP_KIND_INT4_MATMUL, &p->h);
    if (st) return st;
    const op_kernel_table *kt = kernels_for(isa, &st);
    if (!kt) return st;
    const op_packed_header *h = &p->h;
    if (!A || !Y || M == 0 || lda < h->K || ldy < h->N) return OP_E_ARG;
    if (accuracy_level < 0) accuracy_level = (int)((h->flags & OP_FLAG_ACC_MASK) >> OP_FLAG_ACC_SHIFT);
    if (accuracy_level > 4 && accuracy_level != OP_COMPUTE_FMA32) return OP_E_ARG;

    const size_t K = (size_t)h->K, nb = h->n_blocks, bs = h->block_size, Kp = nb * bs;
    op_mm_args *a = &p->a;
    a->h = h;
    a->panels = packed + h->data_offset;
    a->M = M;
    a->Kp = Kp;
    a->bias = bias;
    a->Y = Y;
    a->ldy = ldy;
    p->kt = kt;

    /* NOTE: levels 0-3 run the block floating point path: fp32-accurate (as close to
     * ONNX Runtime's fp32 result as IEEE fp32 FMA chains are: ~1e-7 of the output
     * magnitude, measured) and, being integer dot products, bandwidth-bound at
     * decode. ONNX Runtime computes levels 0 and 1 alike on CPU. The IEEE fp32 FMA
     * chains (OP_COMPUTE_FMA32) convert every code to float and are compute-bound at
     * decode: ~19 GB/s on one Zen 4 core, ~60% of what it reads from DRAM. Level 1 ran
     * them until run 22 (docs/kernels.md). */
    const int int8 = accuracy_level == 4, bfp = accuracy_level <= 3;
    const int pad = Kp != K;
    const int tiles = (int8 || bfp) && kt == OP_VNNI_TABLE && op_amx_for(M, int8);
    size_t bytes = M * nb * sizeof(float) * (int8 || bfp ? 2 : 1);
    bytes += int8 ? M * Kp : bfp ? M * Kp * 3 * (tiles ? 2 : 1) : (pad ? M * Kp * sizeof(float) : 0);
    void *scratch = malloc(bytes ? bytes : 1);
    if (!scratch) return OP_E_NOMEM;
    p->scratch = scratch;
    float *asum = (float *)scratch;
    a->asum = asum;
    if (bfp) {
        float *p2 = asum + M * nb;
        int8_t *d24 = (int8_t *)(p2 + M * nb);
        for (size_t m = 0; m < M; m++)
            bfp_row(kt, A + m * lda, K, (uint32_t)bs, (uint32_t)nb, d24 + m * Kp * 3, p2 + m * nb,
                    asum + m * nb);
        a->a8 = d24;
        a->ascale = p2;
        p->kernel = kt->mm_bfp;
        if (tiles) {
            /* the tiles read each plane's bytes of a block contiguous: the 24-byte
             * groups (8 bytes a plane) regrouped plane by plane */
            int8_t *planes = d24 + M * Kp * 3;
            for (size_t m = 0; m < M; m++)
                for (size_t g = 0; g < Kp / OP_GROUP_K; g++)
                    for (size_t q = 0; q < 3; q++)
                        memcpy(planes + (m * 3 + q) * Kp + g * 8, d24 + m * Kp * 3 + g * 24 + q * 8, 8);
            a->planes = planes;
            p->kernel = op_mm_bfp_amx;
        }
    } else if (int8) {
        float *ascale = asum + M * nb;
        int8_t *a8 = (int8_t *)(ascale + M * nb);
        for (size_t m = 0; m < M; m++)
            quantize_row(kt, A + m * lda, K, (uint32_t)bs, (uint32_t)nb, a8 + m * Kp, ascale + m * nb,
                         asum + m * nb);
        a->a8 = a8;
        a->ascale = ascale;
        p->kernel = tiles ? op_mm_i8_amx : kt->mm_i8;
    } else {
        const float *src = A;
        size_t ld = lda;
        if (pad) {
            float *ap = asum + M * nb;
            for (size_t m = 0; m < M; m++) {
                memcpy(ap + m * Kp, A + m * lda, K * sizeof(float));
                memset(ap + m * Kp + K, 0, (Kp - K) * sizeof(float));
            }
            src = ap;
            ld = Kp;
        }
        for (size_t m = 0; m < M; m++)
            for (size_t b = 0; b < nb; b++) {
                float s = 0.0f;
                const float *r = src + m * ld + b * bs;
                for (size_t i = 0; i < bs; i++) s += r[i];
                asum[m * nb + b] = s;
            }
        a->A = src;
        a->lda = ld;
        p->kernel = kt->mm_f32;
    }
    return OP_OK;
}

/* Columns [col_begin, col_end) of a prepared matmul; any thread, any number of ranges
 * at once (each writes only its own columns of Y). */
int op_mm_prep_run(const op_mm_prep *p, size_t col_begin, size_t col_end) {
    op_ran(OP_KERNEL_NONE);
    if (col_begin > col_end || col_end > p->h.N) return OP_E_ARG;
    if (col_begin == col_end) return OP_OK;
    op_mm_args a = p->a;
    a.col_begin = col_begin;
    a.col_end = col_end;
    p->kernel(&a);
    return OP_OK;
}

void op_mm_prep_release(op_mm_prep *p) {
    free(p->scratch);
    p->scratch = NULL;
}

int op_matmul_nbits(int isa, const float *A, size_t M, size_t lda, const uint8_t *packed,
                    size_t packed_size, const float *bias, float *Y, size_t ldy,
                    size_t col_begin, size_t col_end, int accuracy_level) {
    op_ran(OP_KERNEL_NONE);
    op_mm_prep p;
    /* the range is checked before A is prepared: an empty range prepares nothing */
    op_packed_header h;
    int st = op_packed_header_read(packed, packed_size, OP_KIND_INT4_MATMUL, &h);
    if (st) return st;
    if (!kernels_for(isa, &st)) return st;
    if (!A || !Y || M == 0 || lda < h.K || ldy < h.N || col_begin > col_end || col_end > h.N)
        return OP_E_ARG;
    if (accuracy_level > 4 && accuracy_level != OP_COMPUTE_FMA32) return OP_E_ARG;
    if (col_begin == col_end) return OP_OK;
    st = op_mm_prepare(&p, isa, A, M, lda, packed, packed_size, bias, Y, ldy, accuracy_level);
    if (st == OP_OK) st = op_mm_prep_run(&p, col_begin, col_end);
    op_mm_prep_release(&p);
    return st;
}

int op_gemm(int isa, const float *A, size_t M, size_t lda, const uint8_t *packed,
            size_t packed_size, const float *bias, ptrdiff_t bias_rs, ptrdiff_t bias_cs,
            float alpha, float beta, float *Y, size_t ldy, size_t col_begin, size_t col_end) {
    op_ran(OP_KERNEL_NONE);
    op_packed_header h;
    int st = op_packed_header_read(packed, packed_size, OP_KIND_GEMM_B, &h);
    if (st) return st;
    const op_kernel_table *kt = kernels_for(isa, &st);
    if (!kt) return st;
    if (!A || !Y || M == 0 || lda < h.K || ldy < h.N || col_begin > col_end || col_end > h.N)
        return OP_E_ARG;
    if (col_begin == col_end) return OP_OK;
    op_gemm_args g = {&h, packed + h.data_offset, M, A, lda, bias, bias_rs, bias_cs,
                      alpha, beta, Y, ldy, col_begin, col_end};
    kt->gemm(&g);
    return OP_OK;
}
