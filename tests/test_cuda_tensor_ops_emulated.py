"""The device tensor ops' CUDA code run on the host, where no GPU is: every entry of
``tensor_ops.cu``, unchanged, built by tests/cuda_host.py and launched with the very
entries, grids, blocks and arguments ``device_tensor_ops``' ``plan_*`` functions decide,
on host arrays, into outputs prefilled with NaN garbage and followed by a guard tail
(the grid rounds up to whole blocks: threads past n must write nothing).

Against the CPU runtime's ops (core/ops/elementwise.py) and numpy, held to what
tensor_ops.cu claims: Add, Sub, Mul, Div (numpy broadcasting up to 4-D, inf, NaN,
signed zeros, subnormals), the casts, Transpose, Split, Concat and Gather bit for bit
(a NaN for a NaN: its payload is the hardware's); Cos, Sin within 4 ulp, the GPU test's
bound, and Sigmoid within 2^-22 absolute (4 ulp of its values in [0.5, 1)), not in
ulps: its 1 + tanh cancels below x ~ -2, so a few ulps of tanh are many of a small
sigmoid (tensor_ops.cu's "a few ulp" did not hold for it: this test found it). The
host's tanhf / cosf / sinf stand in for CUDA's, so this checks the kernels' formulas
and indexing, not CUDA's libm. A Gather index out of range gives a row of zeros.

The fake driver's twins of these entries are numpy itself (fake_cuda_tensor_ops.py):
this is where the kernels' own offset arithmetic is checked without a GPU. Skipped,
saying so, without a C++20 compiler."""
from __future__ import annotations

import numpy as np
import pytest
from cuda_host import host_driver, host_kernels

from onnx_prep.core.cuda.device_tensor_ops import (ENTRIES, PARAMS, THREADS, DeviceTensorOps, kernel_source,
                                                   plan_binary, plan_cast, plan_concat, plan_gather, plan_split,
                                                   plan_transpose, plan_unary)
from onnx_prep.core.ops import elementwise

GARBAGE = 0x7FBADBAD  # a NaN: an element the kernel should have written and did not shows
TAIL = 300  # elements after each output: a thread past n writing shows there


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    return host_kernels(tmp_path_factory, kernel_source(), ENTRIES)


class Output:
    """A 32-bit output array of ``shape`` prefilled with garbage, then a guard tail."""

    def __init__(self, shape, dtype=np.float32) -> None:
        self.shape, self.n = tuple(shape), int(np.prod(shape, dtype=np.int64))
        self.buf = np.full(self.n + TAIL, GARBAGE, np.uint32).view(dtype)
        self.address = self.buf.ctypes.data

    def get(self) -> np.ndarray:
        assert (self.buf[self.n:].view(np.uint32) == GARBAGE).all(), "a thread past n wrote past the output"
        return self.buf[:self.n].reshape(self.shape)


def run(kernels, launches) -> None:
    for plan in launches:
        assert plan.block == (THREADS, 1, 1)
        kernels.launch(plan.name, plan.grid, plan.block, plan.shared_bytes, plan.args)


def assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Bit for bit, a NaN standing for any NaN (its payload is the hardware's)."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    nan = np.isnan(want) if want.dtype.kind == "f" else np.zeros(want.shape, bool)
    assert np.array_equal(np.isnan(got) if got.dtype.kind == "f" else nan, nan), f"{what}: NaNs elsewhere"
    bits = f"u{want.dtype.itemsize}"
    differ = np.flatnonzero(got.view(bits)[~nan] != want.view(bits)[~nan])
    assert differ.size == 0, f"{what}: {differ.size} elements differ, the first at {differ[0]}"


def specials(rng, shape) -> np.ndarray:
    """Random fp32 with inf, NaN, signed zeros, subnormals and huge values sprinkled in."""
    x = np.asarray((rng.standard_normal(shape) * 3).astype(np.float32))
    flat = x.reshape(-1)
    values = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-45, -3e-39, 3e38, -3e38], np.float32)
    at = rng.choice(flat.size, min(flat.size, values.size), replace=False)
    flat[at] = values[:at.size]
    return x


BINARY = {"Add": elementwise.add, "Sub": elementwise.sub, "Mul": elementwise.mul, "Div": elementwise.div}


