/* Scalar reference kernels: the portable path and the oracle for the SIMD paths.
 *
 * Each loop mirrors, per output column, the exact operation sequence of the SIMD
 * kernels (one fmaf chain per block in ascending k, then the per-block fold), so
 * the SIMD paths must match this file bit for bit. fmaf() is used explicitly:
 * the build is -std=c11, which keeps the compiler from contracting a*b+c on its
 * own, so the reference rounds exactly where written. */
#include <math.h>
#include "op_internal.h"

static inline uint32_t code_at(const uint8_t *group, int c, int j) {
    /* j = 0..7 is the k offset inside the 8-code group (see op_internal.h) */
    uint8_t byte = group[4 * c + (j & 3)];
    return j < 4 ? (byte & 0x0Fu) : (byte >> 4);
}

static void store_tile(const op_mm_args *a, size_t m, size_t t, const float out[OP_TILE_N]) {
    for (int c = 0; c < OP_TILE_N; c++) {
        size_t col = t * OP_TILE_N + (size_t)c;
        if (col < a->col_begin || col >= a->col_end) continue;
        float v = out[c];
        if (a->bias) v = v + a->bias[col];
        a->Y[m * a->ldy + col] = v;
    }
}

/* The walk every mode shares: per tile of the column range, per row of A, the blocks
 * in ascending order; BLOCK adds one block's contribution to the row's 16 outputs. */
typedef void (*block_fn)(const op_mm_args *a, size_t m, int i, uint32_t b, const uint8_t *blk,
                         float out[OP_TILE_N]);

static void mm_walk(const op_mm_args *a, block_fn block) {
    op_ran(OP_KERNEL_SCALAR);
    const op_packed_header *h = a->h;
    for (size_t t = op_tile_begin(a), t1 = op_tile_end(a); t < t1; t++) {
        const size_t p = t / OP_PANEL_TILES;
        const int i = (int)(t % OP_PANEL_TILES);
        for (size_t m = 0; m < a->M; m++) {
            float out[OP_TILE_N] = {0};
            for (uint32_t b = 0; b < h->n_blocks; b++) block(a, m, i, b, op_mm_block(h, a->panels, p, b), out);
            store_tile(a, m, t, out);
        }
    }
}

/* fp32: one fmaf chain per column over the block's k, then
 * out = fmaf(scale, fmaf(-zero, sum(a), acc), out). */
static void f32_block(const op_mm_args *a, size_t m, int i, uint32_t b, const uint8_t *blk,
                      float out[OP_TILE_N]) {
    const op_packed_header *h = a->h;
    const uint32_t bs = h->block_size;
    float acc[OP_TILE_N] = {0}, z[OP_TILE_N];
    for (uint32_t g = 0; g < bs / OP_GROUP_K; g++) {
        const uint8_t *grp = op_mm_group(blk, g, i);
        const float *ak = a->A + m * a->lda + (size_t)b * bs + (size_t)g * OP_GROUP_K;
        for (int j = 0; j < OP_GROUP_K; j++)
            for (int c = 0; c < OP_TILE_N; c++)
                acc[c] = fmaf(ak[j], (float)code_at(grp, c, j), acc[c]);
    }
    op_mm_block_zeros(h, blk, i, z);
    const float *sc = op_mm_scales(h, blk, i);
    const float s_a = a->asum[m * h->n_blocks + b];
    for (int c = 0; c < OP_TILE_N; c++) {
        float d = fmaf(-z[c], s_a, acc[c]);
        out[c] = fmaf(sc[c], d, out[c]);
    }
}

/* The int8 and bfp fold: out = fmaf(ascale * scale, fmaf(-zero, sum(a), d), out). */
static void fold_int_block(const op_mm_args *a, size_t m, int i, uint32_t b, const uint8_t *blk,
                           const float d[OP_TILE_N], float out[OP_TILE_N]) {
    const op_packed_header *h = a->h;
    float z[OP_TILE_N];
    op_mm_block_zeros(h, blk, i, z);
    const float *sc = op_mm_scales(h, blk, i);
    const float s_a = a->asum[m * h->n_blocks + b], as = a->ascale[m * h->n_blocks + b];
    for (int c = 0; c < OP_TILE_N; c++) out[c] = fmaf(as * sc[c], fmaf(-z[c], s_a, d[c]), out[c]);
}

