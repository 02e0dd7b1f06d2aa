/* AVX-512 (F/BW/VL/DQ) kernels, plus VNNI for the int8 path where the CPU has it.
 *
 * Lane layout: one ZMM register = one 16-column tile, lane c = column c. A 64-byte
 * group of the packed data (see op_internal.h) loads as 16 dwords; dword c holds
 * the 8 codes of column c for k0..k0+7:
 *   fp32 path: code(k0 + j) = dword >> shift(j) (low 4 bits), shift = 8j for j < 4
 *              and 8(j - 4) + 4 for j >= 4; vpermps with a 0..15 table turns those
 *              4 bits into the float code in one instruction (it ignores the rest).
 *   int8 path: bytes & 0x0F give [k0..k0+3] of each column, (bytes >> 4) & 0x0F give
 *              [k0+4..k0+7]: each dword is one u8x4 operand of vpdpbusd against a
 *              broadcast s8x4 slice of A.
 * Every fp32 accumulation runs per lane in ascending k with one fused multiply-add
 * per step, the same sequence the scalar reference spells out, so results are
 * equal bit for bit. Latency is hidden by working on several tiles and rows at
 * once (independent chains), never by splitting an fp32 chain (integer chains,
 * being exact, may be split).
 *
 * NOTE: per-file `#pragma GCC target`, not a global -m flag: the module must
 * still load on CPUs without these instructions (dispatch never calls in). */
#include "op_internal.h"

#if OP_SIMD
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#include <immintrin.h>

#define AI static inline __attribute__((always_inline))
/* What every driver below records as the code that ran (op_last_kernel); the VNNI
 * section at the end redefines it for its drivers. */
#define KERNEL_CODE OP_KERNEL_AVX512

#include "avx512_epilogue.h"

/* One block's dot products d[i][r] (tiles from i0, rows from m) folded into out with
 * the block's scales and zero points: the epilogue of the int8 and bfp panels. */
AI void fold_block_tiles(const op_mm_args *a, const uint8_t *blk, int i0, size_t m, uint32_t b,
                         const int TP, const int R, __m512 d[4][4], __m512 out[4][4]) {
    const op_packed_header *h = a->h;
    for (int i = 0; i < TP; i++) {
        const __m512 s = _mm512_loadu_ps(op_mm_scales(h, blk, i0 + i));
        const __m512 z = block_zeros(h, blk, i0 + i);
        for (int r = 0; r < R; r++) {
            const size_t ab = (m + r) * h->n_blocks + b;
            out[i][r] = fold_int_block(out[i][r], d[i][r], s, z, a->asum[ab], a->ascale[ab]);
        }
    }
}

/* ---- fp32 compute ------------------------------------------------------------
 * Per k: one shift brings the code's nibble to the bottom of each lane, one
 * vpermps (which reads only the low 4 bits of each index) turns it into the float
 * code, one FMA. With one row (decode) the conversion is most of the work, so
 * there code_f32 converts two codes per shifted copy (3 shifts per 8 codes, not 7).
 * NOTE: this loop is bound by the vector pipes, not memory: on the development
 * machine (Zen 4: two zmm ops per cycle, at most one FMA, and vpermps/vpermw
 * contend with the FMAs) 8 FMAs + 8 permutes + 3 shifts per 16 x 8 codes run at
 * ~20 GB/s of packed data from cache (was ~18.6 with 7 shifts), i.e. ~60-65% of
 * one core's read bandwidth: the one-thread level-1 GEMV cannot stream at the
 * read bandwidth with one fp32 FMA per code. Measured and slower: unaligned loads
 * at group + j instead of the shifts (split-line loads), and + cvtdq2ps for some
 * codes (cvt shares the shift pipe), OR-ing the nibble into a float's mantissa
 * and subtracting the implicit one (vpternlogd + vsubps: more ops), software
 * prefetch 1-8 KiB ahead. Also slower, measured 2026-11-29 (one thread, DRAM,
 * the four medium shapes): the same mantissa trick with one shift per 8 codes,
 * each nibble masked where it lies (at bit s <= 16 of the lane, or of the lane
 * shifted right by 12) and A pre-scaled by 2^-s so each product stays exactly
 * a * q: 13.9-15.8 GB/s against 15.3-18.8 for this loop in the same runs. */

/* Upper halves of float(q) for q = i & 15 (float(q) has zero low 16 bits for q < 16):
 * the vpermw table, duplicated because vpermw reads 5 index bits. */
static const uint16_t code_bf16[32] __attribute__((aligned(64))) = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

/* Code j of each lane as a float, from xv[v] = group dwords >> 4v. Code j's nibble
 * sits at bit 8j (j < 4) or 8(j - 4) + 4 (j >= 4). vpermps converts the nibble at
 * bits 0-3 of a dword; vpermw, zero-masked to the upper word, converts the one at
 * bits 16-19 (bit 20 is ignored by the duplicated table) into float(q)'s upper
 * half. So each shifted copy serves two codes: 3 shifts per 8 codes instead of 7. */
AI __m512 code_f32(const __m512i xv[4], int j, __m512 tbl, __m512i tblw) {
    static const int vsel[8] = {0, 2, 0, 2, 1, 3, 1, 3};
    const __m512i x = xv[vsel[j]];
    if ((j & 2) == 0) return _mm512_permutexvar_ps(x, tbl); /* j = 0, 1, 4, 5 */
    return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16((__mmask32)0xAAAAAAAAu, x, tblw));
}

