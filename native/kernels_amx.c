/* AMX tile kernels of the INT4 matmul for several rows of A (a prompt's prefill, a
 * batch's decode step), accuracy levels 0-4.
 *
 * The packed layout (op_internal.h) already holds what a tile dot product wants: a
 * 64-byte group masked with 0x0F is k0..k0+3 of its 16 columns, four bytes a column,
 * and shifted down by 4 it is k0+4..k0+7: two rows of a B tile in the VNNI order
 * (row r: k 4r..4r+3 of every column). So a block's B tile is its groups unpacked
 * (64 bytes a row), and TDPBSUD (A signed bytes x B unsigned codes, 32-bit sums)
 * gives a block's integer dot products for up to 16 rows and one 16-column tile at
 * once: the sums the AVX-512 panels get from 8 (int8) or 24 (bfp) VPDPBUSD a row.
 * They are exact, so the epilogue (avx512_epilogue.h, the panels' own) gives the
 * same bits:
 *   int8 (level 4)   one plane, the rows' int8 bytes as they are ([M][Kp]);
 *   bfp (levels 0-3) the three digit planes of the 24-bit mantissas, each its own
 *                    A tile and C tile, from the planes regrouped apart by
 *                    op_mm_prepare (a->planes), then d = hi * 65536 + (lo + 256 mid).
 * A block of more than 64 codes is several tile products into the same C.
 *
 * Tiles: int8  A 0, B 1 and 2 (two column tiles), C 4-5 and 6-7 (blocks alternating);
 *        bfp   A 0-2 (planes), B 3 and 7 (alternating), C 4-6 (planes).
 *
 * NOTE: the tile configuration and data are the calling thread's state: each call
 * loads its configuration and releases it at the end (TILERELEASE puts the thread's
 * tile state back to its initial, unsaved form), so every thread of a split matmul
 * configures its own. Linux grants the tile data state per process
 * (op_cpu_has_amx asks, once). */
#include "op_internal.h"

int op_amx_on = 1;

#if OP_SIMD && __GNUC__ >= 11 /* the AMX intrinsics: GCC 11 */
#define OP_AMX_BUILT 1
#else
#define OP_AMX_BUILT 0
#endif

int op_amx_for(size_t M, int int8) {
    return OP_AMX_BUILT && M >= (int8 ? OP_AMX_MIN_ROWS_INT8 : OP_AMX_MIN_ROWS_BFP) &&
           __atomic_load_n(&op_amx_on, __ATOMIC_RELAXED) && op_cpu_has_amx();
}

#if OP_AMX_BUILT
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")
#include <immintrin.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))
#include "avx512_epilogue.h"

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* R rows of A (1-16) against blocks taken kc codes (16-64) at a time. */
static void configure(int bfp, int R, uint32_t kc) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const int a_tiles = bfp ? 3 : 1;
    for (int t = 0; t < a_tiles; t++) c.rows[t] = (uint8_t)R, c.colsb[t] = (uint16_t)kc;
    const int b_tiles[2] = {bfp ? 3 : 1, bfp ? 7 : 2};
    for (int j = 0; j < 2; j++) c.rows[b_tiles[j]] = (uint8_t)(kc / 4), c.colsb[b_tiles[j]] = 64;
    for (int t = 4; t < (bfp ? 7 : 8); t++) c.rows[t] = (uint8_t)R, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* Rows a bfp tile takes at once: the rows in equal chunks of at most 16 (24 rows as
 * 12 + 12, not 16 + 8). */
static size_t chunk_rows(size_t M) {
    const size_t chunks = (M + 15) / 16;
    return (M + chunks - 1) / chunks;
}

/* The rows of the chunk at row m (at most `rows`), the tiles configured for them
 * when the last chunk had another count. */
static size_t rows_at(size_t M, size_t m, size_t rows, size_t *configured, int bfp, uint32_t kc) {
    const size_t R = M - m < rows ? M - m : rows;
    if (R != *configured) {
        configure(bfp, (int)R, kc);
        *configured = R;
    }
    return R;
}

