/* AVX2 + FMA kernels.
 *
 * Lane layout: a 16-column tile is two YMM registers, half 0 = columns 0..7 (bytes
 * 0..31 of each 64-byte group), half 1 = columns 8..15 (bytes 32..63); lane c of a
 * half is the dword holding column c's 8 codes (see op_internal.h):
 *   fp32 path: code(k0 + j) = (dword >> shift(j)) & 0xF, converted with cvtdq2ps;
 *              shift = 8j for j < 4, 8(j - 4) + 4 for j >= 4. The byte shifts are
 *              done by loading from group + j instead (loads are cheaper than
 *              shifts here; measured ~10% faster).
 *   int8 path: bytes & 0x0F / (bytes >> 4) & 0x0F are u8x4 quads [k0..k0+3] /
 *              [k0+4..k0+7] per column; maddubs against broadcast s8 A gives s16
 *              pair sums (at most 2 * 15 * 128: no saturation), madd with ones
 *              widens them to the s32 quad sums.
 * Per lane, the operation sequence equals the scalar reference's (one fused
 * multiply-add per k, ascending), so results are bit-identical to it.
 * NOTE: per-file `#pragma GCC target`, never a global -m flag. */
#include "op_internal.h"

#if OP_SIMD
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#define AI static inline __attribute__((always_inline))
/* What every driver below records as the code that ran (op_last_kernel). */
#define KERNEL_CODE OP_KERNEL_AVX2

/* Lanes of half `hf` of tile t inside [cb, ce), as a vector mask for maskstore. */
AI __m256i half_mask(size_t cb, size_t ce, size_t t, int hf) {
    const long c0 = (long)(t * OP_TILE_N) + 8 * hf;
    const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32((int)c0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i lo = _mm256_set1_epi32((int)cb - 1), hi = _mm256_set1_epi32((int)ce);
    return _mm256_and_si256(_mm256_cmpgt_epi32(lane, lo), _mm256_cmpgt_epi32(hi, lane));
}

AI void block_zeros(const op_packed_header *h, const uint8_t *blk, int i, __m256 z[2]) {
    switch (op_zp_kind(h)) {
    case OP_ZP_U4: {
        const uint8_t *zp = (const uint8_t *)op_mm_zeros(h, blk, i);
        z[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)zp)));
        z[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(zp + 8))));
        break;
    }
    case OP_ZP_FLOAT: {
        const float *zf = (const float *)op_mm_zeros(h, blk, i);
        z[0] = _mm256_loadu_ps(zf);
        z[1] = _mm256_loadu_ps(zf + 8);
        break;
    }
    default:
        z[0] = z[1] = _mm256_set1_ps(8.0f);
    }
}

AI void store_out(const op_mm_args *a, size_t m, size_t t, const __m256 v[2]) {
    for (int hf = 0; hf < 2; hf++) {
        const size_t c0 = t * OP_TILE_N + 8 * (size_t)hf;
        __m256 o = v[hf];
        if (c0 >= a->col_begin && c0 + 8 <= a->col_end) {
            if (a->bias) o = _mm256_add_ps(o, _mm256_loadu_ps(a->bias + c0));
            _mm256_storeu_ps(a->Y + m * a->ldy + c0, o);
        } else {
            const __m256i mk = half_mask(a->col_begin, a->col_end, t, hf);
            if (_mm256_testz_si256(mk, mk)) continue;
            if (a->bias) o = _mm256_add_ps(o, _mm256_maskload_ps(a->bias + c0, mk));
            _mm256_maskstore_ps(a->Y + m * a->ldy + c0, mk, o);
        }
    }
}

/* ---- fp32 compute -----------------------------------------------------------------
 * Code k0+j (j < 4) is the low nibble of byte j of each lane: a load from group + j
 * brings it to the bottom of the lane, saving a shift (loads past the group's end
 * stay inside the buffer: a scale record always follows the data). */

/* Per-panel accumulator blocks: [tile][half][row], 16 columns as two YMM halves. */
AI void zero_tiles(__m256 out[4][2][2], const int TP, const int R) {
    for (int i = 0; i < TP; i++)
        for (int hf = 0; hf < 2; hf++)
            for (int r = 0; r < R; r++) out[i][hf][r] = _mm256_setzero_ps();
}

