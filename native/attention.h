/* Internal to the attention kernel (attention.c, attention_simd.c): the per-ISA row
 * primitives its driver runs, one call each per query row. Every table computes the
 * same values up to the order of the additions and, in the SIMD tables, a vector exp
 * within ~1 ulp of expf (tests: ISA paths within a stated tolerance of the scalar twin). */
#ifndef ONNX_PREP_ATTENTION_H
#define ONNX_PREP_ATTENTION_H

#include "op_internal.h"

#define OP_ATTN_ROWS 4  /* query rows in a row group (scores_rows, weighted_sum_rows) */

typedef struct {
    /* scores[i] = scale * (q . k_i) (+ mask[i] when mask != NULL) for i < n, key i at
     * k + i * h (h floats each). Returns the largest score, NaN scores skipped (-inf
     * when every score is -inf or NaN). */
    float (*scores)(const float *q, const float *k, size_t h, size_t n, float scale, const float *mask,
                    float *scores);
    /* scores[i] = exp(scores[i] - max) for i < n, max the largest score (so every
     * argument is <= 0 or NaN: -inf gives 0, NaN gives NaN). Returns their sum. */
    float (*softmax)(float *scores, size_t n, float max);
    /* o[j] = sum_i (p[i] * w) * v[i * h + j] for j < h, over i < n in ascending order. */
    void (*weighted_sum)(float *o, const float *p, float w, const float *v, size_t h, size_t n);
    /* Row groups (NULL in a table without them): OP_ATTN_ROWS query rows that weigh the
     * same n keys, each key and value read once for the group; row r's results are those
     * of scores / weighted_sum on row r, bit for bit. A group of fewer rows repeats its
     * last row's pointers (the same values written twice). mask NULL: no row has one. */
    void (*scores_rows)(const float *const q[], const float *k, size_t h, size_t n, float scale,
                        const float *const mask[], float *const scores[], float max[]);
    void (*weighted_sum_rows)(float *const o[], const float *const p[], const float w[], const float *v,
                              size_t h, size_t n);
    int code;  /* OP_KERNEL_* of this table */
} op_attn_table;

extern const op_attn_table op_attn_scalar;
#if OP_SIMD
extern const op_attn_table op_attn_avx2;
extern const op_attn_table op_attn_avx512;
#endif

#endif
