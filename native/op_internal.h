/* Internal declarations shared by the native sources (not part of the cdef).
 *
 * Packed INT4 matmul layout (kind OP_KIND_INT4_MATMUL, OP_PACK_FORMAT_VERSION)
 * --------------------------------------------------------------------------
 * After the 64-byte header come ceil(N / 64) PANELS of 64 output columns, each
 * panel_stride bytes. A panel is 4 TILES of 16 columns. For each of the n_blocks
 * K-blocks a panel holds one block record of block_bytes bytes:
 *
 *   data    block_size/8 groups x 4 tiles x 64 bytes: group g of tile i at
 *           g * 256 + i * 64. A 64-byte group covers 8 consecutive k
 *           (k0..k0+7) for the 16 columns of its tile: byte 4*c + j
 *           (c = column in tile, j = 0..3) holds
 *             low nibble  = code(k0 + j,     c)
 *             high nibble = code(k0 + 4 + j, c)
 *           Read as 16 little-endian 32-bit lanes, lane c holds column c's 8
 *           codes; masking with 0x0F / shifting by 4 gives the bytes
 *           [k0..k0+3] / [k0+4..k0+7] of every column: the operand shape of
 *           u8 x s8 -> s32 four-way dot products (VNNI vpdpbusd, AVX2 maddubs +
 *           madd), and one 32-bit lane per column for the fp32 path.
 *   scales  4 tiles x 16 fp32 (tile i at i * 64)
 *   zeros   OP_ZP_U4: 4 x 16 uint8 (one code per byte); OP_ZP_FLOAT: 4 x 16 fp32;
 *           OP_ZP_NONE: absent (implicit 8)
 * Every part is a multiple of 64 bytes, so all records stay 64-byte aligned.
 *
 * NOTE: why panels: a decode GEMV (M = 1) is memory-bound, and it streams best
 * as ONE sequential read with several independent accumulator chains. A panel
 * gives both: the kernel walks the buffer front to back while four tiles give
 * four (or more) independent chains. Measured on the development machine:
 * separate per-tile streams read at ~19 GB/s, the panel layout at the machine's
 * read bandwidth (~24 GB/s); scales inline per block keep it one stream.
 *
 * Codes for k >= K (the block padding of the source) and columns >= N are stored
 * as 0 with scale 0 and zero 0, so they contribute nothing and the bytes do not
 * depend on whatever the source had there.
 *
 * Compute (every ISA, same order per output lane, so paths agree bit for bit):
 *   fp32 mode  (OP_COMPUTE_FMA32, asked for explicitly; levels 1-3 until run 22)
 *              acc_b = fma-chain over k in block (k ascending) of a[k] * code
 *              out  = fma(scale, fma(-zero, sum_b(a), acc_b), out)      per block
 *   bfp mode   (accuracy levels 0-3: fp32-accurate block floating point)
 *              a[k] = m[k] * p2_b with m integer, |m| < 2^23 (24-bit mantissas
 *              sharing the block's exponent), split into signed bytes
 *              m = hi * 65536 + mid * 256 + lo. Exact integer dot products per
 *              byte plane (isum_lo, isum_mid, isum_hi), then
 *              d   = fma(float(isum_hi), 65536, float(isum_lo + 256 * isum_mid))
 *              out = fma(scale * p2_b, fma(-zero, sum_b(m), d), out)
 *   int8 mode  (accuracy level 4)
 *              isum_b = exact integer sum of a8[k] * code
 *              out  = fma(ascale_b * scale, fma(-zero, sum_b(a8), isum_b), out)
 *   Y = out (+ bias).
 * NOTE: why bfp: an fp32 FMA per code needs the code converted to float first
 * (shift + vpermps), which bounds a decode GEMV at ~17 GB/s on the development
 * machine (~55% of its read bandwidth). Three byte-plane VNNI dot products per
 * 4 codes cost a third of that, so the GEMV becomes memory-bound, while the
 * 24-bit mantissas keep the error at fp32's level (<= 2^-22 of the block's max
 * |a| per element, then exact integer sums).
 * With an integer zero point, fma(-zero, sum(a8), isum) is the exact integer
 * sum(a8 * (code - zero)) (all terms < 2^24), which is what ONNX Runtime computes.
 */
#ifndef ONNX_PREP_INTERNAL_H
#define ONNX_PREP_INTERNAL_H

#include "onnx_prep_native.h"

#define OP_TILE_N 16
#define OP_PANEL_TILES 4
#define OP_PANEL_N (OP_TILE_N * OP_PANEL_TILES)
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
/* SIMD kernel files present in this build: x86 with GCC.
 * KNOWN GAP: the SIMD files enable their ISA with `#pragma GCC target`, which clang
 * ignores (it would need `#pragma clang attribute`); rather than fail to compile,
 * other compilers build the scalar path only. */
