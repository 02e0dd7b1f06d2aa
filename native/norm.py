"""Row normalization in C (``norm.c``, ``norm_simd.c``): LayerNorm and RMSNorm over the
last axis of a 2-D float32 array, with the Skip forms' residual sum, GIL released.

Every ISA gives the scalar path's bits (the lane contract of ``norm.h``); ``isa=``
forces a path (tests, benchmarks)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from onnx_prep.native._module import check, ffi, lib
from onnx_prep.native.isa import isa_id
from onnx_prep.native.packed import ptr

_F32 = np.dtype(np.float32)


class NormResult(NamedTuple):
    y: np.ndarray                 # [rows, n]
    sum: np.ndarray | None        # [rows, n] x + skip (+ bias), when asked for
    mean: np.ndarray | None       # [rows], when asked for
    inv_std: np.ndarray | None    # [rows], when asked for


def _f32(a: np.ndarray | None, n: int | None, what: str) -> np.ndarray | None:
    if a is None:
        return None
    a = np.ascontiguousarray(a, dtype=np.float32)
    if n is not None and a.shape != (n,):
        raise ValueError(f"norm_rows: {what} has shape {a.shape}, expected ({n},)")
    return a


def _call(x, skip, skip_rows, bias, gamma, beta, epsilon, simplified, y, total, mean, inv, isa) -> None:
    """The one C call of every entry here, on arrays already in the kernel's form (None:
    NULL)."""
    check(lib.op_norm_rows(isa_id(isa), ptr(x, "float *"), ptr(skip, "float *"), skip_rows,
                           ptr(bias, "float *"), ptr(gamma, "float *"), ptr(beta, "float *"), x.shape[0],
                           x.shape[1], float(epsilon), 1 if simplified else 0, ptr(y, "float *"),
                           ptr(total, "float *"), ptr(mean, "float *"), ptr(inv, "float *")), "norm_rows")


def norm_rows(x: np.ndarray, gamma: np.ndarray, *, beta: np.ndarray | None = None,
              skip: np.ndarray | None = None, bias: np.ndarray | None = None, epsilon: float,
              simplified: bool, want_sum: bool = False, want_stats: bool = False,
              isa: str | None = None) -> NormResult:
    """Normalize each row of ``x`` ([rows, n] float32): RMSNorm when ``simplified``, else
    LayerNorm (``beta`` optional), after adding ``skip`` ([skip_rows, n], rows a multiple
    of skip_rows: row r adds skip row r % skip_rows) and ``bias`` ([n]) when given.
    See ``op_norm_rows`` in ``onnx_prep_native.h`` for the exact arithmetic."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"norm_rows: x must be 2-D, got shape {x.shape}")
    rows, n = x.shape
    gamma, beta, bias = _f32(gamma, n, "gamma"), _f32(beta, n, "beta"), _f32(bias, n, "bias")
    skip_rows = 0
    if skip is not None:
        skip = np.ascontiguousarray(skip, dtype=np.float32)
        if skip.ndim != 2 or skip.shape[1] != n or skip.shape[0] == 0 or rows % skip.shape[0]:
            raise ValueError(f"norm_rows: skip of shape {skip.shape} does not repeat over x of shape {x.shape}")
        skip_rows = skip.shape[0]
    y = np.empty_like(x)
    total = np.empty_like(x) if want_sum else None
    mean = np.empty(rows, np.float32) if want_stats else None
    inv = np.empty(rows, np.float32) if want_stats else None
    _call(x, skip, skip_rows, bias, gamma, beta, epsilon, simplified, y, total, mean, inv, isa)
    if want_sum and skip is None and bias is None:
        total = x.copy()  # nothing was added: the sum is the input
    return NormResult(y, total, mean, inv)


def _plain(a, ndim: int) -> bool:
    """``a`` is in the kernel's own form: a C-contiguous float32 ndarray of rank ``ndim``."""
    return type(a) is np.ndarray and a.dtype == _F32 and a.ndim == ndim and a.flags.c_contiguous


def skip_norm_rows(x: np.ndarray, skip: np.ndarray, gamma: np.ndarray, *, epsilon: float, simplified: bool,
                   want_stats: bool) -> NormResult:
    """``norm_rows(x, gamma, skip=skip, epsilon=epsilon, simplified=simplified,
    want_sum=True, want_stats=want_stats)``: a decode step's Skip norm (the residual sum
    comes back as ``sum``; no beta, no bias).

    NOTE: as for :func:`norm_rows_y`: one C call and little else when x and skip are
    C-contiguous float32 ``[rows, n]`` arrays of one shape and gamma a C-contiguous
    float32 ``[n]`` (32 of these per medium-shaped decode step, where the general path's
    conversions and checks cost more than the rows). The same C call: the same bits."""
    n = x.shape[-1] if x.ndim else 0
    if not (_plain(x, 2) and _plain(skip, 2) and skip.shape == x.shape and _plain(gamma, 1)
            and gamma.shape[0] == n and x.shape[0] > 0):
        return norm_rows(x, gamma, skip=skip, epsilon=epsilon, simplified=simplified, want_sum=True,
                         want_stats=want_stats)
    rows = x.shape[0]
    y = np.empty_like(x)
    total = np.empty_like(x)
    mean = np.empty(rows, np.float32) if want_stats else None
    inv = np.empty(rows, np.float32) if want_stats else None
    _call(x, skip, rows, None, gamma, None, epsilon, simplified, y, total, mean, inv, None)
    return NormResult(y, total, mean, inv)