/* The B tile of groups g0 .. g0 + n - 1 of tile i of a block: two rows a group. */
AI void unpack_b(uint8_t *dst, const uint8_t *blk, int i, uint32_t g0, uint32_t n) {
    const __m512i m0f = _mm512_set1_epi8(0x0F);
    for (uint32_t g = 0; g < n; g++) {
        const __m512i x = _mm512_loadu_si512((const void *)op_mm_group(blk, g0 + g, i));
        _mm512_store_si512((void *)(dst + 128u * g), _mm512_and_si512(x, m0f));
        _mm512_store_si512((void *)(dst + 128u * g + 64u), _mm512_and_si512(_mm512_srli_epi16(x, 4), m0f));
    }
}

/* A block OP_STREAM_AHEAD bytes on, into L2 (PREFETCHT1): in a decode step at batch 8
 * or 16 the weights come from memory, and the hardware prefetchers alone left the
 * tiles waiting for them (as the AVX-512 int8 panels, OP_STREAM_L2). */
AI void prefetch_l2(const uint8_t *blk, size_t bytes) {
    const uint8_t *q = blk + OP_STREAM_AHEAD;
    for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(q + o, 0, 2);
}

/* The panel's running outputs, [row][panel column], folded block after block. */
typedef struct {
    _Alignas(64) float v[16][OP_PANEL_N];
} panel_out;

AI void out_zero(panel_out *o, int R, int tb, int te) {
    for (int r = 0; r < R; r++)
        for (int t = tb; t < te; t++) _mm512_store_ps(&o->v[r][OP_TILE_N * t], _mm512_setzero_ps());
}

/* Block b's dot products of tile t (rows m..m + R - 1) folded into the outputs. */
AI void out_fold(const op_mm_args *a, panel_out *o, const uint8_t *blk, int t, size_t m, int R,
                 uint32_t b, const __m512 *d) {
    const op_packed_header *h = a->h;
    const __m512 s = _mm512_loadu_ps(op_mm_scales(h, blk, t));
    const __m512 z = block_zeros(h, blk, t);
    for (int r = 0; r < R; r++) {
        const size_t ab = (m + (size_t)r) * h->n_blocks + b;
        float *y = &o->v[r][OP_TILE_N * t];
        _mm512_store_ps(y, fold_int_block(_mm512_load_ps(y), d[r], s, z, a->asum[ab], a->ascale[ab]));
    }
}

AI void out_store(const op_mm_args *a, const panel_out *o, size_t p, int tb, int te, size_t m, int R) {
    for (int t = tb; t < te; t++)
        for (int r = 0; r < R; r++)
            store_out(a, m + (size_t)r, p * OP_PANEL_TILES + (size_t)t, _mm512_load_ps(&o->v[r][OP_TILE_N * t]));
}

/* The folds of block b's tiles tp, tp + 1 (nt of them) from their stored sums. */
AI void i8_fold(const op_mm_args *a, panel_out *out, const uint8_t *blk, int tp, int nt, size_t m,
                int R, uint32_t b, int32_t ct[2][16 * 16]) {
    for (int j = 0; j < nt; j++) {
        __m512 d[16];
        for (int r = 0; r < R; r++) d[r] = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(ct[j] + 16 * r)));
        out_fold(a, out, blk, tp + j, m, R, b, d);
    }
}

/* Block b's products for column tiles tp and (nt = 2) tp + 1 into C tiles C0, C1. */
#define I8_PRODUCTS(C0, C1)                                                            \
    do {                                                                               \
        _tile_zero(C0);                                                                \
        if (nt > 1) _tile_zero(C1);                                                    \
        for (uint32_t c = 0; c < chunks; c++) {                                        \
            _tile_loadd(0, a->a8 + m * a->Kp + (size_t)b * bs + (size_t)c * kc, (long)a->Kp); \
            unpack_b(bt[0], blk, tp, c * gpc, gpc);                                    \
            _tile_loadd(1, bt[0], 64);                                                 \
            _tile_dpbsud(C0, 0, 1);                                                    \
            if (nt > 1) {                                                              \
                unpack_b(bt[1], blk, tp + 1, c * gpc, gpc);                            \
                _tile_loadd(2, bt[1], 64);                                             \
                _tile_dpbsud(C1, 0, 2);                                                \
            }                                                                          \
        }                                                                              \
    } while (0)