AI void f32_panel(const op_mm_args *a, size_t p, int i0, size_t m, const int TP, const int R) {
    const op_packed_header *h = a->h;
    const uint32_t bs = h->block_size, nb = h->n_blocks;
    const __m512 tbl = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i tblw = _mm512_loadu_si512((const void *)code_bf16);
    const float *arow[8];
    for (int r = 0; r < R; r++) arow[r] = a->A + (m + r) * a->lda;
    __m512 out[4][8], acc[4][8];
    for (int i = 0; i < TP; i++)
        for (int r = 0; r < R; r++) out[i][r] = _mm512_setzero_ps();
    const size_t bb = op_mm_block_bytes(bs, op_zp_kind(h));
    for (uint32_t b = 0; b < nb; b++) {
        const uint8_t *blk = op_mm_block(h, a->panels, p, b);
        op_stream_block(a, blk, bb);
        for (int i = 0; i < TP; i++)
            for (int r = 0; r < R; r++) acc[i][r] = _mm512_setzero_ps();
        for (uint32_t g = 0; g < bs / OP_GROUP_K; g++) {
            const size_t kb = (size_t)b * bs + (size_t)g * OP_GROUP_K;
            const uint8_t *src[4];
            for (int i = 0; i < TP; i++) src[i] = op_mm_group(blk, g, i0 + i);
            if (R == 1) {
                /* one row: the conversion is most of the work, so share the shifts */
                __m512i xv[4][4];
                for (int i = 0; i < TP; i++) {
                    xv[i][0] = _mm512_loadu_si512((const void *)src[i]);
                    for (int v = 1; v < 4; v++) xv[i][v] = _mm512_srli_epi32(xv[i][0], 4 * v);
                }
                for (int j = 0; j < 8; j++) {
                    const __m512 av = _mm512_set1_ps(arow[0][kb + j]);
                    for (int i = 0; i < TP; i++)
                        acc[i][0] = _mm512_fmadd_ps(av, code_f32(xv[i], j, tbl, tblw), acc[i][0]);
                }
                continue;
            }
            for (int j = 0; j < 8; j++) {
                __m512 av[8];
                for (int r = 0; r < R; r++) av[r] = _mm512_set1_ps(arow[r][kb + j]);
                for (int i = 0; i < TP; i++) {
                    __m512i x = _mm512_loadu_si512((const void *)src[i]);
                    const int sh = j < 4 ? 8 * j : 8 * (j - 4) + 4;
                    if (sh) x = _mm512_srli_epi32(x, sh);
                    const __m512 q = _mm512_permutexvar_ps(x, tbl);
                    for (int r = 0; r < R; r++) acc[i][r] = _mm512_fmadd_ps(av[r], q, acc[i][r]);
                }
            }
        }
        for (int i = 0; i < TP; i++) {
            const __m512 s = _mm512_loadu_ps(op_mm_scales(h, blk, i0 + i));
            const __m512 z = block_zeros(h, blk, i0 + i);
            for (int r = 0; r < R; r++) {
                __m512 d = _mm512_fnmadd_ps(z, _mm512_set1_ps(a->asum[(m + r) * nb + b]), acc[i][r]);
                out[i][r] = _mm512_fmadd_ps(s, d, out[i][r]);
            }
        }
    }
    for (int i = 0; i < TP; i++)
        for (int r = 0; r < R; r++) store_out(a, m + r, p * OP_PANEL_TILES + (size_t)(i0 + i), out[i][r]);
}

/* ---- int8 compute ----------------------------------------------------------------
 * With one row, the low- and high-nibble dot products go to separate integer
 * accumulators (exact, so order is free) to double the independent chains. */

/* The 8 int8 values of A at p as two broadcast dwords: [p..p+3] (the low nibbles' k)
 * and [p+4..p+7] (the high nibbles'), each the s8x4 operand of vpdpbusd. */
AI void a8_words(const int8_t *p, __m512i *lo, __m512i *hi) {
    int32_t w0, w1;
    __builtin_memcpy(&w0, p, 4);
    __builtin_memcpy(&w1, p + 4, 4);
    *lo = _mm512_set1_epi32(w0);
    *hi = _mm512_set1_epi32(w1);
}