@pytest.mark.parametrize("a_shape,b_shape", [
    ((7,), (7,)), ((2, 3, 5), (5,)), ((2, 1, 5), (1, 4, 1)), ((1,), (3, 2, 2, 4)), ((2, 3, 1, 40), (3, 7, 1)),
    ((4, 1), ()), ((600,), (1,)), ((3, 1, 1, 1), (1, 5, 7, 13)),
], ids=lambda s: "x".join(map(str, s)) or "scalar")
def test_binary_ops_are_the_cpu_runtimes_bit_for_bit(kernels, a_shape, b_shape):
    rng = np.random.default_rng(len(a_shape) * 10 + len(b_shape) + sum(a_shape))
    a, b = specials(rng, a_shape), specials(rng, b_shape)
    out = np.broadcast_shapes(a_shape, b_shape)
    for op, cpu in BINARY.items():
        y = Output(out)
        run(kernels, plan_binary(op, y.address, a.ctypes.data, a_shape, b.ctypes.data, b_shape))
        with np.errstate(all="ignore"):
            want = cpu([a, b], {}, {})[0]
        assert_same(y.get(), np.asarray(want, np.float32).reshape(out), f"{op} {a_shape} {b_shape}")


@pytest.mark.parametrize("op", ["Sigmoid", "Cos", "Sin"])
def test_unary_ops_are_the_cpu_runtimes_within_4_ulp(kernels, op):
    x = (np.random.default_rng(3).standard_normal(3000) * 20).astype(np.float32)
    x[:9] = (-1e4, 1e4, 0.0, -0.0, 1e-45, 88.0, -88.0, 3e38, -np.inf)
    cpu = {"Sigmoid": lambda v: elementwise.sigmoid([v.copy()], {}, {})[0], "Cos": np.cos, "Sin": np.sin}[op]
    y = Output(x.shape)
    run(kernels, plan_unary(op, y.address, x.ctypes.data, x.size))
    got = y.get()
    with np.errstate(invalid="ignore"):
        want = cpu(x)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan) and (op != "Sigmoid" or not nan.any())
    if op != "Sigmoid":
        np.testing.assert_array_max_ulp(got[~nan], want[~nan], maxulp=4)
    else:  # 4 ulp of values in [0.5, 1): 1 + tanh cancels, so not in ulps of a small result
        assert np.max(np.abs(got.astype(np.float64) - want)) <= 2.0**-22

        assert got[0] == 0.0 and got[1] == 1.0 and got[2] == 0.5 and got[8] == 0.0  # the tails: no overflow


@pytest.mark.parametrize("source,target", [("int64", "float32"), ("int32", "float32"), ("int64", "int32")])
def test_casts_are_astype_bit_for_bit(kernels, source, target):
    rng = np.random.default_rng(7)
    edges = [0, 1, -7, 2**24 + 1, 2**24 + 3, -(2**25) - 3, 2**31 - 1, -(2**31)]
    if source == "int64":
        edges += [2**31 + 5, -(2**40) - 3, 2**63 - 1, -(2**63), 2**53 + 1]
    info = np.iinfo(source)
    x = np.concatenate([np.array(edges, source), rng.integers(info.min, info.max, 700, dtype=source)])
    y = Output(x.shape, target)
    run(kernels, plan_cast(y.address, x.ctypes.data, x.size, source, target))
    assert_same(y.get(), x.astype(target), f"{source}->{target}")


@pytest.mark.parametrize("shape,perm", [((3, 4), (1, 0)), ((2, 3, 4, 5), (0, 2, 1, 3)), ((2, 3, 40), (2, 0, 1)),
                                        ((2, 3, 4, 5), (3, 2, 1, 0)), ((5, 60), None), ((700,), (0,))])
def test_transpose_is_numpys(kernels, shape, perm):
    x = specials(np.random.default_rng(sum(shape)), shape)
    want = np.ascontiguousarray(x.transpose(perm))
    y = Output(want.shape)
    run(kernels, plan_transpose(y.address, x.ctypes.data, shape, perm))
    assert_same(y.get(), want, f"transpose {shape} {perm}")


@pytest.mark.parametrize("shape,axis,sizes", [((2, 120), -1, (40, 44, 36)), ((2, 3, 100), 1, (1, 2)),
                                              ((6, 50), 0, (1, 0, 5)), ((1, 2, 3, 80), 3, (30, 50))])
def test_split_gives_numpys_slices(kernels, shape, axis, sizes):
    x = specials(np.random.default_rng(len(sizes)), shape)
    want = np.split(x, np.cumsum(sizes)[:-1], axis=axis)
    ys = [Output(w.shape) for w in want]
    run(kernels, plan_split([y.address for y in ys], x.ctypes.data, shape, axis, sizes))
    for y, w in zip(ys, want):
        assert_same(y.get(), np.ascontiguousarray(w), f"split {shape} {axis} {sizes}")