AI void store_tiles(const op_mm_args *a, size_t p, int i0, size_t m, const int TP, const int R,
                    __m256 out[4][2][2]) {
    for (int i = 0; i < TP; i++)
        for (int r = 0; r < R; r++) {
            __m256 v[2] = {out[i][0][r], out[i][1][r]};
            store_out(a, m + r, p * OP_PANEL_TILES + (size_t)(i0 + i), v);
        }
}

/* One block's integer dot product d folded into a row's output (int8 and bfp modes):
 * out + (ascale * scale) * (d - zero * asum). */
AI __m256 fold_int_block(__m256 out, __m256 d, __m256 s, __m256 z, float asum, float ascale) {
    d = _mm256_fnmadd_ps(z, _mm256_set1_ps(asum), d);
    return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(ascale), s), d, out);
}

/* One block's dot products d[i][hf][r] (tiles from i0, rows from m) folded into out
 * with the block's scales and zero points: the epilogue of every panel. ascale: A's
 * per-block scales (int8 and bfp), or NULL for fp32, where the fold is
 * out + scale * (d - zero * asum); always inlined with a constant NULL, so the fp32
 * panel has no multiply by 1 and no branch. */
AI void fold_block_tiles(const op_mm_args *a, const uint8_t *blk, int i0, size_t m, uint32_t b,
                         const int TP, const int R, const float *ascale, __m256 d[4][2][2],
                         __m256 out[4][2][2]) {
    const op_packed_header *h = a->h;
    for (int i = 0; i < TP; i++) {
        const float *sc = op_mm_scales(h, blk, i0 + i);
        __m256 z[2];
        block_zeros(h, blk, i0 + i, z);
        for (int hf = 0; hf < 2; hf++) {
            const __m256 s = _mm256_loadu_ps(sc + 8 * hf);
            for (int r = 0; r < R; r++) {
                const size_t ab = (m + r) * h->n_blocks + b;
                if (ascale) {
                    out[i][hf][r] = fold_int_block(out[i][hf][r], d[i][hf][r], s, z[hf], a->asum[ab], ascale[ab]);
                } else {
                    const __m256 dz = _mm256_fnmadd_ps(z[hf], _mm256_set1_ps(a->asum[ab]), d[i][hf][r]);
                    out[i][hf][r] = _mm256_fmadd_ps(s, dz, out[i][hf][r]);
                }
            }
        }
    }
}

AI void f32_panel(const op_mm_args *a, size_t p, int i0, size_t m, const int TP, const int R) {
    const op_packed_header *h = a->h;
    const uint32_t bs = h->block_size, nb = h->n_blocks;
    const __m256i m0f = _mm256_set1_epi32(0x0F);
    const float *arow[2];
    for (int r = 0; r < R; r++) arow[r] = a->A + (m + r) * a->lda;
    __m256 out[4][2][2], acc[4][2][2];
    zero_tiles(out, TP, R);
    const size_t bb = op_mm_block_bytes(bs, op_zp_kind(h));
    for (uint32_t b = 0; b < nb; b++) {
        const uint8_t *blk = op_mm_block(h, a->panels, p, b);
        op_stream_block(a, blk, bb);
        zero_tiles(acc, TP, R);
        for (uint32_t g = 0; g < bs / OP_GROUP_K; g++) {
            const size_t kb = (size_t)b * bs + (size_t)g * OP_GROUP_K;
            for (int j = 0; j < 8; j++) {
                __m256 av[2];
                for (int r = 0; r < R; r++) av[r] = _mm256_set1_ps(arow[r][kb + j]);
                for (int i = 0; i < TP; i++)
                    for (int hf = 0; hf < 2; hf++) {
                        __m256i x = _mm256_loadu_si256(
                            (const __m256i *)(op_mm_group(blk, g, i0 + i) + 32 * hf + (j & 3)));
                        if (j >= 4) x = _mm256_srli_epi32(x, 4);
                        const __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(x, m0f));
                        for (int r = 0; r < R; r++) acc[i][hf][r] = _mm256_fmadd_ps(av[r], q, acc[i][hf][r]);
                    }
            }
        }
        fold_block_tiles(a, blk, i0, m, b, TP, R, NULL, acc, out);
    }
    store_tiles(a, p, i0, m, TP, R, out);
}

/* ---- int8 compute ------------------------------------------------------------------ */

