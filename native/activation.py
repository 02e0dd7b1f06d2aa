"""Element-wise activations in C (``activation.c``, ``activation_simd.c``), GIL
released: com.microsoft QuickGelu, ``x * sigmoid(alpha * x)``.

Every ISA gives the scalar twin's bits (``activation.h`` states the arithmetic);
``isa=`` forces a path (tests, benchmarks)."""
from __future__ import annotations

import numpy as np

from onnx_prep.native._module import check, ffi, lib
from onnx_prep.native.isa import isa_id

_F32 = np.dtype(np.float32)


def quick_gelu(x: np.ndarray, alpha: float, *, out: np.ndarray | None = None, isa: str | None = None) -> np.ndarray:
    """``x * sigmoid(alpha * x)`` of a float32 array (any shape; a non-contiguous or
    other-typed one is converted first), into ``out`` when given (C-contiguous float32
    of x's shape; may be ``x`` itself), else a new array."""
    if not (type(x) is np.ndarray and x.dtype == _F32 and x.flags.c_contiguous):
        x = np.ascontiguousarray(x, dtype=np.float32)
    if out is None:
        out = np.empty_like(x)
    elif not (type(out) is np.ndarray and out.dtype == _F32 and out.flags.c_contiguous and out.shape == x.shape
              and out.flags.writeable):
        raise ValueError(f"quick_gelu: out must be a writable C-contiguous float32 array of shape {x.shape}")
    if x.size:
        check(lib.op_quick_gelu(isa_id(isa), ffi.from_buffer("float[]", x), ffi.from_buffer("float[]", out),
                                x.size, float(alpha)), "quick_gelu")
    return out
