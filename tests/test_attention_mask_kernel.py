"""The attention kernel's additive mask (native/attention.py ``attention_with_past(...,
mask=, nan_to_zero=)``): what the Hugging Face exports' attention computes, softmax(scale
q.k + mask) over every key, the mask broadcast over batch rows, heads and query rows.

Against the numpy formula (hypothesis over shapes, masks of 0 / -inf / float32-lowest /
random values and fully masked rows), each ISA against the scalar twin, the mask's
broadcasts and strides, the GIL released. Tolerances: test_native_gqa's (the same
kernel: fp32 dot products summed in another order than numpy's matmul).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gil_release import run_checking_gil_release
from test_attention_fusion import ISAS, kernel_inputs
from test_native_gqa import ISA_ATOL, ISA_RTOL, OUT_ATOL, OUT_RTOL

from onnx_prep import native

LOWEST = np.finfo(np.float32).min


def formula(q, k, v, pk, pv, scale, mask, nan_to_zero):
    """The ops in numpy: kv heads repeated, Softmax's max-subtracted formula (NaN for a row
    with every key at -inf), then Where(IsNaN(p), 0, p) when ``nan_to_zero``."""
    G = q.shape[1] // k.shape[1]
    keys, values = (np.repeat(np.concatenate([p, x], axis=2), G, axis=1) for p, x in ((pk, k), (pv, v)))
    scores = np.matmul(q, keys.transpose(0, 1, 3, 2)) * np.float32(scale) + mask
    with np.errstate(invalid="ignore"):
        e = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = e / e.sum(axis=-1, keepdims=True)
    if nan_to_zero:
        probs = np.where(np.isnan(probs), np.float32(0), probs)
    return np.matmul(probs, values).transpose(0, 2, 1, 3)


def random_mask(rng, shape, kind):
    if kind == "values":
        return rng.standard_normal(shape).astype(np.float32) * 4
    fill = {"-inf": -np.inf, "lowest": LOWEST}[kind]
    mask = np.where(rng.random(shape) < 0.4, np.float32(fill), np.float32(0)).astype(np.float32)
    if shape[2] > 1:
        mask[..., 0, :] = fill  # a fully masked query row (a left-padded prompt's)
    return mask


@st.composite
def cases(draw):
    kv = draw(st.sampled_from([1, 2, 4]))
    case = dict(B=draw(st.integers(1, 3)), KN=kv, N=kv * draw(st.sampled_from([1, 2, 4])),
                H=draw(st.sampled_from([8, 16, 24, 40, 64])), P=draw(st.integers(0, 12)),
                S=draw(st.integers(1, 5)), seed=draw(st.integers(0, 2 ** 16)))
    # which dims the mask broadcasts over: batch, heads, query rows (keys always given)
    bcast = draw(st.tuples(st.booleans(), st.booleans(), st.booleans()))
    return case, bcast, draw(st.sampled_from(["-inf", "lowest", "values"])), draw(st.booleans())


@settings(deadline=None, max_examples=80)
@given(cases())
def test_the_masked_kernel_matches_the_formula(args):
    case, bcast, kind, nan_to_zero = args
    inputs = kernel_inputs(**case)
    B, N, S, T = case["B"], case["N"], case["S"], case["P"] + case["S"]
    shape = tuple(1 if b else n for b, n in zip(bcast, (B, N, S))) + (T,)
    mask = random_mask(np.random.default_rng(case["seed"]), shape, kind)
    scale = 1 / np.sqrt(case["H"])
    out, pk, pv = native.attention_with_past(*inputs, scale=scale, mask=mask, nan_to_zero=nan_to_zero)
    want = formula(*inputs, scale, mask, nan_to_zero)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))  # -inf rows: NaN, or 0 with nan_to_zero
    np.testing.assert_allclose(np.nan_to_num(out), np.nan_to_num(want), rtol=OUT_RTOL, atol=OUT_ATOL)
    np.testing.assert_array_equal(pk, np.concatenate([inputs[3], inputs[1]], axis=2))
    np.testing.assert_array_equal(pv, np.concatenate([inputs[4], inputs[2]], axis=2))


def test_a_fully_masked_row_follows_the_fill():
    """float32's lowest fill: every score of the row rounds to the same value, the weights
    are uniform (the mean of the values); -inf: NaN, or 0 with nan_to_zero."""
    q, k, v, pk, pv = kernel_inputs(B=1, KN=1, N=2, H=16, P=3, S=2, seed=5)
    mask = np.zeros((1, 1, 2, 5), np.float32)
    for fill in (LOWEST, -np.inf):
        mask[0, 0, 0] = fill
        out = native.attention_with_past(q, k, v, pk, pv, scale=0.25, mask=mask)[0]
        if fill == LOWEST:
            np.testing.assert_allclose(out[0, 0], np.broadcast_to(np.concatenate([pv, v], 2)[0, 0].mean(0), (2, 16)),
                                       rtol=1e-5, atol=1e-6)
        else:
            assert np.isnan(out[0, 0]).all()
            zero = native.attention_with_past(q, k, v, pk, pv, scale=0.25, mask=mask, nan_to_zero=True)[0]
            assert (zero[0, 0] == 0).all()
            np.testing.assert_array_equal(zero[0, 1], out[0, 1])
        assert np.isfinite(out[0, 1]).all()


def test_a_causal_mask_gives_the_unmasked_kernel_s_result():
    """The causal span and an explicit causal mask of zeros and -inf weigh the same keys."""
    q, k, v, pk, pv = kernel_inputs(B=2, KN=2, N=4, H=32, P=4, S=3, seed=9)
    causal = np.where(np.arange(7)[None, :] <= 4 + np.arange(3)[:, None], 0, -np.inf).astype(np.float32)
    plain = native.attention_with_past(q, k, v, pk, pv, scale=0.2)
    masked = native.attention_with_past(q, k, v, pk, pv, scale=0.2, mask=causal)
    np.testing.assert_allclose(masked[0], plain[0], rtol=1e-6, atol=1e-6)


def test_a_strided_or_key_broadcast_mask_is_read_right():
    q, k, v, pk, pv = kernel_inputs(B=2, KN=1, N=2, H=8, P=2, S=2, seed=4)
    rng = np.random.default_rng(0)
    wide = rng.standard_normal((2, 1, 2, 8)).astype(np.float32)
    strided = wide[..., ::2]  # keys 8 bytes apart: copied to contiguous keys
    column = rng.standard_normal((2, 1, 2, 1)).astype(np.float32)  # one value for every key
    for mask in (strided, column):
        got = native.attention_with_past(q, k, v, pk, pv, scale=0.3, mask=mask)[0]
        np.testing.assert_allclose(got, formula(q, k, v, pk, pv, 0.3, mask, False), rtol=OUT_RTOL, atol=OUT_ATOL)
    with pytest.raises(ValueError, match="does not broadcast to"):
        native.attention_with_past(q, k, v, pk, pv, scale=0.3, mask=np.zeros((2, 1, 2, 3), np.float32))
    with pytest.raises(ValueError, match="must be float32"):
        native.attention_with_past(q, k, v, pk, pv, scale=0.3, mask=np.zeros((2, 1, 2, 4), np.float64))


@pytest.mark.parametrize("isa", ISAS)
def test_masked_isa_paths_match_the_scalar_twin(isa):
    rng = np.random.default_rng(2)
    for case in (dict(B=2, KN=2, N=4, H=24, P=6, S=1), dict(B=2, KN=1, N=4, H=64, P=9, S=3),
                 dict(B=1, KN=4, N=4, H=136, P=0, S=4)):
        inputs = kernel_inputs(**case, seed=7)
        mask = random_mask(rng, (case["B"], 1, case["S"], case["P"] + case["S"]), "-inf")
        scalar = native.attention_with_past(*inputs, scale=0.25, mask=mask, nan_to_zero=True, isa="scalar")
        assert native.last_kernel() == "scalar"
        got = native.attention_with_past(*inputs, scale=0.25, mask=mask, nan_to_zero=True, isa=isa)
        assert native.last_kernel() == isa
        np.testing.assert_allclose(got[0], scalar[0], rtol=ISA_RTOL, atol=ISA_ATOL)


def test_the_masked_kernel_releases_the_gil():
    inputs = kernel_inputs(B=2, KN=4, N=8, H=64, P=2048, S=4, seed=1)
    mask = np.zeros((2, 1, 4, 2052), np.float32)
    out, _, _ = run_checking_gil_release(lambda: native.attention_with_past(*inputs, scale=0.125, mask=mask))
    assert out.shape == (2, 4, 8, 64)


@settings(deadline=None, max_examples=40)
@given(cases())
def test_attention_over_complete_caches_matches_the_formula(args):
    """attention_over_cache: the caches a Concat already extended, read in place (a view
    with room after its rows too), never written."""
    case, bcast, kind, nan_to_zero = args
    q, k, v, pk, pv = kernel_inputs(**case)
    B, N, S, T = case["B"], case["N"], case["S"], case["P"] + case["S"]
    room = [np.zeros((B, case["KN"], T + 3, case["H"]), np.float32) for _ in range(2)]
    caches = []
    for buf, past, new in zip(room, (pk, pv), (k, v)):
        buf[:, :, :T] = np.concatenate([past, new], axis=2)
        caches.append(buf[:, :, :T])
    before = [c.copy() for c in caches]
    shape = tuple(1 if b else n for b, n in zip(bcast, (B, N, S))) + (T,)
    mask = random_mask(np.random.default_rng(case["seed"]), shape, kind)
    out = native.attention_over_cache(q, *caches, scale=0.3, mask=mask, nan_to_zero=nan_to_zero)
    want = formula(q, k, v, pk, pv, 0.3, mask, nan_to_zero).transpose(0, 2, 1, 3)
    assert out.shape == (B, N, S, case["H"])
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    np.testing.assert_allclose(np.nan_to_num(out), np.nan_to_num(want), rtol=OUT_RTOL, atol=OUT_ATOL)
    for c, b in zip(caches, before):
        np.testing.assert_array_equal(c, b)
