"""What the device-step tests share, on the fake driver and on a real device alike: a
random MatMulNBits weight packed by this package, and one matmul step on a device
(the packed bytes paged into a DeviceSlotPool slot; A and Y in plain device buffers,
copied from and to page-locked host buffers on the step's stream)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from fake_cuda_driver import ready
from test_native_reference import random_matmul_nbits

from onnx_prep import native
from onnx_prep.core.cuda.device_int4_matmul import DeviceInt4Matmul
from onnx_prep.core.cuda.device_probe import probe_devices
from onnx_prep.core.cuda.device_slot_pool import DeviceSlotPool

# For the GPU test files: the probe, once per process, and their module marks (marker
# gpu; skipped, with discovery's one-line reason, where CUDA is not usable)
GPU_PROBE = probe_devices()
GPU_MARKS = [pytest.mark.gpu,
             pytest.mark.skipif(not GPU_PROBE.usable, reason=f"needs a CUDA device: {GPU_PROBE.one_line()}")]


@pytest.fixture
def fake_device():
    """(fake driver, a DeviceSlotPool on it, a stream): import it into a test module."""
    d = ready(memory=256 << 20)
    pool = DeviceSlotPool(d)
    stream = d.stream_create()
    yield d, pool, stream
    pool.close()


@pytest.fixture(scope="module")
def gpu_device():
    """(cuda-python's driver, a DeviceSlotPool on device 0, a stream): import it into a
    GPU test module (whose marks are GPU_MARKS)."""
    from onnx_prep.core.cuda.cuda_python_driver import load_driver

    d = load_driver()
    d.init()
    if not d.vmm_supported(0):
        pytest.skip(f"device 0 ({d.device_name(0)}) has no virtual memory management")
    pool = DeviceSlotPool(d)
    stream = d.stream_create()
    yield d, pool, stream
    d.stream_destroy(stream)
    pool.close()


@dataclass
class MatmulCase:
    A: np.ndarray  # float32 [M, K]
    packed: np.ndarray  # the CPU kernels' packed bytes
    bias: np.ndarray | None
    sources: tuple  # (B, scales, zero points) as MatMulNBits has them

    def cpu(self, A: np.ndarray | None = None) -> np.ndarray:
        """The CPU kernel's FMA mode: the op sequence the device kernels follow."""
        return native.matmul_nbits(self.A if A is None else A, self.packed, bias=self.bias, compute="fma")


def matmul_case(seed: int, M: int, K: int, N: int, block_size: int, zp: str = "none", *, bias: bool = False,
                accuracy_level: int = 0) -> MatmulCase:
    rng = np.random.default_rng(seed)
    B, s, z = random_matmul_nbits(rng, K=K, N=N, block_size=block_size, zp=zp)
    A = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32) if bias else None
    packed = native.prepack_matmul_nbits(B, s, z, K=K, N=N, block_size=block_size, accuracy_level=accuracy_level)
    return MatmulCase(A, packed, b, (B, s, z))


class MatmulStep:
    """``Y = A x W (+ bias)`` as one device step: ``step(stream)`` queues copy A in,
    the INT4 matmul, copy Y out. ``key`` is what a captured graph of it depends on."""

    def __init__(self, driver, pool, key: str, case: MatmulCase) -> None:
        self.driver, self.pool, self.slot = driver, pool, key
        self.M, K = case.A.shape
        self.header = native.packed_header(case.packed)
        self.N = self.header.N
        self.view = pool.page_in(key, case.packed)
        self.a_dev = driver.mem_alloc(4 * self.M * K)
        self.y_dev = driver.mem_alloc(4 * self.M * self.N)
        self.bias_dev = 0
        if case.bias is not None:
            self.bias_dev = driver.mem_alloc(4 * self.N)
            driver.copy_to_device(self.bias_dev, case.bias)
        self.a_host = driver.host_alloc(4 * self.M * K)
        self.y_host = driver.host_alloc(4 * self.M * self.N)
        self.matmul = DeviceInt4Matmul(driver, pool.device)
        self.set_a(case.A)

    def set_a(self, A: np.ndarray) -> None:
        self.a_host[:] = np.ascontiguousarray(A, dtype=np.float32).view(np.uint8).reshape(-1)

    def __call__(self, stream) -> None:
        d = self.driver
        d.copy_to_device_async(self.a_dev, self.a_host, stream)
        self.plan = self.matmul.launch(stream, self.a_dev, self.view, self.y_dev, self.M, header=self.header,
                                       bias_addr=self.bias_dev)
        d.copy_to_host_async(self.y_host, self.y_dev, stream)

    @property
    def key(self) -> tuple:
        return (self.view.address, self.a_dev, self.y_dev, self.bias_dev, self.M)

    def y(self) -> np.ndarray:
        return self.y_host.view(np.float32).reshape(self.M, self.N).copy()

    def close(self) -> None:
        d = self.driver
        for address in (self.a_dev, self.y_dev, self.bias_dev):
            if address:
                d.mem_free(address)
        d.host_free(self.a_host)
        d.host_free(self.y_host)