AI void i8_panel(const op_mm_args *a, size_t p, int i0, size_t m, const int TP, const int R) {
    const op_packed_header *h = a->h;
    const uint32_t bs = h->block_size, nb = h->n_blocks;
    const __m256i m0f = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const int8_t *arow[2];
    for (int r = 0; r < R; r++) arow[r] = a->a8 + (m + r) * a->Kp;
    __m256 out[4][2][2];
    __m256i isum[4][2][2];
    zero_tiles(out, TP, R);
    const size_t bb = op_mm_block_bytes(bs, op_zp_kind(h));
    for (uint32_t b = 0; b < nb; b++) {
        const uint8_t *blk = op_mm_block(h, a->panels, p, b);
        op_stream_block(a, blk, bb);
        for (int i = 0; i < TP; i++)
            for (int hf = 0; hf < 2; hf++)
                for (int r = 0; r < R; r++) isum[i][hf][r] = _mm256_setzero_si256();
        for (uint32_t g = 0; g < bs / OP_GROUP_K; g++) {
            const size_t kb = (size_t)b * bs + (size_t)g * OP_GROUP_K;
            __m256i alo[2], ahi[2];
            for (int r = 0; r < R; r++) {
                int32_t w0, w1;
                __builtin_memcpy(&w0, arow[r] + kb, 4);
                __builtin_memcpy(&w1, arow[r] + kb + 4, 4);
                alo[r] = _mm256_set1_epi32(w0);
                ahi[r] = _mm256_set1_epi32(w1);
            }
            for (int i = 0; i < TP; i++)
                for (int hf = 0; hf < 2; hf++) {
                    __m256i x = _mm256_loadu_si256((const __m256i *)(op_mm_group(blk, g, i0 + i) + 32 * hf));
                    __m256i lo = _mm256_and_si256(x, m0f);
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m0f);
                    for (int r = 0; r < R; r++) {
                        /* two maddubs (each |.| <= 3840) summed in s16 stay below 2^15 */
                        __m256i pr = _mm256_add_epi16(_mm256_maddubs_epi16(lo, alo[r]),
                                                      _mm256_maddubs_epi16(hi, ahi[r]));
                        isum[i][hf][r] = _mm256_add_epi32(isum[i][hf][r], _mm256_madd_epi16(pr, ones));
                    }
                }
        }
        __m256 d[4][2][2];
        for (int i = 0; i < TP; i++)
            for (int hf = 0; hf < 2; hf++)
                for (int r = 0; r < R; r++) d[i][hf][r] = _mm256_cvtepi32_ps(isum[i][hf][r]);
        fold_block_tiles(a, blk, i0, m, b, TP, R, a->ascale, d, out);
    }
    store_tiles(a, p, i0, m, TP, R, out);
}

/* ---- bfp compute (accuracy level 0) ----------------------------------------------
 * Three byte planes of A's 24-bit block mantissas against the same unpacked codes;
 * per plane, two maddubs summed in s16 (|.| <= 7680) and one madd to s32. */

AI __m256i plane_dot(__m256i acc, __m256i lo, __m256i hi, const int8_t *w, __m256i ones) {
    int32_t v0, v1;
    __builtin_memcpy(&v0, w, 4);
    __builtin_memcpy(&v1, w + 4, 4);
    __m256i pr = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(v0)),
                                  _mm256_maddubs_epi16(hi, _mm256_set1_epi32(v1)));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pr, ones));
}

AI void bfp_panel(const op_mm_args *a, size_t p, int i0, size_t m, const int TP, const int R) {
    const op_packed_header *h = a->h;
    const uint32_t bs = h->block_size, nb = h->n_blocks;
    const __m256i m0f = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const int8_t *drow[2];
    for (int r = 0; r < R; r++) drow[r] = a->a8 + (m + r) * a->Kp * 3;
    __m256 out[4][2][2];
    __m256i il[4][2][2], im[4][2][2], ih[4][2][2];
    zero_tiles(out, TP, R);
    const size_t bb = op_mm_block_bytes(bs, op_zp_kind(h));
    for (uint32_t b = 0; b < nb; b++) {
        const uint8_t *blk = op_mm_block(h, a->panels, p, b);
        op_stream_block(a, blk, bb);
        for (int i = 0; i < TP; i++)
            for (int hf = 0; hf < 2; hf++)
                for (int r = 0; r < R; r++) il[i][hf][r] = im[i][hf][r] = ih[i][hf][r] = _mm256_setzero_si256();
        for (uint32_t g = 0; g < bs / OP_GROUP_K; g++) {
            for (int i = 0; i < TP; i++)
                for (int hf = 0; hf < 2; hf++) {
                    __m256i x = _mm256_loadu_si256((const __m256i *)(op_mm_group(blk, g, i0 + i) + 32 * hf));
                    __m256i lo = _mm256_and_si256(x, m0f);
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m0f);
                    for (int r = 0; r < R; r++) {
                        const int8_t *w = drow[r] + ((size_t)b * bs / OP_GROUP_K + g) * 24;
                        il[i][hf][r] = plane_dot(il[i][hf][r], lo, hi, w, ones);
                        im[i][hf][r] = plane_dot(im[i][hf][r], lo, hi, w + 8, ones);
                        ih[i][hf][r] = plane_dot(ih[i][hf][r], lo, hi, w + 16, ones);
                    }
                }
        }
        __m256 d[4][2][2];
        for (int i = 0; i < TP; i++)
            for (int hf = 0; hf < 2; hf++)
                for (int r = 0; r < R; r++) {
                    __m256i t = _mm256_add_epi32(il[i][hf][r], _mm256_slli_epi32(im[i][hf][r], 8));
                    d[i][hf][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ih[i][hf][r]), _mm256_set1_ps(65536.0f),
                                                  _mm256_cvtepi32_ps(t));
                }
        fold_block_tiles(a, blk, i0, m, b, TP, R, a->ascale, d, out);
    }
    store_tiles(a, p, i0, m, TP, R, out);
}

