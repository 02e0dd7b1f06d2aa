"""The device INT4 prepack's whole call sequence on the fake driver, which runs the
prepack entries through this package's CPU prepack on its device bytes
(tests/fake_cuda_kernels.py): sources from page-locked host buffers into device
staging, the launch into the weight's DeviceSlotPool slot, the bytes read back after
the stream is synchronised, equal to the CPU prepack's for random shapes over every
zero-point kind, both scale types and the block sizes; the device INT4 matmul over the
device-packed slot equal to the CPU kernel; the staging reused and freed only after its
event; what is refused before a launch; the module compiled once per process and
device. What this proves is the call sequence, the arguments and the checks: the CUDA
code itself is compiled in test_cuda_nvrtc.py and run on a GPU in
test_cuda_gpu_int4_prepack.py."""
from __future__ import annotations

import numpy as np
import pytest
from cuda_steps import fake_device as device  # noqa: F401 (a fixture)
from fake_cuda_driver import ready
from test_native_reference import random_matmul_nbits

from onnx_prep import native
from onnx_prep.core.cuda import device_int4_prepack
from onnx_prep.core.cuda.device_int4_matmul import DeviceInt4Matmul
from onnx_prep.core.cuda.device_int4_prepack import (DeviceInt4Prepack, Int4Source, PrepackStaging, kernel_source,
                                                     plan_prepack)
from onnx_prep.core.cuda.device_slot_pool import DeviceView
from onnx_prep.core.cuda.driver import DriverCallError
from onnx_prep.core.errors import DeviceError
from onnx_prep.core.model.weights import DigestSource, WeightDescriptor

MATMUL_ZP = ("none", "u4", "float32", "float16")
GATHER_ZP = ("none", "u4", "u4_bytes", "float32", "float16")


def matmul_sources(rng, K: int, N: int, bs: int, zp: str, scales: str) -> tuple:
    kind = {"none": "none", "u4": "u4"}.get(zp, "float")
    B, s, z = random_matmul_nbits(rng, K=K, N=N, block_size=bs, zp=kind, scale_dtype=np.dtype(scales))
    if z is not None and kind == "float":
        z = z.astype(zp)
    return (B, s) + (() if z is None else (z,))


