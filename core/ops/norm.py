"""Row normalization ops: LayerNormalization, SimplifiedLayerNormalization (RMSNorm,
registered by ONNX Runtime in the default domain) and com.microsoft
SkipLayerNormalization / SkipSimplifiedLayerNormalization, over the native kernel
(``onnx_prep.native.norm_rows``), or numpy where the native module is absent.

Semantics (ONNX Runtime's CPU kernels; tests/test_native_norm.py checks them against it):

- ``v = input + skip (+ bias)`` for the Skip forms (skip ``[H]``-rowed: ``[S, H]`` or
  ``[B, S, H]``, repeating over the input's rows), else ``v = X``;
- RMSNorm: ``y = v / sqrt(mean(v^2) + epsilon) * gamma``; LayerNorm: ``y = (v - mean) /
  sqrt(var + epsilon) * gamma (+ beta)``, over the last axis (LayerNormalization and
  SimplifiedLayerNormalization: over the axes from ``axis`` on, scale / bias
  broadcasting to them);
- optional outputs: LayerNormalization Mean, InvStdDev; SimplifiedLayerNormalization
  inv_std_var; the Skip forms mean (0 for SkipSimplifiedLayerNormalization, which
  subtracts none), inv_std_var, input_skip_bias_sum (each statistic with the
  normalized axes kept as 1; float32).

float16 inputs are computed in float32 and rounded back, as ONNX Runtime does.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from onnx_prep.core.errors import NativeError
from onnx_prep.core.ops.attributes import ABSENT_OUTPUTS, N_OUTPUTS, axis_index

_DEFAULT_EPSILON = 1e-5


def _norm_rows(x2, gamma, beta, skip2, bias, eps, simplified, want_sum, want_stats):
    try:
        from onnx_prep import native

        return tuple(native.norm_rows(x2, gamma, beta=beta, skip=skip2, bias=bias, epsilon=eps,
                                      simplified=simplified, want_sum=want_sum, want_stats=want_stats))
    except NativeError:
        return _norm_rows_numpy(x2, gamma, beta, skip2, bias, eps, simplified)


@functools.cache
def _native(name: str):
    """``onnx_prep.native``'s ``name``, or None without the native module (looked up once)."""
    try:
        from onnx_prep import native

        return getattr(native, name)
    except NativeError:
        return None


def _norm_y(x2, gamma, beta, eps, simplified):
    """Only ``y`` of ``_norm_rows`` without skip or bias (``native.norm_rows_y``: the
    decode step's lean call)."""
    try:
        from onnx_prep import native

        return native.norm_rows_y(x2, gamma, beta, epsilon=eps, simplified=simplified)
    except NativeError:
        return _norm_rows_numpy(x2, gamma, beta, None, None, eps, simplified)[0]


def _norm_rows_numpy(x2, gamma, beta, skip2, bias, eps, simplified):
    """The same computation in numpy (float32 throughout; sums in numpy's order)."""
    v = x2
    if skip2 is not None:
        v = (v.reshape(-1, *skip2.shape) + skip2).reshape(x2.shape)
    if bias is not None:
        v = v + bias
    mean = v.mean(axis=-1, dtype=np.float32)
    d = v if simplified else v - mean[:, None]
    inv = (np.float32(1) / np.sqrt((d * d).mean(axis=-1, dtype=np.float32) + np.float32(eps))).astype(np.float32)
    y = (d * inv[:, None]) * gamma
    if beta is not None and not simplified:
        y = y + beta
    return y, v, mean, inv


def _flat(a, n):
    return None if a is None else np.ascontiguousarray(np.broadcast_to(np.asarray(a, np.float32), (n,)))


def _row_param(a, norm_shape: tuple[int, ...], n: int) -> np.ndarray:
    """Scale or bias as a contiguous float32 [n] row; as it is when it already is one
    (a decode step normalizes a few rows: the broadcast would cost more than the rows)."""
    if isinstance(a, np.ndarray) and a.dtype == np.float32 and a.shape == norm_shape and a.flags.c_contiguous:
        return a.reshape(n)
    return np.ascontiguousarray(np.broadcast_to(np.asarray(a, np.float32), norm_shape)).reshape(n)


