// INT4 prepack on a CUDA device: the source tensors of one weight, already in device
// memory, into this package's packed layout, byte for byte what the CPU prepack writes
// (native/pack.c: op_prepack_matmul_nbits, op_prepack_gather), the 64-byte header
// included. Compiled at run time by NVRTC (core/cuda/device_int4_prepack.py), so it
// includes nothing and its entries are extern "C". The header's constants (magic,
// format version, kind codes, panel width) are not repeated here: the host prepends
// them as #defines taken from the native module, so a format change cannot leave this
// file behind.
//
// Every byte of the output is written by exactly one thread (padding included), with
// plain stores: no atomics, no order between blocks, the same bytes on every run.
// Block 0's first 16 threads write the header.
//
// Sources (all device addresses 4-byte aligned; the host checks it):
//   B / data  uint8 [rows][n_blocks][block_size / 2], two codes a byte, low nibble first
//   scales    fp32 or fp16 [rows * n_blocks]   (scales_f16), stored as fp32
//   zero pts  ZP_SRC_NONE; ZP_SRC_U4: uint4 [rows][ceil(n_blocks / 2)], two a byte, low
//             nibble first; ZP_SRC_U4_BYTES: one code a byte in its low nibble
//             [rows * n_blocks] (GatherBlockQuantized's [V, n_blocks, 1]); ZP_SRC_F32 /
//             ZP_SRC_F16 [rows * n_blocks], stored as fp32
// rows: N (output columns) for the matmul, V (table rows) for the gather.
//
// Kernel parameters (both entries, this order; device_int4_prepack.py KERNEL_PARAMS):
//   b, scales, zp (0 when none), out (the slot: header first), K (the matmul's K, the
//   gather's n_blocks * block_size), rows, block_size, n_blocks, scales_f16, zp_source,
//   flags (the header's), stride (panel_stride / row stride), total_size.

#if !defined(OP_PACK_MAGIC) || !defined(OP_PACK_FORMAT_VERSION) || !defined(OP_KIND_INT4_MATMUL) || \
    !defined(OP_KIND_INT4_GATHER) || !defined(PANEL_N) || !defined(HEADER_BYTES)
#error "the host prepends the packed format's constants (device_int4_prepack.kernel_source)"
#endif

#define GROUP_K 8           // codes per 32-bit group word
#define PREPACK_THREADS 256
#define MAX_GROUPS 32       // block_size 256 / GROUP_K
#define ZP_SRC_NONE 0
#define ZP_SRC_U4 1
#define ZP_SRC_U4_BYTES 2
#define ZP_SRC_F32 3
#define ZP_SRC_F16 4

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

// fp16 bits -> fp32, exact (what numpy's astype(float32) gives; subnormals normalised,
// inf kept, a NaN's payload kept).
__device__ __forceinline__ float half_to_float(u16 h) {
    const u32 sign = (u32)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    u32 bits;
    if (exp == 0x1Fu) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {  // subnormal: shift the leading 1 up to the implicit bit
        int e = 113;
        u32 m = mant;
        while (!(m & 0x400u)) { m <<= 1; e--; }
        bits = sign | ((u32)e << 23) | ((m & 0x3FFu) << 13);
    }
    return __uint_as_float(bits);
}

__device__ __forceinline__ float scale_at(const void *scales, int f16, u64 i) {
    return f16 ? half_to_float(((const u16 *)scales)[i]) : ((const float *)scales)[i];
}

// The zero point of (row, block) as the packed layout stores it: a code (0..15) or fp32.
__device__ __forceinline__ u32 zero_code(const unsigned char *zp, int zp_source, u64 row, u32 nb, u32 b) {
    if (zp_source == ZP_SRC_U4) {
        const unsigned char byte = zp[row * ((nb + 1) / 2) + b / 2];
        return (b & 1) ? (u32)(byte >> 4) : (u32)(byte & 0x0Fu);
    }
    return zp[row * nb + b] & 0x0Fu;  // ZP_SRC_U4_BYTES
}

__device__ __forceinline__ float zero_float(const void *zp, int zp_source, u64 i) {
    return zp_source == ZP_SRC_F16 ? half_to_float(((const u16 *)zp)[i]) : ((const float *)zp)[i];
}

// Word w (0..15) of the 64-byte header (onnx_prep_native.h, op_packed_header).
__device__ __forceinline__ u32 header_word(int w, u32 kind, u32 flags, u32 bs, u64 K, u64 rows, u32 nb,
                                           u32 panel_n, u64 stride, u64 total) {
    switch (w) {
    case 0: return OP_PACK_MAGIC;
    case 1: return (u32)OP_PACK_FORMAT_VERSION | (kind << 16);
    case 2: return flags;
    case 3: return bs;
    case 4: return (u32)K;
    case 5: return (u32)(K >> 32);
    case 6: return (u32)rows;
    case 7: return (u32)(rows >> 32);
    case 8: return nb;
    case 9: return panel_n;
    case 10: return (u32)stride;
    case 11: return (u32)(stride >> 32);
    case 12: return HEADER_BYTES;
    case 13: return 0;
    case 14: return (u32)total;
    default: return (u32)(total >> 32);
    }
}

// One source word (column's codes k0 .. k0 + 7, low nibble first) into the group
// layout: byte j = code(k0 + j) | code(k0 + 4 + j) << 4 (pack.c, interleave_group).
__device__ __forceinline__ u32 spread_nibbles(u32 x) {
    x = (x | (x << 8)) & 0x00FF00FFu;
    return (x | (x << 4)) & 0x0F0F0F0Fu;
}
__device__ __forceinline__ u32 interleave_group(u32 w) {
    return spread_nibbles(w & 0xFFFFu) | (spread_nibbles(w >> 16) << 4);
}

