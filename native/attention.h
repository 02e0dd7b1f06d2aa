/* Internal to the attention kernel (attention.c, attention_simd.c): the per-ISA vector
 * primitives its driver runs. Every table computes the same values up to the order of
 * the additions (tests: ISA paths within a stated tolerance of the scalar twin). */
#ifndef ONNX_PREP_ATTENTION_H
#define ONNX_PREP_ATTENTION_H

#include "op_internal.h"

typedef struct {
    float (*dot)(const float *a, const float *b, size_t n);        /* sum a[i] * b[i] */
    void (*axpy)(float *y, float a, const float *x, size_t n);     /* y[i] += a * x[i] */
    int code;                                                      /* OP_KERNEL_* of this table */
} op_attn_table;

extern const op_attn_table op_attn_scalar;
#if OP_SIMD
extern const op_attn_table op_attn_avx2;
extern const op_attn_table op_attn_avx512;
#endif

#endif