def _axis_norm(inputs, attrs, simplified: bool):
    x, scale = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 and not simplified else None
    axis = axis_index(attrs.get("axis", -1), x.ndim)
    norm_shape = x.shape[axis:]
    n = math.prod(norm_shape)
    rows = x.size // n if n else 0
    gamma = _row_param(scale, norm_shape, n)
    beta = None if bias is None else _row_param(bias, norm_shape, n)
    stats = attrs.get(N_OUTPUTS, 3) > 1
    x2, eps = x.astype(np.float32, copy=False).reshape(rows, n), float(attrs.get("epsilon", _DEFAULT_EPSILON))
    if not stats:
        return _norm_y(x2, gamma, beta, eps, simplified).reshape(x.shape).astype(x.dtype, copy=False), None, None
    y, _, mean, inv = _norm_rows(x2, gamma, beta, None, None, eps, simplified, False, stats)
    y = y.reshape(x.shape).astype(x.dtype, copy=False)
    stat_shape = x.shape[:axis] + (1,) * (x.ndim - axis)
    return y, mean.reshape(stat_shape), inv.reshape(stat_shape)


def layer_normalization(inputs, attrs, prepared):
    """LayerNormalization(X, Scale, B?) -> Y, Mean, InvStdDev."""
    y, mean, inv = _axis_norm(inputs, attrs, simplified=False)
    return [y] if mean is None else [y, mean, inv]


def simplified_layer_normalization(inputs, attrs, prepared):
    """SimplifiedLayerNormalization(X, scale) -> Y, inv_std_var."""
    x, scale = inputs[0], inputs[1]
    lean = _native("norm_rows_y")
    if (lean is not None and attrs.get(N_OUTPUTS, 2) <= 1 and attrs.get("axis", -1) in (-1, x.ndim - 1)
            and type(x) is np.ndarray and x.dtype == np.float32 and x.ndim and x.flags.c_contiguous
            and type(scale) is np.ndarray and scale.dtype == np.float32 and scale.shape == x.shape[-1:]
            and x.size):
        # the decode step's form: Y only, over the last axis, of a float32 row stack
        # (NOTE: the general path's axis and shape handling cost ~6.6 of its ~12 us a
        # call hot, 33 calls a medium step): the same C call, the same bits
        n = x.shape[-1]
        return [lean(x.reshape(-1, n), scale, None, epsilon=float(attrs.get("epsilon", _DEFAULT_EPSILON)),
                     simplified=True).reshape(x.shape)]
    y, _, inv = _axis_norm(inputs, attrs, simplified=True)
    return [y] if inv is None else [y, inv]


def bind_rms_norm(attrs):
    """SimplifiedLayerNormalization for one node, its attributes read once: a node over
    the last axis whose inv_std_var is absent or not declared gets ``native.rms_norm_y``
    (one C call) for a float32 input; anything else runs the general op. Same bits
    (tests/test_native_norm.py)."""
    n_out = attrs.get(N_OUTPUTS, 2)
    if (n_out > 1 and 1 not in attrs.get(ABSENT_OUTPUTS, ())) or int(attrs.get("axis", -1)) != -1:
        return simplified_layer_normalization
    lean = _native("rms_norm_y")
    if lean is None:  # pragma: no cover - only without the native module
        return simplified_layer_normalization
    eps = float(attrs.get("epsilon", _DEFAULT_EPSILON))

    def rms_norm(inputs, attrs, prepared):
        y = lean(inputs[0], inputs[1], eps)
        if y is None:
            return simplified_layer_normalization(inputs, attrs, prepared)
        return [y] if n_out <= 1 else [y, None]

    rms_norm.unbound = simplified_layer_normalization  # what it stands in for (scripts/ab_decode_step.py)
    return rms_norm


simplified_layer_normalization.bind = bind_rms_norm