#define DEFINE_I8_PANEL(NAME, DOT)                                                     \
    AI void NAME(const op_mm_args *a, size_t p, int i0, size_t m, const int TP, const int R) { \
        const op_packed_header *h = a->h;                                              \
        const uint32_t bs = h->block_size, nb = h->n_blocks;                           \
        const __m512i m0f = _mm512_set1_epi8(0x0F);                                    \
        const int8_t *arow[4];                                                         \
        for (int r = 0; r < R; r++) arow[r] = a->a8 + (m + r) * a->Kp;               \
        __m512 out[4][4];                                                              \
        __m512i is0[4][4], is1[4][4];                                                  \
        for (int i = 0; i < TP; i++)                                                   \
            for (int r = 0; r < R; r++) out[i][r] = _mm512_setzero_ps();              \
        const size_t bb = op_mm_block_bytes(bs, op_zp_kind(h));                        \
        for (uint32_t b = 0; b < nb; b++) {                                            \
            const uint8_t *blk = op_mm_block(h, a->panels, p, b);                      \
            op_stream_block(a, blk, bb);                                               \
            for (int i = 0; i < TP; i++)                                               \
                for (int r = 0; r < R; r++) is0[i][r] = is1[i][r] = _mm512_setzero_si512(); \
            for (uint32_t g = 0; g < bs / OP_GROUP_K; g++) {                           \
                const size_t kb = (size_t)b * bs + (size_t)g * OP_GROUP_K;             \
                __m512i alo[4], ahi[4];                                                \
                for (int r = 0; r < R; r++) a8_words(arow[r] + kb, &alo[r], &ahi[r]);  \
                for (int i = 0; i < TP; i++) {                                         \
                    __m512i x = _mm512_loadu_si512((const void *)op_mm_group(blk, g, i0 + i)); \
                    __m512i lo = _mm512_and_si512(x, m0f);                             \
                    __m512i hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), m0f);       \
                    for (int r = 0; r < R; r++) {                                      \
                        is0[i][r] = DOT(is0[i][r], lo, alo[r]);                        \
                        if (R == 1) is1[i][r] = DOT(is1[i][r], hi, ahi[r]);           \
                        else is0[i][r] = DOT(is0[i][r], hi, ahi[r]);                   \
                    }                                                                  \
                }                                                                      \
            }                                                                          \
            __m512 d[4][4];                                                            \
            for (int i = 0; i < TP; i++)                                               \
                for (int r = 0; r < R; r++)                                            \
                    d[i][r] = _mm512_cvtepi32_ps(R == 1 ? _mm512_add_epi32(is0[i][r], is1[i][r]) \
                                                        : is0[i][r]);                  \
            fold_block_tiles(a, blk, i0, m, b, TP, R, d, out);                         \
        }                                                                              \
        for (int i = 0; i < TP; i++)                                                   \
            for (int r = 0; r < R; r++)                                                \
                store_out(a, m + r, p * OP_PANEL_TILES + (size_t)(i0 + i), out[i][r]); \
    }

/* One or two rows (R; a decode GEMV at batch 1 or 2) over two whole panels side by
 * side: per block, panel p0's
 * record, then p0 + 1's. The weights then arrive as two sequential streams instead of
 * one, and a core keeps more of its reads in flight. NOTE: measured 2026-12-03 on the
 * 2-vCPU Intel Xeon (Sapphire Rapids, KVM), 40 level-4 weights of 2048 x 5632 (289
 * MB), medians of 9: one thread 7.43 -> 8.28 GB/s, two threads 12.1 -> 13.2; a
 * builder-exported Llama's decode step (batch 1, two threads, alternating sessions in
 * one process, scripts/gemv_step_profile.py --compare panels) 57.4 -> 53.0 ms and 51.4
 * -> 49.7 ms. Three panels measured no better than two (and need 8 more registers);
 * PREFETCHT1 instead of NTA made the GEMVs faster and the ops between them slower, the
 * same step. Two rows (batch 2), measured 2026-12-03 on the same machine, the same
 * export, batch 2, alternating sessions: the step's 81 GEMVs on one thread 59.3 ->
 * 53.9 ms; the two-thread step 45.0 -> 44.2 ms (medians; memory-bound there). The
 * integer sums of a (tile, row) go to one accumulator (8 independent chains across
 * the pair per row), and integer sums are exact: the panel function's bits. */
#define DEFINE_I8_PANEL_PAIR(NAME, DOT)                                                \
    AI void NAME(const op_mm_args *a, size_t p0, size_t m, const int R) {              \
        const op_packed_header *h = a->h;                                              \
        const uint32_t bs = h->block_size, nb = h->n_blocks;                           \
        const __m512i m0f = _mm512_set1_epi8(0x0F);                                    \
        const int8_t *arow[2];                                                         \
        for (int r = 0; r < R; r++) arow[r] = a->a8 + (m + r) * a->Kp;               \
        __m512 out[2][4][4];                                                           \
        __m512i is[2][4][2];                                                           \
        for (int j = 0; j < 2; j++)                                                    \
            for (int i = 0; i < 4; i++)                                                \
                for (int r = 0; r < R; r++) out[j][i][r] = _mm512_setzero_ps();       \
        const size_t bb = op_mm_block_bytes(bs, op_zp_kind(h));                        \
        for (uint32_t b = 0; b < nb; b++) {                                            \
            const uint8_t *blk[2];                                                     \
            for (int j = 0; j < 2; j++) {                                              \
                blk[j] = op_mm_block(h, a->panels, p0 + (size_t)j, b);                 \
                op_stream_block(a, blk[j], bb);                                        \
                for (int i = 0; i < 4; i++)                                            \
                    for (int r = 0; r < R; r++) is[j][i][r] = _mm512_setzero_si512();  \
            }                                                                          \
            for (uint32_t g = 0; g < bs / OP_GROUP_K; g++) {                           \
                const size_t kb = (size_t)b * bs + (size_t)g * OP_GROUP_K;             \
                __m512i alo[2], ahi[2];                                                \
                for (int r = 0; r < R; r++) a8_words(arow[r] + kb, &alo[r], &ahi[r]);  \
                for (int j = 0; j < 2; j++)                                            \
                    for (int i = 0; i < 4; i++) {                                      \
                        __m512i x = _mm512_loadu_si512((const void *)op_mm_group(blk[j], g, i)); \
                        const __m512i lo = _mm512_and_si512(x, m0f);                   \
                        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), m0f); \
                        for (int r = 0; r < R; r++) {                                  \
                            is[j][i][r] = DOT(is[j][i][r], lo, alo[r]);                \
                            is[j][i][r] = DOT(is[j][i][r], hi, ahi[r]);                \
                        }                                                              \
                    }                                                                  \
            }                                                                          \
            for (int j = 0; j < 2; j++) {                                              \
                __m512 d[4][4];                                                        \
                for (int i = 0; i < 4; i++)                                            \
                    for (int r = 0; r < R; r++) d[i][r] = _mm512_cvtepi32_ps(is[j][i][r]); \
                fold_block_tiles(a, blk[j], 0, m, b, 4, R, d, out[j]);                 \
            }                                                                          \
        }                                                                              \
        for (int j = 0; j < 2; j++)                                                    \
            for (int i = 0; i < 4; i++)                                                \
                for (int r = 0; r < R; r++)                                            \
                    store_out(a, m + r, (p0 + (size_t)j) * OP_PANEL_TILES + (size_t)i, out[j][i][r]); \
    }

