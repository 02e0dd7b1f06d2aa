// The standard ops a resolved decoder keeps as numpy kernels, on a CUDA device:
// elementwise binary ops with numpy broadcasting, unary ops, casts, and one strided copy
// that Transpose, Split and Concat are made of. Compiled at run time by NVRTC
// (core/cuda/device_tensor_ops.py), so it includes nothing and its entries are extern "C".
//
// Every entry computes one output element per thread: thread i of the grid
// (blockIdx.x * THREADS + threadIdx.x) writes element i of the output, in row-major
// order, and returns when i >= n. So the result is deterministic (no element is
// computed by two threads or summed across threads). Shapes are 4-D: the host pads a
// smaller rank with leading dimensions of 1 and computes every stride (in elements, 0
// where an input is broadcast along a dimension); the kernels never see the rank.
//
// Entries and their parameters (device_tensor_ops.py holds the same lists):
//   add_f32, sub_f32, mul_f32, div_f32:
//     y, a, b, n, d1, d2, d3, as0, as1, as2, as3, bs0, bs1, bs2, bs3
//     y[i] = a[offset(i, as)] op b[offset(i, bs)], y contiguous, the output's dims
//     (d0 implied by n) splitting i into its 4-D index;
//   sigmoid_f32, cos_f32, sin_f32: y, x, n (both contiguous);
//   cast_i64_f32, cast_i32_f32, cast_i64_i32: y, x, n (numpy's astype: round to
//     nearest for the floats, the low 32 bits for the narrowing integer cast);
//   copy_strided_b32: y, x, n, d1, d2, d3, ys0, ys1, ys2, ys3, xs0, xs1, xs2, xs3
//     y[offset(i, ys)] = x[offset(i, xs)] over the 4-D block of n elements: 32-bit
//     words (fp32 or int32) moved unchanged. A Transpose reads with the permuted
//     strides; a Split output reads a slice of its input; a Concat input is written
//     into its slice of the output;
//   gather_rows_b32: y, x, idx, n, row, rows
//     Gather along axis 0 (an embedding lookup): y[r * row + j] = x[idx[r] * row + j]
//     for the n / row int64 indices, a negative one counted from the end; one outside
//     [-rows, rows) gives a row of zeros (a kernel cannot raise: the CPU op does).
//
// fp32 follows IEEE-754 as numpy does for +, -, *, / (NVRTC's defaults: -prec-div=true,
// no fast math); sigmoid is the CPU's 0.5 * (tanh(x / 2) + 1), and tanhf / cosf / sinf
// are within 2 ulp of the correctly rounded result (CUDA's documented bounds), as
// numpy's are: cos and sin may differ from the CPU by a few ulp. Sigmoid by a few ulp
// of tanh's result, not of its own: near tanh = -1 (x below about -2) the + 1 cancels,
// so a 1-ulp difference in tanh (2^-24 there) is 2^-25 absolute, many ulps of a small
// sigmoid (below x ~ -17 one side may give 0, the other 2^-25); within 2^-22 absolute.

#define THREADS 256

typedef long long i64;

__device__ __forceinline__ i64 element(void) {
    return (i64)blockIdx.x * THREADS + threadIdx.x;
}

// The offset, under strides s0..s3, of row-major element i of a d0 x d1 x d2 x d3 block.
__device__ __forceinline__ i64 offset4(i64 i, i64 d1, i64 d2, i64 d3, i64 s0, i64 s1, i64 s2, i64 s3) {
    const i64 i3 = i % d3;
    i /= d3;
    const i64 i2 = i % d2;
    i /= d2;
    const i64 i1 = i % d1;
    const i64 i0 = i / d1;
    return i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3;
}

#define BINARY_PARAMS                                                                              \
    float *__restrict__ y, const float *__restrict__ a, const float *__restrict__ b, i64 n, i64 d1, \
        i64 d2, i64 d3, i64 as0, i64 as1, i64 as2, i64 as3, i64 bs0, i64 bs1, i64 bs2, i64 bs3