def _skip_norm(inputs, attrs, simplified: bool):
    x, skip, gamma = inputs[0], inputs[1], inputs[2]
    beta = None if simplified or len(inputs) <= 3 else inputs[3]
    bias = inputs[3] if simplified and len(inputs) > 3 else (inputs[4] if len(inputs) > 4 else None)
    n = x.shape[-1]
    rows = x.size // n if n else 0
    skip2 = np.asarray(skip).reshape(-1, n) if n else np.asarray(skip).reshape(0, 0)
    n_out = attrs.get(N_OUTPUTS, 4)  # the statistics and the sum only when asked for
    eps = float(attrs.get("epsilon", _DEFAULT_EPSILON))
    lean = _native("skip_norm_rows") if (beta is None and bias is None and n_out > 3 and rows and x.dtype == np.float32
                                 and type(gamma) is np.ndarray and gamma.dtype == np.float32
                                 and gamma.shape == (n,)) else None
    if lean is not None:  # the decode step's form (the builder's residual stream): one lean call
        y, total, mean, inv = lean(x.reshape(rows, n), skip2, gamma, epsilon=eps, simplified=simplified,
                                   want_stats=True)
    else:
        y, total, mean, inv = _norm_rows(
            x.astype(np.float32, copy=False).reshape(rows, n), _flat(gamma, n), _flat(beta, n),
            skip2.astype(np.float32, copy=False), _flat(bias, n), eps, simplified, n_out > 3, n_out > 1)
    if n_out <= 1:
        return [y.reshape(x.shape).astype(x.dtype, copy=False)]
    stat_shape = x.shape[:-1] + (1,)
    if simplified:  # RMSNorm subtracts no mean: ONNX Runtime's mean output is 0
        mean = np.zeros_like(mean)
    # mean and inv_std_var are float32 (the schema's type U) whatever the input type
    return [y.reshape(x.shape).astype(x.dtype, copy=False), mean.reshape(stat_shape), inv.reshape(stat_shape),
            None if total is None else total.reshape(x.shape).astype(x.dtype, copy=False)]


def bind_skip_norm(attrs, simplified: bool):
    """The Skip norm of one node, its attributes read once: a node whose statistics
    (outputs 1 and 2) are absent or not declared gets ``native.skip_norm_sum`` (its y
    and residual sum, one C call) for float32 inputs without beta or bias; anything
    else runs the general op. Same bits either way (tests/test_native_norm.py)."""
    general = skip_simplified_layer_normalization if simplified else skip_layer_normalization
    n_out = attrs.get(N_OUTPUTS, 4)
    absent = set(attrs.get(ABSENT_OUTPUTS, ()))
    if any(i < n_out and i not in absent for i in (1, 2)):
        return general
    lean = _native("skip_norm_sum")
    if lean is None:  # pragma: no cover - only without the native module
        return general
    eps = float(attrs.get("epsilon", _DEFAULT_EPSILON))
    extra = 2 if simplified else 3  # inputs past gamma: bias (simplified); beta, bias

    def skip_norm(inputs, attrs, prepared):
        if len(inputs) <= 3 or all(x is None for x in inputs[3:3 + extra]):
            r = lean(inputs[0], inputs[1], inputs[2], eps, simplified)
            if r is not None:
                return [r[0], None, None, r[1]][:n_out]
        return general(inputs, attrs, prepared)

    skip_norm.unbound = general  # what it stands in for (scripts/ab_decode_step.py)
    return skip_norm


def skip_layer_normalization(inputs, attrs, prepared):
    """com.microsoft SkipLayerNormalization(input, skip, gamma, beta?, bias?) ->
    output, mean, inv_std_var, input_skip_bias_sum."""
    return _skip_norm(inputs, attrs, simplified=False)


def skip_simplified_layer_normalization(inputs, attrs, prepared):
    """com.microsoft SkipSimplifiedLayerNormalization(input, skip, gamma, bias?) ->
    output, mean, inv_std_var, input_skip_bias_sum."""
    return _skip_norm(inputs, attrs, simplified=True)


skip_layer_normalization.bind = lambda attrs: bind_skip_norm(attrs, simplified=False)
skip_simplified_layer_normalization.bind = lambda attrs: bind_skip_norm(attrs, simplified=True)
