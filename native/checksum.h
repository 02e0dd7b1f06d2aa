/* XXH3-64 internals shared by checksum.c (scalar twin, streaming) and checksum_simd.c
 * (AVX2 and AVX-512 stripe loops): the default secret and the per-ISA stripe loop.
 *
 * Stripe contract: a stripe is 64 input bytes; stripe j of a block (j = 0..15) is
 * accumulated with the secret at 8 * j; after the 16th the block's accumulators are
 * scrambled with the secret at 128. `*in_block` carries j across calls, so a stream
 * cut anywhere on a stripe boundary gives the one-shot value. Every path computes the
 * same 64-bit integer operations, so all give the scalar twin's bits. */
#ifndef ONNX_PREP_CHECKSUM_H
#define ONNX_PREP_CHECKSUM_H
#include "op_internal.h"

#define OP_XXH3_STRIPE 64
#define OP_XXH3_BLOCK_STRIPES 16           /* (secret size - 64) / 8 */
#define OP_XXH3_SCRAMBLE_AT 128            /* secret size - 64 */
#define OP_XXH3_PRIME32_1 0x9E3779B1U

extern const uint8_t op_xxh3_secret[192];

typedef struct {
    int code; /* op_kernel_code of this table's loop */
    /* accumulates n stripes of p into acc[8], scrambling at each block's end */
    void (*stripes)(uint64_t acc[8], const uint8_t *p, size_t n, uint32_t *in_block);
} op_xxh3_table;

extern const op_xxh3_table op_xxh3_scalar;
#if OP_SIMD
extern const op_xxh3_table op_xxh3_avx2;
extern const op_xxh3_table op_xxh3_avx512;
#endif

#endif
