/* com.microsoft GroupQueryAttention (fp32): the driver and the scalar twin.
 *
 * One unit of work is one (batch row, kv head): it writes that kv head's present rows
 * (past rows copied unless the buffer is shared, then the new rows, keys rotated) and
 * computes the outputs of the num_heads / kv_num_heads query heads that read it. Per
 * query row: rotate q, scores = scale * q.k over the causal span, a max-subtracted
 * softmax, out = sum p * v. With an additive mask (op_gqa_params.mask) a query row
 * weighs every key of its row's total length, the mask added to its score. The row's
 * scores, its softmax and its weighted sum go through the ISA's op_attn_table (one call
 * each per query row, or per group of OP_ATTN_ROWS query heads of one kv head where the
 * table has row groups; attention_simd.c); everything else is portable C shared by all
 * ISAs. The scalar table below is the reference the SIMD tables are tested against:
 * plain loops and libm's expf.
 *
 * A sliding window narrows the span to its last `window` positions: the tables get a
 * shorter row starting at the window's first key, so a windowed row is, bit for bit,
 * the same call as an unwindowed one over a cache cut to the window. The softcap
 * (tanhf) runs between the scores and the softmax, in portable C for every ISA. A
 * sliding-window cache (window_cache) indexes its buffers from the first position they
 * hold; a step that evicts reads through a staging copy of its past and new rows.
 *
 * NOTE: a padding row of a first prompt (s >= total_b: rows of different lengths in one
 * batch) attends to the row's total_b positions, as ONNX Runtime's does (its causal
 * span, s + 1, capped at total_b); its keys and values still go to present rows
 * [total_b, S), as there. Nothing downstream should read them. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "attention.h"

static float dot_scalar(const float *a, const float *b, size_t n) {
    float s = 0.0f;
    for (size_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static float scores_scalar(const float *q, const float *k, size_t h, size_t n, float scale, const float *mask,
                           float *scores) {
    float mx = -INFINITY;
    for (size_t i = 0; i < n; i++) {
        scores[i] = scale * dot_scalar(q, k + i * h, h);
        if (mask) scores[i] += mask[i];
        if (scores[i] > mx) mx = scores[i];
    }
    return mx;
}

static float softmax_scalar(float *scores, size_t n, float max) {
    float sum = 0.0f;
    for (size_t i = 0; i < n; i++) {
        scores[i] = expf(scores[i] - max);
        sum += scores[i];
    }
    return sum;
}

static void weighted_sum_scalar(float *o, const float *p, float w, const float *v, size_t h, size_t n) {
    memset(o, 0, h * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        const float a = p[i] * w;
        for (size_t j = 0; j < h; j++) o[j] += a * v[i * h + j];
    }
}

const op_attn_table op_attn_scalar = {scores_scalar, softmax_scalar, weighted_sum_scalar, NULL, NULL, OP_KERNEL_SCALAR};

static const op_attn_table *attn_table(int isa, int *status) {
    if (!op_isa_supported(isa)) {
        *status = OP_E_ISA;
        return NULL;
    }
    *status = OP_OK;
    switch (isa) {
#if OP_SIMD
    case OP_ISA_AVX2: return &op_attn_avx2;
    case OP_ISA_AVX512:
    case OP_ISA_AVX512_NOVNNI: return &op_attn_avx512;
#endif
    default: return &op_attn_scalar;
    }
}

/* dst = x rotated at cache row `pos` (values past rotary_dim copied as they are). */
static void rotate(const op_gqa_params *p, const float *cos_cache, const float *sin_cache, int64_t pos,
                   const float *x, float *dst) {
    const int64_t h = p->head_size, rd = p->rotary_dim, half = rd / 2;
    const float *c = cos_cache + pos * half, *s = sin_cache + pos * half;
    if (p->interleaved) {
        for (int64_t i = 0; i < half; i++) {
            const float x0 = x[2 * i], x1 = x[2 * i + 1];
            dst[2 * i] = x0 * c[i] - x1 * s[i];
            dst[2 * i + 1] = x1 * c[i] + x0 * s[i];
        }
    } else {
        for (int64_t i = 0; i < half; i++) {
            const float x0 = x[i], x1 = x[i + half];
            dst[i] = x0 * c[i] - x1 * s[i];
            dst[i + half] = x1 * c[i] + x0 * s[i];
        }
    }
    memcpy(dst + rd, x + rd, (size_t)(h - rd) * sizeof(float));
}