def gather_sources(rng, V: int, nb: int, bs: int, zp: str, scales: str) -> tuple:
    data = rng.integers(0, 256, (V, nb, bs // 2), dtype=np.uint8)
    s = (rng.random(V * nb) * 0.02 + 0.001).astype(scales)
    z = {"none": None, "u4": rng.integers(0, 256, (V, (nb + 1) // 2), dtype=np.uint8),
         "u4_bytes": rng.integers(0, 256, (V, nb, 1), dtype=np.uint8),  # high nibbles set too: ignored
         "float32": (rng.random(V * nb) * 15).astype(np.float32),
         "float16": (rng.random(V * nb) * 15).astype(np.float16)}[zp]
    return (data, s) + (() if z is None else (z,))


def pinned(driver, arrays) -> list:
    """Each source in a page-locked host buffer, as a read task would leave it."""
    out = []
    for a in arrays:
        raw = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        buf = driver.host_alloc(raw.nbytes)
        buf[:] = raw
        out.append(buf)
    return out


def device_prepack(driver, pool, stream, key: str, source: Int4Source, arrays) -> bytes:
    hosts = pinned(driver, arrays)
    with PrepackStaging(driver, pool, stream) as staging:
        view = staging.prepack(key, source, hosts)
        assert view.nbytes == source.packed_size()
        assert not any(pool.copy_to_host(key)), "queued, not run: nothing is packed before the synchronisation"
        driver.stream_synchronize(stream)
    for buf in hosts:
        driver.host_free(buf)
    return pool.copy_to_host(key)


@pytest.mark.parametrize("zp", MATMUL_ZP)
@pytest.mark.parametrize("scales", ["float32", "float16"])
@pytest.mark.parametrize("bs", [16, 32, 64, 128, 256])
def test_matmul_device_prepack_equals_the_cpu_prepack(device, zp, scales, bs):
    d, pool, stream = device
    rng = np.random.default_rng(bs * 10 + MATMUL_ZP.index(zp) + (scales == "float16") * 5)
    K = int(rng.integers(1, 5 * bs))  # mostly not a multiple of the block: padded codes
    N = int(rng.integers(1, 200))  # mostly not a multiple of the 64-column panel
    level = int(rng.integers(0, 5))
    arrays = matmul_sources(rng, K, N, bs, zp, scales)
    source = Int4Source.of("int4_matmul", arrays, block_size=bs, K=K, N=N, accuracy_level=level)
    assert (source.scales, source.zero_points) == (scales, zp)
    got = device_prepack(d, pool, stream, "w", source, arrays)
    want = native.prepack_matmul_nbits(*arrays[:2], arrays[2] if len(arrays) > 2 else None, K=K, N=N,
                                       block_size=bs, accuracy_level=level)
    assert got == want.tobytes(), f"K={K} N={N}: the device bytes are not the CPU prepack's"
    header = native.packed_header(np.frombuffer(got, np.uint8))
    assert (header.K, header.N, header.accuracy_level, header.scales_were_f16) == (K, N, level, scales == "float16")
    assert source.header() == header, "the header described on the host is not the one the prepack writes"
    assert d.launched == ["int4_matmul_prepack"]


@pytest.mark.parametrize("zp", GATHER_ZP)
@pytest.mark.parametrize("bs", [16, 32, 64, 128])
def test_gather_device_prepack_equals_the_cpu_prepack(device, zp, bs):
    d, pool, stream = device
    rng = np.random.default_rng(1000 + bs + GATHER_ZP.index(zp))
    V, nb = int(rng.integers(1, 90)), int(rng.integers(2, 7))
    scales = "float16" if bs in (32, 128) else "float32"
    arrays = gather_sources(rng, V, nb, bs, zp, scales)
    source = Int4Source.of("int4_gather", arrays, block_size=bs)
    assert (source.rows, source.n_blocks, source.zero_points) == (V, nb, zp)
    got = device_prepack(d, pool, stream, "table", source, arrays)
    want = native.prepack_gather_block_quantized(*arrays[:2], arrays[2] if len(arrays) > 2 else None, block_size=bs)
    assert got == want.tobytes(), f"V={V} n_blocks={nb}: the device bytes are not the CPU prepack's"
    assert source.header() == native.packed_header(want), "the header described on the host is not the prepack's"
    assert d.launched == ["int4_gather_prepack"]


@pytest.mark.parametrize("M,K,N,bs,zp", [(1, 100, 37, 32, "u4"), (3, 250, 70, 16, "float16"),
                                         (9, 129, 130, 64, "none"), (2, 256, 65, 128, "float32")])
def test_the_device_matmul_over_a_device_packed_slot_equals_the_cpu_kernel(device, M, K, N, bs, zp):
    d, pool, stream = device
    rng = np.random.default_rng(M * 7 + K)
    arrays = matmul_sources(rng, K, N, bs, zp, "float32")
    source = Int4Source.of("int4_matmul", arrays, block_size=bs, K=K, N=N)
    A = rng.standard_normal((M, K)).astype(np.float32)
    hosts = pinned(d, arrays + (A,))
    a_dev, y_dev = d.mem_alloc(A.nbytes), d.mem_alloc(4 * M * N)
    y_host = d.host_alloc(4 * M * N)
    staging = PrepackStaging(d, pool, stream)
    view = staging.prepack("w", source, hosts[:-1])
    d.copy_to_device_async(a_dev, hosts[-1], stream)
    header = native.packed_header(native.prepack_matmul_nbits(*arrays[:2], arrays[2] if len(arrays) > 2 else None,
                                                              K=K, N=N, block_size=bs))
    DeviceInt4Matmul(d).launch(stream, a_dev, view, y_dev, M, header=header)  # queued behind the prepack
    d.copy_to_host_async(y_host, y_dev, stream)
    d.stream_synchronize(stream)
    cpu_packed = native.prepack_matmul_nbits(*arrays[:2], arrays[2] if len(arrays) > 2 else None, K=K, N=N,
                                             block_size=bs)
    want = native.matmul_nbits(A, cpu_packed, compute="fma")
    assert np.array_equal(y_host.view(np.float32).reshape(M, N), want)
    assert d.launched[0] == "int4_matmul_prepack" and d.launched[1].startswith("int4_matmul_")
    staging.close()
    for address in (a_dev, y_dev):
        d.mem_free(address)
    for buf in hosts + [y_host]:
        d.host_free(buf)
    assert d.live()["allocations"] == 0 and d.live()["host_buffers"] == 0


def test_the_staging_is_reused_on_its_stream_and_freed_only_after_its_event(device):
    d, pool, stream = device
    rng = np.random.default_rng(5)
    small = matmul_sources(rng, 64, 40, 32, "u4", "float32")
    large = matmul_sources(rng, 512, 300, 32, "u4", "float32")
    staging = PrepackStaging(d, pool, stream)
    staging.prepack("a", Int4Source.of("int4_matmul", small, block_size=32, K=64, N=40), pinned(d, small))
    first, size = staging._staging, staging.staging_bytes
    staging.prepack("b", Int4Source.of("int4_matmul", small, block_size=32, K=64, N=40), pinned(d, small))
    assert (staging._staging, staging.staging_bytes) == (first, size)  # reused: stream order, no wait
    assert "cuEventSynchronize" not in d.names()
    staging.prepack("c", Int4Source.of("int4_matmul", large, block_size=32, K=512, N=300), pinned(d, large))
    names = d.names()
    # growing: the event behind the last prepack first, then the old buffer freed
    assert names.index("cuEventSynchronize") < names.index("cuMemFree") < len(names) - names[::-1].index("cuMemAlloc")
    assert staging.staging_bytes > size and staging.prepacks == 3
    assert staging.staged_bytes == 2 * sum(a.nbytes for a in small) + sum(a.nbytes for a in large)
    staging.close()  # waits, then frees: the last kernel ran before its staging went
    assert d.live()["allocations"] == 0
    for key, arrays, K, N in (("a", small, 64, 40), ("b", small, 64, 40), ("c", large, 512, 300)):
        want = native.prepack_matmul_nbits(*arrays, K=K, N=N, block_size=32)
        assert pool.copy_to_host(key) == want.tobytes(), key
    staging.close()  # idempotent


def test_freeing_the_staging_before_its_prepack_ran_faults_as_a_device_would(device):
    """Why the event: the fake reports the kernel's read of freed staging at the synchronisation."""
    d, pool, stream = device
    arrays = matmul_sources(np.random.default_rng(6), 64, 16, 32, "none", "float32")
    staging = PrepackStaging(d, pool, stream)
    staging.prepack("w", Int4Source.of("int4_matmul", arrays, block_size=32, K=64, N=16), pinned(d, arrays))
    d.mem_free(staging._staging)  # what close() would do without waiting for the event
    with pytest.raises(DriverCallError, match=r"cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS \(700\)"):
        d.stream_synchronize(stream)


def _source(**change) -> Int4Source:
    args = dict(kind="int4_matmul", rows=33, K=50, block_size=16, scales="float32", zero_points="u4")
    args.update(change)
    return Int4Source(**args)


@pytest.mark.parametrize("addresses,dest,error", [
    ((0x1000, 0x2000, 0x3000), DeviceView(0x10000, 64), r"the destination view holds 64 bytes, the packed"),
    ((0x1000, 0x2000), None, r"reads 3 sources \(B, scales, zero points\), got 2 addresses"),
    ((0x1002, 0x2000, 0x3000), None, r"device address of B 0x1002 is not 4-byte aligned"),
    ((0x1000, 0, 0x3000), None, r"device address of scales 0x0 is not 4-byte aligned"),
    ((0x1000, 0x2000, 0x3000), "misaligned", r"device address of the destination 0x10002 is not 4-byte aligned"),
    ((0x1000, DeviceView(0x2000, 8), 0x3000), None, r"the device view of scales holds 8 bytes, its source needs 528"),
], ids=["dest size", "address count", "unaligned source", "null source", "unaligned dest", "short source view"])
def test_what_does_not_fit_is_refused_before_a_launch(device, addresses, dest, error):
    d, pool, stream = device
    source = _source()
    if dest is None or dest == "misaligned":
        dest = DeviceView(0x10000 + (2 if dest else 0), source.packed_size())
    with pytest.raises(DeviceError, match=error):
        DeviceInt4Prepack(d).launch(stream, addresses, dest, source)
    assert "cuLaunchKernel" not in d.names()


@pytest.mark.parametrize("change,error", [
    (dict(block_size=48), "block_size must be a power of two in"),
    (dict(block_size=512), "block_size must be a power of two in"),
    (dict(zero_points="u4_bytes"), "zero points 'u4_bytes', expected one of none, u4, float32, float16"),
    (dict(zero_points="int32"), "zero points 'int32'"),
    (dict(scales="bfloat16"), "scales of bfloat16"),
    (dict(kind="int4_gather", K=40), "a gather's rows are whole blocks"),
    (dict(kind="gemm_b"), "it packs int4_matmul and int4_gather"),
    (dict(rows=0), "rows and K must be positive"),
    (dict(accuracy_level=5), "accuracy_level 5"),
])
def test_a_source_the_cpu_prepack_would_refuse_is_refused_by_name(change, error):
    with pytest.raises(DeviceError, match=error):
        _source(**change)


def test_host_buffers_of_the_wrong_size_are_refused_before_anything_is_queued(device):
    d, pool, stream = device
    arrays = matmul_sources(np.random.default_rng(7), 64, 16, 32, "u4", "float32")
    source = Int4Source.of("int4_matmul", arrays, block_size=32, K=64, N=16)
    hosts = pinned(d, arrays)
    staging = PrepackStaging(d, pool, stream)
    with pytest.raises(DeviceError, match=r"source 1 of int4_matmul .* holds 64 bytes, expected 128"):
        staging.prepack("w", source, [hosts[0], d.host_alloc(64), hosts[2]])
    with pytest.raises(DeviceError, match="reads 3 sources, got 2 host buffers"):
        staging.prepack("w", source, hosts[:2])
    assert not {"cuMemcpyHtoDAsync", "cuLaunchKernel", "cuMemCreate"} & set(d.names())
    staging.close()


def test_the_fake_refuses_header_arguments_that_are_not_the_sources():
    """The fake-only check can fail: a launch whose stride is not the native one's."""
    d = ready()
    d.use_device(0)
    source = _source(zero_points="none")
    dest = d.mem_alloc(source.packed_size())
    plan = plan_prepack(source, (0x1000, 0x2000), DeviceView(dest, source.packed_size()))
    args = tuple((t, v + 64 if i == 11 else v) for i, (t, v) in enumerate(plan.args))  # stride
    function = DeviceInt4Prepack(d)._functions[plan.name]
    with pytest.raises(DriverCallError, match=r"\(fake-only check\) int4_matmul_prepack for .*should be"):
        d.launch(function, plan.grid, plan.block, 0, d.stream_create(), args)
    with pytest.raises(DriverCallError, match="fake-only check"):
        d.launch(function, (plan.grid[0] + 1, 1, 1), plan.block, 0, d.stream_create(), plan.args)


def test_the_kernels_are_compiled_once_per_process_and_device(monkeypatch):
    monkeypatch.setattr(device_int4_prepack._KERNELS, "loaded", {})
    d = ready(devices=2)
    DeviceInt4Prepack(d, 0)
    DeviceInt4Prepack(d, 0)
    DeviceInt4Prepack(d, 1)
    loads = [c for c in d.calls if c[0] == "cuModuleLoadData"]
    assert loads == [("cuModuleLoadData", "int4_prepack.cu", 0), ("cuModuleLoadData", "int4_prepack.cu", 1)]


def test_the_source_takes_the_formats_constants_from_the_native_module():
    d = ready()
    d.use_device(0)
    module = d.module_from_source(kernel_source(), "int4_prepack.cu", 0)
    assert module.entries == set(device_int4_prepack.ENTRIES.values())
    text = device_int4_prepack.SOURCE.read_text()
    assert "0x4B50504F" not in text.upper() and "#define OP_PACK_FORMAT_VERSION" not in text
    assert f"#define OP_PACK_FORMAT_VERSION {int(native.lib.OP_PACK_FORMAT_VERSION)}\n" in kernel_source()
    assert f"#define OP_PACK_MAGIC {int(native.lib.OP_PACK_MAGIC):#x}u\n" in kernel_source()


def _descriptor(name: str, dtype: str, dims: tuple, length: int) -> WeightDescriptor:
    return WeightDescriptor(name, dtype, 0, dims, "w.bin", 0, length, None, DigestSource.NONE)


def test_a_nodes_sources_describe_the_same_source_and_a_fused_dq_weight_is_refused():
    rng = np.random.default_rng(8)
    arrays = matmul_sources(rng, 100, 70, 32, "u4", "float16")
    weights = [_descriptor(n, str(a.dtype), a.shape, a.nbytes) for n, a in zip("BSZ", arrays)]
    attrs = {"K": 100, "N": 70, "block_size": 32, "accuracy_level": 4}
    assert Int4Source.of_node("int4_matmul", attrs, weights) == Int4Source.of(
        "int4_matmul", arrays, block_size=32, K=100, N=70, accuracy_level=4)
    table = gather_sources(rng, 9, 3, 32, "u4_bytes", "float32")  # as the op has them: scales [V, n_blocks, 1]
    weights = [_descriptor(n, str(a.dtype), dims, a.nbytes) for n, a, dims in zip("DSZ", table, [(9, 48), (9, 3, 1),
                                                                                                (9, 3, 1)])]
    assert Int4Source.of_node("int4_gather", {"block_size": 32}, weights) == Int4Source(
        "int4_gather", 9, 96, 32, "float32", "u4_bytes")
    with pytest.raises(DeviceError, match=r"fused DequantizeLinear \+ MatMul weight .* has no device prepack"):
        Int4Source.of_node("int4_matmul", {**attrs, "weight_layout": "KN"}, weights)