/* One or two rows (a decode GEMV at batch 1 or 2): whole panels two at a time
 * (op_gemv_panels), a partial or odd one alone. */
#define DEFINE_I8_1ROW_DRIVER(NAME, PANEL, PAIR)                                       \
    AI void NAME##_rows(const op_mm_args *in, const int R) {                           \
        op_ran(KERNEL_CODE);                                                           \
        OP_STREAM_ARGS(a, in, 1);                                                      \
        const size_t t0 = op_tile_begin(a), t1 = op_tile_end(a);                       \
        const int pairs = __atomic_load_n(&op_gemv_panels, __ATOMIC_RELAXED) == 2;     \
        for (size_t p = t0 / OP_PANEL_TILES; p * OP_PANEL_TILES < t1;) {               \
            const size_t first = p * OP_PANEL_TILES;                                   \
            if (pairs && first >= t0 && first + 2 * OP_PANEL_TILES <= t1) {            \
                PAIR(a, p, 0, R);                                                      \
                p += 2;                                                                \
                continue;                                                              \
            }                                                                          \
            const int tb = (int)(t0 > first ? t0 - first : 0);                         \
            const int te = (int)(t1 - first < OP_PANEL_TILES ? t1 - first : OP_PANEL_TILES); \
            OP_PANEL_WITH_TILES(PANEL, a, p, tb, te - tb, 0, R);                       \
            p++;                                                                       \
        }                                                                              \
    }                                                                                  \
    static void NAME(const op_mm_args *in) {                                           \
        if (in->M == 2) NAME##_rows(in, 2); else NAME##_rows(in, 1);                   \
    }

/* Four rows over a whole panel in ONE pass: per block, the tiles go in pairs
 * (2 tiles x 4 rows = 8 integer chains at a time) while the 16 fp32 outputs of
 * the panel stay live across blocks. NOTE: the two-tile-pair passes this replaces
 * (PANEL(..., 2, 4) twice per panel) read every panel twice, the first pass from
 * DRAM with half the compute per byte, the second from cache; one pass overlaps
 * the whole panel's compute with its one stream. Per lane the fold is the same
 * as in the panel function above (integer sums are exact, blocks ascending). */
#define DEFINE_I8_PANEL4(NAME, DOT)                                                    \
    AI void NAME(const op_mm_args *a, size_t p, int tb, int te, size_t m) {           \
        const op_packed_header *h = a->h;                                              \
        const uint32_t bs = h->block_size, nb = h->n_blocks;                           \
        const __m512i m0f = _mm512_set1_epi8(0x0F);                                    \
        const int8_t *arow[4];                                                         \
        for (int r = 0; r < 4; r++) arow[r] = a->a8 + (m + r) * a->Kp;               \
        __m512 out[4][4];                                                              \
        for (int i = 0; i < 4; i++)                                                    \
            for (int r = 0; r < 4; r++) out[i][r] = _mm512_setzero_ps();              \
        const size_t bb = op_mm_block_bytes(bs, op_zp_kind(h));                        \
        for (uint32_t b = 0; b < nb; b++) {                                            \
            const uint8_t *blk = op_mm_block(h, a->panels, p, b);                      \
            op_stream_block(a, blk, bb);                                               \
            for (int i0 = tb; i0 < te; i0 += 2) {                                      \
                const int TP = i0 + 2 <= te ? 2 : 1;                                   \
                __m512i is[2][4];                                                      \
                for (int i = 0; i < 2; i++)                                            \
                    for (int r = 0; r < 4; r++) is[i][r] = _mm512_setzero_si512();     \
                for (uint32_t g = 0; g < bs / OP_GROUP_K; g++) {                       \
                    const size_t kb = (size_t)b * bs + (size_t)g * OP_GROUP_K;         \
                    __m512i alo[4], ahi[4];                                            \
                    for (int r = 0; r < 4; r++) {                                      \
                        alo[r] = bcast32(arow[r] + kb);                                \
                        ahi[r] = bcast32(arow[r] + kb + 4);                            \
                    }                                                                  \
                    for (int i = 0; i < 2; i++) {                                      \
                        if (i >= TP) break;                                            \
                        __m512i x = _mm512_loadu_si512((const void *)op_mm_group(blk, g, i0 + i)); \
                        __m512i lo = _mm512_and_si512(x, m0f);                         \
                        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), m0f);   \
                        for (int r = 0; r < 4; r++)                                    \
                            is[i][r] = DOT(DOT(is[i][r], lo, alo[r]), hi, ahi[r]);     \
                    }                                                                  \
                }                                                                      \
                for (int i = 0; i < 2; i++) {                                          \
                    if (i >= TP) break;                                                \
                    const __m512 s = _mm512_loadu_ps(op_mm_scales(h, blk, i0 + i));    \
                    const __m512 z = block_zeros(h, blk, i0 + i);                      \
                    for (int r = 0; r < 4; r++) {                                      \
                        const size_t ab = (m + r) * nb + b;                            \
                        out[i0 + i][r] = fold_int_block(out[i0 + i][r], _mm512_cvtepi32_ps(is[i][r]), \
                                                        s, z, a->asum[ab], a->ascale[ab]); \
                    }                                                                  \
                }                                                                      \
            }                                                                          \
        }                                                                              \
        for (int i = tb; i < te; i++)                                                  \
            for (int r = 0; r < 4; r++)                                                \
                store_out(a, m + r, p * OP_PANEL_TILES + (size_t)i, out[i][r]);        \
    }