/* Positions a sliding-window cache keeps after T tokens (onnx_prep_native.h, window_cache):
 * all up to its capacity C, then it drops G = C - W + 1 at once, so the window's W stay. */
static int64_t window_rows(int64_t T, int64_t C, int64_t W) {
    if (T <= C) return T;
    const int64_t G = C - W + 1;
    return T - G * ((T - C + G - 1) / G);
}

/* Where row b's keys are before and after the step. Past buffer rows [0, kept) hold
 * positions [past - kept, past); after the step present rows [0, keep) hold positions
 * [total - keep, total) (a full-length cache: kept = past, keep = past + seq, both from
 * position 0; a first prompt's padding rows are kept too, as ONNX Runtime keeps them). */
typedef struct {
    int64_t total, past, kept, keep;
} op_gqa_row;

/* Row b's layout, or -1 when seqlens_k[b] does not fit the buffers. */
static int row_layout(const op_gqa_params *p, const int64_t *seqlens_k, int64_t b, op_gqa_row *r) {
    const int64_t t = seqlens_k[b] + 1, S = p->seq;
    const int64_t past = p->first_prompt ? 0 : t - S;
    r->total = t;
    r->past = past;
    r->kept = r->keep = 0;
    if (t < 1 || past < 0 || (p->first_prompt && t > S)) return -1;
    if (p->window_cache) {  /* any past fits: the cache keeps a window of it; no padding row (ONNX Runtime's rule) */
        if (p->first_prompt && t < S) return -1;
        r->kept = window_rows(past, p->past_len, p->window);
        r->keep = window_rows(t, p->past_len, p->window);
        return 0;
    }
    if (past + S > p->present_len || (past > 0 && past > p->past_len)) return -1;
    r->kept = past;
    r->keep = past + S;
    return 0;
}

/* A sliding-window cache whose step drops positions it still reads, or whose new rows
 * do not fit after the kept ones, computes through a staging copy (past rows, then the
 * new ones) and writes the rows it keeps to present afterwards. */
static int staged(const op_gqa_params *p, const op_gqa_row *r) {
    return p->window_cache && (r->total - r->keep != r->past - r->kept || r->kept + p->seq > p->present_len);
}

static int64_t stride(int64_t given, int64_t len) { return given > 0 ? given : len; }

/* Present rows other than the new ones of kv head j of row b (pk: its first row): none
 * to write when present is the past's own buffer (shared); otherwise the past's first
 * `kept` rows, then zeros after the new rows. */
static void place_past(const op_gqa_params *p, const float *past_buf, int64_t past_stride, const float *present_buf,
                       float *pk, int64_t b, int64_t j, int64_t kept) {
    const int64_t H = p->head_size, S = p->seq;
    if (past_buf != NULL && past_buf == present_buf) return;
    memset(pk + (kept + S) * H, 0, (size_t)(p->present_len - kept - S) * (size_t)H * sizeof(float));
    if (kept > 0)
        memcpy(pk, past_buf + (b * p->kv_num_heads + j) * past_stride * H, (size_t)(kept * H) * sizeof(float));
}

/* scores[i] = softcap * tanh(scores[i] / softcap), in portable C for every ISA: the same
 * bits from the same scores. Returns the new largest score, NaN skipped as the tables'. */
static float softcap_row(float *scores, size_t n, float softcap) {
    float mx = -INFINITY;
    for (size_t i = 0; i < n; i++) {
        scores[i] = softcap * tanhf(scores[i] / softcap);
        if (scores[i] > mx) mx = scores[i];
    }
    return mx;
}

