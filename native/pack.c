/* Packing: source tensors -> self-describing packed buffers, and header checks.
 *
 * Packing is ISA-independent C (plus an SSE2 form of the INT4 group interleave on
 * x86-64, where SSE2 is the baseline: the same shifts and masks on four groups at a
 * time), and deterministic: every byte of the output is written (padding included),
 * so the same input gives the same bytes on every machine; tests pin the digests.
 * NOTE: the INT4 matmul packer went 1.98 -> 5.40 GB/s of source on 2048x5632 (one
 * group at a time -> two per 64-bit step -> four per SSE2 step), same bytes. Multi-byte values are stored in host byte order, which is
 * little-endian on every platform this project targets (a big-endian host would
 * fail the magic check when reading a little-endian cache). */
#include <string.h>
#include "op_internal.h"
#if defined(__SSE2__)
#include <emmintrin.h> /* x86-64 baseline: no dispatch needed, same bytes as the C path */
#endif

const char *op_status_string(int status) {
    switch (status) {
    case OP_OK: return "ok";
    case OP_E_ARG: return "bad argument";
    case OP_E_HEADER: return "packed buffer header is invalid";
    case OP_E_ISA: return "instruction set not available on this CPU or build";
    case OP_E_NOMEM: return "out of memory";
    case OP_E_INDEX: return "index out of range";
    default: return "unknown status";
    }
}

uint32_t op_packed_panel_n(void) { return OP_PANEL_N; }
uint32_t op_pack_format_version(void) { return OP_PACK_FORMAT_VERSION; }

static size_t align64(size_t n) { return (n + 63u) & ~(size_t)63u; }

static int valid_block_size(uint32_t bs) {
    return bs >= 16 && bs <= 256 && (bs & (bs - 1)) == 0;
}

/* ---- INT4 matmul ---------------------------------------------------------- */

static size_t mm_panel_stride(uint64_t K, uint32_t bs, int zp_kind) {
    size_t nb = (size_t)((K + bs - 1) / bs);
    return nb * op_mm_block_bytes(bs, zp_kind);
}

size_t op_matmul_nbits_packed_size(uint64_t K, uint64_t N, uint32_t block_size, int zp_kind) {
    if (K == 0 || N == 0 || !valid_block_size(block_size) || zp_kind < 0 || zp_kind > 2) return 0;
    if ((K + block_size - 1) / block_size > UINT32_MAX) return 0;
    size_t panels = (size_t)((N + OP_PANEL_N - 1) / OP_PANEL_N);
    return OP_HEADER_SIZE + panels * mm_panel_stride(K, block_size, zp_kind);
}

/* Interleave the nibbles of one 32-bit source word (codes k0..k7 of one column,
 * low nibble first) into the group layout: byte j = code(j) | code(4 + j) << 4. */
static inline uint32_t spread_nibbles(uint32_t x) {
    x = (x | (x << 8)) & 0x00FF00FFu;
    x = (x | (x << 4)) & 0x0F0F0F0Fu;
    return x;
}
static inline uint32_t interleave_group(uint32_t w) {
    return spread_nibbles(w & 0xFFFFu) | (spread_nibbles(w >> 16) << 4);
}

/* interleave_group on both 32-bit halves of a 64-bit word at once (two groups of one
 * column: the shifts never carry across the halves, so each half gets exactly
 * interleave_group of itself). */
static inline uint64_t spread_nibbles2(uint64_t x) {
    x = (x | (x << 8)) & 0x00FF00FF00FF00FFull;
    x = (x | (x << 4)) & 0x0F0F0F0F0F0F0F0Full;
    return x;
}
static inline uint64_t interleave_group2(uint64_t w) {
    return spread_nibbles2(w & 0x0000FFFF0000FFFFull) |
           (spread_nibbles2((w >> 16) & 0x0000FFFF0000FFFFull) << 4);
}

/* Groups g0 .. g0 + n - 1 (n even) of one full column block: src holds them as
 * consecutive 32-bit words; group g goes to dst + g * 256. */
