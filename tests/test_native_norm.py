"""Row normalization (native/norm.c, norm_simd.c; core/ops/norm.py; the row_norm kernel):
every ISA bit-equal to the scalar twin, the ops against ONNX Runtime on random shapes
and values (hypothesis), accuracy against float64, GIL release, and what resolve
refuses or leaves unsupported."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from conftest import ort_or_skip
from gil_release import run_checking_gil_release
from ops_oracle import one_node_model, run_ort, run_ours
from onnx_prep import native
from onnx_prep.core.errors import ModelFormatError
from onnx_prep.core.model.resolution import resolve_model
from test_native_reference import ALL_ISAS, SIMD_ISAS

MS = "com.microsoft"

# Tolerances against ONNX Runtime, per element, in units of the output's own scale.
# RMSNorm: both compute inv = 1/sqrt(mean(v^2) + eps) in fp32, summing in different
# orders (ours: 16 lane sums and a fixed fold; ORT: one running sum), and ORT divides
# where we multiply by the inverse: a relative difference of a few ulp of the sum over
# up to 300 terms [measured 1.2e-6 of max|gamma|, 4.3e-7 relative on inv_std_var].
RMSNORM_RTOL = 4e-6
# LayerNorm: ORT's SkipLayerNormalization takes the variance as E[v^2] - mean^2 in fp32,
# which loses (mean^2 + var) / var times fp32's precision when |mean| >> std; we take it
# around the mean (corrected two-pass). So the bound scales with that conditioning
# number per row [measured 1.1e-6 x the conditioning, of (|y| + |gamma|)].
LAYERNORM_RTOL = 4e-6
# input_skip_bias_sum: (input + skip) + bias in the same order on both sides: bit-equal.


def _cond(v: np.ndarray) -> np.ndarray:
    """(mean^2 + var) / var per row of v (float64), the E[v^2] - mean^2 conditioning."""
    v = v.astype(np.float64)
    var = v.var(axis=-1, keepdims=True)
    return (v.mean(axis=-1, keepdims=True) ** 2 + var) / np.maximum(var, 1e-30)


def _close(ours, theirs, bound, what):
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    assert ours.shape == theirs.shape, (what, ours.shape, theirs.shape)
    err = np.abs(ours - theirs)
    assert np.all(err <= bound), f"{what}: worst {np.max(err - bound):.3g} over the bound"


rows_n = st.tuples(st.integers(1, 6), st.integers(1, 300))


def _values(rng, shape, offset=0.0, scale=1.0):
    return (rng.standard_normal(shape) * scale + offset).astype(np.float32)


# ------------------------------------------------------------ every ISA vs the scalar twin

@pytest.mark.parametrize("isa", SIMD_ISAS)
@given(shape=rows_n, simplified=st.booleans(), parts=st.sets(st.sampled_from(["skip", "bias", "beta", "rep"])),
       offset=st.sampled_from([0.0, 3.0, 500.0]), seed=st.integers(0, 2**32 - 1))
def test_every_isa_gives_the_scalar_twins_bits(isa, shape, simplified, parts, offset, seed):
    rng = np.random.default_rng(seed)
    rows, n = shape
    x = _values(rng, (rows, n), offset)
    gamma, beta, bias = (_values(rng, n) for _ in range(3))
    skip = None
    if "skip" in parts:
        skip = _values(rng, (1 if "rep" in parts else rows, n))
    kw = dict(beta=beta if "beta" in parts else None, skip=skip, bias=bias if "bias" in parts else None,
              epsilon=1e-5, simplified=simplified, want_sum=True, want_stats=True)
    want = native.norm_rows(x, gamma, isa="scalar", **kw)
    got = native.norm_rows(x, gamma, isa=isa, **kw)
    assert native.last_kernel() == ("avx512" if isa == "avx512-novnni" else isa)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_tails_and_non_finite_values_follow_the_scalar_twin(isa):
    rng = np.random.default_rng(3)
    for n in (1, 7, 8, 9, 15, 16, 17, 31, 33, 4096 + 5):
        x = _values(rng, (3, n))
        x[1, n // 2] = np.inf
        x[2, 0] = np.nan
        g = _values(rng, n)
        for simplified in (True, False):
            want = native.norm_rows(x, g, epsilon=1e-6, simplified=simplified, want_stats=True, isa="scalar")
            got = native.norm_rows(x, g, epsilon=1e-6, simplified=simplified, want_stats=True, isa=isa)
            for a, b in zip(got, want):
                if a is not None:
                    np.testing.assert_array_equal(a, b)
            assert np.all(np.isnan(got.y[2]))  # a NaN poisons its row only
            assert np.all(np.isfinite(got.y[0]))


def test_rmsnorm_against_float64():
    """The fp32 lane sums against an exact float64 RMSNorm, on a row long enough for the
    summation order to matter."""
    rng = np.random.default_rng(4)
    x = _values(rng, (4, 8192), 2.0, 3.0)
    g = _values(rng, 8192)
    y = native.norm_rows(x, g, epsilon=1e-6, simplified=True).y
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * g
    _close(y, ref, RMSNORM_RTOL * np.abs(ref) + 1e-30, "rmsnorm vs float64")


def test_layernorm_with_a_large_mean_stays_at_fp32s_limit():
    """|mean| >> std: y can be no better than the rounding of the mean itself
    (ulp(|mean|) / std relative to gamma); the corrected two-pass variance reaches that,
    where E[v^2] - mean^2 in fp32 would lose all digits of var here."""
    rng = np.random.default_rng(5)
    x = _values(rng, (6, 1000), 1000.0, 0.01)
    g = _values(rng, 1000)
    y = native.norm_rows(x, g, epsilon=1e-12, simplified=False).y
    x64 = x.astype(np.float64)
    mu, sd = x64.mean(-1, keepdims=True), x64.std(-1, keepdims=True)
    ref = (x64 - mu) / np.sqrt(sd ** 2 + 1e-12) * g
    limit = np.spacing(np.float32(1000.0)) / sd * np.abs(g)
    _close(y, ref, 2 * limit + LAYERNORM_RTOL * np.abs(ref), "layernorm vs float64")
    naive_var = np.float32((x * x).mean(-1, dtype=np.float32)) - np.float32(x.mean(-1, dtype=np.float32)) ** 2
    assert np.max(np.abs(naive_var - sd[:, 0] ** 2) / sd[:, 0] ** 2) > 1  # what the naive form would do


def test_norm_rows_releases_the_gil():
    rng = np.random.default_rng(6)
    x, g = _values(rng, (3000, 4096)), _values(rng, 4096)
    want = native.norm_rows(x, g, epsilon=1e-6, simplified=False, isa="scalar").y
    got = run_checking_gil_release(lambda: native.norm_rows(x, g, epsilon=1e-6, simplified=False, isa="scalar").y)
    np.testing.assert_array_equal(got, want)


def test_bad_arguments_are_value_errors():
    x, g = np.ones((4, 8), np.float32), np.ones(8, np.float32)
    with pytest.raises(ValueError, match="gamma"):
        native.norm_rows(x, g[:7], epsilon=0.0, simplified=True)
    with pytest.raises(ValueError, match="does not repeat"):
        native.norm_rows(x, g, skip=np.ones((3, 8), np.float32), epsilon=0.0, simplified=True)
    with pytest.raises(ValueError, match="2-D"):
        native.norm_rows(x[0], g, epsilon=0.0, simplified=True)


@given(shape=rows_n, simplified=st.booleans(), with_beta=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_the_decode_paths_lean_call_gives_norm_rows_bits(shape, simplified, with_beta, seed):
    """norm_rows_y (the ops' call without skip, bias or statistics) is norm_rows(...).y bit
    for bit, on the active ISA as norm_rows' default."""
    rng = np.random.default_rng(seed)
    x, g, b = _values(rng, shape), _values(rng, shape[1]), _values(rng, shape[1])
    beta = b if with_beta else None
    got = native.norm_rows_y(x, g, beta, epsilon=1e-5, simplified=simplified)
    want = native.norm_rows(x, g, beta=beta, epsilon=1e-5, simplified=simplified).y
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_array_equal(got, want)


def test_the_lean_call_takes_norm_rows_for_any_other_form():
    """Arguments not in the kernel's form (a strided x, float64 gamma, a Python list) are
    copied as norm_rows copies them, with the same bits; a gamma of the wrong length is
    norm_rows' ValueError, not a read past its end."""
    rng = np.random.default_rng(7)
    x, g = _values(rng, (5, 64)), _values(rng, 64)
    want = native.norm_rows(x, g, epsilon=1e-6, simplified=True).y
    strided = np.zeros((5, 128), np.float32)
    strided[:, ::2] = x
    np.testing.assert_array_equal(native.norm_rows_y(strided[:, ::2], g, None, epsilon=1e-6, simplified=True), want)
    np.testing.assert_array_equal(native.norm_rows_y(x, g.astype(np.float64), None, epsilon=1e-6, simplified=True),
                                  native.norm_rows(x, g.astype(np.float64), epsilon=1e-6, simplified=True).y)
    np.testing.assert_array_equal(native.norm_rows_y(x, g.tolist(), None, epsilon=1e-6, simplified=True), want)
    with pytest.raises(ValueError, match="gamma"):
        native.norm_rows_y(x, g[:63], None, epsilon=1e-6, simplified=True)
    with pytest.raises(ValueError, match="beta"):
        native.norm_rows_y(x, g, g[:63], epsilon=1e-6, simplified=False)
    with pytest.raises(ValueError, match="2-D"):
        native.norm_rows_y(x[0], g, None, epsilon=1e-6, simplified=True)


@given(shape=rows_n, simplified=st.booleans(), want_stats=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_the_decode_paths_lean_skip_call_gives_norm_rows_bits(shape, simplified, want_stats, seed):
    """skip_norm_rows (the Skip ops' call without bias or beta) is norm_rows(...,
    want_sum=True) bit for bit: y, the residual sum and the statistics."""
    rng = np.random.default_rng(seed)
    x, skip, g = _values(rng, shape), _values(rng, shape), _values(rng, shape[1])
    got = native.skip_norm_rows(x, skip, g, epsilon=1e-5, simplified=simplified, want_stats=want_stats)
    want = native.norm_rows(x, g, skip=skip, epsilon=1e-5, simplified=simplified, want_sum=True,
                            want_stats=want_stats)
    for a, b in zip(got, want):
        if b is None:
            assert a is None
        else:
            np.testing.assert_array_equal(a, b)


def test_the_lean_skip_call_takes_norm_rows_for_any_other_form():
    """A strided skip, a skip of fewer rows (repeated), float16 skip, or a gamma of the
    wrong length go the general way: the same bits, or norm_rows' ValueError."""
    rng = np.random.default_rng(8)
    x, skip, g = _values(rng, (6, 64)), _values(rng, (6, 64)), _values(rng, 64)
    strided = np.zeros((6, 128), np.float32)
    strided[:, ::2] = skip
    want = native.norm_rows(x, g, skip=skip, epsilon=1e-6, simplified=True, want_sum=True)
    for got in (native.skip_norm_rows(x, strided[:, ::2], g, epsilon=1e-6, simplified=True, want_stats=False),):
        np.testing.assert_array_equal(got.y, want.y)
        np.testing.assert_array_equal(got.sum, want.sum)
    few = skip[:2]
    np.testing.assert_array_equal(
        native.skip_norm_rows(x, few, g, epsilon=1e-6, simplified=False, want_stats=True).y,
        native.norm_rows(x, g, skip=few, epsilon=1e-6, simplified=False, want_sum=True, want_stats=True).y)
    half = skip.astype(np.float16)
    np.testing.assert_array_equal(
        native.skip_norm_rows(x, half, g, epsilon=1e-6, simplified=True, want_stats=False).sum,
        native.norm_rows(x, g, skip=half, epsilon=1e-6, simplified=True, want_sum=True).sum)
    with pytest.raises(ValueError, match="gamma"):
        native.skip_norm_rows(x, skip, g[:63], epsilon=1e-6, simplified=True, want_stats=False)


@pytest.mark.parametrize("op, simplified", [("simplified_layer_normalization", True),
                                              ("layer_normalization", False)])
def test_a_single_output_norm_op_computes_what_norm_rows_does(op, simplified):
    """A norm node with one output (the fused RMSNorm of a decode step) takes the lean call:
    the values norm_rows gives, for a contiguous input, a strided view and float16."""
    from onnx_prep.core.ops import norm
    from onnx_prep.core.ops.attributes import N_OUTPUTS

    rng = np.random.default_rng(8)
    x = _values(rng, (2, 3, 96))
    g, b = _values(rng, 96), _values(rng, 96)
    inputs = [x, g] if simplified else [x, g, b]
    attrs = {"epsilon": 1e-6, N_OUTPUTS: 1}
    want = native.norm_rows(x.reshape(6, 96), g, beta=None if simplified else b, epsilon=1e-6,
                            simplified=simplified).y.reshape(x.shape)
    (y,) = getattr(norm, op)(inputs, attrs, {})
    np.testing.assert_array_equal(y, want)
    view = np.ascontiguousarray(x.transpose(1, 0, 2)).transpose(1, 0, 2)  # same values, strided
    np.testing.assert_array_equal(getattr(norm, op)([view] + inputs[1:], attrs, {})[0], want)
    h = x.astype(np.float16)
    (y16,) = getattr(norm, op)([h] + inputs[1:], attrs, {})
    want16 = native.norm_rows(h.astype(np.float32).reshape(6, 96), g, beta=None if simplified else b, epsilon=1e-6,
                              simplified=simplified).y.reshape(x.shape).astype(np.float16)
    assert y16.dtype == np.float16
    np.testing.assert_array_equal(y16, want16)


def test_the_rmsnorm_ops_lean_path_is_taken_only_for_its_form(monkeypatch):
    """SimplifiedLayerNormalization with Y only, over the last axis of a contiguous
    float32 input and a float32 [n] scale: one norm_rows_y call (core/ops/norm.py);
    statistics asked for, another axis: the general path. The same values either way."""
    from onnx_prep.core.ops import norm
    from onnx_prep.core.ops.attributes import N_OUTPUTS

    calls = []
    real = norm._native
    counted = lambda *a, **k: calls.append(1) or native.norm_rows_y(*a, **k)  # noqa: E731
    monkeypatch.setattr(norm, "_native", lambda name: counted if name == "norm_rows_y" else real(name))
    rng = np.random.default_rng(9)
    x, g = _values(rng, (2, 3, 96)), _values(rng, 96)
    want = native.norm_rows(x.reshape(6, 96), g, epsilon=1e-6, simplified=True).y.reshape(x.shape)
    for axis in (-1, 2):
        np.testing.assert_array_equal(norm.simplified_layer_normalization(
            [x, g], {"epsilon": 1e-6, "axis": axis, N_OUTPUTS: 1}, {})[0], want)
    np.testing.assert_array_equal(norm.simplified_layer_normalization(
        [x[0, 0], g], {"epsilon": 1e-6, N_OUTPUTS: 1}, {})[0], want[0, 0])  # one row, 1-D
    assert len(calls) == 3
    y, inv = norm.simplified_layer_normalization([x, g], {"epsilon": 1e-6, N_OUTPUTS: 2}, {})
    np.testing.assert_array_equal(y, want)
    g3 = _values(rng, (3, 96))  # axis 1: each row of 3 x 96 values normalized as one
    ref = native.norm_rows(x.reshape(2, 288), g3.reshape(288), epsilon=1e-6, simplified=True).y.reshape(x.shape)
    np.testing.assert_array_equal(norm.simplified_layer_normalization(
        [x, g3], {"epsilon": 1e-6, "axis": 1, N_OUTPUTS: 1}, {})[0], ref)
    assert len(calls) == 3 and inv.shape == (2, 3, 1)


# ------------------------------------------------------------------ against ONNX Runtime

def _ort_and_ours(op, domain, inputs, attrs, n_out, opset=21):
    model = one_node_model(op, inputs, attrs, opset=opset, n_out=n_out, domain=domain)
    return run_ort(model, inputs), run_ours(op, inputs, attrs, opset=opset, n_out=n_out, domain=domain,
                                            kernel="row_norm")


shapes = st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 300))
eps = st.sampled_from([1e-12, 1e-6, 1e-5])


