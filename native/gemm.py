"""fp32 Gemm / MatMul with a constant B, packed once into column tiles.

``gemm`` computes ``Y = alpha * A x B + beta * C`` on a column range (C = ``bias``,
broadcastable to ``[M, N]`` as ONNX Gemm allows), with the GIL released."""
from __future__ import annotations

import numpy as np

from onnx_prep.native._module import check, lib
from onnx_prep.native.isa import isa_id
from onnx_prep.native.matmul_nbits import col_range, out_rows, rows_f32
from onnx_prep.native.packed import k_n, new_buffer, ptr


def gemm_b_packed_size(*, K: int, N: int) -> int:
    size = lib.op_gemm_b_packed_size(int(K), int(N))
    if size == 0:
        raise ValueError(f"invalid Gemm B shape K={K} N={N}")
    return int(size)


def prepack_gemm_b(B: np.ndarray, *, trans_b: bool, out: np.ndarray | None = None) -> np.ndarray:
    """Pack a constant fp32 B: ``[K, N]``, or ``[N, K]`` when ``trans_b``. Deterministic."""
    B = np.asarray(B)
    if B.dtype != np.float32 or B.ndim != 2:
        raise ValueError(f"B must be a 2-D float32 array, got {B.dtype} {B.shape}")
    N, K = B.shape if trans_b else B.shape[::-1]
    size = gemm_b_packed_size(K=K, N=N)
    b = np.ascontiguousarray(B)
    buf = new_buffer(size, out, "prepack_gemm_b")
    check(lib.op_prepack_gemm_b(ptr(b, "float *"), K, N, int(bool(trans_b)), ptr(buf, "uint8_t *"), size),
          "prepack_gemm_b")
    return buf


def gemm(A: np.ndarray, packed: np.ndarray, *, bias: np.ndarray | None = None, alpha: float = 1.0,
         beta: float = 1.0, out: np.ndarray | None = None, col_begin: int = 0,
         col_end: int | None = None, isa: str | None = None) -> np.ndarray:
    """``Y[..., c] = alpha * (A x B)[..., c] + beta * bias`` for c in [col_begin, col_end).

    A: float32 ``[..., K]``; bias: broadcastable to ``[M, N]`` (M = rows of A), or None.
    Only the range's columns are written (a fresh ``out`` is zeros elsewhere)."""
    K, N = k_n(packed, lib.OP_KIND_GEMM_B)
    A2, M, lda = rows_f32(A, K, "gemm")
    cb, ce = col_range(col_begin, col_end, N, "gemm")
    bp, rs, cs = None, 0, 0
    if bias is not None:
        b = np.asarray(bias, dtype=np.float32)
        try:
            bb = np.broadcast_to(b, (M, N))
        except ValueError:
            raise ValueError(f"gemm: bias of shape {b.shape} does not broadcast to [{M}, {N}]") from None
        # Keep the broadcast (stride 0) axes; C reads bias[m * rs + c * cs].
        base = np.ascontiguousarray(b.reshape(b.shape[-2:] if b.ndim >= 2 else (1,) * (2 - b.ndim) + b.shape))
        bb = np.broadcast_to(base, (M, N))
        rs, cs = bb.strides[0] // 4, bb.strides[1] // 4
        bp = base
    res, o2, ldy = out_rows(out, A.shape[:-1], M, N, cb == 0 and ce == N, "gemm")
    check(lib.op_gemm(isa_id(isa), ptr(A2, "float *"), M, lda, ptr(packed, "uint8_t *"), packed.nbytes,
                      ptr(bp, "float *"), rs, cs, float(alpha), float(beta), ptr(o2, "float *"), ldy, cb, ce),
          "gemm")
    return res