#if OP_X86 && defined(__GNUC__) && !defined(__clang__)
#define OP_SIMD 1
#else
#define OP_SIMD 0
#endif

/* Arguments for one INT4 matmul call, after validation and A preprocessing. */
typedef struct {
    const op_packed_header *h;
    const uint8_t *panels;  /* packed + data_offset */
    size_t M;
    size_t Kp;              /* n_blocks * block_size: row length of the A operand */
    /* fp32 mode: A rows of length >= Kp (zero-padded past K) */
    const float *A;
    size_t lda;
    /* int8 mode: a8 [M][Kp], ascale [M][n_blocks];
     * bfp mode: a8 = digit planes [M][3 * Kp] (24-byte groups), ascale = p2 [M][n_blocks] */
    const int8_t *a8;
    const float *ascale;
    /* all: per-block sums of the A operand, [M][n_blocks] (of a8 / m in int8 / bfp mode) */
    const float *asum;
    /* bfp mode on AMX tiles (op_mm_prepare): the digit planes apart, [M][3][Kp]: plane
     * p of row m at (3m + p) * Kp */
    const int8_t *planes;
    const float *bias;      /* [N] or NULL */
    float *Y;
    size_t ldy;
    size_t col_begin, col_end;
    /* Set by a driver (on its own copy) when its passes read every panel byte once: the
     * panels then prefetch their blocks ahead of use (op_stream_block), non-temporally
     * (OP_STREAM_NTA) or, where a driver asks, into L2 (OP_STREAM_L2). */
    int stream;
} op_mm_args;

/* How far ahead of the block being computed a one-pass GEMV prefetches its weights, and
 * how: PREFETCHNTA, i.e. into L1 without allocating in L2 (and, on Intel's non-inclusive
 * L3, without keeping the lines there). A decode step streams hundreds of MB of weights
 * that it reads once; loaded plainly they evict everything the ops between the GEMVs
 * use (the interpreter's objects, the numpy and cffi code paths, the KV cache), which
 * then come back from DRAM one dependent miss at a time. Measured 2026-12-02 on a
 * 2-vCPU Intel Xeon (Sapphire Rapids, KVM; ~10 GB/s read on one core), medium fixture,
 * two threads, batch 1, prefetch on and off every two steps in one session (median step):
 * level 4 62.1 -> 56.9 ms at 2560 bytes ahead, 56.2 at 5120; level 0 60.6 -> 52.1; the
 * step's GEMVs alone, one thread, 75 -> 61 ms. 20 KiB ahead was twice as slow (lines
 * leave L1 before their use and are read again). np.add on 8 KiB took 2 us hot and 22-37
 * us after a 32-400 MB stream; a trivial attention call 40 us and ~270 us. */
#define OP_STREAM_AHEAD 2560u
extern int op_weight_streaming_on; /* op_set_weight_streaming (dispatch.c) */
/* Run task(ctx, ranges[2i], ranges[2i + 1]) for i < n as one batch of m (handoff.c):
 * the caller and m's helpers take the chunks; rcs[i] gets each chunk's status. 0, or
 * the first failing chunk's. */
int op_mailbox_run_task(op_mailbox *m, op_task_fn task, void *ctx, const int64_t *ranges, int64_t n, int *rcs);
extern int op_gemv_panels;         /* op_set_gemv_panels (dispatch.c) */
/* In a driver taking `in`: `a`, its own copy of the arguments with `stream` = `once` (its
 * passes for this M read every panel byte once; a byte read again must stay cached). */
#define OP_STREAM_ARGS(a, in, once)                                                   \
    op_mm_args a##_own_ = *(in);                                                      \
    a##_own_.stream = (once) && __atomic_load_n(&op_weight_streaming_on, __ATOMIC_RELAXED); \
    const op_mm_args *a = &a##_own_
/* After OP_STREAM_ARGS(a, ...): a driver whose passes do not stream prefetches into L2
 * instead where `cond` holds (OP_STREAM_L2 below). */
