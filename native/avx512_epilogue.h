/* The INT4 matmul's per-block epilogue and output store, shared by the AVX-512 panels
 * (kernels_avx512.c) and the AMX tiles (kernels_amx.c), so both fold a block's integer
 * dot products into the output with the same operations in the same order (the same
 * bits). Included after the including file's `#pragma GCC target` with AVX-512; AI is
 * that file's always-inline. */
#ifndef ONNX_PREP_AVX512_EPILOGUE_H
#define ONNX_PREP_AVX512_EPILOGUE_H

/* Columns of tile t inside [col_begin, col_end), as a lane mask. */
AI __mmask16 col_mask(size_t cb, size_t ce, size_t t) {
    size_t c0 = t * OP_TILE_N;
    size_t lo = cb > c0 ? cb - c0 : 0, hi = ce - c0 < OP_TILE_N ? ce - c0 : OP_TILE_N;
    return (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

AI __m512 block_zeros(const op_packed_header *h, const uint8_t *blk, int i) {
    switch (op_zp_kind(h)) {
    case OP_ZP_U4:
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)op_mm_zeros(h, blk, i))));
    case OP_ZP_FLOAT:
        return _mm512_loadu_ps((const float *)op_mm_zeros(h, blk, i));
    default:
        return _mm512_set1_ps(8.0f);
    }
}

/* One block's integer dot product d folded into a row's output (int8 and bfp modes):
 * out + (ascale * scale) * (d - zero * asum). */
AI __m512 fold_int_block(__m512 out, __m512 d, __m512 s, __m512 z, float asum, float ascale) {
    d = _mm512_fnmadd_ps(z, _mm512_set1_ps(asum), d);
    return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(ascale), s), d, out);
}

AI void store_out(const op_mm_args *a, size_t m, size_t t, __m512 v) {
    __mmask16 mk = col_mask(a->col_begin, a->col_end, t);
    size_t c0 = t * OP_TILE_N;
    if (a->bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, a->bias + c0));
    _mm512_mask_storeu_ps(a->Y + m * a->ldy + c0, mk, v);
}

#endif
