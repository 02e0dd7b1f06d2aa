/* Internal declarations shared by the native sources (not part of the cdef).
 *
 * Packed INT4 matmul layout (kind OP_KIND_INT4_MATMUL, format version 1)
 * ----------------------------------------------------------------------
 * After the 64-byte header come ceil(N / 16) column tiles, each tile_stride bytes
 * (a multiple of 64). A tile holds 16 output columns c0..c0+15 over the whole K:
 *
 *   data    n_blocks * block_size * 8 bytes: for each block, block_size/8 groups of
 *           64 bytes. A group covers 8 consecutive k (k0..k0+7) for the 16 columns:
 *           byte 4*c + j (c = column in tile, j = 0..3) holds
 *             low nibble  = code(k0 + j,     c)
 *             high nibble = code(k0 + 4 + j, c)
 *           So, read as 16 little-endian 32-bit lanes, lane c holds the 8 codes of
 *           column c, and masking with 0x0F / shifting by 4 gives the bytes
 *           [k0..k0+3] and [k0+4..k0+7] of every column: exactly the operand shape
 *           of u8 x s8 -> s32 four-way dot products (VNNI vpdpbusd, or AVX2 maddubs
 *           + madd), and one 32-bit lane per column for the fp32 path.
 *   scales  n_blocks * 16 fp32 (block-major: block b's 16 column scales together)
 *   zeros   OP_ZP_U4: n_blocks * 16 uint8 (one code per byte); OP_ZP_FLOAT:
 *           n_blocks * 16 fp32; OP_ZP_NONE: absent (implicit 8)
 *   padding to a multiple of 64, zero.
 * Codes for k >= K (the block padding of the source) and columns >= N are stored
 * as 0 with scale 0 and zero 0, so they contribute nothing and the bytes do not
 * depend on whatever the source had there.
 *
 * Compute (every ISA, same order per output lane, so paths agree bit for bit):
 *   fp32 mode  acc_b = fma-chain over k in block (k ascending) of a[k] * code
 *              out  = fma(scale, fma(-zero, sum_b(a), acc_b), out)      per block
 *   int8 mode  isum_b = exact integer sum of a8[k] * code
 *              out  = fma(ascale_b * scale, fma(-zero, sum_b(a8), isum_b), out)
 *   Y = out (+ bias).
 * With an integer zero point, fma(-zero, sum(a8), isum) is the exact integer
 * sum(a8 * (code - zero)) (all terms < 2^24), which is what ONNX Runtime computes.
 */
#ifndef ONNX_PREP_INTERNAL_H
#define ONNX_PREP_INTERNAL_H

#include "onnx_prep_native.h"

#define OP_TILE_N 16
#define OP_GROUP_K 8      /* k values per 64-byte group */
#define OP_GROUP_BYTES 64
#define OP_HEADER_SIZE 64

_Static_assert(sizeof(op_packed_header) == OP_HEADER_SIZE, "packed header must be 64 bytes");
_Static_assert(OP_TILE_N * 4 == OP_GROUP_BYTES, "a group is 16 columns x 8 codes x 4 bits");

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#define OP_X86 1
#else
#define OP_X86 0
#endif
/* SIMD kernel files present in this build (x86 only). */
#define OP_SIMD OP_X86

/* Arguments for one INT4 matmul call, after validation and A preprocessing. */
typedef struct {
    const op_packed_header *h;
    const uint8_t *tiles;   /* packed + data_offset */
    size_t M;
    size_t Kp;              /* n_blocks * block_size: row length of the A operand */
    /* fp32 mode: A rows of length >= Kp (zero-padded past K) */
    const float *A;
    size_t lda;
    /* int8 mode: a8 [M][Kp], ascale [M][n_blocks] */
    const int8_t *a8;
    const float *ascale;
    /* both: per-block sums of the A operand, [M][n_blocks] (of a8 in int8 mode) */
    const float *asum;
    const float *bias;      /* [N] or NULL */
    float *Y;
    size_t ldy;
    size_t col_begin, col_end;
} op_mm_args;

typedef struct {
    const op_packed_header *h;
    const uint8_t *tiles;
    size_t M;
    const float *A;
    size_t lda;
    const float *bias;
    ptrdiff_t bias_rs, bias_cs;
    float alpha, beta;
    float *Y;
    size_t ldy;
    size_t col_begin, col_end;
} op_gemm_args;

typedef struct {
    void (*mm_f32)(const op_mm_args *);
    void (*mm_i8)(const op_mm_args *);
    void (*gemm)(const op_gemm_args *);
} op_kernel_table;

/* Per-ISA tables; NULL members / missing tables mean "not compiled". */
extern const op_kernel_table op_kernels_scalar;
#if OP_SIMD
extern const op_kernel_table op_kernels_avx2;
extern const op_kernel_table op_kernels_avx512;
extern const op_kernel_table op_kernels_avx512_vnni;
#endif

/* Tile geometry helpers shared by packing and kernels. */
static inline size_t op_mm_data_bytes(const op_packed_header *h) {
    return (size_t)h->n_blocks * h->block_size * 8u;
}
static inline const float *op_mm_scales(const op_packed_header *h, const uint8_t *tile) {
    return (const float *)(tile + op_mm_data_bytes(h));
}
static inline const void *op_mm_zeros(const op_packed_header *h, const uint8_t *tile) {
    return tile + op_mm_data_bytes(h) + (size_t)h->n_blocks * OP_TILE_N * 4u;
}
static inline int op_zp_kind(const op_packed_header *h) { return (int)(h->flags & OP_FLAG_ZP_MASK); }

/* Zero points of one block as 16 floats (scalar helper used by every path's tail). */
static inline void op_mm_block_zeros(const op_packed_header *h, const uint8_t *tile, uint32_t b,
                                     float z[OP_TILE_N]) {
    int kind = op_zp_kind(h);
    for (int c = 0; c < OP_TILE_N; c++) {
        if (kind == OP_ZP_U4)
            z[c] = (float)((const uint8_t *)op_mm_zeros(h, tile))[(size_t)b * OP_TILE_N + c];
        else if (kind == OP_ZP_FLOAT)
            z[c] = ((const float *)op_mm_zeros(h, tile))[(size_t)b * OP_TILE_N + c];
        else
            z[c] = 8.0f;
    }
}

#endif
