"""Reductions in numpy: ReduceMean, ReduceSum, ReduceMax, ReduceMin, ReduceProd,
ReduceSumSquare, ArgMax, ArgMin.

Axes arrive as the ``axes`` attribute (ReduceSum < 13, the others < 18) or as the
second input (later opsets); ``attributes.axes_from`` reads whichever exists. No axes
means "reduce all" unless ``noop_with_empty_axes`` is set, then the op is Identity.
"""
from __future__ import annotations

import numpy as np

from onnx_prep.core.ops.attributes import axes_from, axis_index


def _reduction(fn):
    def op(inputs, attrs, prepared):
        x = inputs[0]
        axes = axes_from(inputs, 1, attrs)
        if not axes:
            if attrs.get("noop_with_empty_axes", 0):
                return [x]
            axes = tuple(range(x.ndim))
        axes = tuple(sorted({axis_index(a, x.ndim) for a in axes}))
        keep = bool(attrs.get("keepdims", 1))
        return [np.asarray(fn(x, axes, keep))]

    op.__name__ = fn.__name__
    return op


def _mean(x, axes, keep):
    if x.dtype.kind != "f":
        return np.mean(x, axis=axes, keepdims=keep).astype(x.dtype)
    # What np.mean computes (add.reduce in the input's float type, then one true
    # divide), without its Python-level argument handling (~10 us per call).
    s = np.add.reduce(x, axis=axes, keepdims=keep)
    count = 1
    for a in axes:
        count *= x.shape[a]
    s = np.asarray(s)
    if s.ndim:
        s /= s.dtype.type(count)
        return s
    return s / s.dtype.type(count)


def _sum(x, axes, keep):
    return np.sum(x, axis=axes, keepdims=keep, dtype=x.dtype)


def _max(x, axes, keep):
    return np.max(x, axis=axes, keepdims=keep)


def _min(x, axes, keep):
    return np.min(x, axis=axes, keepdims=keep)


def _prod(x, axes, keep):
    return np.prod(x, axis=axes, keepdims=keep, dtype=x.dtype)


def _sum_square(x, axes, keep):
    return np.sum(np.square(x), axis=axes, keepdims=keep, dtype=x.dtype)


reduce_mean = _reduction(_mean)
reduce_sum = _reduction(_sum)
reduce_max = _reduction(_max)
reduce_min = _reduction(_min)
reduce_prod = _reduction(_prod)
reduce_sum_square = _reduction(_sum_square)


def _arg(fn):
    def op(inputs, attrs, prepared):
        x = inputs[0]
        axis = axis_index(attrs.get("axis", 0), x.ndim)
        keep = bool(attrs.get("keepdims", 1))
        if attrs.get("select_last_index", 0):
            # Last occurrence: search the reversed axis and map the index back.
            r = fn(np.flip(x, axis=axis), axis=axis, keepdims=keep)
            out = x.shape[axis] - 1 - r
        else:
            out = fn(x, axis=axis, keepdims=keep)
        return [np.asarray(out, dtype=np.int64)]

    op.__name__ = fn.__name__
    return op


arg_max = _arg(np.argmax)
arg_min = _arg(np.argmin)