static inline void pack_groups(const uint8_t *src, uint8_t *dst, uint32_t g0, uint32_t n) {
    const size_t gs = OP_GROUP_BYTES * OP_PANEL_TILES;
    uint32_t g = g0;
#if defined(__SSE2__)
    /* four groups per step: the same shifts and masks as interleave_group, on 4 lanes */
    const __m128i m16 = _mm_set1_epi32(0xFFFF), m8 = _mm_set1_epi32(0x00FF00FF),
                  m4 = _mm_set1_epi32(0x0F0F0F0F);
    for (; g + 4 <= g0 + n; g += 4) {
        const __m128i w = _mm_loadu_si128((const __m128i *)(src + (size_t)g * 4u));
        __m128i lo = _mm_and_si128(w, m16), hi = _mm_srli_epi32(w, 16);
        lo = _mm_and_si128(_mm_or_si128(lo, _mm_slli_epi32(lo, 8)), m8);
        hi = _mm_and_si128(_mm_or_si128(hi, _mm_slli_epi32(hi, 8)), m8);
        lo = _mm_and_si128(_mm_or_si128(lo, _mm_slli_epi32(lo, 4)), m4);
        hi = _mm_and_si128(_mm_or_si128(hi, _mm_slli_epi32(hi, 4)), m4);
        const __m128i r = _mm_or_si128(lo, _mm_slli_epi32(hi, 4));
        uint32_t v[4];
        _mm_storeu_si128((__m128i *)v, r);
        for (int j = 0; j < 4; j++) memcpy(dst + (size_t)(g + j) * gs, &v[j], 4);
    }
#endif
    for (; g < g0 + n; g += 2) {
        uint64_t w;
        memcpy(&w, src + (size_t)g * 4u, 8);
        w = interleave_group2(w);
        const uint32_t lo = (uint32_t)w, hi = (uint32_t)(w >> 32);
        memcpy(dst + (size_t)g * gs, &lo, 4);
        memcpy(dst + (size_t)(g + 1) * gs, &hi, 4);
    }
}

/* Where a block's scale and zero point come from. */
typedef struct {
    const float *scales;
    const uint8_t *zp_u4;
    const float *zp_f32;
    int zp_kind;
    uint32_t bs;
} scale_zero_src;

/* Column col's scale and zero point in its block record, from source index s (n * nb + b). */
static inline void put_scale_zero(const scale_zero_src *q, uint8_t *blk, size_t col, size_t s) {
    uint8_t *sc = blk + (size_t)q->bs * 32u, *zb = sc + OP_PANEL_N * 4u;
    memcpy(sc + col * 4u, q->scales + s, 4);
    if (q->zp_kind == OP_ZP_U4)
        zb[col] = q->zp_u4[s] & 0x0Fu;
    else if (q->zp_kind == OP_ZP_FLOAT)
        memcpy(zb + col * 4u, q->zp_f32 + s, 4);
}

/* One column's block that runs past K: the codes past `valid` are zero. */
static void pack_partial_block(const uint8_t *src, uint64_t valid, uint32_t bs, uint8_t *blk,
                               size_t col) {
    for (uint32_t g = 0; g < bs / OP_GROUP_K; g++) {
        uint32_t w;
        memcpy(&w, src + (size_t)g * 4u, 4);
        uint64_t first = (uint64_t)g * OP_GROUP_K;
        if (first + OP_GROUP_K > valid) /* block padding past K: zero codes */
            w = first >= valid ? 0u : w & (uint32_t)((1ull << (4 * (valid - first))) - 1u);
        w = interleave_group(w);
        memcpy((uint8_t *)op_mm_group(blk, g, (int)(col / OP_TILE_N)) + 4 * (col % OP_TILE_N), &w, 4);
    }
}

