"""Neural-network ONNX ops in numpy: Softmax, LogSoftmax, MatMul, Gemm (non-constant B),
LayerNormalization, and the Erf/Gelu activations.

Softmax changed meaning at opset 13: before it, the input is coerced to 2-D at ``axis``
(default 1) and normalised over the flattened trailing block; from 13 on it normalises
one axis (default -1). ``get_op`` hands out the variant for the model's opset.
"""
from __future__ import annotations

import math

import numpy as np

from onnx_prep.core.errors import NativeError
from onnx_prep.core.ops.attributes import axis_index


def _softmax_axis(x: np.ndarray, axis: int) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    e = np.subtract(x, m)
    np.exp(e, out=e)  # in place: the same values, one temporary fewer
    e /= np.sum(e, axis=axis, keepdims=True)
    return e


def softmax(inputs, attrs, prepared):
    x = inputs[0]
    return [_softmax_axis(x, axis_index(attrs.get("axis", -1), x.ndim))]


def _coerced_2d(fn, inputs, attrs):
    """Opset < 13 semantics: apply ``fn`` over axis 1 of x coerced to 2-D
    [prod(shape[:axis]), prod(shape[axis:])]."""
    x = inputs[0]
    axis = axis_index(attrs.get("axis", 1), x.ndim)
    lead = int(np.prod(x.shape[:axis], dtype=np.int64))
    return [fn(x.reshape(lead, -1), 1).reshape(x.shape)]


def softmax_legacy(inputs, attrs, prepared):
    """Softmax for opset < 13 (see _coerced_2d)."""
    return _coerced_2d(_softmax_axis, inputs, attrs)


def _log_softmax_axis(x, axis):
    m = np.max(x, axis=axis, keepdims=True)
    s = x - m
    return s - np.log(np.sum(np.exp(s), axis=axis, keepdims=True))


def log_softmax(inputs, attrs, prepared):
    x = inputs[0]
    return [_log_softmax_axis(x, axis_index(attrs.get("axis", -1), x.ndim))]


def log_softmax_legacy(inputs, attrs, prepared):
    """LogSoftmax for opset < 13 (see _coerced_2d)."""
    return _coerced_2d(_log_softmax_axis, inputs, attrs)


def matmul(inputs, attrs, prepared):
    # numpy's matmul broadcasting and 1-D promotion rules are ONNX's.
    return [np.matmul(inputs[0], inputs[1])]


def gemm(inputs, attrs, prepared):
    a, b = inputs[0], inputs[1]
    c = inputs[2] if len(inputs) > 2 else None
    if attrs.get("transA", 0):
        a = a.T
    if attrs.get("transB", 0):
        b = b.T
    y = np.matmul(a, b)
    alpha = attrs.get("alpha", 1.0)
    if alpha != 1.0:
        y *= y.dtype.type(alpha)
    if c is not None:
        beta = attrs.get("beta", 1.0)
        y += c if beta == 1.0 else c * c.dtype.type(beta)
    return [y]


def layer_normalization(inputs, attrs, prepared):
    x, scale = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    axis = axis_index(attrs.get("axis", -1), x.ndim)
    eps = attrs.get("epsilon", 1e-5)
    axes = tuple(range(axis, x.ndim))
    mean = np.mean(x, axis=axes, keepdims=True)
    d = x - mean
    var = np.mean(d * d, axis=axes, keepdims=True)
    inv = 1.0 / np.sqrt(var + x.dtype.type(eps))
    y = d * inv * scale
    if bias is not None:
        y = y + bias
    # Optional outputs Mean and InvStdDev (stash_type float32 for float inputs).
    return [y.astype(x.dtype, copy=False), mean.astype(np.float32), inv.astype(np.float32)]


_erf_vec = np.vectorize(math.erf, otypes=[np.float64])


def _erf64(x: np.ndarray) -> np.ndarray:
    """erf of every element, in float64: the native module's loop over libm's erf
    (bit-identical to math.erf, ~6x faster), or math.erf per element without it."""
    try:
        from onnx_prep import native

        return native.erf(x)
    except NativeError:
        return _erf_vec(x)


def erf(inputs, attrs, prepared):
    x = inputs[0]
    return [_erf64(x).astype(x.dtype)]


def gelu(inputs, attrs, prepared):
    x = inputs[0]
    if attrs.get("approximate", "none") == "tanh":
        c = math.sqrt(2.0 / math.pi)
        return [(0.5 * x * (1.0 + np.tanh(c * (x + 0.044715 * x ** 3)))).astype(x.dtype)]
    return [(0.5 * x * (1.0 + _erf64(x / math.sqrt(2.0)))).astype(x.dtype)]
