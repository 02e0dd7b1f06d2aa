"""The device INT4 prepack's CUDA code run on the host, where no GPU is: the source the
device compiles (``device_int4_prepack.kernel_source()``, unchanged) built as C++ with a
few definitions standing in for CUDA's (each block's 256 threads are host threads,
``__syncthreads`` a barrier among them, ``__shared__`` one array, the blocks run one
after another by the same threads), launched with the very arguments ``plan_prepack`` decides, into an
output prefilled with other bytes. Its bytes equal the CPU prepack's: every zero-point
form, both scale types (fp16 scales with a subnormal, signed zeros, inf and the largest
half), block sizes 16-256, K and N off the block and the 64-column panel, both layouts.

This checks the kernels' index arithmetic, padding, header and conversions, which the
fake driver's twin (the CPU prepack itself) cannot; it does not check what only a
device has (alignment faults, the memory model, NVRTC's code): that is
test_cuda_gpu_int4_prepack.py's. Skipped, saying so, without a C++20 compiler."""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from test_cuda_device_int4_prepack import GATHER_ZP, MATMUL_ZP, gather_sources, matmul_sources

from onnx_prep import native
from onnx_prep.core.cuda.device_int4_prepack import KERNEL_PARAMS, Int4Source, kernel_source, plan_prepack
from onnx_prep.core.cuda.device_slot_pool import DeviceView

CXX = shutil.which("g++") or shutil.which("c++")
HARNESS = r"""
#include <barrier>
#include <cstring>
#include <thread>
#include <vector>
struct HostDim3 { unsigned x = 0, y = 0, z = 0; };
thread_local HostDim3 threadIdx, blockIdx;
static std::barrier<> *block_barrier;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __restrict__
#define __shared__ static
static inline void __syncthreads() { block_barrier->arrive_and_wait(); }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
#include "int4_prepack_host.cu"
typedef void (*entry_t)(KERNEL_PARAMS);
extern "C" void launch(int gather, unsigned grid, const unsigned char *b, const void *s, const void *zp,
                       unsigned char *out, u64 K, u64 rows, int bs, u32 nb, int f16, int zps, u32 flags, u64 stride,
                       u64 total) {
    const entry_t entry = gather ? int4_gather_prepack : int4_matmul_prepack;
    std::barrier<> barrier(PREPACK_THREADS);
    block_barrier = &barrier;
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < PREPACK_THREADS; t++)
        threads.emplace_back([=, &barrier] {
            threadIdx.x = t;
            for (unsigned blk = 0; blk < grid; blk++) {  // the block's threads, block after block
                blockIdx.x = blk;
                entry(b, s, zp, out, K, rows, bs, nb, f16, zps, flags, stride, total);
                barrier.arrive_and_wait();  // the next block's shared memory is this one's
            }
        });
    for (auto &thread : threads) thread.join();
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    if CXX is None:
        pytest.skip("needs a C++ compiler (g++) to build the kernels for the host")
    folder = tmp_path_factory.mktemp("int4_prepack_host")
    (folder / "int4_prepack_host.cu").write_text(kernel_source())
    (folder / "harness.cpp").write_text(HARNESS)
    library = folder / "int4_prepack_host.so"
    built = subprocess.run([CXX, "-std=c++20", "-O1", "-fno-strict-aliasing", "-shared", "-fPIC", "-pthread",
                            "-o", str(library), str(folder / "harness.cpp")], capture_output=True, text=True)
    if built.returncode != 0:
        if "barrier" in built.stderr and "No such file" in built.stderr:
            pytest.skip(f"needs a C++20 compiler with <barrier>: {CXX} has none")
        pytest.fail(f"the kernels did not build for the host:\n{built.stderr[-3000:]}")
    lib = ctypes.CDLL(str(library))
    lib.launch.argtypes = [ctypes.c_int, ctypes.c_uint] + [t for _, t in KERNEL_PARAMS]
    lib.launch.restype = None
    return lib


def run_emulated(lib, source: Int4Source, arrays) -> bytes:
    arrays = [np.ascontiguousarray(a) for a in arrays]
    out = np.full(source.packed_size(), 0xAB, np.uint8)  # every byte must be written by the kernel
    plan = plan_prepack(source, [a.ctypes.data for a in arrays], DeviceView(out.ctypes.data, out.nbytes))
    assert plan.grid[1:] == (1, 1) and plan.block == (256, 1, 1)
    lib.launch(int(source.kind == "int4_gather"), plan.grid[0], *(value for _, value in plan.args))
    return out.tobytes()


@pytest.mark.parametrize("zp", MATMUL_ZP)
@pytest.mark.parametrize("bs", [16, 32, 64, 128, 256])
def test_the_matmul_kernel_writes_the_cpu_prepacks_bytes(emulated, zp, bs):
    rng = np.random.default_rng(bs + 3 * MATMUL_ZP.index(zp))
    for scales in ("float32", "float16"):
        K, N, level = int(rng.integers(1, 4 * bs)), int(rng.integers(1, 150)), int(rng.integers(0, 5))
        arrays = matmul_sources(rng, K, N, bs, zp, scales)
        if scales == "float16":
            special = np.array([6e-8, 0.0, -0.0, np.inf, 65504, -6.1e-5], np.float16)
            arrays[1].reshape(-1)[:special.size] = special[:arrays[1].size]
        source = Int4Source.of("int4_matmul", arrays, block_size=bs, K=K, N=N, accuracy_level=level)
        want = native.prepack_matmul_nbits(*arrays[:2], arrays[2] if len(arrays) > 2 else None, K=K, N=N,
                                           block_size=bs, accuracy_level=level)
        got = run_emulated(emulated, source, arrays)
        assert got == want.tobytes(), (f"K={K} N={N} {scales}: first differing byte "
                                       f"{np.flatnonzero(np.frombuffer(got, np.uint8) != want)[:1]}")


@pytest.mark.parametrize("zp", GATHER_ZP)
@pytest.mark.parametrize("bs", [16, 64, 256])
def test_the_gather_kernel_writes_the_cpu_prepacks_bytes(emulated, zp, bs):
    rng = np.random.default_rng(70 + bs + GATHER_ZP.index(zp))
    for scales in ("float32", "float16"):
        V, nb = int(rng.integers(1, 40)), int(rng.integers(1, 7))
        arrays = gather_sources(rng, V, nb, bs, zp, scales)
        source = Int4Source.of("int4_gather", arrays, block_size=bs)
        want = native.prepack_gather_block_quantized(*arrays[:2], arrays[2] if len(arrays) > 2 else None,
                                                     block_size=bs)
        got = run_emulated(emulated, source, arrays)
        assert got == want.tobytes(), (f"V={V} n_blocks={nb} {scales}: first differing byte "
                                       f"{np.flatnonzero(np.frombuffer(got, np.uint8) != want)[:1]}")


def test_a_wrong_kernel_is_caught(emulated):
    """The comparison can fail: the same launch with the zero points' form misdescribed
    (packed uint4 read as one code a byte) gives other bytes."""
    rng = np.random.default_rng(9)
    arrays = gather_sources(rng, 5, 4, 32, "u4", "float32")
    source = Int4Source.of("int4_gather", arrays, block_size=32)
    wrong = Int4Source("int4_gather", source.rows, source.K, 32, "float32", "u4_bytes")
    padded = arrays[:2] + (np.resize(arrays[2], source.rows * source.n_blocks),)  # sized for the wrong form
    want = native.prepack_gather_block_quantized(*arrays, block_size=32)
    assert run_emulated(emulated, wrong, padded) != want.tobytes()
