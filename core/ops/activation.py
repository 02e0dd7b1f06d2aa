"""Activation ops over native kernels: com.microsoft QuickGelu,
``Y = X * sigmoid(alpha * X)`` (``alpha`` 1.702 by default, ONNX Runtime's), which the
``silu`` fusion also makes from ``Sigmoid(x) * x`` (core/model/fusion.py).

The native kernel (``onnx_prep.native.quick_gelu``; its arithmetic in
native/activation.h) is within 2e-7 relative of the exact value for finite inputs;
ONNX Runtime's own is within ~2e-6 absolute and returns 0 below x ~ -18 where this one
keeps the tiny value. Without the native module: numpy, with the Sigmoid op's formula.
float16 is computed in float32 and rounded back, as ONNX Runtime does.
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


def _quick_gelu(x: np.ndarray, alpha: float, kernel) -> np.ndarray:
    x32 = np.asarray(x).astype(np.float32, copy=False)
    if kernel is not None:
        y = kernel(x32, alpha)
    else:  # pragma: no cover - only without the native module
        half = np.float32(0.5)
        y = np.tanh(x32 * np.float32(alpha) * half)
        y += 1
        y *= half
        y *= x32
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