#if defined(__SSE2__)
/* interleave_group on each 32-bit lane */
static inline __m128i interleave_group4(__m128i w) {
    const __m128i m16 = _mm_set1_epi32(0xFFFF), m8 = _mm_set1_epi32(0x00FF00FF),
                  m4 = _mm_set1_epi32(0x0F0F0F0F);
    __m128i lo = _mm_and_si128(w, m16), hi = _mm_srli_epi32(w, 16);
    lo = _mm_and_si128(_mm_or_si128(lo, _mm_slli_epi32(lo, 8)), m8);
    hi = _mm_and_si128(_mm_or_si128(hi, _mm_slli_epi32(hi, 8)), m8);
    lo = _mm_and_si128(_mm_or_si128(lo, _mm_slli_epi32(lo, 4)), m4);
    hi = _mm_and_si128(_mm_or_si128(hi, _mm_slli_epi32(hi, 4)), m4);
    return _mm_or_si128(lo, _mm_slli_epi32(hi, 4));
}

/* Whole blocks of four adjacent columns (source rows `row_stride` bytes apart, the
 * first column 4-aligned in its tile): n_groups (a multiple of 4) groups each; group
 * g of the four goes to dst + g * 256 as 16 contiguous bytes. */
static inline void pack_4_columns(const uint8_t *src, size_t row_stride, uint8_t *dst,
                                  uint32_t n_groups) {
    const size_t gs = OP_GROUP_BYTES * OP_PANEL_TILES;
    for (uint32_t g = 0; g < n_groups; g += 4) {
        const uint8_t *s = src + (size_t)g * 4u;
        const __m128i r0 = _mm_loadu_si128((const __m128i *)s),
                      r1 = _mm_loadu_si128((const __m128i *)(s + row_stride)),
                      r2 = _mm_loadu_si128((const __m128i *)(s + 2 * row_stride)),
                      r3 = _mm_loadu_si128((const __m128i *)(s + 3 * row_stride));
        const __m128i t0 = _mm_unpacklo_epi32(r0, r1), t1 = _mm_unpacklo_epi32(r2, r3),
                      t2 = _mm_unpackhi_epi32(r0, r1), t3 = _mm_unpackhi_epi32(r2, r3);
        uint8_t *d = dst + (size_t)g * gs;
        _mm_storeu_si128((__m128i *)d, interleave_group4(_mm_unpacklo_epi64(t0, t1)));
        _mm_storeu_si128((__m128i *)(d + gs), interleave_group4(_mm_unpackhi_epi64(t0, t1)));
        _mm_storeu_si128((__m128i *)(d + 2 * gs), interleave_group4(_mm_unpacklo_epi64(t2, t3)));
        _mm_storeu_si128((__m128i *)(d + 3 * gs), interleave_group4(_mm_unpackhi_epi64(t2, t3)));
    }
}
#endif

static void write_header(uint8_t *out, uint16_t kind, uint32_t flags, uint32_t bs, uint64_t K,
                         uint64_t N, uint32_t nb, uint32_t panel_n, uint64_t stride,
                         uint64_t total) {
    op_packed_header h;
    memset(&h, 0, sizeof h);
    h.magic = OP_PACK_MAGIC;
    h.format_version = OP_PACK_FORMAT_VERSION;
    h.kind = kind;
    h.flags = flags;
    h.block_size = bs;
    h.K = K;
    h.N = N;
    h.n_blocks = nb;
    h.panel_n = panel_n;
    h.panel_stride = stride;
    h.data_offset = OP_HEADER_SIZE;
    h.total_size = total;
    memcpy(out, &h, sizeof h);
}