#define BINARY_OPERANDS                                             \
    const i64 i = element();                                        \
    if (i >= n) return;                                             \
    const float u = a[offset4(i, d1, d2, d3, as0, as1, as2, as3)]; \
    const float v = b[offset4(i, d1, d2, d3, bs0, bs1, bs2, bs3)]

extern "C" __global__ void __launch_bounds__(THREADS) add_f32(BINARY_PARAMS) {
    BINARY_OPERANDS;
    y[i] = __fadd_rn(u, v);
}

extern "C" __global__ void __launch_bounds__(THREADS) sub_f32(BINARY_PARAMS) {
    BINARY_OPERANDS;
    y[i] = __fsub_rn(u, v);
}

extern "C" __global__ void __launch_bounds__(THREADS) mul_f32(BINARY_PARAMS) {
    BINARY_OPERANDS;
    y[i] = __fmul_rn(u, v);
}

extern "C" __global__ void __launch_bounds__(THREADS) div_f32(BINARY_PARAMS) {
    BINARY_OPERANDS;
    y[i] = __fdiv_rn(u, v);
}

#define UNARY_PARAMS float *__restrict__ y, const float *__restrict__ x, i64 n

extern "C" __global__ void __launch_bounds__(THREADS) sigmoid_f32(UNARY_PARAMS) {
    const i64 i = element();
    if (i >= n) return;
    // the CPU's form (core/ops/elementwise.py): no overflow for large -x
    y[i] = __fmul_rn(__fadd_rn(tanhf(__fmul_rn(x[i], 0.5f)), 1.0f), 0.5f);
}

extern "C" __global__ void __launch_bounds__(THREADS) cos_f32(UNARY_PARAMS) {
    const i64 i = element();
    if (i >= n) return;
    y[i] = cosf(x[i]);
}

extern "C" __global__ void __launch_bounds__(THREADS) sin_f32(UNARY_PARAMS) {
    const i64 i = element();
    if (i >= n) return;
    y[i] = sinf(x[i]);
}

extern "C" __global__ void __launch_bounds__(THREADS) cast_i64_f32(float *__restrict__ y,
                                                                   const i64 *__restrict__ x, i64 n) {
    const i64 i = element();
    if (i >= n) return;
    y[i] = __ll2float_rn(x[i]);
}

extern "C" __global__ void __launch_bounds__(THREADS) cast_i32_f32(float *__restrict__ y,
                                                                   const int *__restrict__ x, i64 n) {
    const i64 i = element();
    if (i >= n) return;
    y[i] = __int2float_rn(x[i]);
}

extern "C" __global__ void __launch_bounds__(THREADS) cast_i64_i32(int *__restrict__ y,
                                                                   const i64 *__restrict__ x, i64 n) {
    const i64 i = element();
    if (i >= n) return;
    y[i] = (int)(unsigned int)(unsigned long long)x[i];  // the low 32 bits, as astype
}

extern "C" __global__ void __launch_bounds__(THREADS) copy_strided_b32(
    unsigned int *__restrict__ y, const unsigned int *__restrict__ x, i64 n, i64 d1, i64 d2, i64 d3, i64 ys0,
    i64 ys1, i64 ys2, i64 ys3, i64 xs0, i64 xs1, i64 xs2, i64 xs3) {
    const i64 i = element();
    if (i >= n) return;
    y[offset4(i, d1, d2, d3, ys0, ys1, ys2, ys3)] = x[offset4(i, d1, d2, d3, xs0, xs1, xs2, xs3)];
}

extern "C" __global__ void __launch_bounds__(THREADS) gather_rows_b32(unsigned int *__restrict__ y,
                                                                      const unsigned int *__restrict__ x,
                                                                      const i64 *__restrict__ idx, i64 n, i64 row,
                                                                      i64 rows) {
    const i64 i = element();
    if (i >= n) return;
    i64 k = idx[i / row];
    if (k < 0) k += rows;
    y[i] = k >= 0 && k < rows ? x[k * row + i % row] : 0u;
}