/* u8 x s8 four-way dot product without VNNI: maddubs gives s16 pair sums (at most
 * 2 * 15 * 128, no saturation), madd with ones widens them to s32 quads. */
AI __m512i dot_bw(__m512i acc, __m512i u, __m512i s) {
    __m512i p = _mm512_maddubs_epi16(u, s);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
}
DEFINE_I8_PANEL(i8_panel_bw, dot_bw)

AI __m512i bcast32(const int8_t *p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* ---- bfp compute (accuracy level 0) --------------------------------------------
 * Three byte planes of A's 24-bit block mantissas against the same unpacked codes:
 * six four-way dot products per 8 codes x 16 columns, all exact. */
#define DEFINE_BFP_PANEL(NAME, DOT)                                                    \
    AI void NAME##_rng(const op_mm_args *a, size_t p, int i0, size_t m, const int TP, const int R, \
                       uint32_t b0, uint32_t b1, __m512 *st) {                          \
        const op_packed_header *h = a->h;                                              \
        const uint32_t bs = h->block_size, nb = h->n_blocks;                           \
        const __m512i m0f = _mm512_set1_epi8(0x0F);                                    \
        const int8_t *drow[4];                                                         \
        for (int r = 0; r < R; r++) drow[r] = a->a8 + (m + r) * a->Kp * 3;           \
        __m512 out[4][4];                                                              \
        __m512i il[4][4], im[4][4], ih[4][4];                                          \
        for (int i = 0; i < TP; i++)                                                   \
            for (int r = 0; r < R; r++) out[i][r] = b0 ? st[i * R + r] : _mm512_setzero_ps(); \
        const size_t bb = op_mm_block_bytes(bs, op_zp_kind(h));                        \
        for (uint32_t b = b0; b < b1; b++) {                                           \
            const uint8_t *blk = op_mm_block(h, a->panels, p, b);                      \
            op_stream_block(a, blk, bb);                                               \
            for (int i = 0; i < TP; i++)                                               \
                for (int r = 0; r < R; r++)                                            \
                    il[i][r] = im[i][r] = ih[i][r] = _mm512_setzero_si512();           \
            for (uint32_t g = 0; g < bs / OP_GROUP_K; g++) {                           \
                const size_t go = ((size_t)b * bs / OP_GROUP_K + g) * 24;              \
                /* one row: the six broadcasts serve every tile, so hoist them;    \
                 * several rows: broadcast at the point of use (memory operands),   \
                 * since R x 6 live registers would spill */                       \
                __m512i w[6];                                                          \
                if (R == 1)                                                            \
                    for (int d = 0; d < 6; d++) w[d] = bcast32(drow[0] + go + 4 * d);  \
                for (int i = 0; i < TP; i++) {                                         \
                    const uint8_t *src = op_mm_group(blk, g, i0 + i);                  \
                    __m512i x = _mm512_loadu_si512((const void *)src);                 \
                    __m512i lo = _mm512_and_si512(x, m0f);                             \
                    __m512i hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), m0f);       \
                    for (int r = 0; r < R; r++) {                                      \
                        const int8_t *v = drow[r] + go;                                \
                        if (R == 1) {                                                  \
                            il[i][r] = DOT(DOT(il[i][r], lo, w[0]), hi, w[1]);         \
                            im[i][r] = DOT(DOT(im[i][r], lo, w[2]), hi, w[3]);         \
                            ih[i][r] = DOT(DOT(ih[i][r], lo, w[4]), hi, w[5]);         \
                        } else {                                                       \
                            il[i][r] = DOT(DOT(il[i][r], lo, bcast32(v)), hi, bcast32(v + 4)); \
                            im[i][r] = DOT(DOT(im[i][r], lo, bcast32(v + 8)), hi, bcast32(v + 12)); \
                            ih[i][r] = DOT(DOT(ih[i][r], lo, bcast32(v + 16)), hi, bcast32(v + 20)); \
                        }                                                              \
                    }                                                                  \
                }                                                                      \
            }                                                                          \
            __m512 d[4][4];                                                            \
            for (int i = 0; i < TP; i++)                                               \
                for (int r = 0; r < R; r++) {                                          \
                    __m512i t = _mm512_add_epi32(il[i][r], _mm512_slli_epi32(im[i][r], 8)); \
                    d[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ih[i][r]), _mm512_set1_ps(65536.0f), \
                                              _mm512_cvtepi32_ps(t));                  \
                }                                                                      \
            fold_block_tiles(a, blk, i0, m, b, TP, R, d, out);                         \
        }                                                                              \
        for (int i = 0; i < TP; i++)                                                   \
            for (int r = 0; r < R; r++) {                                              \
                if (b1 < nb) st[i * R + r] = out[i][r];                                \
                else store_out(a, m + r, p * OP_PANEL_TILES + (size_t)(i0 + i), out[i][r]); \
            }                                                                          \
    }                                                                                  \
    AI void NAME(const op_mm_args *a, size_t p, int i0, size_t m, const int TP, const int R) { \
        NAME##_rng(a, p, i0, m, TP, R, 0, a->h->n_blocks, NULL);                       \
    }