int op_prepack_matmul_nbits(const uint8_t *B, const float *scales, const uint8_t *zp_u4,
                            const float *zp_f32, uint64_t K, uint64_t N, uint32_t bs,
                            int zp_kind, int accuracy_level, int scales_were_f16,
                            uint8_t *out, size_t out_size) {
    op_ran(OP_KERNEL_NONE);
    size_t need = op_matmul_nbits_packed_size(K, N, bs, zp_kind);
    if (!need || out_size != need || !B || !scales || !out) return OP_E_ARG;
    if (accuracy_level < 0 || accuracy_level > 4) return OP_E_ARG;
    if ((zp_kind == OP_ZP_U4 && !zp_u4) || (zp_kind == OP_ZP_FLOAT && !zp_f32)) return OP_E_ARG;
    op_ran(OP_KERNEL_SCALAR); /* packing is portable C on every ISA */
    const uint32_t nb = (uint32_t)((K + bs - 1) / bs);
    const size_t blob = bs / 2, stride = mm_panel_stride(K, bs, zp_kind);
    const size_t blk_bytes = op_mm_block_bytes(bs, zp_kind);
    const size_t panels = (size_t)((N + OP_PANEL_N - 1) / OP_PANEL_N);
    uint32_t flags = (uint32_t)zp_kind | ((uint32_t)accuracy_level << OP_FLAG_ACC_SHIFT) |
                     (scales_were_f16 ? OP_FLAG_SCALES_F16 : 0u);
    write_header(out, OP_KIND_INT4_MATMUL, flags, bs, K, N, nb, OP_PANEL_N, stride, need);
    const scale_zero_src q = {scales, zp_u4, zp_f32, zp_kind, bs};

    for (size_t p = 0; p < panels; p++) {
        uint8_t *panel = out + OP_HEADER_SIZE + p * stride;
        const size_t n0 = p * OP_PANEL_N;
        const size_t ncols = (N - n0) < OP_PANEL_N ? (size_t)(N - n0) : OP_PANEL_N;
        if (ncols < OP_PANEL_N) memset(panel, 0, stride); /* padded columns: all zero */
        /* NOTE: column-major walk: each column's source row (all its blocks) is read
         * front to back, so the panel's 64 contiguous source rows stream in order
         * while its output (nb blocks, ~80 KiB for K = 2048) stays in L2 as its dwords
         * fill in. Blocks outer, columns inner (before) read 64 rows 1 KiB apart per
         * step. Measured on the medium fixture's matmuls (Zen 4 VM, one thread): into
         * committed pages that have left the cache, 2.0 -> 3.0 GB/s of output; into a
         * slot committed just before (the runtime's case) or a fresh buffer, no change:
         * there the kernel's page zeroing (or faults) costs as much as the pack. */
        size_t col = 0;
#if defined(__SSE2__)
        /* four columns at a time: each whole block's four source rows are loaded 16
         * bytes (four groups) each, transposed 4 x 4 in registers and written as 16
         * contiguous bytes (four columns) to each group's row; what is left (blocks
         * of 16 codes, the block padded past K, a panel's last columns) takes the
         * one-column path below. Same bytes. */
        if (bs >= 32)
            for (; col + 4 <= ncols; col += 4) {
                const size_t n = n0 + col;
                for (uint32_t b = 0; b < nb; b++) {
                    uint8_t *blk = panel + (size_t)b * blk_bytes;
                    const uint64_t valid = (K - (uint64_t)b * bs) < bs ? K - (uint64_t)b * bs : bs;
                    const uint8_t *src = B + ((size_t)n * nb + b) * blob;
                    if (valid == bs)
                        pack_4_columns(src, (size_t)nb * blob, blk + col * 4u, bs / OP_GROUP_K);
                    else
                        for (size_t j = 0; j < 4; j++)
                            pack_partial_block(src + j * nb * blob, valid, bs, blk, col + j);
                    for (size_t j = 0; j < 4; j++)
                        put_scale_zero(&q, blk, col + j, (n + j) * nb + b);
                }
            }
#endif
        for (; col < ncols; col++) {
            const size_t n = n0 + col, i = col / OP_TILE_N, c = col % OP_TILE_N;
            for (uint32_t b = 0; b < nb; b++) {
                uint8_t *blk = panel + (size_t)b * blk_bytes;
                const uint64_t valid = (K - (uint64_t)b * bs) < bs ? K - (uint64_t)b * bs : bs;
                const uint8_t *src = B + ((size_t)n * nb + b) * blob;
                uint8_t *dst = (uint8_t *)op_mm_group(blk, 0, (int)i) + 4 * c; /* group g: + g * 256 */
                if (valid == bs) {
                    /* the common case: whole block, several groups per step (bs / 8 is
                     * even, bs >= 16) */
                    pack_groups(src, dst, 0, bs / OP_GROUP_K);
                } else {
                    pack_partial_block(src, valid, bs, blk, col);
                }
                put_scale_zero(&q, blk, col, (size_t)n * nb + b);
            }
        }
    }
    return OP_OK;
}

