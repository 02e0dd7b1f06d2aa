"""The twins of core/cuda/tensor_ops.cu's entries, for the fake driver
(fake_cuda_driver.py runs them through fake_cuda_kernels.KERNELS): numpy on the fake's
device bytes at the launch's addresses, read and written as the CUDA kernel would
(element i of the 4-D block at its offset under the launch's strides), so a test of a
whole step checks real numbers.

The arithmetic is numpy's fp32, as the CPU runtime's ops compute it (sigmoid in the
CPU's tanh form): on the fake the device ops equal the CPU ones exactly; on a GPU
tanhf / cosf / sinf may differ by a few ulp (tensor_ops.cu says why).

Fake-only checks, which a real device would not make: the argument types are the
entry's parameter list, and the grid and block are one thread per element in blocks of
THREADS (a grid too small would leave elements unwritten; one too large is waste).
"""
from __future__ import annotations

import numpy as np

from onnx_prep.core.cuda.device_tensor_ops import BINARY, CASTS, COPY, GATHER, PARAMS, THREADS, UNARY
from onnx_prep.core.cuda.driver import DriverCallError

UFUNCS = {"add_f32": np.add, "sub_f32": np.subtract, "mul_f32": np.multiply, "div_f32": np.divide}
CAST_TYPES = {entry: (np.dtype(s), np.dtype(t)) for (s, t), entry in CASTS.items()}


def _refuse(detail: str) -> DriverCallError:
    return DriverCallError("cuLaunchKernel", 1, "CUDA_ERROR_INVALID_VALUE", f"(fake-only check) {detail}")


def check_tensor_op(name: str, grid: tuple, block: tuple, args: tuple) -> dict:
    """The launch's arguments by name, once its types and geometry are the entry's."""
    params = PARAMS[name]
    if tuple(t for t, _ in args) != tuple(t for _, t in params):
        raise _refuse(f"{name} takes {[p for p, _ in params]}, got {len(args)} arguments of other types")
    v = {p: value for (p, _), (_, value) in zip(params, args)}
    want = ((-(-v["n"] // THREADS), 1, 1), (THREADS, 1, 1))
    if v["n"] < 1 or (tuple(grid), tuple(block)) != want:
        raise _refuse(f"{name} over n={v['n']} runs as grid {want[0]} block {want[1]}, got {grid} {block}")
    return v


def _dims(v: dict) -> tuple[int, ...]:
    d1, d2, d3 = v["d1"], v["d2"], v["d3"]
    return (v["n"] // (d1 * d2 * d3), d1, d2, d3)


def _read_strided(driver, address: int, dims: tuple, strides: tuple, dtype) -> np.ndarray:
    """The 4-D block read at ``address`` under element ``strides``, as the kernel reads it."""
    dtype = np.dtype(dtype)
    extent = 1 + sum((d - 1) * s for d, s in zip(dims, strides))
    flat = np.frombuffer(driver.read(address, extent * dtype.itemsize), dtype=dtype)
    return np.lib.stride_tricks.as_strided(flat, dims, tuple(s * dtype.itemsize for s in strides)).copy()


def _write_strided(driver, address: int, dims: tuple, strides: tuple, values: np.ndarray) -> None:
    dtype = values.dtype
    extent = 1 + sum((d - 1) * s for d, s in zip(dims, strides))
    flat = np.frombuffer(driver.read(address, extent * dtype.itemsize), dtype=dtype).copy()
    view = np.lib.stride_tricks.as_strided(flat, dims, tuple(s * dtype.itemsize for s in strides))
    view[...] = values
    driver.write(address, flat.tobytes())


def binary(driver, name: str, grid: tuple, block: tuple, args: tuple) -> None:
    v = check_tensor_op(name, grid, block, args)
    dims = _dims(v)
    a = _read_strided(driver, v["a"], dims, tuple(v[f"as{k}"] for k in range(4)), np.float32)
    b = _read_strided(driver, v["b"], dims, tuple(v[f"bs{k}"] for k in range(4)), np.float32)
    driver.write(v["y"], UFUNCS[name](a, b).astype(np.float32).tobytes())


def _sigmoid(x: np.ndarray) -> np.ndarray:
    half = np.float32(0.5)
    return ((np.tanh(x * half) + np.float32(1)) * half).astype(np.float32)


UNARY_FUNCS = {"sigmoid_f32": _sigmoid, "cos_f32": np.cos, "sin_f32": np.sin}


def unary(driver, name: str, grid: tuple, block: tuple, args: tuple) -> None:
    v = check_tensor_op(name, grid, block, args)
    x = np.frombuffer(driver.read(v["x"], 4 * v["n"]), dtype=np.float32)
    driver.write(v["y"], UNARY_FUNCS[name](x).astype(np.float32).tobytes())


def cast(driver, name: str, grid: tuple, block: tuple, args: tuple) -> None:
    v = check_tensor_op(name, grid, block, args)
    source, target = CAST_TYPES[name]
    x = np.frombuffer(driver.read(v["x"], source.itemsize * v["n"]), dtype=source)
    driver.write(v["y"], x.astype(target).tobytes())


def copy_strided(driver, name: str, grid: tuple, block: tuple, args: tuple) -> None:
    v = check_tensor_op(name, grid, block, args)
    dims = _dims(v)
    x = _read_strided(driver, v["x"], dims, tuple(v[f"xs{k}"] for k in range(4)), np.uint32)
    _write_strided(driver, v["y"], dims, tuple(v[f"ys{k}"] for k in range(4)), x)


def gather_rows(driver, name: str, grid: tuple, block: tuple, args: tuple) -> None:
    v = check_tensor_op(name, grid, block, args)
    row, rows = v["row"], v["rows"]
    idx = np.frombuffer(driver.read(v["idx"], 8 * (v["n"] // row)), dtype=np.int64)
    x = np.frombuffer(driver.read(v["x"], 4 * row * rows), dtype=np.uint32).reshape(rows, row)
    k = np.where(idx < 0, idx + rows, idx)
    inside = (k >= 0) & (k < rows)
    y = np.zeros((idx.size, row), np.uint32)
    y[inside] = x[k[inside]]
    driver.write(v["y"], y.tobytes())


# name -> (check at launch, run when the stream gets to it), as fake_cuda_kernels.KERNELS
KERNELS = {**{e: (check_tensor_op, binary) for e in BINARY.values()},
           **{e: (check_tensor_op, unary) for e in UNARY.values()},
           **{e: (check_tensor_op, cast) for e in CASTS.values()},
           COPY: (check_tensor_op, copy_strided), GATHER: (check_tensor_op, gather_rows)}