@given(shape=shapes, bias=st.booleans(), skip_2d=st.booleans(), epsilon=eps,
       scale=st.sampled_from([1e-3, 1.0, 40.0]), seed=st.integers(0, 2**32 - 1))
def test_skip_simplified_layer_normalization_matches_onnxruntime(shape, bias, skip_2d, epsilon, scale, seed):
    ort_or_skip()
    rng = np.random.default_rng(seed)
    x = _values(rng, shape, scale=scale)
    skip = _values(rng, shape[1:] if skip_2d else shape)
    gamma, b = _values(rng, shape[-1]), _values(rng, shape[-1])
    inputs = [x, skip, gamma] + ([b] if bias else [])
    theirs, ours = _ort_and_ours("SkipSimplifiedLayerNormalization", MS, inputs, {"epsilon": epsilon}, 4)
    np.testing.assert_array_equal(ours[3], theirs[3])  # input_skip_bias_sum
    _close(ours[0], theirs[0], RMSNORM_RTOL * (np.abs(theirs[0]) + np.abs(gamma)), "output")
    np.testing.assert_array_equal(ours[1], theirs[1])  # mean: 0, no mean is subtracted
    _close(ours[2], theirs[2], RMSNORM_RTOL * np.abs(theirs[2]), "inv_std_var")