/* int8: exact integer sums of a8[k] * code. */
static void i8_block(const op_mm_args *a, size_t m, int i, uint32_t b, const uint8_t *blk,
                     float out[OP_TILE_N]) {
    const uint32_t bs = a->h->block_size;
    int32_t isum[OP_TILE_N] = {0};
    for (uint32_t g = 0; g < bs / OP_GROUP_K; g++) {
        const uint8_t *grp = op_mm_group(blk, g, i);
        const int8_t *ak = a->a8 + m * a->Kp + (size_t)b * bs + (size_t)g * OP_GROUP_K;
        for (int j = 0; j < OP_GROUP_K; j++)
            for (int c = 0; c < OP_TILE_N; c++)
                isum[c] += (int32_t)ak[j] * (int32_t)code_at(grp, c, j);
    }
    float d[OP_TILE_N];
    for (int c = 0; c < OP_TILE_N; c++) d[c] = (float)isum[c];
    fold_int_block(a, m, i, b, blk, d, out);
}

/* bfp: exact sums per byte plane of the 24-bit mantissas, recombined as
 * fmaf(hi, 65536, lo + 256 * mid). */
static void bfp_block(const op_mm_args *a, size_t m, int i, uint32_t b, const uint8_t *blk,
                      float out[OP_TILE_N]) {
    const uint32_t bs = a->h->block_size;
    int32_t il[OP_TILE_N] = {0}, im[OP_TILE_N] = {0}, ih[OP_TILE_N] = {0};
    for (uint32_t g = 0; g < bs / OP_GROUP_K; g++) {
        const uint8_t *grp = op_mm_group(blk, g, i);
        const int8_t *w = a->a8 + m * a->Kp * 3 + ((size_t)b * bs / OP_GROUP_K + g) * 24;
        for (int j = 0; j < OP_GROUP_K; j++) {
            const int o = (j >= 4 ? 4 : 0) + (j & 3);
            for (int c = 0; c < OP_TILE_N; c++) {
                const int32_t q = (int32_t)code_at(grp, c, j);
                il[c] += w[o] * q;
                im[c] += w[8 + o] * q;
                ih[c] += w[16 + o] * q;
            }
        }
    }
    float d[OP_TILE_N];
    for (int c = 0; c < OP_TILE_N; c++) d[c] = fmaf((float)ih[c], 65536.0f, (float)(il[c] + im[c] * 256));
    fold_int_block(a, m, i, b, blk, d, out);
}

static void mm_f32_scalar(const op_mm_args *a) { mm_walk(a, f32_block); }
static void mm_i8_scalar(const op_mm_args *a) { mm_walk(a, i8_block); }
static void mm_bfp_scalar(const op_mm_args *a) { mm_walk(a, bfp_block); }

static void gemm_scalar(const op_gemm_args *g) {
    op_ran(OP_KERNEL_SCALAR);
    const op_packed_header *h = g->h;
    const size_t K = (size_t)h->K;
    const size_t t0 = g->col_begin / OP_TILE_N, t1 = (g->col_end + OP_TILE_N - 1) / OP_TILE_N;
    for (size_t t = t0; t < t1; t++) {
        const float *tile = (const float *)(g->tiles + t * h->panel_stride);
        for (size_t m = 0; m < g->M; m++) {
            const float *arow = g->A + m * g->lda;
            float acc[OP_TILE_N] = {0};
            for (size_t k = 0; k < K; k++)
                for (int c = 0; c < OP_TILE_N; c++)
                    acc[c] = fmaf(arow[k], tile[k * OP_TILE_N + c], acc[c]);
            for (int c = 0; c < OP_TILE_N; c++) {
                size_t col = t * OP_TILE_N + (size_t)c;
                if (col < g->col_begin || col >= g->col_end) continue;
                float v = g->alpha * acc[c];
                if (g->bias) v = fmaf(g->beta, g->bias[(ptrdiff_t)m * g->bias_rs + (ptrdiff_t)col * g->bias_cs], v);
                g->Y[m * g->ldy + col] = v;
            }
        }
    }
}

const op_kernel_table op_kernels_scalar = {mm_f32_scalar, mm_bfp_scalar, mm_i8_scalar, gemm_scalar,
                                           op_bfp_digits_portable, op_block_amax_portable, op_i8_round_portable};
