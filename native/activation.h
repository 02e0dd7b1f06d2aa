/* Element-wise activations (activation.c, activation_simd.c): the per-ISA loops.
 *
 * QuickGelu (com.microsoft): y = x * sigmoid(alpha * x), per element, as
 *   t = alpha * x, a = max(-|t|, -86), e = exp(a) (vector_exp.h), d = 1 + e,
 *   s = (t >= 0 ? 1 : e) / d, y = x * s (one division: the numerator chosen first).
 * exp only ever sees an argument in [-86, 0], where its result is a normal float, so
 * every path (scalar twin, AVX2, AVX-512) gives the same bits. Below t = -86 the
 * sigmoid is taken as exp(-86) / (1 + exp(-86)) ~ 4.5e-38: an absolute error under
 * 4.5e-38 * |x|. NaN in, NaN out. */
#ifndef ONNX_PREP_ACTIVATION_H
#define ONNX_PREP_ACTIVATION_H
#include <stddef.h>

#define OP_SIGMOID_LO (-86.0f)

typedef struct {
    int code; /* op_kernel_code of this table's loops */
    void (*quick_gelu)(const float *x, float *y, size_t n, float alpha);
} op_activation_table;

extern const op_activation_table op_activation_scalar;
#if OP_SIMD
extern const op_activation_table op_activation_avx2;
extern const op_activation_table op_activation_avx512;
#endif

#endif