/* The first rows of unit u's past keys and values (where the unit will read them),
 * asked for while the unit before it computes. NOTE: in a decode step the KV cache
 * comes from DRAM (the step's weights streamed through the caches since this layer
 * last ran), and each unit's rows are a few 4 KiB pages that the hardware prefetcher
 * starts on afresh; asking for the next unit's first rows ahead measured 419 -> 388
 * us a call (median of 480 each, on and off alternating every two steps; 32 heads,
 * past 64-84, the medium fixture's layers in one-thread decode steps, 2-vCPU Intel
 * Xeon, 2026-12-02). Past OP_ATTN_PREFETCH bytes a row's stream
 * is long enough for the hardware prefetcher; prefetching more would only evict. */
#define OP_ATTN_PREFETCH 32768u
static void prefetch_unit(const op_gqa_params *p, const float *past_key, const float *past_value,
                          const float *present_key, const float *present_value, int64_t u, int64_t past) {
    const int64_t b = u / p->kv_num_heads, j = u % p->kv_num_heads, H = p->head_size;
    const int shared_k = past_key != NULL && past_key == present_key;
    const int shared_v = past_value != NULL && past_value == present_value;
    const float *k = shared_k ? present_key + (b * p->kv_num_heads + j) * stride(p->present_key_stride, p->present_len) * H
                   : past_key ? past_key + (b * p->kv_num_heads + j) * stride(p->past_key_stride, p->past_len) * H : NULL;
    const float *v = shared_v ? present_value + (b * p->kv_num_heads + j) * stride(p->present_value_stride, p->present_len) * H
                   : past_value ? past_value + (b * p->kv_num_heads + j) * stride(p->past_value_stride, p->past_len) * H : NULL;
    size_t n = (size_t)(past > 0 ? past : 0) * (size_t)H * sizeof(float);
    if (n > OP_ATTN_PREFETCH) n = OP_ATTN_PREFETCH;
    for (size_t o = 0; o < n; o += 64) {
        if (k) __builtin_prefetch((const char *)k + o, 0, 3);
        if (v) __builtin_prefetch((const char *)v + o, 0, 3);
    }
}

