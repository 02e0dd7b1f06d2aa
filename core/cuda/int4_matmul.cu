// INT4 matmul on a CUDA device, reading this package's packed layout as it is (the bytes
// the CPU kernels read, uploaded unchanged: native/op_internal.h describes them byte by
// byte). Compiled at run time by NVRTC (core/cuda/device_int4_matmul.py), so it includes
// nothing and its entries are extern "C".
//
// The layout, as these kernels read it: after the 64-byte header come ceil(N / 64)
// panels of panel_stride bytes; a panel holds n_blocks block records of
// bs * 32 + 256 (+ zero points) bytes. In a record, group g (the block's k values
// 8g .. 8g + 7) is 256 bytes at g * 256 read as 64 little-endian 32-bit words: word q is
// panel column q's 8 codes, byte j holding code(k0 + j) in its low nibble and
// code(k0 + 4 + j) in its high one. Then 64 fp32 scales (column q at q), then the zero
// points: 64 uint8 (ZP_U4), 64 fp32 (ZP_FLOAT), or none (the implicit 8). Codes past K
// are 0; columns past N have scale 0.
//
// Compute: fp32, per column and row, the CPU's FMA mode (kernels_scalar.c, f32_block)
// block by block: acc = fmaf chain of a * code over the block's k ascending, sum_a = the
// block's a added in ascending k, out = fmaf(scale, fmaf(-zero, sum_a, acc), out); then
// Y = out (+ bias). The tiled kernel keeps that order whole; the GEMV folds its blocks in
// per-warp partial sums, then adds the warps' sums in warp order (deterministic, not the
// CPU's order: within fp32 reassociation of it).
//
// Kernel parameters (both kernels, this order; device_int4_matmul.py KERNEL_PARAMS):
//   A (fp32 [M][lda]), lda, packed (the buffer's start: its header is skipped), Y (fp32
//   [M][ldy]), ldy, bias (fp32 [N] or 0), M, K, N, block_size, n_blocks, zp_kind,
//   panel_stride.

#define HEADER_BYTES 64
#define PANEL_N 64
#define GROUP_K 8
#define ZP_U4 1
#define ZP_FLOAT 2
#define GEMV_COLUMNS 32  // columns of one GEMV block: one per lane
#define GEMV_WARPS 8     // warps of one GEMV block, splitting the K blocks
#define TILE_M 32        // rows of one tiled block
#define TILE_ROWS 8      // rows per thread in the tiled kernel
#define TILE_THREADS 256 // 64 columns x 4 row groups of TILE_ROWS
#define MAX_BLOCK_SIZE 256

typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u64 record_bytes(int bs, int zp_kind) {
    const u64 zeros = zp_kind == ZP_U4 ? PANEL_N : zp_kind == ZP_FLOAT ? PANEL_N * 4 : 0;
    return (u64)bs * 32 + PANEL_N * 4 + zeros;
}

// Code j (0..7: k0 + j) of a group word.
__device__ __forceinline__ float code_at(u32 w, int j) {
    return (float)((w >> ((j & 3) * 8 + (j >> 2) * 4)) & 0xFu);
}

// a[0..7] = row[k .. k + 7], zeros past K: two 16-byte loads where the row allows them
// (vec: row 16-byte aligned; every k here is a multiple of 8), else one at a time.
__device__ __forceinline__ void load_a8(const float *row, int k, int K, bool vec, float a[GROUP_K]) {
    if (vec && k + GROUP_K <= K) {
        const float4 lo = __ldg((const float4 *)(row + k)), hi = __ldg((const float4 *)(row + k + 4));
        a[0] = lo.x, a[1] = lo.y, a[2] = lo.z, a[3] = lo.w, a[4] = hi.x, a[5] = hi.y, a[6] = hi.z, a[7] = hi.w;
    } else {
#pragma unroll
        for (int j = 0; j < GROUP_K; j++) a[j] = k + j < K ? __ldg(row + k + j) : 0.0f;
    }
}

__device__ __forceinline__ float scale_at(const unsigned char *rec, int bs, int q) {
    return __ldg((const float *)(rec + (u64)bs * 32) + q);
}