DEFINE_BFP_PANEL(bfp_panel_bw, dot_bw)

/* ---- drivers ------------------------------------------------------------------------
 * Walk the panels overlapping the column range front to back, finishing every row
 * of a panel while its data is in cache. fp32 rows go in chunks of 8 (one tile x
 * 8 rows, so each unpacked code feeds 8 FMAs), then of 4 (two tiles x 4 rows);
 * int8 rows in chunks of 4, each one pass over the panel (PANEL4 above); then the
 * last 1-3 rows take all of the panel's tiles in one pass, so a decode GEMV (M = 1)
 * reads the buffer as one sequential stream with four independent chains.
 * NOTE: tried and left out: non-temporal loads (vmovntdqa) of the weights on these
 * one-pass decode passes, so a step's hundreds of MB would not evict what the ops
 * between the matmuls use. Same bits; no change in a decode step, switched on and off
 * every two steps in one process (2026-12-02, 2-vCPU AMD EPYC, median step ratio
 * 1.009 / 1.009 / 1.001 for the builder Llama at level 4, batch 1 / 2 / 8, and 0.980
 * for the medium fixture at level 0, batch 1): on write-back memory the non-temporal
 * hint of a load is ignored. What does keep the stream out of L2 is a PREFETCHNTA
 * ahead of the loads: op_stream_block (op_internal.h), which the one-pass drivers
 * below turn on through OP_STREAM_ARGS. */
/* The last 1-3 rows of a panel, all of its tiles in one pass. */
#define REST_ROWS(PANEL, a, p, tb, te, m)                                             \
    switch (a->M - m) {                                                               \
    case 3: OP_PANEL_WITH_TILES(PANEL, a, p, tb, te - tb, m, 3); break;               \
    case 2: OP_PANEL_WITH_TILES(PANEL, a, p, tb, te - tb, m, 2); break;               \
    case 1: OP_PANEL_WITH_TILES(PANEL, a, p, tb, te - tb, m, 1); break;               \
    default: break;                                                                   \
    }

#define DEFINE_DRIVER(NAME, PANEL, BIG)                                               \
    static void NAME(const op_mm_args *in) {                                          \
        op_ran(KERNEL_CODE);                                                          \
        OP_STREAM_ARGS(a, in, in->M <= 3); /* REST_ROWS alone: one pass */            \
        OP_FOR_PANELS(a, p, tb, te) {                                                 \
            size_t m = 0;                                                             \
            if (BIG == 8)                                                             \
                for (; m + 8 <= a->M; m += 8)                                         \
                    for (int i = tb; i < te; i++) PANEL(a, p, i, m, 1, 8);            \
            for (; m + 4 <= a->M; m += 4)                                             \
                for (int i = tb; i < te; i += 2) {                                    \
                    if (i + 2 <= te) PANEL(a, p, i, m, 2, 4); else PANEL(a, p, i, m, 1, 4); \
                }                                                                     \
            REST_ROWS(PANEL, a, p, tb, te, m)                                         \
        }                                                                             \
    }

DEFINE_DRIVER(mm_f32_avx512, f32_panel, 8)

/* int8: one row (decode) by the one-row driver above; more rows in chunks of four,
 * each chunk one pass over the panel (PANEL4), then the last 1-3 rows as in
 * DEFINE_DRIVER. */
#define DEFINE_I8_DRIVER(NAME, PANEL, PANEL4, ONEROW)                                 \
    static void NAME(const op_mm_args *in) {                                          \
        if (in->M <= 2) { ONEROW(in); return; }                                       \
        op_ran(KERNEL_CODE);                                                          \
        OP_STREAM_ARGS(a, in, in->M <= 4); /* one PANEL4 or REST_ROWS pass */         \
        OP_STREAM_L2_WHERE(a, in->M >= 3 && in->M <= 16);                             \
        OP_FOR_PANELS(a, p, tb, te) {                                                 \
            size_t m = 0;                                                             \
            for (; m + 4 <= a->M; m += 4) PANEL4(a, p, tb, te, m);                    \
            REST_ROWS(PANEL, a, p, tb, te, m)                                         \
        }                                                                             \
    }
DEFINE_I8_PANEL4(i8_panel4_bw, dot_bw)
DEFINE_I8_PANEL_PAIR(i8_panel_pair_bw, dot_bw)
DEFINE_I8_1ROW_DRIVER(mm_i8_1row_bw, i8_panel_bw, i8_panel_pair_bw)
DEFINE_I8_DRIVER(mm_i8_avx512_bw, i8_panel_bw, i8_panel4_bw, mm_i8_1row_bw)

/* bfp: three accumulators per (tile, row), so prefill goes one tile by four rows
 * (12 chains), and every remaining row takes the whole panel in one pass. The
 * four-row chunks walk the panel's blocks in ~16 KiB chunks, the four tiles one
 * after the other per chunk (running outputs carried in st), so the panel streams
 * from memory once rather than once per tile (measured ~15% faster from DRAM at
 * M = 4; the same chunking made the fp32 M = 4 / 8 paths slower, so they keep
 * their tile-group passes, whose later passes hit L2). */
#define OP_CHUNK_BYTES 16384u
#define FOR_BLOCK_CHUNKS(a, b0, b1)                                                   \
    for (uint32_t nb_ = (a)->h->n_blocks,                                             \
                  ch_ = chunk_blocks((a)->h), b0 = 0, b1 = ch_ < nb_ ? ch_ : nb_;     \
         b0 < nb_; b0 = b1, b1 = b1 + ch_ < nb_ ? b1 + ch_ : nb_)