static void unit(const op_attn_table *t, const op_gqa_params *p, const float *query, const float *key,
                 const float *value, const float *past_key, const float *past_value, int64_t b, int64_t j,
                 const op_gqa_row *row, const float *cos_cache, const float *sin_cache, float *out,
                 float *present_key, float *present_value, float *scratch, float *stage) {
    const int64_t S = p->seq, H = p->head_size, N = p->num_heads, KN = p->kv_num_heads, G = N / KN;
    const int64_t past = row->past, total = row->total, kept = row->kept;
    const size_t row_bytes = (size_t)H * sizeof(float);
    float *pk = present_key + (b * KN + j) * stride(p->present_key_stride, p->present_len) * H;
    float *pv = present_value + (b * KN + j) * stride(p->present_value_stride, p->present_len) * H;
    /* dk / dv: the rows the queries read, position `first` at row 0 (present itself, or
     * the staging copy) */
    float *dk = pk, *dv = pv;
    const int64_t first = past - kept;
    const int staging = staged(p, row);
    if (staging) {
        dk = stage;
        dv = stage + (kept + S) * H;
        if (kept > 0) {
            memcpy(dk, past_key + (b * KN + j) * stride(p->past_key_stride, p->past_len) * H, (size_t)kept * row_bytes);
            memcpy(dv, past_value + (b * KN + j) * stride(p->past_value_stride, p->past_len) * H,
                   (size_t)kept * row_bytes);
        }
    } else {
        place_past(p, past_key, stride(p->past_key_stride, p->past_len), present_key, pk, b, j, kept);
        place_past(p, past_value, stride(p->past_value_stride, p->past_len), present_value, pv, b, j, kept);
    }
    for (int64_t s = 0; s < S && !p->cache_only; s++) {
        const float *k = key + ((b * S + s) * KN + j) * H, *v = value + ((b * S + s) * KN + j) * H;
        if (p->rotary_dim > 0)
            rotate(p, cos_cache, sin_cache, past + s, k, dk + (kept + s) * H);
        else
            memcpy(dk + (kept + s) * H, k, row_bytes);
        memcpy(dv + (kept + s) * H, v, row_bytes);
    }
    /* The query rows of one position s that read this kv head weigh the same keys: up to
     * OP_ATTN_ROWS of them go through a table's row-group entries at once (each key and
     * value read once for the group), else one at a time. */
    const int64_t R = t->scores_rows ? OP_ATTN_ROWS : 1;
    for (int64_t s = 0; s < S; s++) {
        /* keys [lo, hi) by position: causal up to the row's total, from the window's start.
         * NOTE: a first prompt's padding row (past + s + 1 > total) has its window end at
         * its own position in ONNX Runtime 1.32's kernel without softcap (past it: no key)
         * and at the row's total with softcap (its other path): both copied, though ONNX
         * Runtime calls these rows unspecified, so that every output row compares. */
        const int64_t hi = p->mask ? total : (past + s + 1 < total ? past + s + 1 : total);
        const int64_t end = p->softcap > 0.0f ? hi : past + s + 1;
        const int64_t lo = p->windowed && end - p->window > 0 ? end - p->window : 0;
        const size_t span = hi > lo ? (size_t)(hi - lo) : 0;
        const float *ks = dk + (lo - first) * H, *vs = dv + (lo - first) * H;
        for (int64_t g0 = 0; g0 < G; g0 += R) {
            const int64_t rows = G - g0 < R ? G - g0 : R;
            const float *qs[OP_ATTN_ROWS], *m[OP_ATTN_ROWS];
            float *sc[OP_ATTN_ROWS], *o[OP_ATTN_ROWS], mx[OP_ATTN_ROWS], w[OP_ATTN_ROWS];
            for (int64_t r = 0; r < OP_ATTN_ROWS; r++) {
                const int64_t h = j * G + g0 + (r < rows ? r : rows - 1);  /* past `rows`: the last again */
                qs[r] = query + ((b * S + s) * N + h) * H;
                if (p->rotary_dim > 0 && r < rows) rotate(p, cos_cache, sin_cache, past + s, qs[r], scratch + r * H);
                if (p->rotary_dim > 0) qs[r] = scratch + (r < rows ? r : rows - 1) * H;
                m[r] = p->mask ? p->mask + b * p->mask_b + h * p->mask_h + s * p->mask_s : NULL;
                sc[r] = scratch + OP_ATTN_ROWS * H + (r < rows ? r : rows - 1) * p->present_len;
                o[r] = out + ((b * S + s) * N + h) * H;
            }
            if (span == 0) {  /* a window that holds no key: zeros, as ONNX Runtime's empty sum */
                for (int64_t r = 0; r < rows; r++) memset(o[r], 0, row_bytes);
                continue;
            }
            if (rows > 1)
                t->scores_rows(qs, ks, (size_t)H, span, p->scale, p->mask ? m : NULL, sc, mx);
            else
                mx[0] = t->scores(qs[0], ks, (size_t)H, span, p->scale, m[0], sc[0]);
            if (p->softcap > 0.0f)
                for (int64_t r = 0; r < rows; r++) mx[r] = softcap_row(sc[r], span, p->softcap);
            int nan_rows = 0;
            for (int64_t r = 0; r < rows; r++) {
                const float sum = t->softmax(sc[r], span, mx[r]);
                w[r] = 1.0f / sum;
                if (p->mask && !(sum >= 1.0f && sum <= (float)span)) nan_rows |= 1 << r;  /* see the header */
            }
            for (int64_t r = rows; r < OP_ATTN_ROWS; r++) w[r] = w[rows - 1];
            if (rows > 1)
                t->weighted_sum_rows(o, (const float *const *)sc, w, vs, (size_t)H, span);
            else if (!nan_rows)
                t->weighted_sum(o[0], sc[0], w[0], vs, (size_t)H, span);
            for (int64_t r = 0; r < rows; r++)
                if (nan_rows & (1 << r))
                    for (int64_t i = 0; i < H; i++) o[r][i] = p->nan_to_zero ? 0.0f : NAN;
        }
    }
    if (staging) {  /* the rows kept: positions [total - keep, total), from the staging copy */
        const int64_t keep = row->keep, from = total - keep - first;
        memcpy(pk, dk + from * H, (size_t)keep * row_bytes);
        memcpy(pv, dv + from * H, (size_t)keep * row_bytes);
        if (past_key != present_key)
            memset(pk + keep * H, 0, (size_t)(p->present_len - keep) * row_bytes);
        if (past_value != present_value)
            memset(pv + keep * H, 0, (size_t)(p->present_len - keep) * row_bytes);
    }
}

