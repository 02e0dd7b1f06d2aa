// The decoder's fused ops on a CUDA device, fp32, with the CPU kernels' semantics
// (native/norm.c, rotary.c, attention.c, gather.c): what a decode step runs besides the
// INT4 matmul (int4_matmul.cu), so the whole step can be captured as one graph.
// Compiled at run time by NVRTC (core/cuda/device_decoder_ops.py), so it includes
// nothing and its entries are extern "C"; their parameter lists are
// device_decoder_ops.py's PARAMS, in order.
//
// Every reduction has a fixed order (a thread's strided terms in ascending order, then a
// fixed tree or the warps' sums in warp order): the same inputs give the same bits on
// every run. Where an op's CPU kernel rounds each product (rotary, the gather's
// dequantization), the device does too (__fmul_rn / __fadd_rn: no contraction into
// FMAs), so those two ops give the CPU kernel's bits; the norm and attention are within
// fp32 reassociation of it (other sum orders, libdevice's expf).
//
// What the host cannot check before a launch (a position id, a gathered index, a
// row's seqlens_k: device data, read only when the kernel runs, and differing between
// the replays of one captured graph) is checked here: an element that does not fit is
// written as NaN and sets its op's bit in *status (when status is not 0), which the
// host reads after the stream is synchronised (device_decoder_ops.status_problems).

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define STATUS_GATHER_INDEX 1u
#define STATUS_ROTARY_POSITION 2u
#define STATUS_GQA_SEQLENS 4u

#define NORM_THREADS 256
#define ROTARY_THREADS 64
#define GATHER_THREADS 256
#define GQA_THREADS 128  // 4 warps
#define GQA_WARPS (GQA_THREADS / 32)
#define GQA_MAX_HEAD 256
#define GQA_CHUNK 1024   // keys whose probabilities are staged at once
#define GQA_APPEND_ROWS 8  // new rows a decoder_gqa_append block writes (a tile; a decode step is one)

#define HEADER_BYTES 64
#define PANEL_N 64
#define KIND_INT4_MATMUL 1
#define KIND_INT4_GATHER 2
#define ZP_U4 1
#define ZP_FLOAT 2

__device__ __forceinline__ void flag(u32 *status, u32 bit) {
    if (status) atomicOr(status, bit);
}

// A block's sum of one value per thread: a fixed tree over NORM_THREADS slots.
__device__ __forceinline__ float block_sum(float v, float *red) {
    const int t = threadIdx.x;
    red[t] = v;
    __syncthreads();
    for (int w = NORM_THREADS / 2; w >= 1; w /= 2) {
        if (t < w) red[t] = red[t] + red[t + w];
        __syncthreads();
    }
    const float total = red[0];
    __syncthreads();  // red is free again
    return total;
}

__device__ __forceinline__ float norm_input(const float *x, const float *skip, const float *bias, u64 r,
                                            u64 skip_rows, int n, int i) {
    float v = x[r * n + i];
    if (skip) v = v + skip[(r % skip_rows) * n + i];
    if (bias) v = v + bias[i];
    return v;
}

// Row normalization (norm.c): v = x (+ skip) (+ bias), written to sum_out when given;
// RMS: inv = 1 / sqrt(sum(v^2) / n + eps), y = (v * inv) * gamma; layer: the corrected
// two-pass mean and variance, y = ((v - mean) * inv) * gamma (+ beta). One block per
// row; rows [rows][n] contiguous, skip [skip_rows][n] repeating over them (row r adds
// skip row r % skip_rows). y may be x (each element is read and written by one thread).
extern "C" __global__ void __launch_bounds__(NORM_THREADS) decoder_row_norm(
    const float *x, const float *skip, u64 skip_rows, const float *bias, const float *gamma, const float *beta,
    float *y, float *sum_out, int rows, int n, float epsilon, int simplified) {
    __shared__ float red[NORM_THREADS];
    const u64 r = blockIdx.x;
    const int t = threadIdx.x;
    float s = 0.0f, ss = 0.0f;
    for (int i = t; i < n; i += NORM_THREADS) {
        const float v = norm_input(x, skip, bias, r, skip_rows, n, i);
        if (sum_out) sum_out[r * n + i] = v;
        s = s + v;
        ss = fmaf(v, v, ss);
    }
    float mean = block_sum(s, red) / (float)n, var;
    if (simplified) {
        var = block_sum(ss, red) / (float)n;
        mean = 0.0f;
    } else {
        float sd = 0.0f;
        ss = 0.0f;
        for (int i = t; i < n; i += NORM_THREADS) {
            const float d = norm_input(x, skip, bias, r, skip_rows, n, i) - mean;
            sd = sd + d;
            ss = fmaf(d, d, ss);
        }
        const float dsum = block_sum(sd, red);
        var = (block_sum(ss, red) - dsum * (dsum / (float)n)) / (float)n;
        var = var > 0.0f ? var : 0.0f;
        mean = mean + dsum / (float)n;
    }
    const float inv = 1.0f / sqrtf(var + epsilon);
    for (int i = t; i < n; i += NORM_THREADS) {
        const float v = norm_input(x, skip, bias, r, skip_rows, n, i);
        const float w = __fmul_rn(__fmul_rn(v - mean, inv), gamma[i]);
        y[r * n + i] = (beta && !simplified) ? w + beta[i] : w;
    }
}

