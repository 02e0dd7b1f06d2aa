"""Activation ops over native kernels: com.microsoft QuickGelu,
``Y = X * sigmoid(alpha * X)`` (``alpha`` 1.702 by default, ONNX Runtime's), which the
``silu`` fusion also makes from ``Sigmoid(x) * x`` (core/model/fusion.py).

The native kernel (``onnx_prep.native.quick_gelu``; its arithmetic in
native/activation.h) is within 2e-7 relative of the exact value for finite inputs;
ONNX Runtime's own is within ~2e-6 absolute and returns 0 below x ~ -18 where this one
keeps the tiny value. Without the native module: numpy, with the Sigmoid op's formula.
float16 is computed in float32 and rounded back, as ONNX Runtime does; float64 (a model
whose SiLU the fusion rewrote) in float64 with that formula.
"""
from __future__ import annotations

import numpy as np

from onnx_prep.core.errors import NativeError

DEFAULT_ALPHA = 1.702  # ONNX Runtime's QuickGelu default


def _kernel():
    try:
        from onnx_prep import native

        return native.quick_gelu
    except NativeError:  # pragma: no cover - only without the native module
        return None


def _numpy(x: np.ndarray, alpha: float) -> np.ndarray:
    """``x * sigmoid(alpha x)`` in x's own float type, the Sigmoid op's formula."""
    half = x.dtype.type(0.5)
    y = np.tanh(x * x.dtype.type(alpha) * half)
    y += 1
    y *= half
    y *= x
    return y


def _quick_gelu(x: np.ndarray, alpha: float, kernel) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype not in (np.float32, np.float16):  # float64 (what the fusion may meet): in its own precision
        return _numpy(x, alpha)
    x32 = x.astype(np.float32, copy=False)
    y = kernel(x32, alpha) if kernel is not None else _numpy(x32, alpha)
    return y if x.dtype == np.float32 else y.astype(x.dtype)


def quick_gelu(inputs, attrs, prepared):
    """com.microsoft QuickGelu(X) -> Y."""
    return [_quick_gelu(inputs[0], float(attrs.get("alpha", DEFAULT_ALPHA)), _kernel())]


def bind_quick_gelu(attrs):
    """QuickGelu for one node: alpha and the kernel looked up once."""
    alpha, kernel = float(attrs.get("alpha", DEFAULT_ALPHA)), _kernel()

    def quick_gelu_node(inputs, attrs, prepared):
        return [_quick_gelu(inputs[0], alpha, kernel)]

    quick_gelu_node.unbound = quick_gelu  # what it stands in for (scripts/ab_decode_step.py)
    return quick_gelu_node


quick_gelu.bind = bind_quick_gelu