int op_group_query_attention(int isa, const op_gqa_params *p, const float *query, const float *key,
                             const float *value, const float *past_key, const float *past_value,
                             const int64_t *seqlens_k, const float *cos_cache, const float *sin_cache,
                             float *out, float *present_key, float *present_value,
                             int64_t unit_begin, int64_t unit_end, int64_t *bad_row) {
    op_ran(OP_KERNEL_NONE);
    if (bad_row) *bad_row = -1;
    if (!p || !query || !key || !value || !seqlens_k || !out || !present_key || !present_value)
        return OP_E_ARG;
    if (p->batch < 0 || p->seq < 1 || p->num_heads < 1 || p->kv_num_heads < 1 || p->head_size < 1 ||
        p->num_heads % p->kv_num_heads || p->past_len < 0 || (p->present_len < p->seq && !p->window_cache) ||
        (p->past_len > 0 && (!past_key || !past_value)) || p->rotary_dim < 0 || p->rotary_dim % 2 ||
        p->rotary_dim > p->head_size || (p->rotary_dim > 0 && (!cos_cache || !sin_cache)))
        return OP_E_ARG;
    if ((p->windowed && p->window < 0) || ((p->windowed || p->softcap > 0.0f || p->window_cache) &&
                                           (p->mask || p->cache_only)))
        return OP_E_ARG;
    if (p->window_cache && (!p->windowed || p->window < 1 || p->past_len != p->present_len ||
                            p->past_len < p->window || !past_key || !past_value))
        return OP_E_ARG;  /* the capacity holds at least the window (ONNX Runtime's rule) */
    const int64_t units = p->batch * p->kv_num_heads;
    if (unit_begin < 0 || unit_end > units || unit_begin > unit_end) return OP_E_ARG;
    const int64_t pks = stride(p->past_key_stride, p->past_len), pvs = stride(p->past_value_stride, p->past_len);
    const int64_t qks = stride(p->present_key_stride, p->present_len);
    const int64_t qvs = stride(p->present_value_stride, p->present_len);
    if (pks < p->past_len || pvs < p->past_len || qks < p->present_len || qvs < p->present_len ||
        (past_key && past_key == present_key && pks != qks) ||
        (past_value && past_value == present_value && pvs != qvs))
        return OP_E_ARG;  /* a shared buffer has one stride */
    int st;
    const op_attn_table *t = attn_table(isa, &st);
    if (!t) return st;
    for (int64_t b = unit_begin / p->kv_num_heads; b * p->kv_num_heads < unit_end; b++) {
        op_gqa_row row;
        if (row_layout(p, seqlens_k, b, &row) < 0 || (p->rotary_dim > 0 && row.past + p->seq > p->cache_rows)) {
            if (bad_row) *bad_row = b;
            return OP_E_ARG;
        }
    }
    if (unit_begin == unit_end) return OP_OK;
    float *scratch = malloc((size_t)OP_ATTN_ROWS * (size_t)(p->head_size + p->present_len) * sizeof(float));
    /* a staging copy holds a row's kept rows and its new ones, keys then values */
    float *stage = p->window_cache ? malloc(2 * (size_t)(p->present_len + p->seq) * (size_t)p->head_size *
                                            sizeof(float)) : NULL;
    if (!scratch || (p->window_cache && !stage)) {
        free(scratch);
        free(stage);
        return OP_E_NOMEM;
    }
    for (int64_t u = unit_begin; u < unit_end; u++) {
        const int64_t b = u / p->kv_num_heads, j = u % p->kv_num_heads;
        op_gqa_row row;
        row_layout(p, seqlens_k, b, &row);
        if (u + 1 < unit_end) prefetch_unit(p, past_key, past_value, present_key, present_value, u + 1, row.kept);
        unit(t, p, query, key, value, past_key, past_value, b, j, &row, cos_cache, sin_cache, out,
             present_key, present_value, scratch, stage);
    }
    free(scratch);
    free(stage);
    op_ran(t->code);
    return OP_OK;
}