#define I8_STORE(C0, C1, ct)                                                           \
    do {                                                                               \
        _tile_stored(C0, (ct)[0], 64);                                                 \
        if (nt > 1) _tile_stored(C1, (ct)[1], 64);                                     \
    } while (0)

/* Column tiles two at a time, each pair's blocks in turn with two sets of C tiles
 * (4-5, 6-7) alternating, so a block's products start before the previous block's
 * sums are stored, and its folds run while the next block's products do. */
void op_mm_i8_amx(const op_mm_args *in) {
    op_ran(OP_KERNEL_AMX);
    /* whole chunks of 16 rows only: a tile of fewer rows measured no faster than the
     * panels at this level (12 rows 1.07x, 10 0.88x, 8 1.00x; 16 1.17x) */
    const size_t tail = in->M % 16;
    op_mm_args whole = *in;
    whole.M -= tail;
    const op_mm_args *a = &whole;
    const op_packed_header *h = a->h;
    const uint32_t bs = h->block_size, nb = h->n_blocks;
    const uint32_t kc = bs < 64 ? bs : 64, chunks = bs / kc, gpc = kc / OP_GROUP_K;
    const size_t bb = op_mm_block_bytes(bs, op_zp_kind(h));
    _Alignas(64) uint8_t bt[2][16 * 64];
    _Alignas(64) int32_t ct[2][2][16 * 16]; /* a block's sums, two blocks apart */
    panel_out out;
    size_t configured_rows = 0;
    const size_t rows = 16;
    OP_FOR_PANELS(a, p, tb, te) {
        /* panels outer, chunks of 16 rows inner: a panel's blocks stay in L2 while
         * every row goes through them */
        for (size_t m = 0, R; m < a->M; m += R) {
            R = rows_at(a->M, m, rows, &configured_rows, 0, kc);
            out_zero(&out, (int)R, tb, te);
            for (int tp = tb; tp < te; tp += 2) {
                const int nt = te - tp < 2 ? te - tp : 2;
                for (uint32_t b = 0; b < nb; b++) {
                    const uint8_t *blk = op_mm_block(h, a->panels, p, b);
                    if (tp == tb) prefetch_l2(blk, bb); /* the later pairs find it in L2 */
                    if (b & 1) I8_PRODUCTS(6, 7); else I8_PRODUCTS(4, 5);
                    if (b > 0) {
                        i8_fold(a, &out, op_mm_block(h, a->panels, p, b - 1), tp, nt, m, (int)R, b - 1, ct[(b - 1) & 1]);
                    }
                    if (b & 1) I8_STORE(6, 7, ct[1]); else I8_STORE(4, 5, ct[0]);
                }
                i8_fold(a, &out, op_mm_block(h, a->panels, p, nb - 1), tp, nt, m, (int)R, nb - 1, ct[(nb - 1) & 1]);
            }
            out_store(a, &out, p, tb, te, m, (int)R);
        }
    }
    _tile_release();
    if (tail) { /* the last M % 16 rows: the AVX-512 VNNI panels (the same bits) */
        op_mm_args t = *in;
        const size_t m = in->M - tail, nb_ = in->h->n_blocks;
        t.M = tail, t.a8 += m * in->Kp, t.asum += m * nb_, t.ascale += m * nb_, t.Y += m * in->ldy;
        op_kernels_avx512_vnni.mm_i8(&t);
        op_ran(OP_KERNEL_AMX); /* what computed most rows */
    }
}

/* One column tile j of a bfp block b: the three planes' products into C 4-6, with B
 * in tile TB. The A planes are loaded for every chunk, except that a block of one
 * chunk loads them once, at its first tile. */
