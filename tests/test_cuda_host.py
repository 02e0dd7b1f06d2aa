"""The host emulation of CUDA kernels (tests/cuda_host.py) on small kernels written for
it: each stand-in does what CUDA documents (thread and block indices in three
dimensions, ``__syncthreads`` ordering shared memory, the four shuffles at every width,
dynamic shared memory poisoned before each block, ``fmaf`` fused and ``a * b + c`` not,
atomics from every thread, CUDA's ``min`` / ``max``),
and what CUDA leaves undefined is refused, naming the block and thread: a barrier in
divergent code (returned early, or never completed), partial masks and
warps, a misaligned ``__ldg``, an argument of the wrong size, an unknown entry.
Skipped, saying so, without a C++20 compiler."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from cuda_host import HostKernelFault, host_kernels, host_source

P, I32 = ctypes.c_void_p, ctypes.c_int32
FULL = "0xffffffffu"
SOURCE = r"""
extern "C" __global__ void indices(unsigned *out) {
    const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    unsigned *o = out + 6 * (b * blockDim.x * blockDim.y * blockDim.z + t);
    o[0] = threadIdx.x, o[1] = threadIdx.y, o[2] = threadIdx.z, o[3] = blockIdx.x, o[4] = blockIdx.y, o[5] = blockIdx.z;
}

// rounds of s[t] <- s[t] * 3 + s[t + 1] through shared memory: right only if every
// barrier orders the block's writes and reads
extern "C" __global__ void __launch_bounds__(256) rounds(const unsigned *in, unsigned *out, int n_rounds) {
    __shared__ unsigned s[256];
    const unsigned t = threadIdx.x, n = blockDim.x, base = blockIdx.x * n;
    s[t] = in[base + t];
    for (int r = 0; r < n_rounds; r++) {
        __syncthreads();
        const unsigned v = s[t] * 3u + s[(t + 1) % n];
        __syncthreads();
        s[t] = v;
    }
    __syncthreads();
    out[base + t] = s[t];
}

extern "C" __global__ void shuffles(const float *in, float *out, int width) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    const float v = in[i];
    float sum = v;
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    float *o = out + 5 * i;
    o[0] = sum;
    o[1] = __shfl_down_sync(0xffffffffu, v, 3, width);
    o[2] = __shfl_up_sync(0xffffffffu, v, 5, width);
    o[3] = __shfl_sync(0xffffffffu, v, 7 + 32, width);
    o[4] = __shfl_xor_sync(0xffffffffu, v, 9, width);
}

extern "C" __global__ void dynamic(float *first, float *then) {
    extern __shared__ __align__(16) float dyn[];
    const unsigned t = threadIdx.x, n = blockDim.x, i = blockIdx.x * n + t;
    first[i] = dyn[t];
    __syncthreads();
    dyn[t] = (float)i;
    __syncthreads();
    then[i] = dyn[n - 1 - t] + ((unsigned long long)dyn % 16 ? 0.5f : 0.0f);
}

extern "C" __global__ void fused(const float *abc, float *out) {
    out[0] = fmaf(abc[0], abc[1], abc[2]);
    out[1] = abc[0] * abc[1] + abc[2];
}

// every thread of 4 blocks: its bit, its count and its index into one word each
extern "C" __global__ void atomics(unsigned *word, int *count, int *hi, int *lo, float *sum) {
    const int t = threadIdx.x + blockIdx.x * blockDim.x;
    atomicOr(word + t / 32, 1u << (t % 32));
    atomicAdd(count, 1);
    atomicMax(hi, t);
    atomicMin(lo, -t);
    atomicAdd(sum, 0.5f);
}

extern "C" __global__ void minmax(float *out) {
    const unsigned u = 3u;
    out[0] = min(-1, u) == 3u ? 1.0f : 0.0f;  // int with unsigned: compared as unsigned, as in CUDA
    out[1] = min(2.0f, __int_as_float(0x7fc00000));  // fminf: the NaN loses
    out[2] = max(-2, 5);
    out[3] = max(1.5f, -2.0f);
}

