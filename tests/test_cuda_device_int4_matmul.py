"""The device INT4 matmul's whole call sequence on the fake driver, which runs the kernel
through this package's CPU kernel on its device bytes (tests/fake_cuda_kernels.py):
packed weights paged into a DeviceSlotPool slot, A copied in, the launch, Y copied back
after the stream is synchronised, equal bit for bit to the CPU kernel; which entry
and geometry each M gets; what is checked before a launch; level 4 declined; the
module compiled once per process and device. The real kernels: test_cuda_nvrtc.py
(compiled) and test_cuda_gpu_int4_matmul.py (run on a GPU)."""
from __future__ import annotations

import numpy as np
import pytest
from cuda_steps import MatmulStep, matmul_case
from cuda_steps import fake_device as device  # noqa: F401 (a fixture)
from fake_cuda_driver import ready

from onnx_prep import native
from onnx_prep.core.cuda import device_int4_matmul
from onnx_prep.core.cuda.device_int4_matmul import DeviceInt4Matmul, kernel_source, plan_launch
from onnx_prep.core.cuda.device_slot_pool import DeviceView
from onnx_prep.core.cuda.driver import DriverCallError
from onnx_prep.core.errors import DeviceError


@pytest.mark.parametrize("M,K,N,bs,zp,bias", [
    (1, 100, 37, 32, "none", False), (2, 256, 129, 128, "u4", True), (3, 250, 70, 32, "float", False),
    (8, 129, 19, 128, "u4", False), (9, 300, 65, 32, "float", True), (33, 64, 200, 16, "none", False),
])
def test_page_in_copy_launch_copy_back_equals_the_cpu_kernel(device, M, K, N, bs, zp, bias):
    d, pool, stream = device
    case = matmul_case(M * 1000 + K, M, K, N, bs, zp, bias=bias)
    step = MatmulStep(d, pool, "w", case)
    step(stream)
    assert not step.y().any()  # queued, not run: nothing is back before the stream is synchronised
    d.stream_synchronize(stream)
    assert np.array_equal(step.y(), case.cpu()), "the device result is not the CPU kernel's, bit for bit"
    assert step.plan.name == ("int4_matmul_tiled" if M > 8 else f"int4_matmul_gemv_m{next(r for r in (1, 2, 4, 8) if r >= M)}")
    assert d.launched == [step.plan.name]
    names = d.names()
    assert names.index("cuMemcpyHtoDAsync") < names.index("cuLaunchKernel") < names.index("cuMemcpyDtoHAsync")
    step.close()
    assert d.live()["allocations"] == 0 and d.live()["host_buffers"] == 0


def test_the_launch_reads_the_weight_where_the_slot_is_now(device):
    """Evict → page-in of other bytes under the same address: the next launch reads them."""
    d, pool, stream = device
    first, second = matmul_case(1, 2, 96, 40, 32, "u4"), matmul_case(2, 2, 96, 40, 32, "u4")
    step = MatmulStep(d, pool, "w", first)
    address = step.view.address
    step(stream)
    d.stream_synchronize(stream)
    assert np.array_equal(step.y(), first.cpu())
    pool.decommit("w")
    assert pool.page_in("w", second.packed).address == address
    step(stream)
    d.stream_synchronize(stream)
    assert np.array_equal(step.y(), second.cpu(first.A))
    step.close()


def test_a_launch_over_evicted_memory_faults_at_the_synchronisation(device):
    d, pool, stream = device
    step = MatmulStep(d, pool, "w", matmul_case(3, 1, 64, 16, 32))
    step(stream)
    pool.decommit("w")  # a bug the fake catches as a device would: the kernel reads unmapped memory
    with pytest.raises(DriverCallError, match=r"cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS \(700\)"):
        d.stream_synchronize(stream)
    step.close()


