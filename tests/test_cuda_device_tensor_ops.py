"""The device tensor ops (core/cuda/device_tensor_ops.py, tensor_ops.cu) on the fake
driver, which runs each entry through its numpy twin on the device bytes
(tests/fake_cuda_tensor_ops.py): each op's result, copied back after the stream is
synchronised, equals numpy's (the CPU runtime's op) on the same inputs, broadcasting
and permutations included; what is refused before a launch; the launches' geometry.
The real source compiled by NVRTC: test_cuda_nvrtc.py."""
from __future__ import annotations

import numpy as np
import pytest
from cuda_steps import fake_device as device  # noqa: F401 (a fixture)

from onnx_prep.core.cuda.device_tensor_ops import (ENTRIES, THREADS, DeviceTensorOps, broadcast_shape,
                                                   kernel_source, plan_binary, plan_cast, plan_concat, plan_split,
                                                   plan_transpose)
from onnx_prep.core.errors import DeviceError
from onnx_prep.core.ops import elementwise


class Buffers:
    """Device buffers for a test: arrays in, arrays back after the stream's work ran."""

    def __init__(self, driver) -> None:
        self.driver, self.held = driver, []

    def put(self, array: np.ndarray) -> int:
        array = np.ascontiguousarray(array)
        address = self.driver.mem_alloc(max(array.nbytes, 4))
        self.held.append(address)
        if array.nbytes:
            self.driver.copy_to_device(address, array.reshape(-1))
        return address

    def empty(self, shape, dtype=np.float32) -> int:
        return self.put(np.zeros(shape, dtype))

    def get(self, address: int, shape, dtype=np.float32) -> np.ndarray:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if n == 0:
            return np.zeros(shape, dtype)
        return np.frombuffer(self.driver.copy_to_host(address, n), dtype=dtype).reshape(shape)

    def close(self) -> None:
        for address in self.held:
            self.driver.mem_free(address)


@pytest.fixture
def ops(device):
    d, _, stream = device
    bufs = Buffers(d)
    yield DeviceTensorOps(d), bufs, d, stream
    bufs.close()
    assert d.live()["allocations"] == 0