#define BFP_PRODUCTS(TB, j)                                                            \
    do {                                                                               \
        _tile_zero(4);                                                                 \
        _tile_zero(5);                                                                 \
        _tile_zero(6);                                                                 \
        for (uint32_t c = 0; c < chunks; c++) {                                        \
            if ((j) == 0 || chunks > 1) {                                              \
                const int8_t *q = a->planes + m * 3 * a->Kp + (size_t)b * bs + (size_t)c * kc; \
                _tile_loadd(0, q, (long)(3 * a->Kp));                                  \
                _tile_loadd(1, q + a->Kp, (long)(3 * a->Kp));                          \
                _tile_loadd(2, q + 2 * a->Kp, (long)(3 * a->Kp));                      \
            }                                                                          \
            unpack_b(bt[(j) & 1], blk, tb + (j), c * gpc, gpc);                        \
            _tile_loadd(TB, bt[(j) & 1], 64);                                          \
            _tile_dpbsud(4, 0, TB);                                                    \
            _tile_dpbsud(5, 1, TB);                                                    \
            _tile_dpbsud(6, 2, TB);                                                    \
        }                                                                              \
    } while (0)

/* A tile's three planes' sums, stored, with where they fold. */
typedef struct {
    _Alignas(64) int32_t lo[16 * 16], mid[16 * 16], hi[16 * 16];
    const uint8_t *blk;
    uint32_t b;
    int tile;
} bfp_sums;

/* d = hi * 65536 + (lo + 256 mid) a row, folded (the panels' bfp epilogue). */
AI void bfp_fold(const op_mm_args *a, panel_out *out, const bfp_sums *q, size_t m, int R) {
    const __m512 k65536 = _mm512_set1_ps(65536.0f);
    __m512 d[16];
    for (int r = 0; r < R; r++) {
        const __m512i t = _mm512_add_epi32(_mm512_load_si512((const void *)(q->lo + 16 * r)),
                                           _mm512_slli_epi32(_mm512_load_si512((const void *)(q->mid + 16 * r)), 8));
        d[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)(q->hi + 16 * r))), k65536,
                               _mm512_cvtepi32_ps(t));
    }
    out_fold(a, out, q->blk, q->tile, m, R, q->b, d);
}

void op_mm_bfp_amx(const op_mm_args *a) {
    op_ran(OP_KERNEL_AMX);
    const op_packed_header *h = a->h;
    const uint32_t bs = h->block_size, nb = h->n_blocks;
    const uint32_t kc = bs < 64 ? bs : 64, chunks = bs / kc, gpc = kc / OP_GROUP_K;
    const size_t bb = op_mm_block_bytes(bs, op_zp_kind(h));
    _Alignas(64) uint8_t bt[2][16 * 64];
    bfp_sums sums[2]; /* one tile's, the next one's: the fold of one runs while the next's products do */
    panel_out out;
    size_t configured_rows = 0;
    const size_t rows = chunk_rows(a->M);
    OP_FOR_PANELS(a, p, tb, te) {
        const int nt = te - tb;
        for (size_t m = 0, R; m < a->M; m += R) {
            R = rows_at(a->M, m, rows, &configured_rows, 1, kc);
            out_zero(&out, (int)R, tb, te);
            unsigned n = 0; /* (block, tile) steps so far */
            for (uint32_t b = 0; b < nb; b++) {
                const uint8_t *blk = op_mm_block(h, a->panels, p, b);
                prefetch_l2(blk, bb);
                for (int j = 0; j < nt; j++, n++) {
                    if (j & 1) BFP_PRODUCTS(7, j); else BFP_PRODUCTS(3, j);
                    if (n > 0) bfp_fold(a, &out, &sums[(n - 1) & 1], m, (int)R);
                    bfp_sums *q = &sums[n & 1];
                    _tile_stored(4, q->lo, 64);
                    _tile_stored(5, q->mid, 64);
                    _tile_stored(6, q->hi, 64);
                    q->blk = blk, q->b = b, q->tile = tb + j;
                }
            }
            bfp_fold(a, &out, &sums[(n - 1) & 1], m, (int)R);
            out_store(a, &out, p, tb, te, m, (int)R);
        }
    }
    _tile_release();
}

#else
/* never called: op_amx_for is 0 in a build without them */
void op_mm_i8_amx(const op_mm_args *a) { (void)a; }
void op_mm_bfp_amx(const op_mm_args *a) { (void)a; }
#endif