AI uint32_t chunk_blocks(const op_packed_header *h) {
    const size_t bb = op_mm_block_bytes(h->block_size, op_zp_kind(h));
    return bb >= OP_CHUNK_BYTES ? 1u : (uint32_t)(OP_CHUNK_BYTES / bb);
}
#define DEFINE_BFP_DRIVER(NAME, PANEL)                                                \
    static void NAME(const op_mm_args *in) {                                          \
        op_ran(KERNEL_CODE);                                                          \
        OP_STREAM_ARGS(a, in, in->M == 1); /* a pass per row */                       \
        __m512 st[OP_PANEL_TILES * 4];                                                \
        OP_FOR_PANELS(a, p, tb, te) {                                                 \
            size_t m = 0;                                                             \
            for (; m + 4 <= a->M; m += 4)                                             \
                FOR_BLOCK_CHUNKS(a, b0, b1)                                           \
                    for (int i = tb; i < te; i++)                                     \
                        PANEL##_rng(a, p, i, m, 1, 4, b0, b1, st + i * 4);            \
            for (; m < a->M; m++) OP_PANEL_WITH_TILES(PANEL, a, p, tb, te - tb, m, 1); \
        }                                                                             \
    }
DEFINE_BFP_DRIVER(mm_bfp_avx512_bw, bfp_panel_bw)

/* ---- fp32 gemm ------------------------------------------------------------------ */

AI void gemm_panel(const op_gemm_args *g, size_t t, size_t m, const int TP, const int R) {
    const size_t K = (size_t)g->h->K, stride = g->h->panel_stride;
    const float *tile0 = (const float *)(g->tiles + t * stride);
    __m512 acc[4][4];
    for (int i = 0; i < TP; i++)
        for (int r = 0; r < R; r++) acc[i][r] = _mm512_setzero_ps();
    for (size_t k = 0; k < K; k++) {
        __m512 av[4];
        for (int r = 0; r < R; r++) av[r] = _mm512_set1_ps(g->A[(m + r) * g->lda + k]);
        for (int i = 0; i < TP; i++) {
            __m512 bv = _mm512_loadu_ps((const float *)((const uint8_t *)tile0 + i * stride) + k * OP_TILE_N);
            for (int r = 0; r < R; r++) acc[i][r] = _mm512_fmadd_ps(av[r], bv, acc[i][r]);
        }
    }
    const __m512 alpha = _mm512_set1_ps(g->alpha), beta = _mm512_set1_ps(g->beta);
    for (int i = 0; i < TP; i++) {
        const size_t c0 = (t + i) * OP_TILE_N;
        const __mmask16 mk = col_mask(g->col_begin, g->col_end, t + i);
        for (int r = 0; r < R; r++) {
            __m512 v = _mm512_mul_ps(alpha, acc[i][r]);
            if (g->bias) {
                /* bias[m * rs + c * cs]: gather the 16 columns (strides may be 0) */
                __m512i idx = _mm512_add_epi32(
                    _mm512_set1_epi32((int)((ptrdiff_t)(m + r) * g->bias_rs + (ptrdiff_t)c0 * g->bias_cs)),
                    _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                       _mm512_set1_epi32((int)g->bias_cs)));
                __m512 bv = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mk, idx, g->bias, 4);
                v = _mm512_fmadd_ps(beta, bv, v);
            }
            _mm512_mask_storeu_ps(g->Y + (m + r) * g->ldy + c0, mk, v);
        }
    }
}

static void gemm_avx512(const op_gemm_args *g) {
    op_ran(KERNEL_CODE);
    const size_t t0 = g->col_begin / OP_TILE_N, t1 = (g->col_end + OP_TILE_N - 1) / OP_TILE_N;
    if (g->M < 4) {
        for (size_t m = 0; m < g->M; m++) {
            size_t t = t0;
            for (; t + 4 <= t1; t += 4) gemm_panel(g, t, m, 4, 1);
            for (; t < t1; t++) gemm_panel(g, t, m, 1, 1);
        }
        return;
    }
    for (size_t t = t0; t < t1; t += 2) {
        const int tp = t + 2 <= t1 ? 2 : 1;
        size_t m = 0;
        for (; m + 4 <= g->M; m += 4) {
            if (tp == 2) gemm_panel(g, t, m, 2, 4); else gemm_panel(g, t, m, 1, 4);
        }
        for (; m < g->M; m++) {
            if (tp == 2) gemm_panel(g, t, m, 2, 1); else gemm_panel(g, t, m, 1, 1);
        }
    }
}

/* Level 0's A digits (op_kernel_table.bfp_digits), 8 values (one group) at a time:
 * the same double operations as the portable loop in dispatch.c (a * inv is exact: a
 * power of two; adding and removing 1.5 * 2^52 rounds half to even; the integral
 * result converts exactly), the same integer splitting (an arithmetic shift divides
 * the multiples of 256 exactly), and the bytes of group g stored at dst + 24 g as
 * [lo k0..7][mid k0..7][hi k0..7], the portable loop's positions. A tail of fewer
 * than 8 values goes through the portable loop itself (it starts on a group boundary,
 * so its positions are the same). */
