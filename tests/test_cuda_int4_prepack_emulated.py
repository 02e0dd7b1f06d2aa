"""The device INT4 prepack's CUDA code run on the host, where no GPU is: the source the
device compiles (``device_int4_prepack.kernel_source()``, unchanged) built for the host
by tests/cuda_host.py (each block's 256 threads are fibers, ``__syncthreads`` a
barrier among them, the blocks one after another), launched with the very entry, grid,
block and arguments ``plan_prepack`` decides, into an output prefilled with other
bytes. Its bytes equal the CPU prepack's: every zero-point form, both scale types (fp16
scales with a subnormal, signed zeros, inf and the largest half), block sizes 16-256, K
and N off the block and the 64-column panel, both layouts.

This checks the kernels' index arithmetic, padding, header and conversions, which the
fake driver's twin (the CPU prepack itself) cannot; it does not check what only a
device has (alignment faults of plain loads, the memory model, NVRTC's code): that is
test_cuda_gpu_int4_prepack.py's. Skipped, saying so, without a C++20 compiler."""
from __future__ import annotations

import numpy as np
import pytest
from cuda_host import host_kernels
from test_cuda_device_int4_prepack import GATHER_ZP, MATMUL_ZP, gather_sources, matmul_sources

from onnx_prep import native
from onnx_prep.core.cuda.device_int4_prepack import ENTRIES, Int4Source, kernel_source, plan_prepack
from onnx_prep.core.cuda.device_slot_pool import DeviceView


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return host_kernels(tmp_path_factory, kernel_source(), tuple(ENTRIES.values()))


def run_emulated(kernels, source: Int4Source, arrays) -> bytes:
    arrays = [np.ascontiguousarray(a) for a in arrays]
    out = np.full(source.packed_size(), 0xAB, np.uint8)  # every byte must be written by the kernel
    plan = plan_prepack(source, [a.ctypes.data for a in arrays], DeviceView(out.ctypes.data, out.nbytes))
    kernels.launch(plan.name, plan.grid, plan.block, plan.shared_bytes, plan.args)
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
