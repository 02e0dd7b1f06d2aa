"""The INT4 matmul on a CUDA device: ``Y = A x dequant(B) (+ bias)`` over the packed
bytes the CPU kernels read (uploaded unchanged into a device slot), with MatMulNBits
semantics for accuracy levels 0-3 (fp32 compute).

The kernels are CUDA C (``int4_matmul.cu`` beside this file, shipped as package data),
compiled at run time through the driver protocol (NVRTC for the device's own
architecture, then ``cuModuleLoadData``) ONCE per process and device, on first use:

- decode, M = 1..8: ``int4_matmul_gemv_m{1,2,4,8}`` (the smallest that holds M rows):
  a warp per 32 columns, 8 warps per block splitting the K blocks, the warps' sums
  added in warp order (deterministic); grid ``ceil(N / 32)``;
- prefill, M > 8: ``int4_matmul_tiled``: a block per (64-column panel, 32 rows), the A
  tile of each K block staged in shared memory; grid ``(ceil(N / 64), ceil(M / 32))``.

Both compute the CPU's FMA mode block by block (``native.matmul_nbits(...,
compute="fma")``); the tiled kernel in its very order, the GEMV within fp32
reassociation of it (its blocks are folded per warp). Accuracy level 4 (A quantized to
int8, ONNX Runtime's semantics) is declined by name: computing it in fp32 would differ
from the oracle it is tested against.

``DeviceInt4Matmul.launch`` checks everything it can know before launching (the
packed header, read from the host copy of the bytes or given, against the device
view's size; M, the row strides, the addresses' alignment) and queues the kernel on a
stream: it returns at once, the result is there after the stream is synchronised
(or inside a captured graph: core/cuda/step_graph.py).
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from onnx_prep.core.cuda.device_slot_pool import DeviceView
from onnx_prep.core.cuda.compiled_kernels import CompiledKernels, KernelLaunch
from onnx_prep.core.cuda.driver import DeviceDriver
from onnx_prep.core.errors import DeviceError

__all__ = ["DeviceInt4Matmul", "KERNEL_PARAMS", "KernelLaunch", "kernel_source", "plan_launch"]

SOURCE = Path(__file__).with_name("int4_matmul.cu")
# The kernels' parameters, in order (int4_matmul.cu says the same).
KERNEL_PARAMS: tuple[tuple[str, type], ...] = (
    ("a", ctypes.c_void_p), ("lda", ctypes.c_uint64), ("packed", ctypes.c_void_p), ("y", ctypes.c_void_p),
    ("ldy", ctypes.c_uint64), ("bias", ctypes.c_void_p), ("m", ctypes.c_int32), ("k", ctypes.c_int32),
    ("n", ctypes.c_int32), ("block_size", ctypes.c_int32), ("n_blocks", ctypes.c_int32),
    ("zp_kind", ctypes.c_int32), ("panel_stride", ctypes.c_uint64))
# The geometry int4_matmul.cu is written for (its #defines).
PANEL_N = 64
GEMV_ROWS = (1, 2, 4, 8)
GEMV_COLUMNS, GEMV_WARPS = 32, 8
TILE_M, TILE_THREADS = 32, 256
ZP_KINDS = {"none": 0, "u4": 1, "float": 2}
INT32_MAX = 2**31 - 1
PARAM_NAMES = tuple(n for n, _ in KERNEL_PARAMS)


def kernel_source() -> str:
    return SOURCE.read_text()


def plan_launch(header: Any, m: int, a_addr: int, packed: DeviceView, y_addr: int, *, lda: int | None = None,
                ldy: int | None = None, bias_addr: int = 0) -> KernelLaunch:
    """The launch for ``Y[m, N] = A[m, K] x B`` over ``packed`` (``header``: its
    :class:`~onnx_prep.native.PackedHeader`), or DeviceError naming what does not fit."""
    if header.kind != "int4_matmul":
        raise DeviceError(f"the device INT4 matmul reads int4_matmul packed buffers, got a {header.kind} buffer")
    if header.accuracy_level == 4:
        raise DeviceError("accuracy level 4 (A quantized to int8, ONNX Runtime's semantics) is not built on the "
                          "device: its kernels compute levels 0-3 (fp32)")
    if packed.nbytes != header.total_size:
        raise DeviceError(f"the device view holds {packed.nbytes:,} bytes, its packed header says "
                          f"{header.total_size:,}")
    K, N = header.K, header.N
    if m < 1 or m > INT32_MAX or K > INT32_MAX or N > INT32_MAX:
        raise DeviceError(f"device INT4 matmul of M={m} K={K} N={N}: each must be 1 .. {INT32_MAX}")
    lda, ldy = K if lda is None else lda, N if ldy is None else ldy
    if lda < K or ldy < N:
        raise DeviceError(f"row strides lda={lda} ldy={ldy} are below K={K} N={N}")
    for what, address in (("A", a_addr), ("Y", y_addr), ("packed", packed.address), ("bias", bias_addr)):
        if address % 4 or (address == 0 and what != "bias"):
            raise DeviceError(f"device address of {what} {address:#x} is not 4-byte aligned device memory")
    values = {"a": a_addr, "lda": lda, "packed": packed.address, "y": y_addr, "ldy": ldy, "bias": bias_addr,
              "m": m, "k": K, "n": N, "block_size": header.block_size, "n_blocks": header.n_blocks,
              "zp_kind": ZP_KINDS[header.zero_points], "panel_stride": header.panel_stride}
    args = tuple((ctype, values[name]) for name, ctype in KERNEL_PARAMS)
    if m <= GEMV_ROWS[-1]:
        rows = next(r for r in GEMV_ROWS if r >= m)
        return KernelLaunch(f"int4_matmul_gemv_m{rows}", (-(-N // GEMV_COLUMNS), 1, 1), (GEMV_COLUMNS, GEMV_WARPS, 1),
                            args, PARAM_NAMES)
    return KernelLaunch("int4_matmul_tiled", (-(-N // PANEL_N), -(-m // TILE_M), 1), (TILE_THREADS, 1, 1), args,
                        PARAM_NAMES)


ENTRIES = tuple(f"int4_matmul_gemv_m{r}" for r in GEMV_ROWS) + ("int4_matmul_tiled",)
# compiled once per process and device (compiled_kernels.py)
_KERNELS = CompiledKernels(lambda: kernel_source(), SOURCE.name, ENTRIES)
_functions = _KERNELS.functions


class DeviceInt4Matmul:
    """The device INT4 matmul of one device, its kernels compiled on first use."""

    def __init__(self, driver: DeviceDriver, ordinal: int = 0) -> None:
        self.driver = driver
        self.ordinal = ordinal
        self._functions = _functions(driver, ordinal)

    def launch(self, stream: Any, a_addr: int, packed: DeviceView, y_addr: int, m: int, *, header: Any = None,
               host_packed: Any = None, bias_addr: int = 0, lda: int | None = None,
               ldy: int | None = None) -> KernelLaunch:
        """Queue ``Y[m, N] = A[m, K] x B (+ bias)`` on ``stream``: A and Y fp32 rows
        (strides ``lda`` / ``ldy``, default K / N) at device addresses, B the packed
        object under ``packed``. ``header`` (a PackedHeader) or ``host_packed`` (the
        host copy of the packed bytes, whose header is read and validated) says its
        shape; nothing is read back from the device."""
        if header is None:
            if host_packed is None:
                raise DeviceError("the device INT4 matmul needs the packed header: give header= or host_packed=")
            from onnx_prep.native import packed_header

            header = packed_header(host_packed)
        plan = plan_launch(header, m, a_addr, packed, y_addr, lda=lda, ldy=ldy, bias_addr=bias_addr)
        self.driver.launch(self._functions[plan.name], plan.grid, plan.block, plan.shared_bytes, stream, plan.args)
        return plan