/* ---- the same, its units split across a mailbox's helpers ---------------------------- */

#define GQA_MAX_CHUNKS 64

typedef struct {
    int isa;
    const op_gqa_params *p;
    const float *query, *key, *value, *past_key, *past_value;
    const int64_t *seqlens_k;
    const float *cos_cache, *sin_cache;
    float *out, *present_key, *present_value;
    int64_t bad_row; /* a chunk's bad row (any one), or -1 */
} gqa_task_ctx;

static int gqa_task(void *c, int64_t begin, int64_t end) {
    gqa_task_ctx *x = c;
    int64_t bad = -1;
    const int st = op_group_query_attention(x->isa, x->p, x->query, x->key, x->value, x->past_key, x->past_value,
                                            x->seqlens_k, x->cos_cache, x->sin_cache, x->out, x->present_key,
                                            x->present_value, begin, end, &bad);
    if (bad >= 0) __atomic_store_n(&x->bad_row, bad, __ATOMIC_RELAXED);
    return st;
}

int op_mailbox_gqa(op_mailbox *m, int isa, const op_gqa_params *p, const float *query, const float *key,
                   const float *value, const float *past_key, const float *past_value,
                   const int64_t *seqlens_k, const float *cos_cache, const float *sin_cache, float *out,
                   float *present_key, float *present_value, int64_t chunks, int64_t *bad_row) {
    op_ran(OP_KERNEL_NONE);
    if (bad_row) *bad_row = -1;
    if (!m || !p || chunks < 1 || p->batch < 0 || p->kv_num_heads < 1) return OP_E_ARG;
    const int64_t units = p->batch * p->kv_num_heads;
    if (chunks > GQA_MAX_CHUNKS) chunks = GQA_MAX_CHUNKS; /* a machine with more threads: fewer, larger chunks */
    if (chunks > units) chunks = units > 0 ? units : 1;
    int64_t ranges[2 * GQA_MAX_CHUNKS];
    int rcs[GQA_MAX_CHUNKS];
    for (int64_t i = 0; i < chunks; i++) { /* units in chunks of equal size, the first ones one larger */
        ranges[2 * i] = i * (units / chunks) + (i < units % chunks ? i : units % chunks);
        ranges[2 * i + 1] = ranges[2 * i] + units / chunks + (i < units % chunks);
    }
    gqa_task_ctx x = {isa, p, query, key, value, past_key, past_value, seqlens_k, cos_cache, sin_cache, out,
                      present_key, present_value, -1};
    const int st = op_mailbox_run_task(m, gqa_task, &x, ranges, chunks, rcs);
    if (bad_row) *bad_row = x.bad_row;
    if (st) return st;
    int ignored;
    const op_attn_table *t = attn_table(isa, &ignored);
    if (t && units > 0) op_ran(t->code); /* whoever ran the chunks: the code they ran */
    return OP_OK;
}