static size_t gather_row_stride(uint32_t nb, uint32_t bs, int zp_kind);

/* ---- header validation ----------------------------------------------------- */

int op_packed_header_read(const uint8_t *packed, size_t size, int expected_kind,
                          op_packed_header *out) {
    op_packed_header h;
    if (!packed || size < OP_HEADER_SIZE) return OP_E_HEADER;
    memcpy(&h, packed, sizeof h);
    if (h.magic != OP_PACK_MAGIC || h.format_version != OP_PACK_FORMAT_VERSION) return OP_E_HEADER;
    if (expected_kind && h.kind != expected_kind) return OP_E_HEADER;
    if (h.total_size != size || h.data_offset != OP_HEADER_SIZE || h.K == 0 || h.N == 0)
        return OP_E_HEADER;
    size_t expect;
    switch (h.kind) {
    case OP_KIND_INT4_MATMUL: {
        int zk = (int)(h.flags & OP_FLAG_ZP_MASK);
        uint32_t acc = (h.flags & OP_FLAG_ACC_MASK) >> OP_FLAG_ACC_SHIFT;
        if (zk > 2 || acc > 4 || h.panel_n != OP_PANEL_N) return OP_E_HEADER;
        if (!valid_block_size(h.block_size)) return OP_E_HEADER;
        if (h.n_blocks != (h.K + h.block_size - 1) / h.block_size) return OP_E_HEADER;
        if (h.panel_stride != mm_panel_stride(h.K, h.block_size, zk)) return OP_E_HEADER;
        expect = op_matmul_nbits_packed_size(h.K, h.N, h.block_size, zk);
        break;
    }
    case OP_KIND_INT4_GATHER: {
        int zk = (int)(h.flags & OP_FLAG_ZP_MASK);
        if (zk > 2 || h.panel_n != 0 || !valid_block_size(h.block_size) ||
            (uint64_t)h.n_blocks * h.block_size != h.K ||
            h.panel_stride != gather_row_stride(h.n_blocks, h.block_size, zk))
            return OP_E_HEADER;
        expect = op_gather_packed_size(h.N, h.n_blocks, h.block_size, zk);
        break;
    }
    case OP_KIND_GEMM_B:
        if (h.panel_n != OP_TILE_N || h.panel_stride != h.K * OP_TILE_N * 4u) return OP_E_HEADER;
        expect = op_gemm_b_packed_size(h.K, h.N);
        break;
    default:
        return OP_E_HEADER;
    }
    if (!expect || expect != size) return OP_E_HEADER;
    if (out) *out = h;
    return OP_OK;
}

/* ---- GatherBlockQuantized ------------------------------------------------------
 * Layout: after the header, V rows of row_stride bytes (a multiple of 64):
 *   [codes n_blocks * block_size/2 bytes, the source's bytes unchanged]
 *   [scales n_blocks fp32][zeros n_blocks uint8 | n_blocks fp32 | absent][zero pad] */

static size_t gather_row_stride(uint32_t nb, uint32_t bs, int zp_kind) {
    size_t zb = zp_kind == OP_ZP_U4 ? 1u : zp_kind == OP_ZP_FLOAT ? 4u : 0u;
    return align64((size_t)nb * bs / 2u + (size_t)nb * 4u + (size_t)nb * zb);
}

size_t op_gather_packed_size(uint64_t V, uint32_t nb, uint32_t bs, int zp_kind) {
    if (V == 0 || nb == 0 || !valid_block_size(bs) || zp_kind < 0 || zp_kind > 2) return 0;
    return OP_HEADER_SIZE + (size_t)V * gather_row_stride(nb, bs, zp_kind);
}