@given(shape=shapes, axis=st.sampled_from([-1, -2]), epsilon=eps, seed=st.integers(0, 2**32 - 1))
def test_simplified_layer_normalization_matches_onnxruntime(shape, axis, epsilon, seed):
    ort_or_skip()
    rng = np.random.default_rng(seed)
    x = _values(rng, shape)
    gamma = _values(rng, shape[axis:])
    theirs, ours = _ort_and_ours("SimplifiedLayerNormalization", "", [x, gamma], {"epsilon": epsilon,
                                                                                    "axis": axis}, 2)
    _close(ours[0], theirs[0], RMSNORM_RTOL * (np.abs(theirs[0]) + np.abs(gamma)), "Y")
    _close(ours[1], theirs[1], RMSNORM_RTOL * np.abs(theirs[1]), "inv_std_var")


@given(shape=shapes, beta=st.booleans(), bias=st.booleans(), skip_2d=st.booleans(), epsilon=eps,
       offset=st.sampled_from([0.0, 4.0, 60.0]), seed=st.integers(0, 2**32 - 1))
def test_skip_layer_normalization_matches_onnxruntime(shape, beta, bias, skip_2d, epsilon, offset, seed):
    ort_or_skip()
    rng = np.random.default_rng(seed)
    x = _values(rng, shape, offset)
    skip = _values(rng, shape[1:] if skip_2d else shape)
    gamma, be, b = (_values(rng, shape[-1]) for _ in range(3))
    inputs = [x, skip, gamma, be if beta else None, b if bias else None]
    while inputs[-1] is None:
        inputs.pop()
    theirs, ours = _ort_and_ours("SkipLayerNormalization", MS, inputs, {"epsilon": epsilon}, 4)
    np.testing.assert_array_equal(ours[3], theirs[3])
    cond = _cond(theirs[3])
    _close(ours[0], theirs[0], LAYERNORM_RTOL * cond * (np.abs(theirs[0]) + np.abs(gamma)), "output")
    _close(ours[1], theirs[1], LAYERNORM_RTOL * np.abs(theirs[3]).max(-1, keepdims=True), "mean")
    _close(ours[2], theirs[2], LAYERNORM_RTOL * cond * np.abs(theirs[2]), "inv_std_var")