__device__ __forceinline__ float zero_at(const unsigned char *rec, int bs, int zp_kind, int q) {
    const unsigned char *z = rec + (u64)bs * 32 + PANEL_N * 4;
    if (zp_kind == ZP_U4) return (float)__ldg(z + q);
    if (zp_kind == ZP_FLOAT) return __ldg((const float *)z + q);
    return 8.0f;
}

// Decode (M = 1..8): one warp per 32 columns (a lane per column: a group's 32 words of
// them are one 128-byte read), GEMV_WARPS warps per block splitting the K blocks
// (warp w takes blocks w, w + GEMV_WARPS, ...), MR >= M rows in registers. Every lane
// reads the same 8 A values of a group at once (a broadcast; two 16-byte loads where
// A's rows are 16-byte aligned). Grid: ceil(N / 32) blocks of (32, GEMV_WARPS).
template <int MR>
__device__ __forceinline__ void gemv(const float *__restrict__ A, u64 lda, const unsigned char *__restrict__ packed,
                                     float *__restrict__ Y, u64 ldy, const float *__restrict__ bias, int M, int K,
                                     int N, int bs, int n_blocks, int zp_kind, u64 panel_stride) {
    __shared__ float partial[GEMV_WARPS][MR][GEMV_COLUMNS];
    const int lane = threadIdx.x, warp = threadIdx.y;
    const int col = blockIdx.x * GEMV_COLUMNS + lane;  // < the panels' columns: padded ones read 0
    const int q = col % PANEL_N;
    const unsigned char *panel = packed + HEADER_BYTES + (u64)(col / PANEL_N) * panel_stride;
    const u64 rec_bytes = record_bytes(bs, zp_kind);
    const bool vec = (lda % 4 == 0) && ((u64)A % 16 == 0);
    float out[MR];
#pragma unroll
    for (int m = 0; m < MR; m++) out[m] = 0.0f;
    for (int b = warp; b < n_blocks; b += GEMV_WARPS) {
        const unsigned char *rec = panel + (u64)b * rec_bytes;
        const u32 *words = (const u32 *)rec;
        float acc[MR], sum_a[MR];
#pragma unroll
        for (int m = 0; m < MR; m++) acc[m] = sum_a[m] = 0.0f;
        const int k0 = b * bs;
        for (int g = 0; g < bs / GROUP_K; g++) {
            const u32 w = __ldg(words + g * PANEL_N + q);
            float c[GROUP_K];
#pragma unroll
            for (int j = 0; j < GROUP_K; j++) c[j] = code_at(w, j);
#pragma unroll
            for (int m = 0; m < MR; m++) {
                if (m >= M) break;  // uniform: rows past M stay 0
                float a[GROUP_K];
                load_a8(A + (u64)m * lda, k0 + g * GROUP_K, K, vec, a);
#pragma unroll
                for (int j = 0; j < GROUP_K; j++) {
                    acc[m] = fmaf(a[j], c[j], acc[m]);
                    sum_a[m] += a[j];
                }
            }
        }
        const float s = scale_at(rec, bs, q), z = zero_at(rec, bs, zp_kind, q);
#pragma unroll
        for (int m = 0; m < MR; m++) out[m] = fmaf(s, fmaf(-z, sum_a[m], acc[m]), out[m]);
    }
#pragma unroll
    for (int m = 0; m < MR; m++) partial[warp][m][lane] = out[m];
    __syncthreads();
    if (warp != 0 || col >= N) return;
#pragma unroll
    for (int m = 0; m < MR; m++) {
        if (m >= M) break;
        float v = partial[0][m][lane];
        for (int w = 1; w < GEMV_WARPS; w++) v += partial[w][m][lane];
        if (bias) v = v + bias[col];
        Y[(u64)m * ldy + col] = v;
    }
}

// The entries: one per row count, so M's loops unroll into registers.
#define KERNEL_PARAMS                                                                                       \
    const float *A, u64 lda, const unsigned char *packed, float *Y, u64 ldy, const float *bias, int M, int K, \
        int N, int bs, int n_blocks, int zp_kind, u64 panel_stride