#define OP_STREAM_L2_WHERE(a, cond)                                                   \
    if (!a##_own_.stream && (cond)) a##_own_.stream = OP_STREAM_L2
enum { OP_STREAM_NONE = 0, OP_STREAM_NTA = 1, OP_STREAM_L2 = 2 };
/* OP_STREAM_L2: with weight streaming off, the AVX-512 int8 driver at M = 3-16
 * (decode at batch 3 and up, short prefills) prefetches each block into L2
 * (PREFETCHT1) the same distance ahead. Its passes do three to four times a one-row
 * pass's work per byte in one stream, and the hardware prefetchers alone left them
 * waiting on memory. NOTE: measured 2026-12-03 on a 2-core KVM Xeon with AMX (where
 * streaming is off: core/ops/weight_streaming.py), level 4, one thread, 60 rotating
 * copies, medians, 2048 x 5632 / 5632 x 2048: M = 3 0.842 / 0.840 -> 0.696 / 0.662 ms,
 * M = 4 0.963 / 0.955 -> 0.716 / 0.721, M = 8 1.435 / 1.425 -> 1.117 / 1.104, M = 16
 * 2.13-2.16 / 2.05-2.09 -> 1.83-1.93 / 1.85-1.91; M = 64 within noise (5.30-5.45 ms
 * hot against 5.28-5.67), so from 17 rows none. At M = 1 and 2 it measured 0.529 ->
 * 0.513 and 0.545 -> 0.579 ms (noise or worse): they keep none. */
static inline void op_stream_block(const op_mm_args *a, const uint8_t *blk, size_t bytes) {
    if (!a->stream) return;
    const uint8_t *q = blk + OP_STREAM_AHEAD;
    if (a->stream == OP_STREAM_L2) {
        for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(q + o, 0, 2);  /* read, into L2 */
        return;
    }
    for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(q + o, 0, 0);  /* 0, 0: read, no locality */
}

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
    void (*mm_bfp)(const op_mm_args *);
    void (*mm_i8)(const op_mm_args *);
    void (*gemm)(const op_gemm_args *);
    /* Level 0's A digits for one block (dispatch.c, bfp_row): for each of the block's
     * n values, m = round_even(a * inv) split into lo / mid / hi bytes at their group
     * positions in dst (zeroed by the caller); returns sum m. Must give exactly the
     * portable loop's bytes and sum (tested through the ISA-vs-scalar matmul tests). */
    int64_t (*bfp_digits)(const float *a, size_t n, double inv, int8_t *dst);
    /* The per-block scan of levels 0 and 4: max |a[i]| over the n values, NaN ignored
     * (0 if there is none), and *finite = 0 if any value is inf or NaN (left as it is
     * otherwise). A max is exact, so any order gives the portable loop's value. */
    float (*block_amax)(const float *a, size_t n, int *finite);
    /* Level 4's A bytes for one finite block: a8[i] = round_even(a[i] * inv) clamped
     * to [-128, 127] (the portable loop's float steps, then its truncating
     * conversion); returns their sum. Must give exactly the portable loop's bytes and
     * sum (tested through the ISA-vs-scalar matmul tests). */
    int32_t (*i8_round)(const float *a, size_t n, float inv, int8_t *a8);
} op_kernel_table;

/* One matmul validated and its A prepared once, for any number of column ranges run on
 * any threads (dispatch.c: op_mm_prepare, op_mm_prep_run, op_mm_prep_release). a.h
 * points into the struct: it must not move between prepare and release. */
typedef struct {
    op_packed_header h;
    op_mm_args a;
    const op_kernel_table *kt;
    void (*kernel)(const op_mm_args *);
    void *scratch;
} op_mm_prep;
int op_mm_prepare(op_mm_prep *p, int isa, const float *A, size_t M, size_t lda, const uint8_t *packed,
                  size_t packed_size, const float *bias, float *Y, size_t ldy, int accuracy_level);
int op_mm_prep_run(const op_mm_prep *p, size_t col_begin, size_t col_end);
void op_mm_prep_release(op_mm_prep *p);

/* The portable hooks (dispatch.c): the scalar table's, and the tails of the ISAs'. */
int64_t op_bfp_digits_portable(const float *a, size_t n, double inv, int8_t *dst);
float op_block_amax_portable(const float *a, size_t n, int *finite);
int32_t op_i8_round_portable(const float *a, size_t n, float inv, int8_t *a8);

/* The calling thread's op_last_kernel() (dispatch.c). Entry points reset it with
 * op_ran(OP_KERNEL_NONE); the code that computes writes its own id with op_ran. */
extern _Thread_local int op_last_kernel_code;
static inline void op_ran(int code) { op_last_kernel_code = code; }

/* Per-ISA tables. */
extern const op_kernel_table op_kernels_scalar;
#if OP_SIMD
extern const op_kernel_table op_kernels_avx2;
extern const op_kernel_table op_kernels_avx512;
extern const op_kernel_table op_kernels_avx512_vnni;
#endif

/* ---- AMX tiles (kernels_amx.c) --------------------------------------------------- */
/* Rows from which an INT4 matmul runs on AMX tiles (op_set_amx), by mode: below them
 * the AVX-512 VNNI panels are as fast or faster (docs/kernels.md, "AMX tiles"). */