@given(shape=shapes, axis=st.sampled_from([-1, -2, 1]), bias=st.booleans(), epsilon=eps,
       offset=st.sampled_from([0.0, 30.0]), seed=st.integers(0, 2**32 - 1))
def test_layer_normalization_matches_onnxruntime(shape, axis, bias, epsilon, offset, seed):
    ort_or_skip()
    rng = np.random.default_rng(seed)
    x = _values(rng, shape, offset)
    gamma, b = _values(rng, shape[axis:]), _values(rng, shape[axis:])
    inputs = [x, gamma] + ([b] if bias else [])
    theirs, ours = _ort_and_ours("LayerNormalization", "", inputs, {"epsilon": epsilon, "axis": axis}, 3)
    rows = x.reshape(int(np.prod(shape[:axis % 3])), -1)
    cond = _cond(rows).reshape(theirs[1].shape)
    _close(ours[0], theirs[0], LAYERNORM_RTOL * cond * (np.abs(theirs[0]) + np.abs(gamma)), "Y")
    _close(ours[1], theirs[1], LAYERNORM_RTOL * np.abs(rows).max(-1).reshape(theirs[1].shape), "Mean")
    _close(ours[2], theirs[2], LAYERNORM_RTOL * cond * np.abs(theirs[2]), "InvStdDev")


