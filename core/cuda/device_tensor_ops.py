"""The standard ops a resolved decoder keeps as ``numpy`` kernels, on a CUDA device: Add,
Sub, Mul, Div with numpy broadcasting, Sigmoid, Cos, Sin, the casts the fixtures use,
Transpose, Split and Concat as strided copies, and Gather of rows (the builder's fp32
embedding lookup). fp32 (the copies move any 32-bit
word), up to 4-D, deterministic: one thread per output element.

The kernels are CUDA C (``tensor_ops.cu`` beside this file, package data), compiled
through the driver protocol ONCE per process and device on first use, as the INT4
matmul's are (device_int4_matmul.py). The host does the shape work: each ``plan_*``
function checks what it is given (shapes, broadcasting, axes, sizes, the addresses'
alignment) and computes the 4-D dims and element strides the kernels take, raising
DeviceError naming what does not fit BEFORE anything is launched; ``DeviceTensorOps``
queues the launches on a stream (the results are there once the stream is
synchronised, or inside a captured graph: step_graph.py).

Why the host computes strides: every op here is "output element i reads its inputs at
offsets that are linear in i's 4-D index", so one index computation serves broadcasting,
permuting and slicing, and the kernels never see a rank, an axis or a perm. A smaller
rank is padded with leading dimensions of 1.

What is refused by name, not approximated: a cast between other types (only int64 or
int32 to float32 and int64 to int32 are built: what the tiny fixture and the builder's
graphs cast on tensors), a rank over 4, a dtype other than float32 for the arithmetic.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Sequence

from onnx_prep.core.cuda.compiled_kernels import CompiledKernels, KernelLaunch
from onnx_prep.core.cuda.driver import DeviceDriver
from onnx_prep.core.errors import DeviceError

__all__ = ["BINARY", "CASTS", "DeviceTensorOps", "ENTRIES", "PARAMS", "KernelLaunch", "UNARY", "broadcast_shape",
           "contiguous_strides", "kernel_source", "plan_binary", "plan_cast", "plan_concat", "plan_copy",
           "plan_gather", "plan_split", "plan_transpose", "plan_unary"]

SOURCE = Path(__file__).with_name("tensor_ops.cu")
THREADS = 256  # tensor_ops.cu's THREADS: one block's threads, one element each
MAX_RANK = 4
MAX_BLOCKS = 2**31 - 1  # gridDim.x

BINARY = {"Add": "add_f32", "Sub": "sub_f32", "Mul": "mul_f32", "Div": "div_f32"}
UNARY = {"Sigmoid": "sigmoid_f32", "Cos": "cos_f32", "Sin": "sin_f32"}
CASTS = {("int64", "float32"): "cast_i64_f32", ("int32", "float32"): "cast_i32_f32",
         ("int64", "int32"): "cast_i64_i32"}
COPY = "copy_strided_b32"
GATHER = "gather_rows_b32"
ENTRIES = (*BINARY.values(), *UNARY.values(), *CASTS.values(), COPY, GATHER)

_P, _N = ctypes.c_void_p, ctypes.c_int64
_DIMS = (("d1", _N), ("d2", _N), ("d3", _N))
_BINARY_PARAMS = (("y", _P), ("a", _P), ("b", _P), ("n", _N), *_DIMS,
                  *((f"as{k}", _N) for k in range(4)), *((f"bs{k}", _N) for k in range(4)))
_UNARY_PARAMS = (("y", _P), ("x", _P), ("n", _N))
_COPY_PARAMS = (("y", _P), ("x", _P), ("n", _N), *_DIMS,
                *((f"ys{k}", _N) for k in range(4)), *((f"xs{k}", _N) for k in range(4)))
_GATHER_PARAMS = (("y", _P), ("x", _P), ("idx", _P), ("n", _N), ("row", _N), ("rows", _N))
# Each entry's parameters, in order (tensor_ops.cu says the same).
PARAMS: dict[str, tuple[tuple[str, type], ...]] = {
    **{e: _BINARY_PARAMS for e in BINARY.values()}, **{e: _UNARY_PARAMS for e in UNARY.values()},
    **{e: _UNARY_PARAMS for e in CASTS.values()}, COPY: _COPY_PARAMS, GATHER: _GATHER_PARAMS}
Shape = tuple[int, ...]


def kernel_source() -> str:
    return SOURCE.read_text()


def contiguous_strides(shape: Sequence[int]) -> Shape:
    """Row-major element strides of ``shape``."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= int(d)
    return tuple(reversed(strides))