// One rotation as rotary.c and attention.c compute it: each product rounded, then the
// sum (-xb * s rounds as -(xb * s): the same bits).
__device__ __forceinline__ void rotate_pair(float xa, float xb, float c, float s, float *ya, float *yb) {
    *ya = __fsub_rn(__fmul_rn(xa, c), __fmul_rn(xb, s));
    *yb = __fadd_rn(__fmul_rn(xb, c), __fmul_rn(xa, s));
}

// dst[i] for i = threadIdx.x, + blockDim.x, ...: x rotated by the cache rows c and s
// (rotary_dim / 2 values each; values past rotary_dim copied). dst may be x.
__device__ __forceinline__ void rotate_head(const float *x, float *dst, int head_size, int rotary_dim,
                                            int interleaved, const float *c, const float *sn) {
    const int half = rotary_dim / 2;
    for (int i = threadIdx.x; i < head_size; i += blockDim.x) {
        if (i < half) {
            const int ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + half;
            float ya, yb;
            rotate_pair(x[ia], x[ib], c[i], sn[i], &ya, &yb);
            dst[ia] = ya;
            dst[ib] = yb;
        } else if (i >= rotary_dim) {
            dst[i] = x[i];
        }
    }
}

// com.microsoft RotaryEmbedding (rotary.c): x [B][S][heads * head_size] or, transposed,
// [B][heads][S][head_size]; position ids [B][S] (pos_per_token) or one start id (token
// s at id + s); caches [max_pos][rot_dim / 2], rows cache_stride floats apart (a
// fused rotary's tables [.., S, 2 x rot_dim / 2] are read in place). The first rot_dim values of a head
// rotate as pairs (i, i + rot_dim / 2) or, interleaved, (2i, 2i + 1); the rest is
// copied. One block per (head, token, batch row); y may be x. A position outside the
// caches writes the token's heads as NaN and flags STATUS_ROTARY_POSITION.
extern "C" __global__ void __launch_bounds__(ROTARY_THREADS) decoder_rotary(
    const float *x, float *y, const i64 *pos, int pos_per_token, const float *cos_cache, const float *sin_cache,
    u64 cache_stride, i64 max_pos, int batch, int seq, int heads, int head_size, int rot_dim, int transposed, int interleaved,
    u32 *status) {
    const int h = blockIdx.x, s = blockIdx.y, b = blockIdx.z, t = threadIdx.x;
    const u64 off = transposed ? (((u64)b * heads + h) * seq + s) * head_size
                               : (((u64)b * seq + s) * heads + h) * head_size;
    const float *xi = x + off;
    float *yo = y + off;
    const i64 p = pos_per_token ? pos[(u64)b * seq + s] : pos[0] + s;
    if (p < 0 || p >= max_pos) {
        for (int i = t; i < head_size; i += ROTARY_THREADS) yo[i] = __int_as_float(0x7fc00000);
        if (t == 0 && h == 0) flag(status, STATUS_ROTARY_POSITION);
        return;
    }
    rotate_head(xi, yo, head_size, rot_dim, interleaved, cos_cache + (u64)p * cache_stride,
                sin_cache + (u64)p * cache_stride);
}

