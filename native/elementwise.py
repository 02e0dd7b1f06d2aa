"""Element-wise math that numpy lacks, in C (``elementwise.c``), with the GIL released."""
from __future__ import annotations

import numpy as np

from onnx_prep.native._module import lib
from onnx_prep.native.packed import ptr


def erf(x: np.ndarray) -> np.ndarray:
    """``erf(x)`` as a new float64 array of x's shape: libm's ``erf`` per element, so
    equal bit for bit to ``math.erf`` applied to each element (float32 inputs widen
    exactly), at ~10-20 ns an element instead of ~0.4 us through Python."""
    x64 = np.ascontiguousarray(x, dtype=np.float64)
    y = np.empty_like(x64)
    if y.size:
        lib.op_erf_f64(ptr(x64, "double *"), ptr(y, "double *"), y.size)
    return y
