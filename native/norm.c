/* Row normalization: LayerNormalization, SimplifiedLayerNormalization (RMSNorm) and
 * their com.microsoft Skip* forms, with ONNX Runtime's semantics:
 *
 *   v = x + skip (+ bias)                      (Skip* forms; else v = x)
 *   RMS:   inv = 1 / sqrt(sum(v^2) / n + eps), y = (v * inv) * gamma
 *   layer: mean = sum(v) / n, inv = 1 / sqrt(sum((v - mean)^2) / n + eps),
 *          y = ((v - mean) * inv) * gamma (+ beta)
 *
 * The sums follow the lane contract of norm.h (16 fp32 lane sums, fixed fold); the
 * variance is taken around the mean (two passes, corrected) rather than as
 * E[v^2] - mean^2, which cancels catastrophically when |mean| >> std. The entry point below drives
 * the per-ISA loops; this file holds the scalar twin they are tested against.
 * NOTE: a decode step's rows are a few thousand floats: the work is memory-bound,
 * so the SIMD loops only vectorize the passes, nothing is blocked or threaded. */
#include <math.h>

#include "op_internal.h"
#include "norm.h"

static void add_scalar(const float *x, const float *skip, const float *bias, float *out, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float v = skip ? x[i] + skip[i] : x[i];
        out[i] = bias ? v + bias[i] : v;
    }
}

static void sums_scalar(const float *v, size_t n, float mean, float sd[OP_NORM_LANES],
                        float ss[OP_NORM_LANES]) {
    for (int j = 0; j < OP_NORM_LANES; j++) sd[j] = ss[j] = 0.0f;
    for (size_t i = 0; i < n; i += OP_NORM_LANES)
        for (int j = 0; j < OP_NORM_LANES; j++) {
            const float d = i + j < n ? v[i + j] - mean : 0.0f;
            sd[j] = sd[j] + d;
            ss[j] = fmaf(d, d, ss[j]);
        }
}

static void apply_scalar(const float *v, size_t n, float mean, float inv, const float *gamma,
                         const float *beta, float *y) {
    for (size_t i = 0; i < n; i++) {
        const float t = ((v[i] - mean) * inv) * gamma[i];
        y[i] = beta ? t + beta[i] : t;
    }
}

const op_norm_table op_norm_scalar = {OP_KERNEL_SCALAR, add_scalar, sums_scalar, apply_scalar};

static const op_norm_table *norm_table(int isa) {
    switch (isa) {
#if OP_SIMD
    case OP_ISA_AVX2: return &op_norm_avx2;
    case OP_ISA_AVX512:
    case OP_ISA_AVX512_NOVNNI: return &op_norm_avx512;
#endif
    default: return &op_norm_scalar;
    }
}

int op_norm_rows(int isa, const float *x, const float *skip, size_t skip_rows, const float *bias,
                 const float *gamma, const float *beta, size_t rows, size_t n, float epsilon,
                 int simplified, float *y, float *sum_out, float *mean_out, float *inv_out) {
    op_ran(OP_KERNEL_NONE);
    if (!op_isa_supported(isa)) return OP_E_ISA;
    if ((rows && n && (!x || !y || !gamma)) || (skip && (skip_rows == 0 || rows % skip_rows)))
        return OP_E_ARG;
    if (rows == 0) return OP_OK;
    const op_norm_table *t = norm_table(isa);
    float s[OP_NORM_LANES], ss[OP_NORM_LANES], sd[OP_NORM_LANES];
    for (size_t r = 0; r < rows; r++) {
        const float *v = x + r * n;
        if (skip || bias) {
            float *dst = sum_out ? sum_out + r * n : y + r * n;
            t->add(v, skip ? skip + (r % skip_rows) * n : NULL, bias, dst, n);
            v = dst;
        }
        t->sums(v, n, 0.0f, s, ss);
        float mean = op_norm_fold(s) / (float)n, var;
        if (simplified) {
            var = op_norm_fold(ss) / (float)n;
        } else {
            /* The corrected two-pass form: the deviations' own sum corrects the
             * rounding of the first pass's mean (which, with |mean| >> std, is a
             * visible fraction of std), and takes its square off the variance. */
            t->sums(v, n, mean, sd, ss);
            const float dsum = op_norm_fold(sd);
            var = (op_norm_fold(ss) - dsum * (dsum / (float)n)) / (float)n;
            var = var > 0.0f ? var : 0.0f;
            mean = mean + dsum / (float)n;
        }
        const float inv = 1.0f / sqrtf(var + epsilon);
        t->apply(v, n, simplified ? 0.0f : mean, inv, gamma, simplified ? NULL : beta, y + r * n);
        if (mean_out) mean_out[r] = mean;
        if (inv_out) inv_out[r] = inv;
    }
    op_ran(t->code);
    return OP_OK;
}