// GroupQueryAttention (attention.c) for a decode step or a prompt of any length, as two
// launches on one stream: decoder_gqa_append writes each (batch row, kv head)'s present
// rows, then decoder_gqa_attend computes each (query head, query row, batch row)'s
// output from them. Layouts: query head h of row s of batch row b at q + b q_b + s q_s +
// h q_h (its head_size values contiguous), kv head j at k (v) + b kv_b + s kv_s + j kv_h: BSNH
// tensors, the parts of a packed QKV row, or BNSH ones (onnx_prep.fused::Attention);
// past and present [B][KN][stride rows][head_size] (BNSH with room after the rows); a
// present that is the past's own buffer (same address) gets only the new rows; output
// rows [B * S] of ld_out floats (head h at h * head_size). seqlens_k [B] (int64, or
// int32 when seqlens_i32). Row b: total = seqlens_k[b] + 1, past = 0 for a first
// prompt, else total - S; query row s attends to present rows [0, min(past + s + 1,
// total)), scores scale * q.k, a max-subtracted softmax. Rotary (rotary_dim > 0): q and
// the new keys rotate at position past + s.
#define GQA_PARAMS                                                                                             \
    const float *q, u64 q_b, u64 q_s, u64 q_h, const float *k, const float *v, u64 kv_b, u64 kv_s, u64 kv_h,    \
        const float *past_key, const float *past_value, u64 past_stride, float *present_key, float *present_value, u64 present_stride, \
        const void *seqlens, int seqlens_i32, const float *cos_cache, const float *sin_cache, i64 cache_rows,   \
        float *out, u64 ld_out, int batch, int seq, int num_heads, int kv_num_heads, int head_size,            \
        i64 past_len, i64 present_len, int rotary_dim, int interleaved, int first_prompt, float scale,        \
        u32 *status

// Row b's past length, its total in *total; -1 when seqlens_k[b] does not fit the
// buffers (attention.c row_lengths, and the caches' rows).
__device__ __forceinline__ i64 gqa_row(const void *seqlens, int seqlens_i32, int b, int seq, i64 past_len,
                                       i64 present_len, int first_prompt, int rotary_dim, i64 cache_rows,
                                       i64 *total) {
    const i64 t = (seqlens_i32 ? (i64)((const int *)seqlens)[b] : ((const i64 *)seqlens)[b]) + 1;
    const i64 past = first_prompt ? 0 : t - seq;
    *total = t;
    if (t < 1 || past < 0 || past + seq > present_len || (first_prompt && t > seq)) return -1;
    if (past > 0 && past > past_len) return -1;
    if (rotary_dim > 0 && past + seq > cache_rows) return -1;
    return past;
}


// One block per (kv head j, batch row b, tile of GQA_APPEND_ROWS new rows; tile z, then
// z + gridDim.z, ...: a decode step is one tile): tile 0's block copies the past's rows
// and zeroes the rows after the new ones (unless present is the past's buffer), each
// block writes its tiles' new rows (keys rotated). The blocks' rows are disjoint. A row
// whose seqlens_k does not fit leaves its present rows untouched.
extern "C" __global__ void __launch_bounds__(GQA_THREADS) decoder_gqa_append(GQA_PARAMS) {
    const int j = blockIdx.x, b = blockIdx.y, H = head_size, KN = kv_num_heads;
    i64 total;
    const i64 past = gqa_row(seqlens, seqlens_i32, b, seq, past_len, present_len, first_prompt, rotary_dim,
                             cache_rows, &total);
    if (past < 0) {
        if (threadIdx.x == 0 && j == 0 && blockIdx.z == 0) flag(status, STATUS_GQA_SEQLENS);
        return;
    }
    const u64 unit = (u64)b * KN + j;
    float *pk = present_key + unit * present_stride * H, *pv = present_value + unit * present_stride * H;
    for (int which = 0; which < 2 && blockIdx.z == 0; which++) {
        const float *src = which ? past_value : past_key;
        float *dst = which ? pv : pk;
        if (src == (which ? present_value : present_key)) continue;
        const u64 head = unit * past_stride * H, rows_before = (u64)past * H;
        for (u64 i = threadIdx.x; i < rows_before; i += GQA_THREADS) dst[i] = src[head + i];
        for (u64 i = (u64)(past + seq) * H + threadIdx.x; i < (u64)present_len * H; i += GQA_THREADS) dst[i] = 0.0f;
    }
    for (i64 s0 = (i64)blockIdx.z * GQA_APPEND_ROWS; s0 < seq; s0 += (i64)gridDim.z * GQA_APPEND_ROWS) {
        const i64 s1 = s0 + GQA_APPEND_ROWS < seq ? s0 + GQA_APPEND_ROWS : seq;
        for (i64 s = s0; s < s1; s++) {
            const u64 at = (u64)b * kv_b + (u64)s * kv_s + (u64)j * kv_h;
            const float *kr = k + at, *vr = v + at;
            float *dk = pk + (u64)(past + s) * H, *dv = pv + (u64)(past + s) * H;
            if (rotary_dim > 0)
                rotate_head(kr, dk, H, rotary_dim, interleaved, cos_cache + (past + s) * (rotary_dim / 2),
                            sin_cache + (past + s) * (rotary_dim / 2));
            else
                for (int i = threadIdx.x; i < H; i += GQA_THREADS) dk[i] = kr[i];
            for (int i = threadIdx.x; i < H; i += GQA_THREADS) dv[i] = vr[i];
        }
    }
}

