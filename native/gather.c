/* GatherBlockQuantized (gather_axis 0, quantize_axis last): dequantized rows of either
 * INT4 packed kind.
 *
 * - OP_KIND_INT4_GATHER: row v is one contiguous record (its codes as the source's
 *   bytes, then its scales and zero points; pack.c).
 * - OP_KIND_INT4_MATMUL: row v is output column v of the matmul's B (op_internal.h's
 *   panel layout): column v % 64 of panel v / 64, lane v % 16 of tile (v % 64) / 16.
 *   Block b's codes are that lane's 4 bytes in each of the block record's 64-byte
 *   groups (byte j: code k0 + j low, k0 + 4 + j high), its scale and zero point the
 *   lane's entries of the record's scales and zeros. This is how a tied embedding
 *   reads its LM head's object: the one weight is packed, cached and held once.
 *
 * Both compute out = ((float)code - zero) * scale, in that order, as the op's
 * reference does, from the same fp32 scales and zero points (fp16 ones widened when
 * packed, exactly), so a row gives the same bits from either kind (tested).
 *
 * NOTE: one portable implementation for every ISA: a decode step gathers one row per
 * token (K values), so a call costs microseconds against the step's GEMVs; from the
 * matmul layout it touches one 4-byte lane per 64-byte group, latency- not
 * compute-bound, where vector code has nothing to widen. */
#include <string.h>
#include "op_internal.h"

/* out = dequant(row v) of an INT4 gather buffer: K = n_blocks * block_size values. */
static void gather_record_row(const op_packed_header *h, const uint8_t *rows, uint64_t v, float *o) {
    const uint32_t nb = h->n_blocks, bs = h->block_size;
    const size_t codes = (size_t)nb * bs / 2u;
    const int zk = op_zp_kind(h);
    const uint8_t *row = rows + (size_t)v * h->panel_stride;
    const float *sc = (const float *)(row + codes);
    const uint8_t *zu = row + codes + (size_t)nb * 4u;
    const float *zf = (const float *)zu;
    for (uint32_t b = 0; b < nb; b++) {
        const float s = sc[b];
        const float z = zk == OP_ZP_U4 ? (float)zu[b] : zk == OP_ZP_FLOAT ? zf[b] : 8.0f;
        const uint8_t *q = row + (size_t)b * bs / 2u;
        float *ob = o + (size_t)b * bs;
        for (uint32_t j = 0; j < bs / 2u; j++) {
            ob[2 * j] = ((float)(q[j] & 0x0F) - z) * s;
            ob[2 * j + 1] = ((float)(q[j] >> 4) - z) * s;
        }
    }
}

/* out = dequant(column v) of an INT4 matmul buffer: its K values (a block past K is
 * cut at K; its padding codes are never read). */
static void gather_column_row(const op_packed_header *h, const uint8_t *panels, uint64_t v, float *o) {
    const size_t p = (size_t)(v / OP_PANEL_N);
    const int t = (int)((v % OP_PANEL_N) / OP_TILE_N);
    const size_t c = (size_t)(v % OP_TILE_N);
    const uint32_t bs = h->block_size;
    const int zk = op_zp_kind(h);
    for (uint32_t b = 0; b < h->n_blocks; b++) {
        const uint8_t *blk = op_mm_block(h, panels, p, b);
        const float s = op_mm_scales(h, blk, t)[c];
        const void *zeros = op_mm_zeros(h, blk, t);
        const float z = zk == OP_ZP_U4 ? (float)((const uint8_t *)zeros)[c]
                        : zk == OP_ZP_FLOAT ? ((const float *)zeros)[c] : 8.0f;
        const uint64_t k0 = (uint64_t)b * bs;
        const uint32_t valid = h->K - k0 < bs ? (uint32_t)(h->K - k0) : bs;
        float *ob = o + k0;
        for (uint32_t g = 0; g * OP_GROUP_K < valid; g++) {
            const uint8_t *q = op_mm_group(blk, g, t) + 4u * c;
            float vals[OP_GROUP_K];
            for (int j = 0; j < 4; j++) {
                vals[j] = ((float)(q[j] & 0x0F) - z) * s;
                vals[4 + j] = ((float)(q[j] >> 4) - z) * s;
            }
            const uint32_t left = valid - g * OP_GROUP_K;
            memcpy(ob + (size_t)g * OP_GROUP_K, vals, (left < OP_GROUP_K ? left : OP_GROUP_K) * sizeof(float));
        }
    }
}

int op_gather_block_quantized(const int64_t *indices, size_t n_indices, const uint8_t *packed,
                              size_t packed_size, float *out, size_t *bad_position) {
    op_ran(OP_KERNEL_NONE);
    op_packed_header h;
    int st = op_packed_header_read(packed, packed_size, 0, &h);
    if (st) return st;
    if (h.kind != OP_KIND_INT4_GATHER && h.kind != OP_KIND_INT4_MATMUL) return OP_E_HEADER;
    if ((!indices || !out) && n_indices) return OP_E_ARG;
    const int64_t V = (int64_t)h.N;
    for (size_t i = 0; i < n_indices; i++)
        if (indices[i] < -V || indices[i] >= V) {
            if (bad_position) *bad_position = i;
            return OP_E_INDEX;
        }
    op_ran(OP_KERNEL_SCALAR); /* one portable implementation for every ISA */
    const uint8_t *data = packed + h.data_offset;
    for (size_t i = 0; i < n_indices; i++) {
        const uint64_t v = (uint64_t)(indices[i] < 0 ? indices[i] + V : indices[i]);
        float *o = out + i * (size_t)h.K;
        if (h.kind == OP_KIND_INT4_GATHER)
            gather_record_row(&h, data, v, o);
        else
            gather_column_row(&h, data, v, o);
    }
    return OP_OK;
}