def skip_norm_sum(x: np.ndarray, skip: np.ndarray, gamma: np.ndarray, epsilon: float,
                  simplified: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """``(y, x + skip)`` of a Skip norm without beta, bias or statistics, each of x's
    shape: x and skip C-contiguous float32 arrays of one shape, gamma a C-contiguous
    float32 [n] (n: their last dimension). None when the arguments are not in that form
    (the caller then takes ``skip_norm_rows``). The same C call as ``skip_norm_rows``:
    the same bits.

    NOTE: the decode step's bound call (core/ops/norm.py ``bind_skip_norm``): after a
    GEMV's weight stream every Python object a call touches costs a cache miss, and
    ``skip_norm_rows`` under the op's reshapes and statistics took ~45-65 us a call there
    for ~7 us of C (builder Llama, hidden 2048, batch 1). No reshapes, no statistics,
    the addresses from ``ffi.from_buffer``."""
    if not (type(x) is np.ndarray and type(skip) is np.ndarray and type(gamma) is np.ndarray
            and x.dtype == _F32 and skip.dtype == _F32 and gamma.dtype == _F32 and x.ndim
            and x.shape == skip.shape and gamma.shape == x.shape[-1:] and x.size
            and x.flags.c_contiguous and skip.flags.c_contiguous and gamma.flags.c_contiguous):
        return None
    n = gamma.shape[0]
    rows = x.size // n
    y, total = np.empty_like(x), np.empty_like(x)
    fb = ffi.from_buffer
    check(lib.op_norm_rows(isa_id(None), fb("float[]", x), fb("float[]", skip), rows, ffi.NULL,
                           fb("float[]", gamma), ffi.NULL, rows, n, epsilon, 1 if simplified else 0,
                           fb("float[]", y), fb("float[]", total), ffi.NULL, ffi.NULL), "norm_rows")
    return y, total


def rms_norm_y(x: np.ndarray, gamma: np.ndarray, epsilon: float) -> np.ndarray | None:
    """RMSNorm over x's last axis, in x's shape (``norm_rows_y`` with no beta, simplified):
    x a C-contiguous float32 array with rows, gamma a C-contiguous float32 [n]. None
    for any other form (the caller takes the general path). The same C call: the same
    bits. The decode step's bound call (core/ops/norm.py ``bind_rms_norm``; why:
    ``skip_norm_sum``)."""
    if not (type(x) is np.ndarray and type(gamma) is np.ndarray and x.dtype == _F32 and gamma.dtype == _F32
            and x.ndim and gamma.shape == x.shape[-1:] and x.size and x.flags.c_contiguous
            and gamma.flags.c_contiguous):
        return None
    n = gamma.shape[0]
    rows = x.size // n
    y = np.empty_like(x)
    fb = ffi.from_buffer
    check(lib.op_norm_rows(isa_id(None), fb("float[]", x), ffi.NULL, 0, ffi.NULL, fb("float[]", gamma), ffi.NULL,
                           rows, n, epsilon, 1, fb("float[]", y), ffi.NULL, ffi.NULL, ffi.NULL), "norm_rows")
    return y


def norm_rows_y(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray | None, *, epsilon: float,
                simplified: bool) -> np.ndarray:
    """``norm_rows(x, gamma, beta=beta, epsilon=epsilon, simplified=simplified).y``: the
    decode step's norm (no skip, no bias, no statistics).

    NOTE: one C call and little else when the arguments already are in the kernel's form
    (x a C-contiguous float32 [rows, n], gamma and beta C-contiguous float32 [n]): a
    decode step normalizes a few rows, so the ~5 us of argument copies, checks and
    result tuple ``norm_rows`` spends per call (33 norms a medium step) weigh more than
    the rows. The same C call with the same pointers: the same bits. Anything else takes
    ``norm_rows``."""
    n = x.shape[-1] if x.ndim else 0
    if not (_plain(x, 2) and _plain(gamma, 1) and gamma.shape[0] == n
            and (beta is None or (_plain(beta, 1) and beta.shape[0] == n))):
        return norm_rows(x, gamma, beta=beta, epsilon=epsilon, simplified=simplified).y
    y = np.empty_like(x)
    _call(x, None, 0, None, gamma, beta, epsilon, simplified, y, None, None, None, None)
    return y
