"""The device INT4 prepack on a real CUDA device, through cuda-python
(core/cuda/cuda_python_driver.py): the NVRTC-compiled kernels pack random sources (every
zero-point kind, both scale types, block sizes 16-256, K and N not multiples of the
block and the 64-column panel; fp16 scales holding a subnormal, a signed zero, inf and
the largest half) into a slot prefilled with other bytes, and the bytes read back
are the CPU prepack's, header included; the device INT4 matmul over such a slot equals
the CPU kernel's output on the CPU-packed bytes within the tolerance of
test_cuda_gpu_int4_matmul.py. Each test skips, with discovery's one-line reason, where
CUDA is not usable (this CI)."""
from __future__ import annotations

import numpy as np
import pytest
from cuda_steps import GPU_MARKS, MatmulCase
from cuda_steps import gpu_device as device  # noqa: F401 (a fixture)
from test_cuda_device_int4_prepack import GATHER_ZP, MATMUL_ZP, gather_sources, matmul_sources, pinned
from test_cuda_gpu_int4_matmul import assert_matches

from onnx_prep import native
from onnx_prep.core.cuda.device_int4_matmul import DeviceInt4Matmul
from onnx_prep.core.cuda.device_int4_prepack import Int4Source, PrepackStaging

pytestmark = GPU_MARKS


def device_bytes(device, key: str, source: Int4Source, arrays) -> bytes:
    d, pool, stream = device
    view = pool.commit(key, source.packed_size())
    pool.upload(key, np.full(view.nbytes, 0xAB, np.uint8))  # every byte must be written by the kernel
    hosts = pinned(d, arrays)
    with PrepackStaging(d, pool, stream) as staging:
        staging.prepack(key, source, hosts)
        d.stream_synchronize(stream)
    for buf in hosts:
        d.host_free(buf)
    return pool.copy_to_host(key)


@pytest.mark.parametrize("zp", MATMUL_ZP)
@pytest.mark.parametrize("scales", ["float32", "float16"])
@pytest.mark.parametrize("bs", [16, 32, 64, 128, 256])
def test_matmul_device_prepack_equals_the_cpu_prepack(device, zp, scales, bs):
    rng = np.random.default_rng(bs + MATMUL_ZP.index(zp) * 7 + (scales == "float16"))
    K, N, level = int(rng.integers(1, 5 * bs)), int(rng.integers(1, 300)), int(rng.integers(0, 5))
    arrays = matmul_sources(rng, K, N, bs, zp, scales)
    if scales == "float16":
        special = np.array([6e-8, 0.0, -0.0, np.inf, 65504], np.float16)
        arrays[1].reshape(-1)[:special.size] = special[:arrays[1].size]
    source = Int4Source.of("int4_matmul", arrays, block_size=bs, K=K, N=N, accuracy_level=level)
    got = device_bytes(device, f"mm-{zp}-{scales}-{bs}", source, arrays)
    want = native.prepack_matmul_nbits(*arrays[:2], arrays[2] if len(arrays) > 2 else None, K=K, N=N, block_size=bs,
                                       accuracy_level=level)
    assert got == want.tobytes(), f"K={K} N={N}: the device bytes are not the CPU prepack's"


@pytest.mark.parametrize("zp", GATHER_ZP)
@pytest.mark.parametrize("bs", [16, 64, 256])
def test_gather_device_prepack_equals_the_cpu_prepack(device, zp, bs):
    rng = np.random.default_rng(500 + bs + GATHER_ZP.index(zp))
    V, nb = int(rng.integers(1, 300)), int(rng.integers(1, 9))
    arrays = gather_sources(rng, V, nb, bs, zp, "float16" if bs == 64 else "float32")
    source = Int4Source.of("int4_gather", arrays, block_size=bs)
    got = device_bytes(device, f"g-{zp}-{bs}", source, arrays)
    want = native.prepack_gather_block_quantized(*arrays[:2], arrays[2] if len(arrays) > 2 else None, block_size=bs)
    assert got == want.tobytes(), f"V={V} n_blocks={nb}: the device bytes are not the CPU prepack's"


@pytest.mark.parametrize("M", [1, 32])
def test_the_device_matmul_over_a_device_packed_slot_matches(device, M):
    d, pool, stream = device
    rng = np.random.default_rng(M)
    K, N, bs = 1000, 333, 32
    arrays = matmul_sources(rng, K, N, bs, "u4", "float16")
    source = Int4Source.of("int4_matmul", arrays, block_size=bs, K=K, N=N)
    device_bytes(device, f"mm-run-{M}", source, arrays)
    view = pool.view(f"mm-run-{M}")
    packed = native.prepack_matmul_nbits(*arrays, K=K, N=N, block_size=bs)
    case = MatmulCase(rng.standard_normal((M, K)).astype(np.float32), packed, None, arrays)
    a_dev, y_dev = d.mem_alloc(4 * M * K), d.mem_alloc(4 * M * N)
    d.copy_to_device(a_dev, case.A)
    DeviceInt4Matmul(d).launch(stream, a_dev, view, y_dev, M, host_packed=packed)
    d.stream_synchronize(stream)
    y = np.frombuffer(d.copy_to_host(y_dev, 4 * M * N), np.float32).reshape(M, N)
    d.mem_free(a_dev)
    d.mem_free(y_dev)
    assert_matches(y, case, f"M={M} over the device-packed slot")