#define OP_AMX_MIN_ROWS_BFP 4
#define OP_AMX_MIN_ROWS_INT8 16
extern int op_amx_on;
/* Whether this build and CPU run an M-row INT4 matmul (int8 mode or bfp) on tiles now. */
int op_amx_for(size_t M, int int8);
void op_mm_i8_amx(const op_mm_args *a);
void op_mm_bfp_amx(const op_mm_args *a);

/* ---- INT4 matmul geometry (shared by packing and every kernel) ---------------- */
static inline int op_zp_kind(const op_packed_header *h) { return (int)(h->flags & OP_FLAG_ZP_MASK); }
static inline size_t op_mm_zero_bytes(int zp_kind) {
    return zp_kind == OP_ZP_U4 ? OP_PANEL_N : zp_kind == OP_ZP_FLOAT ? OP_PANEL_N * 4u : 0u;
}
static inline size_t op_mm_block_bytes(uint32_t block_size, int zp_kind) {
    return (size_t)block_size * 32u + OP_PANEL_N * 4u + op_mm_zero_bytes(zp_kind);
}
/* The block record of block b in panel p. */
static inline const uint8_t *op_mm_block(const op_packed_header *h, const uint8_t *panels, size_t p,
                                         uint32_t b) {
    return panels + p * h->panel_stride + (size_t)b * op_mm_block_bytes(h->block_size, op_zp_kind(h));
}
/* Group g of tile i (0..3) inside a block record. */
static inline const uint8_t *op_mm_group(const uint8_t *blk, uint32_t g, int i) {
    return blk + (size_t)g * (OP_GROUP_BYTES * OP_PANEL_TILES) + (size_t)i * OP_GROUP_BYTES;
}
static inline const float *op_mm_scales(const op_packed_header *h, const uint8_t *blk, int i) {
    return (const float *)(blk + (size_t)h->block_size * 32u) + i * OP_TILE_N;
}
static inline const void *op_mm_zeros(const op_packed_header *h, const uint8_t *blk, int i) {
    const uint8_t *z = blk + (size_t)h->block_size * 32u + OP_PANEL_N * 4u;
    return op_zp_kind(h) == OP_ZP_U4 ? (const void *)(z + i * OP_TILE_N)
                                     : (const void *)((const float *)z + i * OP_TILE_N);
}

/* Tiles of a column range: [op_tile_begin, op_tile_end) covers [col_begin, col_end). */
static inline size_t op_tile_begin(const op_mm_args *a) { return a->col_begin / OP_TILE_N; }
static inline size_t op_tile_end(const op_mm_args *a) { return (a->col_end + OP_TILE_N - 1) / OP_TILE_N; }

/* The panel-walk of every SIMD driver: for each panel p the column range overlaps, front
 * to back, the tiles [tb, te) of it inside the range (0 <= tb < te <= 4). The body is
 * one statement or block; `continue` goes on with the next panel. */
#define OP_FOR_PANELS(a, p, tb, te)                                                    \
    for (size_t op_t0_ = op_tile_begin(a), op_t1_ = op_tile_end(a),                    \
                p = op_t0_ / OP_PANEL_TILES;                                           \
         p * OP_PANEL_TILES < op_t1_; p++)                                             \
        for (int tb = (int)(op_t0_ > p * OP_PANEL_TILES ? op_t0_ - p * OP_PANEL_TILES : 0), \
                 te = (int)(op_t1_ - p * OP_PANEL_TILES < OP_PANEL_TILES                \
                                ? op_t1_ - p * OP_PANEL_TILES : OP_PANEL_TILES),        \
                 op_once_ = 1;                                                         \
             op_once_; op_once_ = 0)

/* PANEL(a, p, tb, m, n, R) with the tile count n (1-4) a compile-time constant, so the
 * panel function's loops over tiles unroll. */
#define OP_PANEL_WITH_TILES(PANEL, a, p, tb, n, m, R)                                 \
    switch (n) {                                                                      \
    case 4: PANEL(a, p, tb, m, 4, R); break;                                          \
    case 3: PANEL(a, p, tb, m, 3, R); break;                                          \
    case 2: PANEL(a, p, tb, m, 2, R); break;                                          \
    default: PANEL(a, p, tb, m, 1, R); break;                                         \
    }

/* Zero points of one tile's block as 16 floats (scalar helper). */
static inline void op_mm_block_zeros(const op_packed_header *h, const uint8_t *blk, int i,
                                     float z[OP_TILE_N]) {
    int kind = op_zp_kind(h);
    for (int c = 0; c < OP_TILE_N; c++) {
        if (kind == OP_ZP_U4)
            z[c] = (float)((const uint8_t *)op_mm_zeros(h, blk, i))[c];
        else if (kind == OP_ZP_FLOAT)
            z[c] = ((const float *)op_mm_zeros(h, blk, i))[c];
        else
            z[c] = 8.0f;
    }
}

#endif
