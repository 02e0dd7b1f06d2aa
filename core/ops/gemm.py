"""fp32 Gemm / MatMul with a constant B read from a prepared form.

Prepared forms, told apart by dtype (as for INT4, see ``int4.py``):
- ``uint8``: native packed B (``onnx_prep.native.prepack_gemm_b``), compute in C.
- ``float32``: the reference form, B as ``[K, N]`` (already transposed if transB).
Without either, Gemm / MatMul run the plain numpy implementations in ``nn.py``.
"""
from __future__ import annotations

import numpy as np

from onnx_prep.core.ops import nn


def gemm_packed(inputs, attrs, prepared):
    """Gemm(A, B, C?) with B prepared (position 1)."""
    packed = prepared.get(1) if prepared else None
    if packed is None:
        return nn.gemm(inputs, attrs, prepared)
    a = inputs[0]
    if attrs.get("transA", 0):
        a = a.T
    c = inputs[2] if len(inputs) > 2 else None
    alpha = float(attrs.get("alpha", 1.0))
    beta = float(attrs.get("beta", 1.0))
    y = _matmul_prepared(np.ascontiguousarray(a, dtype=np.float32), packed, alpha)
    if c is not None and beta != 0.0:
        y += c if beta == 1.0 else c * np.float32(beta)
    return [y]


def matmul_packed(inputs, attrs, prepared):
    """MatMul(A[..., K], B[K, N]) with B prepared (position 1)."""
    packed = prepared.get(1) if prepared else None
    if packed is None:
        return nn.matmul(inputs, attrs, prepared)
    a = inputs[0]
    k = a.shape[-1]
    y = _matmul_prepared(np.ascontiguousarray(a.reshape(-1, k), dtype=np.float32), packed, 1.0)
    return [y.reshape(a.shape[:-1] + (y.shape[-1],))]


def _matmul_prepared(a2: np.ndarray, packed: np.ndarray, alpha: float) -> np.ndarray:
    if packed.dtype == np.uint8:
        from onnx_prep import native

        if a2.shape[0] == 0:  # a zero-size dim (allowed): the kernel takes rows, so one zero row, none kept
            return native.gemm(np.zeros((1, a2.shape[1]), np.float32), packed, alpha=alpha)[:0]
        return native.gemm(a2, packed, alpha=alpha)
    y = a2 @ packed
    if alpha != 1.0:
        y *= np.float32(alpha)
    return y