def _size(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _rank(what: str, shape: Sequence[int]) -> Shape:
    shape = tuple(int(d) for d in shape)
    if len(shape) > MAX_RANK:
        raise DeviceError(f"device {what} of a rank-{len(shape)} tensor {list(shape)}: the kernels take at most "
                          f"{MAX_RANK} dimensions")
    if any(d < 0 for d in shape):
        raise DeviceError(f"device {what}: negative dimension in {list(shape)}")
    return shape


def _address(what: str, address: int, align: int = 4) -> None:
    if not isinstance(address, int) or address <= 0 or address % align:
        shown = f"{address:#x}" if isinstance(address, int) else repr(address)
        raise DeviceError(f"device address of {what} {shown} is not {align}-byte aligned device memory")


def _launch(name: str, n: int, values: dict) -> KernelLaunch:
    blocks = -(-n // THREADS)
    if blocks > MAX_BLOCKS:
        raise DeviceError(f"{name} over {n:,} elements needs {blocks:,} blocks, more than a grid holds")
    return KernelLaunch(name, (blocks, 1, 1), (THREADS, 1, 1),
                        tuple((ctype, values[p]) for p, ctype in PARAMS[name]), tuple(p for p, _ in PARAMS[name]))


def _pad4(shape: Shape, strides: Shape) -> tuple[Shape, Shape]:
    pad = MAX_RANK - len(shape)
    return (1,) * pad + tuple(shape), (0,) * pad + tuple(strides)


def broadcast_shape(a: Sequence[int], b: Sequence[int]) -> Shape:
    """numpy's broadcast of two shapes, or DeviceError naming both."""
    a, b = tuple(a), tuple(b)
    out = []
    for k in range(1, max(len(a), len(b)) + 1):
        x = a[-k] if k <= len(a) else 1
        y = b[-k] if k <= len(b) else 1
        if x != y and 1 not in (x, y):
            raise DeviceError(f"shapes {list(a)} and {list(b)} do not broadcast (dimension -{k}: {x} vs {y})")
        out.append(y if x == 1 else x)
    return tuple(reversed(out))


def _broadcast_strides(shape: Shape, out: Shape) -> Shape:
    """Element strides reading a contiguous ``shape`` as ``out`` (0 where broadcast)."""
    own = contiguous_strides(shape)
    pad = len(out) - len(shape)
    return (0,) * pad + tuple(0 if d == 1 and o != 1 else s for d, s, o in zip(shape, own, out[pad:]))


def plan_binary(op: str, y: int, a: int, a_shape: Sequence[int], b: int, b_shape: Sequence[int]
                ) -> tuple[KernelLaunch, ...]:
    """``Y = A op B`` (fp32, contiguous, numpy broadcasting): one launch, none when Y is
    empty. ``op``: Add, Sub, Mul, Div."""
    if op not in BINARY:
        raise DeviceError(f"no device kernel for the binary op {op} (built: {', '.join(BINARY)})")
    a_shape, b_shape = _rank(op, a_shape), _rank(op, b_shape)
    out = _rank(op, broadcast_shape(a_shape, b_shape))
    for what, address in (("Y", y), ("A", a), ("B", b)):
        _address(f"{op}'s {what}", address)
    n = _size(out)
    if n == 0:
        return ()
    dims, a_st = _pad4(out, _broadcast_strides(a_shape, out))
    _, b_st = _pad4(out, _broadcast_strides(b_shape, out))
    values = {"y": y, "a": a, "b": b, "n": n, "d1": dims[1], "d2": dims[2], "d3": dims[3],
              **{f"as{k}": a_st[k] for k in range(4)}, **{f"bs{k}": b_st[k] for k in range(4)}}
    return (_launch(BINARY[op], n, values),)


def plan_unary(op: str, y: int, x: int, n: int) -> tuple[KernelLaunch, ...]:
    """``Y = op(X)`` over ``n`` contiguous fp32 elements. ``op``: Sigmoid, Cos, Sin."""
    if op not in UNARY:
        raise DeviceError(f"no device kernel for the unary op {op} (built: {', '.join(UNARY)})")
    _address(f"{op}'s Y", y)
    _address(f"{op}'s X", x)
    if n < 0:
        raise DeviceError(f"{op} over {n} elements")
    return (_launch(UNARY[op], n, {"y": y, "x": x, "n": n}),) if n else ()


def plan_cast(y: int, x: int, n: int, source: str, target: str) -> tuple[KernelLaunch, ...]:
    """``Y = X.astype(target)`` over ``n`` contiguous elements; the dtypes by numpy name."""
    entry = CASTS.get((source, target))
    if entry is None:
        built = ", ".join(f"{s}->{t}" for s, t in CASTS)
        raise DeviceError(f"no device Cast from {source} to {target} (built: {built})")
    _address("Cast's Y", y, 4)
    _address("Cast's X", x, 8 if source == "int64" else 4)
    return (_launch(entry, n, {"y": y, "x": x, "n": n}),) if n else ()


def plan_copy(y: int, y_strides: Sequence[int], x: int, x_strides: Sequence[int], shape: Sequence[int]
              ) -> tuple[KernelLaunch, ...]:
    """Copy the ``shape`` block of 32-bit words read at ``x`` under ``x_strides`` to ``y``
    under ``y_strides`` (element strides)."""
    shape = _rank("copy", shape)
    if len(y_strides) != len(shape) or len(x_strides) != len(shape):
        raise DeviceError(f"copy of a {list(shape)} block with strides {list(y_strides)} / {list(x_strides)}")
    _address("the copy's Y", y)
    _address("the copy's X", x)
    n = _size(shape)
    if n == 0:
        return ()
    dims, ys = _pad4(shape, tuple(y_strides))
    _, xs = _pad4(shape, tuple(x_strides))
    values = {"y": y, "x": x, "n": n, "d1": dims[1], "d2": dims[2], "d3": dims[3],
              **{f"ys{k}": int(ys[k]) for k in range(4)}, **{f"xs{k}": int(xs[k]) for k in range(4)}}
    return (_launch(COPY, n, values),)


def _axis(what: str, axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise DeviceError(f"{what} along axis {axis} of a rank-{rank} tensor")
    return axis % rank


def plan_transpose(y: int, x: int, shape: Sequence[int], perm: Sequence[int] | None = None
                   ) -> tuple[KernelLaunch, ...]:
    """``Y = X.transpose(perm)`` (contiguous X of ``shape`` and Y); ``perm`` None
    reverses the axes, as ONNX's default."""
    shape = _rank("Transpose", shape)
    perm = tuple(reversed(range(len(shape)))) if perm is None else tuple(int(p) for p in perm)
    if sorted(perm) != list(range(len(shape))):
        raise DeviceError(f"Transpose perm {list(perm)} is not a permutation of a rank-{len(shape)} tensor's axes")
    strides = contiguous_strides(shape)
    out = tuple(shape[p] for p in perm)
    return plan_copy(y, contiguous_strides(out), x, tuple(strides[p] for p in perm), out)


def plan_split(ys: Sequence[int], x: int, shape: Sequence[int], axis: int, sizes: Sequence[int]
               ) -> tuple[KernelLaunch, ...]:
    """Split contiguous X of ``shape`` along ``axis`` into ``sizes`` (summing to that
    dimension), output k contiguous at ``ys[k]``: a copy each."""
    shape = _rank("Split", shape)
    axis = _axis("Split", axis, len(shape))
    sizes = [int(s) for s in sizes]
    if len(ys) != len(sizes) or any(s < 0 for s in sizes) or sum(sizes) != shape[axis]:
        raise DeviceError(f"Split of {list(shape)} along axis {axis} into {sizes} ({len(ys)} outputs): the sizes "
                          f"must be one per output and sum to {shape[axis]}")
    strides = contiguous_strides(shape)
    launches, start = [], 0
    for y, size in zip(ys, sizes):
        part = shape[:axis] + (size,) + shape[axis + 1:]
        launches += plan_copy(y, contiguous_strides(part), x + 4 * start * strides[axis], strides, part)
        start += size
    return tuple(launches)


def plan_concat(y: int, xs: Sequence[int], shapes: Sequence[Sequence[int]], axis: int
                ) -> tuple[KernelLaunch, ...]:
    """Concatenate contiguous inputs at ``xs`` (of ``shapes``) along ``axis`` into
    contiguous Y: a copy each into its slice of Y."""
    if not xs or len(xs) != len(shapes):
        raise DeviceError(f"Concat of {len(xs)} inputs with {len(shapes)} shapes")
    shapes = [_rank("Concat", s) for s in shapes]
    rank = len(shapes[0])
    axis = _axis("Concat", axis, rank)
    for s in shapes:
        if len(s) != rank or s[:axis] + s[axis + 1:] != shapes[0][:axis] + shapes[0][axis + 1:]:
            raise DeviceError(f"Concat along axis {axis} of shapes {[list(t) for t in shapes]}: every other "
                              "dimension must agree")
    out = shapes[0][:axis] + (sum(s[axis] for s in shapes),) + shapes[0][axis + 1:]
    y_strides = contiguous_strides(out)
    launches, start = [], 0
    for x, s in zip(xs, shapes):
        launches += plan_copy(y + 4 * start * y_strides[axis], y_strides, x, contiguous_strides(s), s)
        start += s[axis]
    return tuple(launches)


def plan_gather(y: int, x: int, x_shape: Sequence[int], indices: int, indices_shape: Sequence[int]
                ) -> tuple[KernelLaunch, ...]:
    """``Y = X[indices]`` along axis 0 (contiguous X of ``x_shape`` with 32-bit elements,
    int64 ``indices`` of ``indices_shape``; Y is ``indices_shape + x_shape[1:]``)."""
    x_shape = tuple(int(d) for d in x_shape)
    if not x_shape:
        raise DeviceError("Gather from a scalar")
    out = _rank("Gather", tuple(indices_shape) + x_shape[1:])
    _address("Gather's Y", y)
    _address("Gather's X", x)
    _address("Gather's indices", indices, 8)
    row, n = _size(x_shape[1:]), _size(out)
    if n == 0:
        return ()
    return (_launch(GATHER, n, {"y": y, "x": x, "idx": indices, "n": n, "row": row, "rows": x_shape[0]}),)


# compiled once per process and device (compiled_kernels.py)
_KERNELS = CompiledKernels(lambda: kernel_source(), SOURCE.name, ENTRIES)
_functions = _KERNELS.functions


class DeviceTensorOps:
    """The tensor ops of one device, their kernels compiled on first use. Each method
    plans (checking everything first), then queues the launches on ``stream`` and
    returns them."""

    def __init__(self, driver: DeviceDriver, ordinal: int = 0) -> None:
        self.driver = driver
        self.ordinal = ordinal
        self._functions = _functions(driver, ordinal)

    def launch(self, stream: Any, launches: Sequence[KernelLaunch]) -> tuple[KernelLaunch, ...]:
        for plan in launches:
            self.driver.launch(self._functions[plan.name], plan.grid, plan.block, plan.shared_bytes, stream,
                               plan.args)
        return tuple(launches)

    def binary(self, stream: Any, op: str, y: int, a: int, a_shape: Sequence[int], b: int,
               b_shape: Sequence[int]) -> tuple[KernelLaunch, ...]:
        return self.launch(stream, plan_binary(op, y, a, a_shape, b, b_shape))

    def unary(self, stream: Any, op: str, y: int, x: int, n: int) -> tuple[KernelLaunch, ...]:
        return self.launch(stream, plan_unary(op, y, x, n))

    def cast(self, stream: Any, y: int, x: int, n: int, source: str, target: str) -> tuple[KernelLaunch, ...]:
        return self.launch(stream, plan_cast(y, x, n, source, target))

    def transpose(self, stream: Any, y: int, x: int, shape: Sequence[int], perm: Sequence[int] | None = None
                  ) -> tuple[KernelLaunch, ...]:
        return self.launch(stream, plan_transpose(y, x, shape, perm))

    def split(self, stream: Any, ys: Sequence[int], x: int, shape: Sequence[int], axis: int,
              sizes: Sequence[int]) -> tuple[KernelLaunch, ...]:
        return self.launch(stream, plan_split(ys, x, shape, axis, sizes))

    def gather(self, stream: Any, y: int, x: int, x_shape: Sequence[int], indices: int,
               indices_shape: Sequence[int]) -> tuple[KernelLaunch, ...]:
        return self.launch(stream, plan_gather(y, x, x_shape, indices, indices_shape))

    def concat(self, stream: Any, y: int, xs: Sequence[int], shapes: Sequence[Sequence[int]], axis: int
               ) -> tuple[KernelLaunch, ...]:
        return self.launch(stream, plan_concat(y, xs, shapes, axis))
