/* Row normalization (norm.c, norm_simd.c): the per-ISA loops and the lane contract
 * every path follows.
 *
 * Lane contract: a row of n values is read in chunks of OP_NORM_LANES; lane j of a
 * 16-float accumulator takes the elements i with i % 16 == j, in ascending i, and a
 * chunk past n adds zeros (an exact no-op on a sum that starts at +0). The 16 lanes
 * are folded by op_norm_fold's fixed tree. Every path (scalar, AVX2 as two 8-lane
 * halves, AVX-512 as one register) performs per lane the same IEEE operations in the
 * same order, so every path gives the scalar twin's bits. */
#ifndef ONNX_PREP_NORM_H
#define ONNX_PREP_NORM_H
#include <stddef.h>

#define OP_NORM_LANES 16

typedef struct {
    int code; /* op_kernel_code of this table's loops */
    /* out[i] = x[i] + skip[i] (+ bias[i]) for i < n; skip or bias may be NULL. */
    void (*add)(const float *x, const float *skip, const float *bias, float *out, size_t n);
    /* Lane sums of d (sd) and of d * d (ss, one fused multiply-add per element) with
     * d = v - mean, padding lanes d = 0. With mean 0 they are v's own sums (v - 0 is
     * v exactly, -0 included). */
    void (*sums)(const float *v, size_t n, float mean, float sd[OP_NORM_LANES],
                 float ss[OP_NORM_LANES]);
    /* y[i] = ((v[i] - mean) * inv) * gamma[i] (+ beta[i]); y may alias v. */
    void (*apply)(const float *v, size_t n, float mean, float inv, const float *gamma,
                  const float *beta, float *y);
} op_norm_table;

extern const op_norm_table op_norm_scalar;
#if OP_SIMD
extern const op_norm_table op_norm_avx2;
extern const op_norm_table op_norm_avx512;
#endif

/* The fixed fold of 16 lane sums: a[j] += a[j + w] for w = 8, 4, 2, 1. */
static inline float op_norm_fold(const float a[OP_NORM_LANES]) {
    float t[OP_NORM_LANES];
    for (int j = 0; j < OP_NORM_LANES; j++) t[j] = a[j];
    for (int w = OP_NORM_LANES / 2; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) t[j] = t[j] + t[j + w];
    return t[0];
}

#endif