def test_float16_is_computed_in_float32_like_onnxruntime():
    ort_or_skip()
    rng = np.random.default_rng(7)
    x, skip = (_values(rng, (2, 3, 64)).astype(np.float16) for _ in range(2))
    gamma = _values(rng, 64).astype(np.float16)
    theirs, ours = _ort_and_ours("SkipSimplifiedLayerNormalization", MS, [x, skip, gamma], {"epsilon": 1e-6}, 4)
    assert ours[0].dtype == np.float16 and ours[3].dtype == np.float16
    np.testing.assert_array_equal(ours[3], theirs[3])
    # both round one float32 result to float16: at most one fp16 ulp apart
    _close(ours[0], theirs[0], np.spacing(np.abs(theirs[0]).astype(np.float16)).astype(np.float64), "output")


def test_a_wrong_epsilon_fails_the_tolerance():
    """Negative control: the tolerances catch an epsilon off by 10x on small inputs."""
    ort_or_skip()
    rng = np.random.default_rng(8)
    x, skip, gamma = _values(rng, (1, 2, 64), scale=1e-3), _values(rng, (1, 2, 64), scale=1e-3), _values(rng, 64)
    model = one_node_model("SkipSimplifiedLayerNormalization", [x, skip, gamma], {"epsilon": 1e-6}, opset=21,
                           n_out=1, domain=MS)
    theirs = run_ort(model, [x, skip, gamma])[0]
    ours = run_ours("SkipSimplifiedLayerNormalization", [x, skip, gamma], {"epsilon": 1e-5}, opset=21,
                    domain=MS, kernel="row_norm")[0]
    with pytest.raises(AssertionError):
        _close(ours, theirs, RMSNORM_RTOL * (np.abs(theirs) + np.abs(gamma)), "output")