/* Panels front to back. Decode (M = 1): all of a panel's tiles in one pass (one
 * sequential stream; measured: two passes of two tiles stream at half the
 * bandwidth, although they spill fewer registers). Otherwise one tile by two rows
 * at a time (16 YMM registers are the limit). */
#define DEFINE_DRIVER(NAME, PANEL)                                                     \
    static void NAME(const op_mm_args *in) {                                           \
        op_ran(KERNEL_CODE);                                                           \
        OP_STREAM_ARGS(a, in, in->M < 2); /* the one-pass decode branch */             \
        OP_FOR_PANELS(a, p, tb, te) {                                                  \
            if (a->M < 2) {                                                            \
                OP_PANEL_WITH_TILES(PANEL, a, p, tb, te - tb, 0, 1)                    \
                continue;                                                              \
            }                                                                          \
            for (int i = tb; i < te; i++) {                                            \
                size_t m = 0;                                                          \
                for (; m + 2 <= a->M; m += 2) PANEL(a, p, i, m, 1, 2);                 \
                for (; m < a->M; m++) PANEL(a, p, i, m, 1, 1);                         \
            }                                                                          \
        }                                                                              \
    }

DEFINE_DRIVER(mm_f32_avx2, f32_panel)
DEFINE_DRIVER(mm_i8_avx2, i8_panel)

/* bfp: every row takes the panel's tiles in one pass (six accumulators per tile
 * spill to L1 at four tiles, which measured faster than a second pass over the
 * panel: the stream stays sequential). */
static void mm_bfp_avx2(const op_mm_args *in) {
    op_ran(KERNEL_CODE);
    OP_STREAM_ARGS(a, in, in->M == 1); /* a pass per row */
    OP_FOR_PANELS(a, p, tb, te)
        for (size_t m = 0; m < a->M; m++) OP_PANEL_WITH_TILES(bfp_panel, a, p, tb, te - tb, m, 1)
}

/* ---- fp32 gemm -------------------------------------------------------------------- */

AI void gemm_panel(const op_gemm_args *g, size_t t, size_t m, const int TP, const int R) {
    const size_t K = (size_t)g->h->K, stride = g->h->panel_stride;
    const float *tile0 = (const float *)(g->tiles + t * stride);
    __m256 acc[2][2][4];
    for (int i = 0; i < TP; i++)
        for (int hf = 0; hf < 2; hf++)
            for (int r = 0; r < R; r++) acc[i][hf][r] = _mm256_setzero_ps();
    for (size_t k = 0; k < K; k++) {
        __m256 av[4];
        for (int r = 0; r < R; r++) av[r] = _mm256_set1_ps(g->A[(m + r) * g->lda + k]);
        for (int i = 0; i < TP; i++)
            for (int hf = 0; hf < 2; hf++) {
                __m256 bv = _mm256_loadu_ps((const float *)((const uint8_t *)tile0 + i * stride) + k * OP_TILE_N + 8 * hf);
                for (int r = 0; r < R; r++) acc[i][hf][r] = _mm256_fmadd_ps(av[r], bv, acc[i][hf][r]);
            }
    }
    const __m256 alpha = _mm256_set1_ps(g->alpha), beta = _mm256_set1_ps(g->beta);
    for (int i = 0; i < TP; i++)
        for (int hf = 0; hf < 2; hf++) {
            const size_t c0 = (t + i) * OP_TILE_N + 8 * (size_t)hf;
            const __m256i mk = half_mask(g->col_begin, g->col_end, t + i, hf);
            if (_mm256_testz_si256(mk, mk)) continue;
            for (int r = 0; r < R; r++) {
                __m256 v = _mm256_mul_ps(alpha, acc[i][hf][r]);
                if (g->bias) {
                    float bb[8];
                    for (int l = 0; l < 8; l++) {
                        const size_t col = c0 + (size_t)l;
                        bb[l] = col < g->col_end ? g->bias[(ptrdiff_t)(m + r) * g->bias_rs + (ptrdiff_t)col * g->bias_cs] : 0.0f;
                    }
                    v = _mm256_fmadd_ps(beta, _mm256_loadu_ps(bb), v);
                }
                _mm256_maskstore_ps(g->Y + (m + r) * g->ldy + c0, mk, v);
            }
        }
}

