/* Element-wise activations: the entry points and the scalar twins the SIMD loops of
 * activation_simd.c are tested against (activation.h states the arithmetic).
 * NOTE: a decode step's activation is a few thousand floats after a GEMV: the work is
 * one pass over memory; the vector loops exist because a scalar expf per element costs
 * more than the pass. */
#include <math.h>

#include "op_internal.h"
#include "activation.h"
#include "vector_exp.h"

static inline float quick_gelu_one(float x, float alpha) {
    const float t = alpha * x;
    float a = -fabsf(t);
    a = a < OP_SIGMOID_LO ? OP_SIGMOID_LO : a; /* NaN: a */
    const float e = op_exp_twin(a), d = 1.0f + e;
    return x * ((t >= 0.0f ? 1.0f : e) / d);
}

static void quick_gelu_scalar(const float *x, float *y, size_t n, float alpha) {
    for (size_t i = 0; i < n; i++) y[i] = quick_gelu_one(x[i], alpha);
}

const op_activation_table op_activation_scalar = {OP_KERNEL_SCALAR, quick_gelu_scalar};

static const op_activation_table *activation_table(int isa) {
    switch (isa) {
#if OP_SIMD
    case OP_ISA_AVX2: return &op_activation_avx2;
    case OP_ISA_AVX512:
    case OP_ISA_AVX512_NOVNNI: return &op_activation_avx512;
#endif
    default: return &op_activation_scalar;
    }
}

int op_quick_gelu(int isa, const float *x, float *y, size_t n, float alpha) {
    op_ran(OP_KERNEL_NONE);
    if (!op_isa_supported(isa)) return OP_E_ISA;
    if (n && (!x || !y)) return OP_E_ARG;
    const op_activation_table *t = activation_table(isa);
    op_ran(t->code);
    t->quick_gelu(x, y, n, alpha);
    return OP_OK;
}
