"""Elementwise ONNX ops in numpy: arithmetic, comparisons, unary math, Where, Cast.

Contract of every function here (the ``OpImpl`` shape, see ``registry.py``):
``fn(inputs, attrs, prepared) -> list[np.ndarray]``. Inputs are never written;
outputs are fresh arrays or views of inputs (Identity), never shared scratch.

ONNX broadcasting is numpy broadcasting for these ops, and ONNX requires both
operands of a binary op to share one type, so numpy's promotion never widens a
result (NEP 50: a 0-d array keeps its dtype).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np


def _binary(ufunc):
    def op(inputs: list, attrs: Mapping[str, Any], prepared: Mapping) -> list:
        return [ufunc(inputs[0], inputs[1])]

    op.__name__ = ufunc.__name__
    return op


def _unary(ufunc):
    def op(inputs: list, attrs: Mapping[str, Any], prepared: Mapping) -> list:
        return [ufunc(inputs[0])]

    op.__name__ = ufunc.__name__
    return op


add = _binary(np.add)
sub = _binary(np.subtract)
mul = _binary(np.multiply)
equal = _binary(np.equal)
less = _binary(np.less)
less_or_equal = _binary(np.less_equal)
greater = _binary(np.greater)
greater_or_equal = _binary(np.greater_equal)
logical_and = _binary(np.logical_and)
logical_or = _binary(np.logical_or)
logical_xor = _binary(np.logical_xor)

sqrt = _unary(np.sqrt)
neg = _unary(np.negative)
exp = _unary(np.exp)
log = _unary(np.log)
tanh = _unary(np.tanh)
cos = _unary(np.cos)
sin = _unary(np.sin)
abs_ = _unary(np.abs)
floor = _unary(np.floor)
ceil = _unary(np.ceil)
logical_not = _unary(np.logical_not)


def div(inputs, attrs, prepared):
    a, b = inputs[0], inputs[1]
    if a.dtype.kind in "iu":
        # ONNX (and ORT, i.e. C++ '/') truncates integer division toward zero;
        # numpy's // floors. Correct the floored quotient where the signs differ.
        q = np.floor_divide(a, b)
        if a.dtype.kind == "i":
            fix = (np.remainder(a, b) != 0) & ((a < 0) != (b < 0))
            q = q + fix.astype(q.dtype)
        return [q]
    return [np.divide(a, b)]


def pow_(inputs, attrs, prepared):
    # Pow(T, T1) -> T: the exponent may have another type than the base.
    x, y = inputs[0], inputs[1]
    if x.dtype == y.dtype:
        return [np.power(x, y)]
    if x.dtype.kind == "f":
        return [np.power(x, y.astype(x.dtype))]
    return [np.power(x.astype(np.float64), y).astype(x.dtype)]


def reciprocal(inputs, attrs, prepared):
    x = inputs[0]
    return [np.reciprocal(x) if x.dtype.kind == "f" else np.divide(1, x).astype(x.dtype)]


def sigmoid(inputs, attrs, prepared):
    # NOTE: 0.5*(tanh(x/2)+1) equals 1/(1+exp(-x)) and cannot overflow for large -x.
    x = inputs[0]
    half = x.dtype.type(0.5)
    y = np.tanh(x * half)
    y += 1
    y *= half
    return [y]


def relu(inputs, attrs, prepared):
    x = inputs[0]
    return [np.maximum(x, x.dtype.type(0))]


def _variadic(ufunc):
    def op(inputs, attrs, prepared):
        it = [x for x in inputs if x is not None]
        out = it[0]
        for x in it[1:]:
            out = ufunc(out, x)
        return [out]

    op.__name__ = ufunc.__name__
    return op


max_ = _variadic(np.maximum)
min_ = _variadic(np.minimum)
sum_ = _variadic(np.add)


def where(inputs, attrs, prepared):
    return [np.where(inputs[0], inputs[1], inputs[2])]


def identity(inputs, attrs, prepared):
    return [inputs[0]]


def onnx_to_numpy_dtype(elem_type: int) -> np.dtype:
    from onnx import helper

    return np.dtype(helper.tensor_dtype_to_np_dtype(int(elem_type)))


# Types numpy represents natively; Cast to or from anything else (bfloat16, float8,
# int4, strings) goes through the reference implementation.
_NATIVE_KINDS = frozenset("biuf")


def cast(inputs, attrs, prepared):
    x = inputs[0]
    to = int(attrs["to"])
    target = onnx_to_numpy_dtype(to)
    if _plain(target) and _plain(x.dtype):
        if x.dtype == target:
            return [x]
        if target.kind in "iu" and x.dtype.kind == "f":
            # ORT truncates toward zero, as astype does; NaN/inf are undefined in ONNX.
            with np.errstate(invalid="ignore"):
                return [x.astype(target)]
        return [x.astype(target)]
    from onnx_prep.core.ops.reference import run_reference

    return run_reference("Cast", "", attrs, inputs)


def _plain(dt: np.dtype) -> bool:
    # onnx's bfloat16 / float8 / int4 numpy dtypes are ml_dtypes extension types.
    return dt.kind in _NATIVE_KINDS and dt.type.__module__ == "numpy"


def cast_like(inputs, attrs, prepared):
    from onnx import helper

    to = helper.np_dtype_to_tensor_dtype(inputs[1].dtype)
    return cast([inputs[0]], {"to": to}, prepared)