static void gemm_avx2(const op_gemm_args *g) {
    op_ran(KERNEL_CODE);
    const size_t t0 = g->col_begin / OP_TILE_N, t1 = (g->col_end + OP_TILE_N - 1) / OP_TILE_N;
    if (g->M < 4) {
        for (size_t m = 0; m < g->M; m++) {
            size_t t = t0;
            for (; t + 2 <= t1; t += 2) gemm_panel(g, t, m, 2, 1);
            for (; t < t1; t++) gemm_panel(g, t, m, 1, 1);
        }
        return;
    }
    for (size_t t = t0; t < t1; t++) {
        size_t m = 0;
        for (; m + 4 <= g->M; m += 4) gemm_panel(g, t, m, 1, 4);
        for (; m < g->M; m++) gemm_panel(g, t, m, 1, 1);
    }
}

/* Levels 0 and 4's block scan (op_kernel_table.block_amax), 8 values at a time, as
 * the AVX-512 one does (max_ps keeps its second operand, the running max, when
 * either is NaN); the tail goes through the portable loop. */
static float block_amax_avx2(const float *a, size_t n, int *finite) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 fmax = _mm256_set1_ps(3.4028234663852886e38f);
    __m256 acc = _mm256_setzero_ps();
    int bad = 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_and_ps(_mm256_loadu_ps(a + i), absmask);
        bad |= _mm256_movemask_ps(_mm256_cmp_ps(v, fmax, _CMP_NLE_UQ)); /* inf or NaN */
        acc = _mm256_max_ps(v, acc);
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    float amax = _mm_cvtss_f32(m);
    if (bad) *finite = 0;
    if (i < n) {
        const float tail = op_block_amax_portable(a + i, n - i, finite);
        amax = tail > amax ? tail : amax;
    }
    return amax;
}

/* Level 4's A bytes (op_kernel_table.i8_round), 8 values at a time, the steps of the
 * AVX-512 one; the low byte of each converted dword (all in [-128, 127]) is stored
 * through a shuffle. */
static int32_t i8_round_avx2(const float *a, size_t n, float inv, int8_t *a8) {
    const __m256 vinv = _mm256_set1_ps(inv), magic = _mm256_set1_ps(12582912.0f);
    const __m256 top = _mm256_set1_ps(127.0f), bottom = _mm256_set1_ps(-128.0f);
    const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                               0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i lanes = _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1);
    __m256i acc = _mm256_setzero_si256();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 r = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(a + i), vinv), magic), magic);
        r = _mm256_blendv_ps(r, top, _mm256_cmp_ps(r, top, _CMP_GT_OQ));
        r = _mm256_blendv_ps(r, bottom, _mm256_cmp_ps(r, bottom, _CMP_LT_OQ));
        const __m256i q = _mm256_cvttps_epi32(r);
        const __m256i b = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(q, low_bytes), lanes);
        _mm_storel_epi64((__m128i *)(a8 + i), _mm256_castsi256_si128(b));
        acc = _mm256_add_epi32(acc, q);
    }
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    int32_t s = _mm_cvtsi128_si32(t);
    if (i < n) s += op_i8_round_portable(a + i, n - i, inv, a8 + i);
    return s;
}

const op_kernel_table op_kernels_avx2 = {mm_f32_avx2, mm_bfp_avx2, mm_i8_avx2, gemm_avx2, op_bfp_digits_portable,
                                         block_amax_avx2, i8_round_avx2};
#endif