// q . k of one key by one warp: lane l takes dims l, l + 32, ... (an FMA chain), then a
// fixed shuffle tree; lane 0's total is every lane's.
__device__ __forceinline__ float warp_dot(const float *qs, const float *key, int H) {
    const int lane = threadIdx.x & 31;
    float d = 0.0f;
    for (int i = lane; i < H; i += 32) d = fmaf(qs[i], key[i], d);
    for (int w = 16; w >= 1; w /= 2) d += __shfl_down_sync(0xffffffffu, d, w);
    return __shfl_sync(0xffffffffu, d, 0);
}

// One block per (query head h, query row, batch row b): rows s = blockIdx.y, + gridDim.y,
// ... (a prompt of more rows than a grid's y holds loops; a decode step, and any prompt
// of up to 65535 rows, is one row a block). Per row: q (rotated) staged in shared
// memory; pass 1: the scores' max (warp w takes keys w, w + GQA_WARPS, ...) over the
// row's causal span, keys [0, past + s]; pass 2, per chunk of GQA_CHUNK keys: the
// probabilities exp(score - max) staged, each warp adding its own in key order, then
// thread t accumulates output dims t, t + GQA_THREADS over the chunk's keys in order;
// out = acc / (the warps' sums in warp order). A batch row whose seqlens_k does not fit
// writes NaN and flags STATUS_GQA_SEQLENS.
extern "C" __global__ void __launch_bounds__(GQA_THREADS) decoder_gqa_attend(GQA_PARAMS) {
    __shared__ float qs[GQA_MAX_HEAD];
    __shared__ float probs[GQA_CHUNK];
    __shared__ float warp_max[GQA_WARPS], warp_sum[GQA_WARPS];
    const int h = blockIdx.x, b = blockIdx.z, H = head_size;
    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    const int G = num_heads / kv_num_heads, j = h / G;
    i64 total;
    const i64 past = gqa_row(seqlens, seqlens_i32, b, seq, past_len, present_len, first_prompt, rotary_dim,
                             cache_rows, &total);
    if (past < 0) {
        for (i64 s = blockIdx.y; s < seq; s += gridDim.y) {
            float *o = out + ((u64)b * seq + s) * ld_out + (u64)h * H;
            for (int i = t; i < H; i += GQA_THREADS) o[i] = __int_as_float(0x7fc00000);
        }
        if (t == 0 && h == 0 && blockIdx.y == 0) flag(status, STATUS_GQA_SEQLENS);
        return;
    }
    const u64 unit = (u64)b * kv_num_heads + j;
    const float *pk = present_key + unit * present_stride * H, *pv = present_value + unit * present_stride * H;
    for (i64 s = blockIdx.y; s < seq; s += gridDim.y) {
        if (s != blockIdx.y) __syncthreads();  // the previous row's reads of qs, warp_max and warp_sum are done
        float *o = out + ((u64)b * seq + s) * ld_out + (u64)h * H;
        const float *qr = q + (u64)b * q_b + (u64)s * q_s + (u64)h * q_h;
        if (rotary_dim > 0)
            rotate_head(qr, qs, H, rotary_dim, interleaved, cos_cache + (past + s) * (rotary_dim / 2),
                        sin_cache + (past + s) * (rotary_dim / 2));
        else
            for (int i = t; i < H; i += GQA_THREADS) qs[i] = qr[i];
        __syncthreads();
        const i64 span = past + s + 1 < total ? past + s + 1 : total;
        float mx = -__int_as_float(0x7f800000);
        for (i64 i = warp; i < span; i += GQA_WARPS) mx = fmaxf(mx, scale * warp_dot(qs, pk + (u64)i * H, H));
        if (lane == 0) warp_max[warp] = mx;
        __syncthreads();
        mx = warp_max[0];
        for (int w = 1; w < GQA_WARPS; w++) mx = fmaxf(mx, warp_max[w]);
        float acc[GQA_MAX_HEAD / GQA_THREADS];
#pragma unroll
        for (int r = 0; r < GQA_MAX_HEAD / GQA_THREADS; r++) acc[r] = 0.0f;
        float my_sum = 0.0f;  // lane 0's: its warp's probabilities in key order
        for (i64 c0 = 0; c0 < span; c0 += GQA_CHUNK) {
            const i64 c1 = c0 + GQA_CHUNK < span ? c0 + GQA_CHUNK : span;
            for (i64 i = c0 + warp; i < c1; i += GQA_WARPS) {
                const float p = expf(scale * warp_dot(qs, pk + (u64)i * H, H) - mx);
                if (lane == 0) {
                    probs[i - c0] = p;
                    my_sum += p;
                }
            }
            __syncthreads();
#pragma unroll
            for (int r = 0; r < GQA_MAX_HEAD / GQA_THREADS; r++) {
                const int d = t + r * GQA_THREADS;
                if (d >= H) break;
                float a = acc[r];
                for (i64 i = c0; i < c1; i++) a = fmaf(probs[i - c0], pv[(u64)i * H + d], a);
                acc[r] = a;
            }
            __syncthreads();  // probs is free for the next chunk
        }
        if (lane == 0) warp_sum[warp] = my_sum;
        __syncthreads();
        float sum = warp_sum[0];
        for (int w = 1; w < GQA_WARPS; w++) sum = sum + warp_sum[w];
        const float inv = 1.0f / sum;
#pragma unroll
        for (int r = 0; r < GQA_MAX_HEAD / GQA_THREADS; r++) {
            const int d = t + r * GQA_THREADS;
            if (d >= H) break;
            o[d] = acc[r] * inv;
        }
    }
}