int op_prepack_gather(const uint8_t *data, const float *scales, const uint8_t *zp_u4,
                      const float *zp_f32, uint64_t V, uint32_t nb, uint32_t bs, int zp_kind,
                      int scales_were_f16, uint8_t *out, size_t out_size) {
    op_ran(OP_KERNEL_NONE);
    size_t need = op_gather_packed_size(V, nb, bs, zp_kind);
    if (!need || out_size != need || !data || !scales || !out) return OP_E_ARG;
    if ((zp_kind == OP_ZP_U4 && !zp_u4) || (zp_kind == OP_ZP_FLOAT && !zp_f32)) return OP_E_ARG;
    op_ran(OP_KERNEL_SCALAR);
    const size_t stride = gather_row_stride(nb, bs, zp_kind), codes = (size_t)nb * bs / 2u;
    uint32_t flags = (uint32_t)zp_kind | (scales_were_f16 ? OP_FLAG_SCALES_F16 : 0u);
    write_header(out, OP_KIND_INT4_GATHER, flags, bs, (uint64_t)nb * bs, V, nb, 0, stride, need);
    for (uint64_t v = 0; v < V; v++) {
        uint8_t *row = out + OP_HEADER_SIZE + v * stride;
        memcpy(row, data + v * codes, codes);
        memcpy(row + codes, scales + v * nb, (size_t)nb * 4u);
        size_t used = codes + (size_t)nb * 4u;
        if (zp_kind == OP_ZP_U4) {
            for (uint32_t b = 0; b < nb; b++) row[used + b] = zp_u4[v * nb + b] & 0x0Fu;
            used += nb;
        } else if (zp_kind == OP_ZP_FLOAT) {
            memcpy(row + used, zp_f32 + v * nb, (size_t)nb * 4u);
            used += (size_t)nb * 4u;
        }
        memset(row + used, 0, stride - used);
    }
    return OP_OK;
}

/* ---- fp32 Gemm B -----------------------------------------------------------------
 * Layout: ceil(N / 16) tiles ("panels" of one tile) of K rows x 16 fp32
 * (row k = B[k, c0..c0+15]), columns past N zero. */

size_t op_gemm_b_packed_size(uint64_t K, uint64_t N) {
    if (K == 0 || N == 0) return 0;
    return OP_HEADER_SIZE + (size_t)((N + OP_TILE_N - 1) / OP_TILE_N) * (size_t)K * OP_TILE_N * 4u;
}

int op_prepack_gemm_b(const float *B, uint64_t K, uint64_t N, int trans_b, uint8_t *out,
                      size_t out_size) {
    op_ran(OP_KERNEL_NONE);
    size_t need = op_gemm_b_packed_size(K, N);
    if (!need || out_size != need || !B || !out) return OP_E_ARG;
    op_ran(OP_KERNEL_SCALAR);
    const size_t stride = (size_t)K * OP_TILE_N * 4u, tiles = (size_t)((N + OP_TILE_N - 1) / OP_TILE_N);
    write_header(out, OP_KIND_GEMM_B, trans_b ? OP_FLAG_TRANS_B : 0u, 0, K, N, 0, OP_TILE_N,
                 stride, need);
    for (size_t t = 0; t < tiles; t++) {
        float *tile = (float *)(out + OP_HEADER_SIZE + t * stride);
        const size_t n0 = t * OP_TILE_N;
        const size_t ncols = (N - n0) < OP_TILE_N ? (size_t)(N - n0) : OP_TILE_N;
        if (ncols < OP_TILE_N) memset(tile, 0, stride);
        if (!trans_b) {
            for (size_t k = 0; k < K; k++)
                memcpy(tile + k * OP_TILE_N, B + k * N + n0, ncols * 4u);
        } else {
            for (size_t c = 0; c < ncols; c++) {
                const float *src = B + (n0 + c) * K;
                for (size_t k = 0; k < K; k++) tile[k * OP_TILE_N + c] = src[k];
            }
        }
    }
    return OP_OK;
}