# ------------------------------------------------------------------ resolve: kernels, refusals

def _model(tmp_path, node, inits, opset=21, name="m"):
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "S", 64]),
                                        helper.make_tensor_value_info("skip", TensorProto.FLOAT, [1, "S", 64])],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in node.output if o],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])
    m.ir_version = 10
    path = tmp_path / f"{name}.onnx"
    onnx.save(m, str(path), save_as_external_data=True, location=f"{name}.data", size_threshold=0)
    return path


GAMMA = {"gamma": np.linspace(0.5, 1.5, 64, dtype=np.float32)}


@pytest.mark.parametrize("op,domain,inputs", [
    ("SimplifiedLayerNormalization", "", ["x", "gamma"]),
    ("LayerNormalization", "", ["x", "gamma"]),
    ("SkipSimplifiedLayerNormalization", MS, ["x", "skip", "gamma"]),
    ("SkipLayerNormalization", MS, ["x", "skip", "gamma"]),
])
def test_resolve_runs_each_op_on_the_row_norm_kernel(tmp_path, op, domain, inputs):
    outs = ["y", "", "", "s"] if domain else ["y"]
    resolved = resolve_model(_model(tmp_path, helper.make_node(op, inputs, outs, name="n", domain=domain,
                                                               epsilon=1e-6), GAMMA))
    assert not resolved.unsupported
    assert [n.kernel for n in resolved.nodes] == ["row_norm"]