@pytest.mark.parametrize("M,grid,block,name", [
    (1, (2, 1, 1), (32, 8, 1), "int4_matmul_gemv_m1"), (3, (2, 1, 1), (32, 8, 1), "int4_matmul_gemv_m4"),
    (8, (2, 1, 1), (32, 8, 1), "int4_matmul_gemv_m8"), (9, (1, 1, 1), (256, 1, 1), "int4_matmul_tiled"),
    (65, (1, 3, 1), (256, 1, 1), "int4_matmul_tiled"),
])
def test_each_m_gets_its_entry_and_geometry(M, grid, block, name):
    case = matmul_case(4, 1, 50, 33, 16, "float")
    header = native.packed_header(case.packed)
    plan = plan_launch(header, M, 0x1000, DeviceView(0x2000, case.packed.nbytes), 0x3000, bias_addr=0x4000)
    assert (plan.name, plan.grid, plan.block, plan.shared_bytes) == (name, grid, block, 0)
    assert [plan.arg(n) for n in ("a", "lda", "packed", "y", "ldy", "bias", "m", "k", "n", "block_size", "n_blocks",
                                  "zp_kind", "panel_stride")] == [
        0x1000, 50, 0x2000, 0x3000, 33, 0x4000, M, 50, 33, 16, 4, 2, header.panel_stride]


@pytest.mark.parametrize("change,error", [
    (dict(view=DeviceView(0x2000, 64)), "the device view holds 64 bytes"),
    (dict(m=0), "M=0"),
    (dict(lda=49), "row strides lda=49"),
    (dict(a=0x1002), "A 0x1002 is not 4-byte aligned"),
    (dict(y=0), "Y 0x0"),
], ids=["view size", "no rows", "short stride", "misaligned A", "null Y"])
def test_what_does_not_fit_is_refused_before_a_launch(change, error):
    case = matmul_case(5, 1, 50, 33, 16)
    header = native.packed_header(case.packed)
    args = dict(m=1, a=0x1000, view=DeviceView(0x2000, case.packed.nbytes), y=0x3000, lda=None)
    args.update(change)
    with pytest.raises(DeviceError, match=error):
        plan_launch(header, args["m"], args["a"], args["view"], args["y"], lda=args["lda"])


def test_level_4_and_other_kinds_are_declined_by_name(device):
    d, pool, stream = device
    level4 = matmul_case(6, 1, 64, 16, 32, accuracy_level=4)
    view = pool.page_in("w4", level4.packed)
    matmul = DeviceInt4Matmul(d)
    with pytest.raises(DeviceError, match=r"accuracy level 4 .* is not built on the device"):
        matmul.launch(stream, 0x1000, view, 0x2000, 1, host_packed=level4.packed)
    gather = native.prepack_gather_block_quantized(np.zeros((4, 2, 16), np.uint8), np.ones(8, np.float32), None,
                                                   block_size=32)
    with pytest.raises(DeviceError, match="got a int4_gather buffer"):
        matmul.launch(stream, 0x1000, DeviceView(0x3000, gather.nbytes), 0x2000, 1, host_packed=gather)
    with pytest.raises(DeviceError, match="needs the packed header"):
        matmul.launch(stream, 0x1000, view, 0x2000, 1)
    assert "cuLaunchKernel" not in d.names()


def test_the_kernels_are_compiled_once_per_process_and_device(monkeypatch):
    monkeypatch.setattr(device_int4_matmul._KERNELS, "loaded", {})
    d = ready(devices=2)
    DeviceInt4Matmul(d, 0)
    DeviceInt4Matmul(d, 0)
    DeviceInt4Matmul(d, 1)
    loads = [c for c in d.calls if c[0] == "cuModuleLoadData"]
    assert loads == [("cuModuleLoadData", "int4_matmul.cu", 0), ("cuModuleLoadData", "int4_matmul.cu", 1)]
    other = ready()
    DeviceInt4Matmul(other, 0)  # another driver (process-wide: one real one) loads its own
    assert other.names().count("cuModuleLoadData") == 1


def test_the_fake_finds_every_entry_the_launches_name_in_the_source():
    """The fake's module lists the source's extern "C" entries: every entry a launch names."""
    d = ready()
    d.use_device(0)
    module = d.module_from_source(kernel_source(), "int4_matmul.cu", 0)
    assert module.entries == set(device_int4_matmul.ENTRIES)
