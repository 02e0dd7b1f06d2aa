"""The kernels the fake driver (fake_cuda_driver.py) runs when their launch comes up on
a stream: the INT4 matmul entries of core/cuda/int4_matmul.cu, computed by this
package's CPU kernel (the scalar twin, ``compute="fma"``: the op sequence the CUDA
kernels follow) on the fake's device bytes at the launch's addresses: A and the packed
buffer read from device memory, Y written there. So a test of the whole call sequence
(upload, copy A, launch, copy Y back) checks real numbers, and a graph replayed after
the memory under an address changed reads the new bytes. Likewise the INT4 prepack
entries of core/cuda/int4_prepack.cu: the source tensors read at the launch's
addresses (as the arguments describe them), packed by this package's CPU prepack, the
packed bytes written at the destination.

Fake-only checks, which a real device would not make (it would compute part of Y, or
read garbage, silently): the argument types are the kernels' parameter list, and the
grid and block are the geometry the CUDA source is written for; a packed buffer that
does not match the shape arguments fails the CPU kernel's header check; a prepack's
header arguments (flags, stride, total size) are the native module's for its shape.
"""
from __future__ import annotations

import numpy as np

from onnx_prep import native
from onnx_prep.core.cuda.device_int4_matmul import (GEMV_COLUMNS, GEMV_ROWS, GEMV_WARPS, KERNEL_PARAMS, PANEL_N,
                                                     TILE_M, TILE_THREADS, ZP_KINDS)
from onnx_prep.core.cuda.device_int4_prepack import ENTRIES as PREPACK_ENTRIES
from onnx_prep.core.cuda.device_int4_prepack import KERNEL_PARAMS as PREPACK_PARAMS
from onnx_prep.core.cuda.device_int4_prepack import PREPACK_THREADS, ZP_SOURCES, Int4Source
from onnx_prep.core.cuda.driver import DriverCallError
from onnx_prep.core.errors import DeviceError
from fake_cuda_tensor_ops import KERNELS as TENSOR_OPS  # tensor_ops.cu's twins
from fake_cuda_decoder_ops import KERNELS as DECODER_KERNELS  # decoder_ops.cu's twins

ZP_NAMES = {v: k for k, v in ZP_KINDS.items()}


def _refuse(detail: str) -> DriverCallError:
    return DriverCallError("cuLaunchKernel", 1, "CUDA_ERROR_INVALID_VALUE", f"(fake-only check) {detail}")