static int64_t bfp_digits_avx512(const float *a, size_t n, double inv, int8_t *dst) {
    const __m512d vinv = _mm512_set1_pd(inv), magic = _mm512_set1_pd(6755399441055744.0);
    const __m256i c128 = _mm256_set1_epi32(128), c255 = _mm256_set1_epi32(255);
    __m512i acc = _mm512_setzero_si512();
    size_t i = 0;
    for (; i + OP_GROUP_K <= n; i += OP_GROUP_K) {
        __m512d x = _mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(a + i)), vinv);
        x = _mm512_sub_pd(_mm512_add_pd(x, magic), magic);
        __m256i m = _mm512_cvtpd_epi32(x);
        __m256i lo = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(m, c128), c255), c128);
        __m256i m1 = _mm256_srai_epi32(_mm256_sub_epi32(m, lo), 8);
        __m256i mid = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(m1, c128), c255), c128);
        __m256i hi = _mm256_srai_epi32(_mm256_sub_epi32(m1, mid), 8);
        int8_t *grp = dst + (i / OP_GROUP_K) * 24;
        _mm_storel_epi64((__m128i *)grp, _mm256_cvtepi32_epi8(lo));
        _mm_storel_epi64((__m128i *)(grp + 8), _mm256_cvtepi32_epi8(mid));
        _mm_storel_epi64((__m128i *)(grp + 16), _mm256_cvtepi32_epi8(hi));
        acc = _mm512_add_epi64(acc, _mm512_cvtepi32_epi64(m));
    }
    int64_t sum = _mm512_reduce_add_epi64(acc);
    if (i < n) sum += op_bfp_digits_portable(a + i, n - i, inv, dst + (i / OP_GROUP_K) * 24);
    return sum;
}

/* Levels 0 and 4's block scan (op_kernel_table.block_amax), 16 values at a time:
 * max_ps returns its second operand when either is NaN, so the running max (always
 * the second operand) ignores a NaN as the portable compare does; a max is exact in
 * any order. The tail is a masked load (the lanes past n read as 0, which no max of
 * absolute values changes). */
static float block_amax_avx512(const float *a, size_t n, int *finite) {
    const __m512 fmax = _mm512_set1_ps(3.4028234663852886e38f);
    __m512 acc = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (size_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 v = _mm512_abs_ps(_mm512_maskz_loadu_ps(k, a + i));
        bad |= _mm512_cmp_ps_mask(v, fmax, _CMP_NLE_UQ); /* inf or NaN */
        acc = _mm512_max_ps(v, acc);
    }
    if (bad) *finite = 0;
    return _mm512_reduce_max_ps(acc);
}

/* Level 4's A bytes (op_kernel_table.i8_round), 16 values at a time: the portable
 * loop's float steps (a * inv, then + and - 1.5 * 2^23), its clamp (as compares, in
 * its order), its truncating conversion and its int32 sum. Only finite blocks come
 * here (quantize_row gives a block holding inf or NaN no bytes). The tail goes
 * through the portable loop. */
static int32_t i8_round_avx512(const float *a, size_t n, float inv, int8_t *a8) {
    const __m512 vinv = _mm512_set1_ps(inv), magic = _mm512_set1_ps(12582912.0f);
    const __m512 top = _mm512_set1_ps(127.0f), bottom = _mm512_set1_ps(-128.0f);
    __m512i acc = _mm512_setzero_si512();
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 r = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(a + i), vinv), magic), magic);
        r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(r, top, _CMP_GT_OQ), r, top);
        r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(r, bottom, _CMP_LT_OQ), r, bottom);
        const __m512i q = _mm512_cvttps_epi32(r);
        _mm_storeu_si128((__m128i *)(a8 + i), _mm512_cvtepi32_epi8(q));
        acc = _mm512_add_epi32(acc, q);
    }
    int32_t s = _mm512_reduce_add_epi32(acc);
    if (i < n) s += op_i8_round_portable(a + i, n - i, inv, a8 + i);
    return s;
}

const op_kernel_table op_kernels_avx512 = {mm_f32_avx512, mm_bfp_avx512_bw, mm_i8_avx512_bw, gemm_avx512,
                                           bfp_digits_avx512, block_amax_avx512, i8_round_avx512};

/* ---- VNNI variant of the int8 path ------------------------------------------------ */
#pragma GCC push_options
#pragma GCC target("avx512vnni")
#undef KERNEL_CODE
#define KERNEL_CODE OP_KERNEL_AVX512_VNNI
AI __m512i dot_vnni(__m512i acc, __m512i u, __m512i s) { return _mm512_dpbusd_epi32(acc, u, s); }
DEFINE_I8_PANEL(i8_panel_vnni, dot_vnni)
DEFINE_I8_PANEL4(i8_panel4_vnni, dot_vnni)
DEFINE_I8_PANEL_PAIR(i8_panel_pair_vnni, dot_vnni)
DEFINE_I8_1ROW_DRIVER(mm_i8_1row_vnni, i8_panel_vnni, i8_panel_pair_vnni)
DEFINE_I8_DRIVER(mm_i8_avx512_vnni, i8_panel_vnni, i8_panel4_vnni, mm_i8_1row_vnni)
DEFINE_BFP_PANEL(bfp_panel_vnni, dot_vnni)
DEFINE_BFP_DRIVER(mm_bfp_avx512_vnni, bfp_panel_vnni)
#pragma GCC pop_options

const op_kernel_table op_kernels_avx512_vnni = {mm_f32_avx512, mm_bfp_avx512_vnni, mm_i8_avx512_vnni,
                                                gemm_avx512, bfp_digits_avx512, block_amax_avx512,
                                                i8_round_avx512};
#endif