def _f32(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("a_shape,b_shape", [
    ((7,), (7,)), ((2, 3, 5), (5,)), ((2, 1, 5), (1, 4, 1)), ((1,), (3, 2, 2, 4)), ((2, 3, 1, 4), (3, 6, 1)),
    ((4, 1), ()), ((300,), (1,)),
], ids=lambda s: "x".join(map(str, s)) or "scalar")
def test_binary_ops_broadcast_as_numpy_does(ops, op, a_shape, b_shape):
    dev, bufs, d, stream = ops
    rng = np.random.default_rng(len(a_shape) * 10 + len(b_shape))
    a, b = _f32(rng, a_shape), _f32(rng, b_shape) + np.float32(3)  # no division by ~0
    want = getattr(elementwise, {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div"}[op])([a, b], {}, {})[0]
    out = np.broadcast_shapes(a_shape, b_shape)
    y = bufs.empty(out)
    launches = dev.binary(stream, op, y, bufs.put(a), a_shape, bufs.put(b), b_shape)
    assert not bufs.get(y, out).any()  # queued, not run
    d.stream_synchronize(stream)
    assert np.array_equal(bufs.get(y, out), want), "the device op is not numpy's, bit for bit"
    n = int(np.prod(out))
    assert [(x.name, x.grid, x.block) for x in launches] == [(f"{op.lower()}_f32", (-(-n // THREADS), 1, 1),
                                                              (THREADS, 1, 1))]


@pytest.mark.parametrize("op", ["Sigmoid", "Cos", "Sin"])
def test_unary_ops_equal_the_cpu_runtimes(ops, op):
    dev, bufs, d, stream = ops
    x = (np.random.default_rng(3).standard_normal(1000) * 20).astype(np.float32)
    x[:3] = (-1e4, 1e4, 0.0)  # sigmoid's tails: no overflow to nan
    cpu = {"Sigmoid": lambda v: elementwise.sigmoid([v], {}, {})[0], "Cos": np.cos, "Sin": np.sin}[op](x)
    y = bufs.empty(x.shape)
    dev.unary(stream, op, y, bufs.put(x), x.size)
    d.stream_synchronize(stream)
    got = bufs.get(y, x.shape)
    # the fake computes them as numpy does; a GPU's tanhf / cosf / sinf are within 2 ulp
    assert np.array_equal(got, cpu)
    assert np.isfinite(got).all()


@pytest.mark.parametrize("source,target", [("int64", "float32"), ("int32", "float32"), ("int64", "int32")])
def test_casts_are_astype(ops, source, target):
    dev, bufs, d, stream = ops
    x = np.array([0, 1, -7, 2**24 + 1, 2**31 + 5, -(2**40) - 3], dtype=source) if source == "int64" else \
        np.array([0, 1, -7, 2**24 + 1, 2**31 - 1], dtype=source)
    y = bufs.empty(x.shape, target)
    dev.cast(stream, y, bufs.put(x), x.size, source, target)
    d.stream_synchronize(stream)
    assert np.array_equal(bufs.get(y, x.shape, target), x.astype(target))


def test_a_cast_that_is_not_built_is_refused_by_name():
    with pytest.raises(DeviceError, match=r"no device Cast from float32 to float16 \(built: int64->float32, "
                                          r"int32->float32, int64->int32\)"):
        plan_cast(512, 1024, 4, "float32", "float16")


@pytest.mark.parametrize("shape,perm", [((3, 4), (1, 0)), ((2, 3, 4, 5), (0, 2, 1, 3)), ((2, 3, 4), (2, 0, 1)),
                                        ((2, 3, 4, 5), (3, 2, 1, 0)), ((5, 6), None), ((7,), (0,))])
def test_transpose_is_numpys(ops, shape, perm):
    dev, bufs, d, stream = ops
    x = _f32(np.random.default_rng(sum(shape)), shape)
    want = np.ascontiguousarray(x.transpose(perm))
    y = bufs.empty(want.shape)
    dev.transpose(stream, y, bufs.put(x), shape, perm)
    d.stream_synchronize(stream)
    assert np.array_equal(bufs.get(y, want.shape), want)


@pytest.mark.parametrize("shape,axis,sizes", [((2, 12), -1, (4, 4, 4)), ((2, 3, 10), 1, (1, 2)),
                                              ((6, 5), 0, (1, 0, 5)), ((1, 2, 3, 8), 3, (3, 5))])
def test_split_gives_numpys_slices(ops, shape, axis, sizes):
    dev, bufs, d, stream = ops
    x = _f32(np.random.default_rng(len(sizes)), shape)
    want = np.split(x, np.cumsum(sizes)[:-1], axis=axis)
    ys = [bufs.empty(w.shape) for w in want]
    dev.split(stream, ys, bufs.put(x), shape, axis, sizes)
    d.stream_synchronize(stream)
    for y, w in zip(ys, want):
        assert np.array_equal(bufs.get(y, w.shape), w)


@pytest.mark.parametrize("shapes,axis", [([(2, 3), (2, 5)], 1), ([(1, 4, 2), (3, 4, 2), (2, 4, 2)], 0),
                                         ([(2, 2, 3, 1), (2, 2, 3, 4)], -1), ([(3, 0), (3, 2)], 1)])
def test_concat_is_numpys(ops, shapes, axis):
    dev, bufs, d, stream = ops
    rng = np.random.default_rng(len(shapes))
    xs = [_f32(rng, s) for s in shapes]
    want = np.concatenate(xs, axis=axis)
    y = bufs.empty(want.shape)
    dev.concat(stream, y, [bufs.put(x) for x in xs], shapes, axis)
    d.stream_synchronize(stream)
    assert np.array_equal(bufs.get(y, want.shape), want)


@pytest.mark.parametrize("x_shape,idx", [((10, 6), [[3, 0, 9]]), ((5, 2, 3), [4, -1, 0, 4]), ((7,), [[1], [6]])])
def test_gather_of_rows_is_numpys_take(ops, x_shape, idx):
    dev, bufs, d, stream = ops
    x = _f32(np.random.default_rng(len(x_shape)), x_shape)
    idx = np.array(idx, np.int64)
    want = np.take(x, idx, axis=0)
    y = bufs.empty(want.shape)
    dev.gather(stream, y, bufs.put(x), x_shape, bufs.put(idx), idx.shape)
    d.stream_synchronize(stream)
    assert np.array_equal(bufs.get(y, want.shape), want)


def test_gather_of_an_index_out_of_range_gives_zeros(ops):
    # a kernel cannot raise (the CPU op does): the row is zeros, never another row's
    dev, bufs, d, stream = ops
    x = np.arange(1, 13, dtype=np.float32).reshape(4, 3)
    y = bufs.empty((3, 3))
    dev.gather(stream, y, bufs.put(x), x.shape, bufs.put(np.array([4, -5, 1], np.int64)), (3,))
    d.stream_synchronize(stream)
    assert np.array_equal(bufs.get(y, (3, 3)), np.stack([np.zeros(3), np.zeros(3), x[1]]).astype(np.float32))


def test_misuse_is_refused_before_any_launch(ops):
    dev, bufs, d, stream = ops
    y, a = bufs.empty(64), bufs.empty(64)
    launches = len(d.launched), d.names().count("cuLaunchKernel")
    with pytest.raises(DeviceError, match=r"shapes \[2, 3\] and \[4\] do not broadcast \(dimension -1: 3 vs 4\)"):
        dev.binary(stream, "Add", y, a, (2, 3), a, (4,))
    with pytest.raises(DeviceError, match=r"rank-5 tensor \[1, 1, 1, 2, 2\]: the kernels take at most 4"):
        dev.binary(stream, "Mul", y, a, (1, 1, 1, 2, 2), a, (2,))
    with pytest.raises(DeviceError, match=r"no device kernel for the binary op Pow"):
        dev.binary(stream, "Pow", y, a, (2,), a, (2,))
    with pytest.raises(DeviceError, match=r"device address of Add's A 0x.*2 is not 4-byte aligned"):
        dev.binary(stream, "Add", y, a + 2, (2,), a, (2,))
    with pytest.raises(DeviceError, match=r"device address of Sigmoid's X 0x0 is not"):
        dev.unary(stream, "Sigmoid", y, 0, 4)
    with pytest.raises(DeviceError, match=r"Cast's X .* is not 8-byte aligned"):
        dev.cast(stream, y, a + 4, 2, "int64", "float32")
    with pytest.raises(DeviceError, match=r"perm \[0, 0, 1\] is not a permutation"):
        dev.transpose(stream, y, a, (2, 2, 2), (0, 0, 1))
    with pytest.raises(DeviceError, match=r"sizes must be one per output and sum to 12"):
        dev.split(stream, [y, y], a, (2, 12), 1, (5, 5))
    with pytest.raises(DeviceError, match=r"along axis 3 of a rank-2"):
        dev.split(stream, [y], a, (2, 12), 3, (12,))
    with pytest.raises(DeviceError, match=r"every other dimension must agree"):
        dev.concat(stream, y, [a, a], [(2, 3), (3, 3)], 1)
    assert (len(d.launched), d.names().count("cuLaunchKernel")) == launches  # nothing was launched


def test_empty_outputs_launch_nothing_and_the_plans_are_pure():
    assert plan_binary("Add", 512, 1024, (0, 3), 2048, (3,)) == ()
    assert plan_split([512, 1024], 2048, (2, 4), 1, (0, 4))[0].arg("n") == 8  # the empty part is skipped
    assert plan_concat(512, [1024], [(2, 0)], 1) == ()
    t = plan_transpose(512, 1024, (2, 3, 4), (2, 0, 1))[0]
    # Y[k, i, j] = X[i, j, k]: read with X's strides permuted (12, 4, 1)[perm] = (1, 12, 4)
    assert [t.arg(f"xs{k}") for k in range(4)] == [0, 1, 12, 4] and [t.arg(f"ys{k}") for k in range(4)] == [0, 6, 3, 1]
    assert broadcast_shape((2, 1, 5), (4, 1)) == (2, 4, 5)


def test_the_fake_refuses_a_launch_with_the_wrong_geometry(ops):
    dev, bufs, d, stream = ops
    from onnx_prep.core.cuda.driver import DriverCallError

    y, x = bufs.empty(600), bufs.empty(600)
    plan = plan_transpose(y, x, (20, 30))[0]
    with pytest.raises(DriverCallError, match=r"copy_strided_b32 over n=600 runs as grid \(3, 1, 1\)"):
        d.launch(dev._functions[plan.name], (2, 1, 1), plan.block, 0, stream, plan.args)


def test_every_entry_is_in_the_source_and_the_module_is_loaded_once(device):
    d, _, _ = device
    source = kernel_source()
    for name in ENTRIES:
        assert f" {name}(" in source, name
    DeviceTensorOps(d)
    DeviceTensorOps(d)
    assert [c for c in d.calls if c[0] == "cuModuleLoadData"] == [("cuModuleLoadData", "tensor_ops.cu", 0)]