@pytest.mark.parametrize("node,inits,message", [
    (helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"], ["y"], name="n", domain=MS,
                      epsilon=-1e-6), GAMMA, "SkipSimplifiedLayerNormalization: epsilon -1e-06 is negative"),
    (helper.make_node("SkipLayerNormalization", ["x", "skip"], ["y"], name="n", domain=MS), {},
     "SkipLayerNormalization: input, skip and gamma are required"),
    (helper.make_node("SkipLayerNormalization", ["x", "skip", "gamma"], ["y"], name="n", domain=MS),
     {"gamma": np.ones((1, 64), np.float32)}, "input 2 has shape [1, 64], expected 1-D"),
    (helper.make_node("SimplifiedLayerNormalization", ["x"], ["y"], name="n"), {},
     "SimplifiedLayerNormalization: X and scale are required"),
])
def test_resolve_refuses_what_onnxruntime_refuses_in_one_line(tmp_path, node, inits, message):
    with pytest.raises(ModelFormatError) as e:
        resolve_model(_model(tmp_path, node, inits))
    text = str(e.value)
    assert message in text and "node 'n'" in text and "\n" not in text


def test_a_double_gamma_is_listed_unsupported_not_refused(tmp_path):
    node = helper.make_node("SimplifiedLayerNormalization", ["x", "gamma"], ["y"], name="n")
    resolved = resolve_model(_model(tmp_path, node, {"gamma": np.ones(64, np.float64)}))
    assert [(u.op_type, u.nodes) for u in resolved.unsupported] == [("SimplifiedLayerNormalization", ("n",))]


@given(shape=rows_n, simplified=st.booleans(), skip=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_the_numpy_form_agrees_with_the_kernel(shape, simplified, skip, seed):
    """Where the native module is absent the ops compute in numpy (float32, numpy's
    summation order): within the tolerances against ONNX Runtime of the kernel."""
    from onnx_prep.core.ops.norm import _norm_rows_numpy

    rng = np.random.default_rng(seed)
    x, sk = _values(rng, shape), _values(rng, shape)
    g, b = _values(rng, shape[1]), _values(rng, shape[1])
    beta = None if simplified else b
    got = _norm_rows_numpy(x, g, beta, sk if skip else None, None, 1e-5, simplified)
    want = native.norm_rows(x, g, beta=beta, skip=sk if skip else None, epsilon=1e-5, simplified=simplified,
                            want_sum=True, want_stats=True)
    np.testing.assert_array_equal(got[1], want.sum)
    cond = 1.0 if simplified else _cond(want.sum)
    _close(got[0], want.y, LAYERNORM_RTOL * cond * (np.abs(want.y) + np.abs(g)), "y")
    _close(got[3], want.inv_std, LAYERNORM_RTOL * cond[..., 0] * np.abs(want.inv_std) if not simplified
           else RMSNORM_RTOL * np.abs(want.inv_std), "inv_std")


# ------------------------------------------- the bound Skip norm (core/ops/norm.py bind)

@given(shape=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 300)), simplified=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_skip_norm_sum_gives_skip_norm_rows_bits(shape, simplified, seed):
    """native.skip_norm_sum (the bound call) is skip_norm_rows' y and residual sum bit
    for bit, in x's own shape."""
    rng = np.random.default_rng(seed)
    x, skip, g = _values(rng, shape), _values(rng, shape), _values(rng, shape[-1])
    y, total = native.skip_norm_sum(x, skip, g, 1e-5, simplified)
    want = native.skip_norm_rows(x.reshape(-1, shape[-1]), skip.reshape(-1, shape[-1]), g, epsilon=1e-5,
                                 simplified=simplified, want_stats=False)
    assert y.shape == total.shape == shape
    np.testing.assert_array_equal(y.reshape(-1, shape[-1]), want.y)
    np.testing.assert_array_equal(total.reshape(-1, shape[-1]), want.sum)