def check_int4_matmul(name: str, grid: tuple, block: tuple, args: tuple) -> dict:
    """The launch's arguments by name, once its types and geometry are the kernel's."""
    if tuple(t for t, _ in args) != tuple(t for _, t in KERNEL_PARAMS):
        raise _refuse(f"{name} takes {[n for n, _ in KERNEL_PARAMS]}, got {len(args)} arguments of other types")
    v = {n: value for (n, _), (_, value) in zip(KERNEL_PARAMS, args)}
    m, n = v["m"], v["n"]
    if name == "int4_matmul_tiled":
        want = ((-(-n // PANEL_N), -(-m // TILE_M), 1), (TILE_THREADS, 1, 1))
    else:
        rows = int(name.rsplit("_m", 1)[1])
        if not 1 <= m <= rows:
            raise _refuse(f"{name} holds 1 .. {rows} rows, got M={m}")
        want = ((-(-n // GEMV_COLUMNS), 1, 1), (GEMV_COLUMNS, GEMV_WARPS, 1))
    if (tuple(grid), tuple(block)) != want:
        raise _refuse(f"{name} for M={m} N={n} runs as grid {want[0]} block {want[1]}, got {grid} {block}")
    return v


def int4_matmul(driver, name: str, grid: tuple, block: tuple, args: tuple) -> None:
    v = check_int4_matmul(name, grid, block, args)
    m, k, n = v["m"], v["k"], v["n"]
    size = native.matmul_nbits_packed_size(K=k, N=n, block_size=v["block_size"], zero_points=ZP_NAMES[v["zp_kind"]])
    packed = np.frombuffer(driver.read(v["packed"], size), dtype=np.uint8).copy()
    a = np.stack([np.frombuffer(driver.read(v["a"] + 4 * r * v["lda"], 4 * k), dtype=np.float32) for r in range(m)])
    bias = np.frombuffer(driver.read(v["bias"], 4 * n), dtype=np.float32) if v["bias"] else None
    y = native.matmul_nbits(a, packed, bias=bias, isa="scalar", compute="fma")
    for r in range(m):
        driver.write(v["y"] + 4 * r * v["ldy"], y[r].tobytes())


PREPACK_KINDS = {entry: kind for kind, entry in PREPACK_ENTRIES.items()}
ZP_SOURCE_NAMES = {v: k for k, v in ZP_SOURCES.items()}


def check_int4_prepack(name: str, grid: tuple, block: tuple, args: tuple) -> tuple[dict, Int4Source]:
    """The launch's arguments by name and the source they describe, once its types, its
    geometry and its header arguments are the kernel's for that source."""
    if tuple(t for t, _ in args) != tuple(t for _, t in PREPACK_PARAMS):
        raise _refuse(f"{name} takes {[n for n, _ in PREPACK_PARAMS]}, got {len(args)} arguments of other types")
    v = {n: value for (n, _), (_, value) in zip(PREPACK_PARAMS, args)}
    try:
        source = Int4Source(PREPACK_KINDS[name], v["rows"], v["k"], v["block_size"],
                            "float16" if v["scales_f16"] else "float32", ZP_SOURCE_NAMES.get(v["zp_source"], "?"),
                            (v["flags"] >> 4) & 0xF)
    except DeviceError as exc:
        raise _refuse(f"{name}: {exc}") from None
    got = (v["n_blocks"], v["flags"], v["stride"], v["total_size"], tuple(grid), tuple(block), bool(v["zp"]))
    want = (source.n_blocks, source.flags(), source.stride(), source.packed_size(), source.grid(),
            (PREPACK_THREADS, 1, 1), source.zero_points != "none")
    if got != want:
        raise _refuse(f"{name} for {source.describe()}: (n_blocks, flags, stride, total_size, grid, block, has zp) "
                      f"should be {want}, got {got}")
    return v, source


def int4_prepack(driver, name: str, grid: tuple, block: tuple, args: tuple) -> None:
    v, source = check_int4_prepack(name, grid, block, args)
    sizes = source.source_nbytes()
    b = np.frombuffer(driver.read(v["b"], sizes[0]), dtype=np.uint8)
    scales = np.frombuffer(driver.read(v["scales"], sizes[1]), dtype=source.scales)
    zp = None
    if source.zero_points != "none":
        zp = np.frombuffer(driver.read(v["zp"], sizes[2]),
                           dtype=np.uint8 if source.zero_points.startswith("u4") else source.zero_points)
    bs, nb = source.block_size, source.n_blocks
    if source.kind == "int4_matmul":
        packed = native.prepack_matmul_nbits(b, scales, zp, K=source.K, N=source.rows, block_size=bs,
                                             accuracy_level=source.accuracy_level)
    else:
        packed = native.prepack_gather_block_quantized(b.reshape(source.rows, nb, bs // 2), scales, zp, block_size=bs)
    driver.write(v["out"], packed)


# name -> (check at launch, run when the stream gets to it)
KERNELS = {**{f"int4_matmul_gemv_m{r}": (check_int4_matmul, int4_matmul) for r in GEMV_ROWS},
           "int4_matmul_tiled": (check_int4_matmul, int4_matmul),
           **{entry: (check_int4_prepack, int4_prepack) for entry in PREPACK_ENTRIES.values()}, **TENSOR_OPS,
           **DECODER_KERNELS}


def check_launch(name: str, grid: tuple, block: tuple, args: tuple) -> None:
    KERNELS[name][0](name, grid, block, args)


def run_kernel(driver, name: str, grid: tuple, block: tuple, shared_bytes: int, args: tuple) -> None:
    KERNELS[name][1](driver, name, grid, block, args)