extern "C" __global__ void partial_mask(float *out) { out[threadIdx.x] = __shfl_sync(0xffffu, 1.0f, 0); }
extern "C" __global__ void warp_op(float *out) { out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1); }
extern "C" __global__ void returns_before_barrier(float *out) {
    if (threadIdx.x == 5) return;
    __syncthreads();
    out[threadIdx.x] = 1.0f;
}
extern "C" __global__ void half_warp_shuffle(float *out) {
    float v = (float)threadIdx.x;
    if (threadIdx.x < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
    out[threadIdx.x] = v;
}
extern "C" __global__ void never_met(float *out) {  // 64 threads: a barrier each half never completes
    if (threadIdx.x >= 48) __syncwarp();
    else __syncthreads();
    out[threadIdx.x] = 1.0f;
}
extern "C" __global__ void misaligned(const float *in, float *out) { out[0] = __ldg((const float4 *)(in + 1)).x; }
"""
ENTRIES = ("indices", "rounds", "shuffles", "dynamic", "fused", "atomics", "minmax", "partial_mask", "warp_op",
           "returns_before_barrier", "half_warp_shuffle", "never_met", "misaligned")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    return host_kernels(tmp_path_factory, SOURCE, ENTRIES)


def addr(a: np.ndarray) -> int:
    return a.ctypes.data


def test_threads_and_blocks_are_numbered_as_cuda_numbers_them(kernels):
    grid, block = (3, 2, 2), (4, 3, 2)
    out = np.full((12, 24, 6), 0xDEAD, np.uint32)
    kernels.launch("indices", grid, block, 0, [(P, addr(out))])
    bz, by, bx = np.meshgrid(*(np.arange(n) for n in grid[::-1]), indexing="ij")
    tz, ty, tx = np.meshgrid(*(np.arange(n) for n in block[::-1]), indexing="ij")
    blocks = np.stack([bx.ravel(), by.ravel(), bz.ravel()], 1)
    threads = np.stack([tx.ravel(), ty.ravel(), tz.ravel()], 1)
    assert np.array_equal(out[..., :3], np.broadcast_to(threads, (12, 24, 3)))
    assert np.array_equal(out[..., 3:], np.broadcast_to(blocks[:, None, :], (12, 24, 3)))


def test_syncthreads_orders_shared_memory_in_every_block(kernels):
    rng = np.random.default_rng(1)
    n, blocks, n_rounds = 256, 3, 40
    x = rng.integers(0, 2**32, n * blocks, dtype=np.uint64).astype(np.uint32)
    out = np.zeros_like(x)
    kernels.launch("rounds", (blocks, 1, 1), (n, 1, 1), 0, [(P, addr(x)), (P, addr(out)), (I32, n_rounds)])
    want = x.reshape(blocks, n).copy()
    for _ in range(n_rounds):
        want = want * np.uint32(3) + np.roll(want, -1, axis=1)
    assert np.array_equal(out.reshape(blocks, n), want)


@pytest.mark.parametrize("width", [32, 16, 8, 1])
def test_the_shuffles_move_what_cuda_documents(kernels, width):
    rng = np.random.default_rng(width)
    v = rng.standard_normal(64).astype(np.float32)
    out = np.zeros((64, 5), np.float32)
    kernels.launch("shuffles", (1, 1, 1), (64, 1, 1), 0, [(P, addr(v)), (P, addr(out)), (I32, width)])
    lane = np.arange(64) % 32
    warp0 = np.arange(64) - lane
    s = v.copy()
    for o in (16, 8, 4, 2, 1):
        s = s + s[warp0 + (lane ^ o)]
    g = lane % width  # the lane within its group of `width`
    own = np.arange(64)
    down = np.where(g + 3 < width, own + 3, own)
    up = np.where(g >= 5, own - 5, own)
    broadcast = own - g + (7 + 32) % width
    xor = np.where(((lane ^ 9) & ~(width - 1)) > (lane & ~(width - 1)), own, warp0 + (lane ^ 9))
    assert np.array_equal(out[:, 0], s)
    assert np.array_equal(out[:, 1:], np.stack([v[down], v[up], v[broadcast], v[xor]], 1))


def test_dynamic_shared_memory_is_poisoned_before_each_block_and_aligned(kernels):
    first, then = np.zeros((2, 96), np.float32), np.zeros((2, 96), np.float32)
    kernels.launch("dynamic", (2, 1, 1), (96, 1, 1), 96 * 4, [(P, addr(first)), (P, addr(then))])
    assert np.isnan(first).all()  # the second block too: refilled, not the first block's values
    assert np.array_equal(then, (np.arange(192, dtype=np.float32).reshape(2, 96))[:, ::-1])
    assert "#define dyn (reinterpret_cast<float *>" in host_source("extern __shared__ float dyn[];")


def test_fmaf_is_fused_and_a_multiply_add_is_not_contracted(kernels):
    a = np.float32(1 + 2**-12)
    abc, out = np.array([a, a, -(1 + 2**-11)], np.float32), np.zeros(2, np.float32)
    kernels.launch("fused", (1, 1, 1), (1, 1, 1), 0, [(P, addr(abc)), (P, addr(out))])
    assert out.tolist() == [2**-24, 0.0]  # one rounding; two (a * a rounds to 1 + 2^-11)


def test_atomics_from_every_thread_and_cudas_min_max(kernels):
    word, count, lo = np.zeros(32, np.uint32), np.zeros(1, np.int32), np.zeros(1, np.int32)
    hi, total = np.full(1, -1, np.int32), np.zeros(1, np.float32)
    kernels.launch("atomics", (4, 1, 1), (256, 1, 1), 0,
                   [(P, addr(word)), (P, addr(count)), (P, addr(hi)), (P, addr(lo)), (P, addr(total))])
    assert (word == 0xFFFFFFFF).all() and count[0] == 1024 and hi[0] == 1023 and lo[0] == -1023 and total[0] == 512
    out = np.zeros(4, np.float32)
    kernels.launch("minmax", (1, 1, 1), (1, 1, 1), 0, [(P, addr(out))])
    assert out.tolist() == [1.0, 2.0, 5.0, 1.5]


@pytest.mark.parametrize("entry,block,message", [
    ("partial_mask", 32, r"__shfl_sync with mask 0xffff: only the full mask is emulated \[block \(0,0,0\) thread"),
    ("warp_op", 48, r"__shfl_xor_sync in a block of 48 threads: its last warp is partial"),
    ("returns_before_barrier", 64, r".* of the block .*: a barrier in divergent code \[block \(0,0,0\)"),
    ("half_warp_shuffle", 32, r".* of the warp .*: a barrier in divergent code \[block \(0,0,0\)"),
])
def test_what_cuda_leaves_undefined_is_refused_naming_the_thread(kernels, entry, block, message):
    out = np.zeros(block, np.float32)
    with pytest.raises(HostKernelFault, match=entry + ": " + message):
        kernels.launch(entry, (2, 1, 1), (block, 1, 1), 0, [(P, addr(out))])
    kernels.launch("fused", (1, 1, 1), (1, 1, 1), 0, [(P, addr(np.ones(3, np.float32))), (P, addr(out))])  # usable


def test_a_barrier_no_thread_can_complete_is_found(kernels):
    out = np.zeros(64, np.float32)
    with pytest.raises(HostKernelFault, match=r"never_met: __syncthreads: 48 of the block's 64 threads wait, the others "
                                              r"never come: a barrier in divergent code \[block \(0,0,0\) thread"):
        kernels.launch("never_met", (1, 1, 1), (64, 1, 1), 0, [(P, addr(out))])


def test_a_misaligned_ldg_wrong_arguments_and_unknown_entries_are_refused(kernels):
    x, out = np.zeros(8, np.float32), np.zeros(1, np.float32)
    with pytest.raises(HostKernelFault, match=r"misaligned: __ldg of a 16-byte value at 0x[0-9a-f]*4: misaligned"):
        kernels.launch("misaligned", (1, 1, 1), (1, 1, 1), 0, [(P, addr(x)), (P, addr(out))])
    with pytest.raises(HostKernelFault, match=r"fused's parameter 1 is 8 bytes, the argument 4"):
        kernels.launch("fused", (1, 1, 1), (1, 1, 1), 0, [(P, addr(x)), (I32, 0)])
    with pytest.raises(HostKernelFault, match=r"fused takes 2 parameters, 1 given"):
        kernels.launch("fused", (1, 1, 1), (1, 1, 1), 0, [(P, addr(x))])
    with pytest.raises(HostKernelFault, match=r"over 1024 threads a block"):
        kernels.launch("fused", (1, 1, 1), (1025, 1, 1), 0, [(P, addr(x)), (P, addr(out))])
    with pytest.raises(HostKernelFault, match=r"no entry named nope"):
        kernels.launch("nope", (1, 1, 1), (1, 1, 1), 0, [])
