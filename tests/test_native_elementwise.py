"""Element-wise native math (native/elementwise.c): erf is libm's, so it must equal
math.erf bit for bit, and the Erf / Gelu ops must not change their outputs by using it."""
from __future__ import annotations

import math

import numpy as np
import pytest

from onnx_prep import native
from onnx_prep.core.ops import nn

SPECIAL = [0.0, -0.0, 1e-300, -1e-300, 5e-324, 1e-8, 0.5, 0.84375, 1.0, 2.0, 3.5, 5.9, 6.0,
           27.0, -27.0, 1e300, math.inf, -math.inf]


def test_erf_equals_math_erf_bit_for_bit():
    rng = np.random.default_rng(3)
    x = np.concatenate([np.array(SPECIAL), rng.standard_normal(20_000) * 3, np.linspace(-7, 7, 5001)])
    got = native.erf(x)
    want = np.array([math.erf(v) for v in x])
    assert got.dtype == np.float64 and got.shape == x.shape
    np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64))  # -0.0 stays -0.0
    assert np.isnan(native.erf(np.array([math.nan])))[0]


def test_erf_keeps_the_shape_and_takes_any_layout_and_float_type():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)[:, ::2, ::-1] / 10  # strided view
    got = native.erf(x)
    assert got.shape == x.shape
    np.testing.assert_array_equal(got, np.vectorize(math.erf)(x.astype(np.float64)))
    assert native.erf(np.zeros((0, 5), np.float16)).shape == (0, 5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_erf_and_gelu_ops_are_unchanged_by_the_native_loop(dtype):
    x = (np.random.default_rng(5).standard_normal((3, 257)) * 4).astype(dtype)
    [got] = nn.erf([x], {}, {})
    want = nn._erf_vec(x).astype(dtype)  # the pure-Python path the op used before
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, want)
    [g] = nn.gelu([x], {}, {})
    want_g = (0.5 * x * (1.0 + nn._erf_vec(x / math.sqrt(2.0)))).astype(dtype)
    np.testing.assert_array_equal(g, want_g)
