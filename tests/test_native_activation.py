"""The QuickGelu activation (native/activation.c, activation_simd.c; core/ops/activation.py;
the ``activation`` kernel): every ISA bit-equal to the scalar twin, accuracy against
float64, the op against ONNX Runtime's com.microsoft QuickGelu (float32 and float16,
hypothesis over shapes, values and alpha), GIL release, and the resolve side.

Tolerances: ours is within QG_RTOL of the exact value of x * sigmoid(t), t the float32
product alpha * x (relative, for |t| < 86; measured 2.0e-7), ONNX Runtime's own within ~2.2e-6 absolute (its logistic is a rational
approximation, 0 below x ~ -18): against it, ORT_ATOL absolute plus F32_RTOL."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ort_or_skip
from gil_release import run_checking_gil_release
from ops_oracle import F16_RTOL, F32_RTOL, check_against_ort, one_node_model, run_ort
from onnx_prep import native
from onnx_prep.core.ops.activation import DEFAULT_ALPHA, quick_gelu
from test_native_reference import SIMD_ISAS

MS = "com.microsoft"
QG_RTOL = 1e-6       # ours against float64 x * sigmoid(alpha x)
ORT_ATOL = 5e-6      # ours against ONNX Runtime, absolute (its error: ~2.2e-6)
SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -200.0, -86.5, -86.0, -85.9, -20.0, -1e-30,
                     1e-30, 20.0, 86.0, 200.0, 3.4e38, -3.4e38, 1.4e-45], np.float32)


def _values(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * rng.choice([0.01, 1.0, 8.0, 40.0], n)).astype(np.float32)
    x[: min(n, SPECIALS.size)] = SPECIALS[: min(n, SPECIALS.size)]
    return x


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("alpha", [1.0, DEFAULT_ALPHA, -0.5, 0.0])
def test_every_isa_gives_the_scalar_twins_bits(isa, alpha):
    """Every length's whole vectors and tail (0-33, then long rows), specials included:
    the same bits as the scalar twin, NaN where it has NaN."""
    for n in [*range(34), 1000, 5632 * 2 + 3]:
        x = _values(n, n)
        ref = native.quick_gelu(x, alpha, isa="scalar")
        assert n == 0 or native.last_kernel() == "scalar"
        got = native.quick_gelu(x, alpha, isa=isa)
        if n:
            assert native.last_kernel() == isa.split("-")[0], isa
        np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(ref)], ref.view(np.uint32)[~np.isnan(ref)],
                                      err_msg=f"{isa} n {n}")
        assert np.array_equal(np.isnan(got), np.isnan(ref))


@pytest.mark.parametrize("alpha", [1.0, DEFAULT_ALPHA, -0.5])
def test_accuracy_against_float64(alpha):
    x = _values(3, 200_000)
    y = native.quick_gelu(x, alpha)
    w = x.astype(np.float64)
    # the kernel's argument, alpha x rounded to float32 (as ONNX Runtime's): its rounding
    # is the input's conditioning (|t| ulp, up to ~4e-6 relative near t = -86), not error
    with np.errstate(over="ignore"):
        t = (np.float32(alpha) * x).astype(np.float64)
    keep = np.isfinite(w) & (np.abs(t) < 86)
    with np.errstate(over="ignore", invalid="ignore"):
        want = w / (1 + np.exp(-t))
    err = np.abs(y[keep] - want[keep])
    assert (err <= QG_RTOL * np.abs(want[keep]) + 1e-38).all(), err.max()
    # the limits: x where alpha x >> 0; below alpha x = -86 a value of x's sign under
    # 4.5e-38 |x| (the exact one underflows)
    big, tiny = native.quick_gelu(np.array([200.0, -200.0], np.float32) * np.sign(alpha), alpha)
    assert big == np.float32(200.0 * np.sign(alpha))
    assert tiny * np.sign(alpha) <= 0 and abs(tiny) < 4.5e-38 * 200


def test_in_place_and_out_and_shapes():
    x = _values(5, 3 * 7 * 11).reshape(3, 7, 11)
    want = native.quick_gelu(x, 1.0)
    assert want.shape == x.shape and want.dtype == np.float32
    y = x.copy()
    assert native.quick_gelu(y, 1.0, out=y) is y
    np.testing.assert_array_equal(y, want)
    # a strided or float64 input is converted first
    np.testing.assert_array_equal(native.quick_gelu(x.astype(np.float64), 1.0), want)
    np.testing.assert_array_equal(native.quick_gelu(np.asfortranarray(x), 1.0), want)
    with pytest.raises(ValueError, match="out must be"):
        native.quick_gelu(x, 1.0, out=np.empty((3, 7, 10), np.float32))


def test_quick_gelu_releases_the_gil():
    x = _values(6, 4_000_000)
    want = native.quick_gelu(x, 1.0, isa="scalar")
    got = run_checking_gil_release(lambda: native.quick_gelu(x, 1.0, isa="scalar"))
    np.testing.assert_array_equal(got, want)


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=3),
       alpha=st.sampled_from([None, 1.0, 1.702, 0.5, -1.0]), scale=st.sampled_from([0.1, 1.0, 6.0]),
       seed=st.integers(0, 2**16))
def test_the_op_matches_onnxruntime(shape, alpha, scale, seed):
    ort_or_skip()
    x = (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)
    attrs = {} if alpha is None else {"alpha": alpha}
    check_against_ort("QuickGelu", [x], attrs, domain=MS, kernel="activation", rtol=F32_RTOL, atol=ORT_ATOL)


def test_float16_is_computed_in_float32_as_onnxruntime_does():
    ort_or_skip()
    x = (np.random.default_rng(9).standard_normal((4, 300)) * 4).astype(np.float16)
    theirs = run_ort(one_node_model("QuickGelu", [x], {"alpha": 1.0}, opset=17, domain=MS), [x])[0]
    ours = quick_gelu([x], {"alpha": 1.0}, {})[0]
    assert ours.dtype == np.float16
    np.testing.assert_allclose(ours.astype(np.float32), theirs.astype(np.float32), rtol=F16_RTOL, atol=1e-3)


def test_float64_stays_float64():
    """What the silu fusion may meet in a float64 graph: computed in float64, not rounded
    through float32."""
    x = np.random.default_rng(10).standard_normal(500) * 5
    y = quick_gelu([x], {"alpha": 1.0}, {})[0]
    assert y.dtype == np.float64
    # within float64's rounding (the tanh form's 1 + tanh cancels for x < 0: absolute, not
    # relative, error there); float32 rounding would be ~1e-7 relative
    np.testing.assert_allclose(y, x / (1 + np.exp(-x)), rtol=1e-13, atol=1e-14)


def test_bound_node_reads_alpha_once_and_gives_the_ops_bits():
    x = _values(8, 999)
    bound = quick_gelu.bind({"alpha": 0.75})
    assert bound.unbound is quick_gelu
    np.testing.assert_array_equal(bound([x], {}, {})[0], quick_gelu([x], {"alpha": 0.75}, {})[0])
    np.testing.assert_array_equal(quick_gelu.bind({})([x], {}, {})[0], native.quick_gelu(x, DEFAULT_ALPHA))