@pytest.mark.parametrize("shapes,axis", [([(2, 30), (2, 50)], 1), ([(1, 4, 20), (3, 4, 20), (2, 4, 20)], 0),
                                         ([(2, 2, 3, 10), (2, 2, 3, 40)], -1), ([(3, 0), (3, 200)], 1)])
def test_concat_is_numpys(kernels, shapes, axis):
    rng = np.random.default_rng(len(shapes))
    xs = [specials(rng, s) for s in shapes]
    want = np.concatenate(xs, axis=axis)
    y = Output(want.shape)
    run(kernels, plan_concat(y.address, [x.ctypes.data for x in xs], shapes, axis))
    assert_same(y.get(), want, f"concat {shapes} {axis}")


@pytest.mark.parametrize("x_shape,idx", [((10, 60), [[3, 0, 9]]), ((5, 2, 30), [4, -1, 0, 4, -5]),
                                         ((7,), [[1], [6]]), ((300, 3), list(range(-150, 150)))])
def test_gather_of_rows_is_numpys_take(kernels, x_shape, idx):
    x = specials(np.random.default_rng(len(x_shape)), x_shape)
    idx = np.array(idx, np.int64)
    want = np.take(x, idx, axis=0)
    y = Output(want.shape)
    run(kernels, plan_gather(y.address, x.ctypes.data, x_shape, idx.ctypes.data, idx.shape))
    assert_same(y.get(), want, f"gather {x_shape}")


def test_gather_of_an_index_out_of_range_gives_zeros(kernels):
    x = np.arange(1, 13, dtype=np.float32).reshape(4, 3)
    idx = np.array([4, -5, 1, 2**40, -(2**62)], np.int64)
    y = Output((5, 3))
    run(kernels, plan_gather(y.address, x.ctypes.data, x.shape, idx.ctypes.data, idx.shape))
    want = np.zeros((5, 3), np.float32)
    want[2] = x[1]
    assert_same(y.get(), want, "out of range")


def test_a_misdescribed_launch_is_caught(kernels):
    """The comparison can fail: Transpose's copy with the input's strides swapped
    (read as if already transposed) gives other bytes. Swapped strides read past
    the 15 elements, so x is the head of a longer finite buffer: what the launch
    reads there is known numbers, not whatever lies beyond an allocation (once a NaN)."""
    backing = np.random.default_rng(1).standard_normal(64).astype(np.float32)
    x = backing[:15].reshape(3, 5)
    y = Output((5, 3))
    (plan,) = plan_transpose(y.address, x.ctypes.data, x.shape, (1, 0))
    names = [p for p, _ in PARAMS[plan.name]]
    args = [(t, plan.arg("xs3") if n == "xs2" else plan.arg("xs2") if n == "xs3" else v)
            for n, (t, v) in zip(names, plan.args)]
    kernels.launch(plan.name, plan.grid, plan.block, 0, args)
    with pytest.raises(AssertionError, match="elements differ"):
        assert_same(y.get(), np.ascontiguousarray(x.T), "misdescribed")


def test_device_tensor_ops_run_through_the_host_driver(tmp_path_factory):
    """DeviceTensorOps itself (its module compiled through the driver protocol, its
    launches queued on a stream) on cuda_host.HostDriver: what a launcher class's
    emulated test stands on."""
    d = host_driver(tmp_path_factory)
    ops, stream = DeviceTensorOps(d), d.stream_create()
    rng = np.random.default_rng(4)
    a, b = specials(rng, (3, 1, 70)), specials(rng, (5, 1))
    ya, yt = d.mem_alloc(3 * 5 * 70 * 4), d.mem_alloc(4 * 3 * 70)
    xa, xb = d.mem_alloc(a.nbytes), d.mem_alloc(b.nbytes)
    d.copy_to_device(xa, a)
    d.copy_to_device(xb, b)
    ops.binary(stream, "Mul", ya, xa, a.shape, xb, b.shape)
    ops.transpose(stream, yt, xa, a.shape, (2, 1, 0))
    d.stream_synchronize(stream)
    with np.errstate(all="ignore"):
        assert_same(np.frombuffer(d.copy_to_host(ya, 3 * 5 * 70 * 4), np.float32).reshape(3, 5, 70), a * b, "Mul")
    assert_same(np.frombuffer(d.copy_to_host(yt, 4 * 3 * 70), np.float32).reshape(70, 1, 3), a.transpose(2, 1, 0),
                "transpose")
    assert d.launched == ["mul_f32", "copy_strided_b32"]