def test_skip_norm_sum_refuses_any_other_form():
    """None (the caller's general path) for a broadcast skip, float16, a strided x, a
    gamma of the wrong length or no rows."""
    rng = np.random.default_rng(5)
    x, skip, g = _values(rng, (2, 64)), _values(rng, (2, 64)), _values(rng, 64)
    for args in ((x, skip[:1], g), (x.astype(np.float16), skip, g), (np.repeat(x, 2, axis=1)[:, ::2], skip, g),
                 (x, skip, g[:63]), (x[:0], skip[:0], g)):
        assert native.skip_norm_sum(*args, 1e-5, True) is None


@pytest.mark.parametrize("simplified", [True, False])
def test_a_skip_norm_node_without_statistics_is_bound_and_gives_the_ops_bits(simplified):
    """A Skip norm node whose mean and inv_std_var are absent binds to one C call: y and
    the residual sum equal to the general op's, the absent outputs None; a bias input
    or declared statistics take the general op."""
    from onnx_prep.core.ops import norm as ops_norm
    from onnx_prep.core.ops.attributes import ABSENT_OUTPUTS, N_OUTPUTS

    rng = np.random.default_rng(9)
    x, skip, g = _values(rng, (1, 3, 96)), _values(rng, (1, 3, 96)), _values(rng, 96)
    general = ops_norm.skip_simplified_layer_normalization if simplified else ops_norm.skip_layer_normalization
    attrs = {"epsilon": 1e-6, N_OUTPUTS: 4, ABSENT_OUTPUTS: (1, 2)}
    bound = general.bind(attrs)
    assert bound is not general and bound.unbound is general
    want = general([x, skip, g], attrs, None)
    got = bound([x, skip, g], attrs, None)
    assert got[1] is None and got[2] is None
    for i in (0, 3):
        np.testing.assert_array_equal(got[i], want[i])
    bias = _values(rng, 96)
    with_bias = [x, skip, g, bias] if simplified else [x, skip, g, None, bias]
    for a, b in zip(bound(with_bias, attrs, None), general(with_bias, attrs, None), strict=True):
        np.testing.assert_array_equal(a, b)  # the general op: every output, the statistics too
    assert general.bind({"epsilon": 1e-6, N_OUTPUTS: 4, ABSENT_OUTPUTS: ()}) is general
    assert general.bind({"epsilon": 1e-6, N_OUTPUTS: 2, ABSENT_OUTPUTS: ()}) is general
    one = general.bind({"epsilon": 1e-6, N_OUTPUTS: 1, ABSENT_OUTPUTS: ()})
    assert len(one([x, skip, g], attrs, None)) == 1


def test_an_rms_norm_node_without_inv_std_var_is_bound_and_gives_the_ops_bits():
    """SimplifiedLayerNormalization over the last axis without its inv_std_var binds to
    one C call: the general op's y bit for bit, in x's shape; float16, another axis or a
    declared inv_std_var take the general op."""
    from onnx_prep.core.ops import norm as ops_norm
    from onnx_prep.core.ops.attributes import ABSENT_OUTPUTS, N_OUTPUTS

    rng = np.random.default_rng(10)
    x, g = _values(rng, (2, 3, 80)), _values(rng, 80)
    general = ops_norm.simplified_layer_normalization
    for attrs in ({"epsilon": 1e-6, N_OUTPUTS: 1, ABSENT_OUTPUTS: ()},
                  {"epsilon": 1e-6, N_OUTPUTS: 2, ABSENT_OUTPUTS: (1,)}):
        bound = general.bind(attrs)
        assert bound is not general and bound.unbound is general
        got, want = bound([x, g], attrs, None), general([x, g], {**attrs, N_OUTPUTS: 1}, None)
        assert got[0].shape == x.shape and len(got) == attrs[N_OUTPUTS]
        np.testing.assert_array_equal(got[0], want[0])
        half = x.astype(np.float16)
        np.testing.assert_array_equal(bound([half, g], attrs, None)[0], general([half, g], attrs, None)[0])
    assert general.bind({"epsilon": 1e-6, N_OUTPUTS: 2, ABSENT_OUTPUTS: ()}) is general
    assert general.bind({"epsilon": 1e-6, "axis": 1, N_OUTPUTS: 1, ABSENT_OUTPUTS: ()}) is general
