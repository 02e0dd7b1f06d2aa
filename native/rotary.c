/* com.microsoft RotaryEmbedding with ONNX Runtime's semantics. Per (batch, position,
 * head) the first rot_dim values of the head rotate by the angle of the token's
 * position id (cos / sin caches [max_pos, rot_dim / 2]); the rest of the head is
 * copied unchanged:
 *   halves (interleaved 0): pairs (i, i + rot_dim / 2);  interleaved 1: pairs (2i, 2i + 1)
 *   y_a = x_a * cos - x_b * sin,  y_b = x_b * cos + x_a * sin
 * each product rounded, then the sum (no fused multiply-add), as ONNX Runtime's
 * portable kernel computes it.
 * NOTE: one portable implementation for every ISA (reported as scalar): a decode
 * step rotates a few heads of 64-128 values, ~0.1 us of arithmetic against a call
 * cost of ~1 us, so SIMD paths would not show. */
#include <string.h>

#include "op_internal.h"

int op_rotary_embedding(const float *x, float *y, size_t batch, size_t seq, size_t heads,
                        size_t head_size, size_t rot_dim, int transposed, int interleaved,
                        const int64_t *pos, int pos_per_token, const float *cos_cache,
                        const float *sin_cache, size_t max_pos, size_t *bad_position) {
    op_ran(OP_KERNEL_NONE);
    if (rot_dim % 2 || rot_dim > head_size || (!x || !y || !pos || !cos_cache || !sin_cache))
        return OP_E_ARG;
    const size_t half = rot_dim / 2, n_pos = pos_per_token ? batch * seq : 1;
    for (size_t i = 0; i < n_pos; i++) {
        const int64_t p0 = pos[i];
        const int64_t last = pos_per_token ? p0 : p0 + (int64_t)seq - 1;
        if (p0 < 0 || last >= (int64_t)max_pos) {
            if (bad_position) *bad_position = i;
            return OP_E_INDEX;
        }
    }
    op_ran(OP_KERNEL_SCALAR);
    /* strides: [B, S, H, D] (transposed 0) or [B, H, S, D] (transposed 1) */
    const size_t s_stride = transposed ? head_size : heads * head_size;
    const size_t h_stride = transposed ? seq * head_size : head_size;
    const size_t b_stride = seq * heads * head_size;
    for (size_t b = 0; b < batch; b++)
        for (size_t s = 0; s < seq; s++) {
            const int64_t p = pos_per_token ? pos[b * seq + s] : pos[0] + (int64_t)s;
            const float *c = cos_cache + (size_t)p * half, *sn = sin_cache + (size_t)p * half;
            for (size_t h = 0; h < heads; h++) {
                const size_t off = b * b_stride + s * s_stride + h * h_stride;
                const float *xi = x + off;
                float *yo = y + off;
                for (size_t i = 0; i < half; i++) {
                    const size_t ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + half;
                    const float xa = xi[ia], xb = xi[ib];
                    const float ya = xa * c[i] + (-xb) * sn[i];
                    const float yb = xb * c[i] + xa * sn[i];
                    yo[ia] = ya;
                    yo[ib] = yb;
                }
                if (rot_dim < head_size && yo != xi)
                    memcpy(yo + rot_dim, xi + rot_dim, (head_size - rot_dim) * sizeof(float));
            }
        }
    return OP_OK;
}