#define KERNEL_ARGS A, lda, packed, Y, ldy, bias, M, K, N, bs, n_blocks, zp_kind, panel_stride
#define GEMV_THREADS (GEMV_COLUMNS * GEMV_WARPS)
extern "C" __global__ void __launch_bounds__(GEMV_THREADS) int4_matmul_gemv_m1(KERNEL_PARAMS) { gemv<1>(KERNEL_ARGS); }
extern "C" __global__ void __launch_bounds__(GEMV_THREADS) int4_matmul_gemv_m2(KERNEL_PARAMS) { gemv<2>(KERNEL_ARGS); }
extern "C" __global__ void __launch_bounds__(GEMV_THREADS) int4_matmul_gemv_m4(KERNEL_PARAMS) { gemv<4>(KERNEL_ARGS); }
extern "C" __global__ void __launch_bounds__(GEMV_THREADS) int4_matmul_gemv_m8(KERNEL_PARAMS) { gemv<8>(KERNEL_ARGS); }

// Prefill (M > 8): one block per (panel, TILE_M rows). Per K block the A tile
// [TILE_M][bs] is staged in shared memory (zeros past K and M) with its row sums;
// thread (q = column in the panel, r = row group) reads its column's group word (the
// panel's 64 words are one 256-byte read; the four row groups hit the same line) and
// keeps TILE_ROWS rows' accumulators, reading A from shared memory as a broadcast.
// Grid: (ceil(N / 64), ceil(M / TILE_M)) blocks of TILE_THREADS.
extern "C" __global__ void __launch_bounds__(TILE_THREADS) int4_matmul_tiled(
    const float *__restrict__ A, u64 lda, const unsigned char *__restrict__ packed, float *__restrict__ Y, u64 ldy,
    const float *__restrict__ bias, int M, int K, int N, int bs, int n_blocks, int zp_kind, u64 panel_stride) {
    __shared__ float tile[TILE_M * MAX_BLOCK_SIZE];
    __shared__ float tile_sum[TILE_M];
    const int t = threadIdx.x, q = t % PANEL_N, rows0 = (t / PANEL_N) * TILE_ROWS;
    const int m0 = blockIdx.y * TILE_M, col = blockIdx.x * PANEL_N + q;
    const unsigned char *panel = packed + HEADER_BYTES + (u64)blockIdx.x * panel_stride;
    const u64 rec_bytes = record_bytes(bs, zp_kind);
    float out[TILE_ROWS];
#pragma unroll
    for (int r = 0; r < TILE_ROWS; r++) out[r] = 0.0f;
    for (int b = 0; b < n_blocks; b++) {
        const int k0 = b * bs;
        __syncthreads();  // the previous block's tile is no longer read
        for (int i = t; i < TILE_M * bs; i += TILE_THREADS) {
            const int r = i / bs, k = k0 + i % bs, m = m0 + r;
            tile[i] = (m < M && k < K) ? __ldg(A + (u64)m * lda + k) : 0.0f;
        }
        __syncthreads();
        if (t < TILE_M) {
            float s = 0.0f;
            for (int k = 0; k < bs; k++) s += tile[t * bs + k];
            tile_sum[t] = s;
        }
        __syncthreads();
        const unsigned char *rec = panel + (u64)b * rec_bytes;
        const u32 *words = (const u32 *)rec;
        float acc[TILE_ROWS];
#pragma unroll
        for (int r = 0; r < TILE_ROWS; r++) acc[r] = 0.0f;
        for (int g = 0; g < bs / GROUP_K; g++) {
            const u32 w = __ldg(words + g * PANEL_N + q);
#pragma unroll
            for (int j = 0; j < GROUP_K; j++) {
                const float c = code_at(w, j);
                const int k = g * GROUP_K + j;
#pragma unroll
                for (int r = 0; r < TILE_ROWS; r++) acc[r] = fmaf(tile[(rows0 + r) * bs + k], c, acc[r]);
            }
        }
        const float s = scale_at(rec, bs, q), z = zero_at(rec, bs, zp_kind, q);
#pragma unroll
        for (int r = 0; r < TILE_ROWS; r++) out[r] = fmaf(s, fmaf(-z, tile_sum[rows0 + r], acc[r]), out[r]);
    }
    if (col >= N) return;
#pragma unroll
    for (int r = 0; r < TILE_ROWS; r++) {
        const int m = m0 + rows0 + r;
        if (m >= M) break;
        float v = out[r];
        if (bias) v = v + bias[col];
        Y[(u64)m * ldy + col] = v;
    }
}