#define KERNEL_PARAMS                                                                                           \
    const unsigned char *__restrict__ b_src, const void *__restrict__ scales, const void *__restrict__ zp,     \
        unsigned char *__restrict__ out, u64 K, u64 rows, int bs, u32 nb, int scales_f16, int zp_source,     \
        u32 flags, u64 stride, u64 total_size

// MatMulNBits -> the INT4 matmul layout (op_internal.h): one block per block record,
// (panel p, K block b) = (blockIdx.x / n_blocks, blockIdx.x % n_blocks). The panel's 64
// columns' source bytes for block b are read column by column (each column's bs / 2
// bytes are contiguous), interleaved, and staged in shared memory, then written group by
// group as 64 consecutive words (word q of group g is column q's). Codes past K are 0,
// columns past N have codes, scale and zero 0, as the CPU writes them.
// Grid: ceil(N / 64) * n_blocks blocks of PREPACK_THREADS.
extern "C" __global__ void __launch_bounds__(PREPACK_THREADS) int4_matmul_prepack(KERNEL_PARAMS) {
    __shared__ u32 staged[PANEL_N * (MAX_GROUPS + 1)];  // [column][group], rows padded: no bank conflicts
    const int t = threadIdx.x;
    const u64 record = blockIdx.x;
    const u64 p = record / nb;
    const u32 b = (u32)(record % nb);
    const int zp_kind = (int)(flags & 3u);
    if (record == 0 && t < HEADER_BYTES / 4)
        ((u32 *)out)[t] = header_word(t, OP_KIND_INT4_MATMUL, flags, (u32)bs, K, rows, nb, PANEL_N, stride, total_size);
    const int groups = bs / GROUP_K, pitch = groups + 1;
    const u64 zero_bytes = zp_kind == 1 ? PANEL_N : zp_kind == 2 ? PANEL_N * 4 : 0;
    const u64 rec_bytes = (u64)bs * 32 + PANEL_N * 4 + zero_bytes;
    unsigned char *rec = out + HEADER_BYTES + p * stride + (u64)b * rec_bytes;
    const u64 k0 = (u64)b * bs, valid = K - k0 < (u64)bs ? K - k0 : (u64)bs;
    for (int i = t; i < PANEL_N * groups; i += PREPACK_THREADS) {
        const int c = i / groups, g = i % groups;
        const u64 n = p * PANEL_N + c;
        u32 w = 0;
        if (n < rows) {
            w = *(const u32 *)(b_src + (n * nb + b) * (u64)(bs / 2) + (u64)g * 4);
            const u64 first = (u64)g * GROUP_K;
            if (first + GROUP_K > valid)  // block padding past K: zero codes
                w = first >= valid ? 0u : w & ((1u << (4 * (u32)(valid - first))) - 1u);
            w = interleave_group(w);
        }
        staged[c * pitch + g] = w;
    }
    __syncthreads();
    for (int i = t; i < PANEL_N * groups; i += PREPACK_THREADS)
        ((u32 *)rec)[i] = staged[(i % PANEL_N) * pitch + i / PANEL_N];
    if (t < PANEL_N) {
        const u64 n = p * PANEL_N + t, i = n * nb + b;
        const bool live = n < rows;
        ((float *)(rec + (u64)bs * 32))[t] = live ? scale_at(scales, scales_f16, i) : 0.0f;
        unsigned char *zeros = rec + (u64)bs * 32 + PANEL_N * 4;
        if (zp_kind == 1)
            zeros[t] = live ? (unsigned char)zero_code((const unsigned char *)zp, zp_source, n, nb, b) : 0;
        else if (zp_kind == 2)
            ((float *)zeros)[t] = live ? zero_float(zp, zp_source, i) : 0.0f;
    }
}

// GatherBlockQuantized -> the INT4 gather layout (pack.c): one block per table row v.
// A row is stride bytes (a multiple of 64): the row's codes unchanged, its n_blocks
// scales (fp32), its zero points (one code a byte, or fp32; none), zeros to the end.
// Each thread writes whole 32-bit words of it (every part but the uint4 zero points
// ends on a word). Grid: V blocks of PREPACK_THREADS.
extern "C" __global__ void __launch_bounds__(PREPACK_THREADS) int4_gather_prepack(KERNEL_PARAMS) {
    const int t = threadIdx.x;
    const u64 v = blockIdx.x;
    const int zp_kind = (int)(flags & 3u);
    if (v == 0 && t < HEADER_BYTES / 4)
        ((u32 *)out)[t] = header_word(t, OP_KIND_INT4_GATHER, flags, (u32)bs, K, rows, nb, 0, stride, total_size);
    const u64 codes = (u64)nb * (bs / 2), scales_end = codes + (u64)nb * 4;
    const u64 zeros_end = scales_end + (zp_kind == 1 ? (u64)nb : zp_kind == 2 ? (u64)nb * 4 : 0);
    u32 *row = (u32 *)(out + HEADER_BYTES + v * stride);
    for (u64 w = t; w < stride / 4; w += PREPACK_THREADS) {
        const u64 off = w * 4;
        u32 word = 0;
        if (off < codes) {
            word = *(const u32 *)(b_src + v * codes + off);
        } else if (off < scales_end) {
            word = __float_as_uint(scale_at(scales, scales_f16, v * nb + (off - codes) / 4));
        } else if (off < zeros_end) {
            if (zp_kind == 2) {
                word = __float_as_uint(zero_float(zp, zp_source, v * nb + (off - scales_end) / 4));
            } else {
                for (int e = 0; e < 4; e++) {
                    const u64 j = off - scales_end + e;
                    if (j < nb) word |= zero_code((const unsigned char *)zp, zp_source, v, nb, (u32)j) << (8 * e);
                }
            }
        }
        row[w] = word;
    }
}