// com.microsoft GatherBlockQuantized (gather.c) from either INT4 packed kind (the
// header's fields passed in): out row i = dequant(row indices[i]) (a negative index
// counts from the end), K values, ((float)code - zero) * scale. KIND_INT4_GATHER: row v
// is one record at v * stride after the header (its codes, byte j holding codes 2j low
// and 2j + 1 high, then n_blocks fp32 scales, then the zero points). KIND_INT4_MATMUL
// (a tied embedding reads its LM head's object): row v is column v % 64 of panel v / 64
// (int4_matmul.cu's layout: word q of group g is column q's codes k0 + 0..7). One block
// per index; an index outside [-V, V) writes NaN and flags STATUS_GATHER_INDEX.
extern "C" __global__ void __launch_bounds__(GATHER_THREADS) decoder_int4_gather(
    const i64 *indices, const unsigned char *packed, float *out, u64 ld_out, int kind, i64 V, int K,
    int block_size, int n_blocks, int zp_kind, u64 stride, u32 *status) {
    const u64 n = blockIdx.x;
    float *o = out + n * ld_out;
    i64 v = indices[n];
    if (v < -V || v >= V) {
        for (int i = threadIdx.x; i < K; i += GATHER_THREADS) o[i] = __int_as_float(0x7fc00000);
        if (threadIdx.x == 0) flag(status, STATUS_GATHER_INDEX);
        return;
    }
    if (v < 0) v += V;
    const unsigned char *data = packed + HEADER_BYTES;  // the packed header (the host read it)
    const int bs = block_size;
    for (int i = threadIdx.x; i < K; i += GATHER_THREADS) {
        const int blk = i / bs;
        float code, s, z;
        const unsigned char *zeros;
        if (kind == KIND_INT4_GATHER) {
            const unsigned char *row = data + (u64)v * stride;
            const u64 codes = (u64)n_blocks * bs / 2;
            const unsigned char byte = row[i / 2];
            code = (float)((i & 1) ? byte >> 4 : byte & 0x0F);
            s = ((const float *)(row + codes))[blk];
            zeros = row + codes + (u64)n_blocks * 4;
            z = zp_kind == ZP_U4 ? (float)zeros[blk] : zp_kind == ZP_FLOAT ? ((const float *)zeros)[blk] : 8.0f;
        } else {
            const int q = (int)(v % PANEL_N), kk = i % bs, jj = kk % 8;
            const u64 zero_bytes = zp_kind == ZP_U4 ? PANEL_N : zp_kind == ZP_FLOAT ? PANEL_N * 4 : 0;
            const unsigned char *rec = data + (u64)(v / PANEL_N) * stride +
                                       (u64)blk * ((u64)bs * 32 + PANEL_N * 4 + zero_bytes);
            const u32 w = ((const u32 *)(rec + (u64)(kk / 8) * 256))[q];
            code = (float)((w >> ((jj & 3) * 8 + (jj >> 2) * 4)) & 0xFu);
            s = ((const float *)(rec + (u64)bs * 32))[q];
            zeros = rec + (u64)bs * 32 + PANEL_N * 4;
            z = zp_kind == ZP_U4 ? (float)zeros[q] : zp_kind == ZP_FLOAT ? ((const float *)zeros)[q] : 8.0f;
        }
        o[i] = __fmul_rn(code - z, s);
    }
}
