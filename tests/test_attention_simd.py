"""The attention kernel's SIMD row primitives (native/attention_simd.c: a block of keys'
scores at once, a vector exp, the weighted sum in registers) against the scalar twin
(native/attention.c: plain loops and libm's expf) on every ISA the CPU has: decode steps
over long pasts (1 to 1030 keys, key blocks with and without a partial last block), head
sizes 64 / 128 / 80 (rotary) and 24; masks with -inf entries and fully masked rows, head
sizes with tails under the 8- and 16-wide vectors (20, 13) (NaN, or 0 with nan_to_zero); and the exp itself over its whole range,
read off one-hot values (subnormal results, underflow to exactly 0, -inf).

Tolerances: the outputs, test_native_gqa's ISA_ATOL / ISA_RTOL (the same products summed
in another order, a vector exp within ~1 ulp of expf). The softmax weights read directly:
EXP_RTOL and SUBNORMAL_ATOL below.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import ort_or_skip
from test_native_gqa import ISA_ATOL, ISA_RTOL, assert_matches, attrs_of, gqa_inputs, ort_gqa, ours

from onnx_prep import native

# A weight p_i = exp(x_i - max) / sum on an ISA against the scalar twin's: the vector exp
# within ~1 ulp of expf, the sum in another order (a few ulp): 1e-6 is ~8 ulp.
EXP_RTOL = 1e-6
# Weights in float32's subnormal range (exp below 2^-126) carry an absolute quantum of
# 2^-149; each side rounds there once or twice: 8 quanta.
SUBNORMAL_ATOL = 8 * 2.0 ** -149

ISAS = [pytest.param(i, marks=pytest.mark.skip(reason=f"{i}: {native.unavailable_reason(i)}"))
        if native.unavailable_reason(i) else i for i in ("avx2", "avx512")]
KEYS = (1, 7, 40, 257, 1030)


def both(fn, isa):
    """fn(isa="scalar") and fn(isa=isa), each checked to have run on that ISA."""
    out = []
    for name in ("scalar", isa):
        out.append(fn(name))
        assert native.last_kernel() == name
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("H", [64, 128, 80, 24])
def test_decode_steps_over_long_pasts_match_the_scalar_twin(isa, H):
    rng = np.random.default_rng(H)
    for keys in KEYS:
        past = keys - 1
        inputs = gqa_inputs(rng, B=2, S=1, N=8, KN=2, H=H, lens=[keys, max(1, keys - 3)], total=keys,
                            past_len=past, rotary=H % 16 == 0, empty_past=past == 0)
        scalar, got = both(lambda i: native.group_query_attention(*inputs, num_heads=8, kv_num_heads=2, isa=i), isa)
        assert np.isfinite(got[0]).all()
        np.testing.assert_allclose(got[0], scalar[0], rtol=ISA_RTOL, atol=ISA_ATOL, err_msg=f"{keys} keys")
        np.testing.assert_array_equal(got[1], scalar[1])
        np.testing.assert_array_equal(got[2], scalar[2])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("nan_to_zero", [False, True])
def test_masks_with_minus_inf_and_fully_masked_rows_match_the_scalar_twin(isa, nan_to_zero):
    rng = np.random.default_rng(11)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    for keys, H in zip(KEYS, (64, 128, 80, 20, 13)):
        S = min(keys, 3)
        P = keys - S
        q, k, v, pk, pv = f(1, 4, S, H), f(1, 2, S, H), f(1, 2, S, H), f(1, 2, P, H), f(1, 2, P, H)
        mask = np.where(rng.random((1, 4, S, keys)) < 0.5, -np.inf, 0).astype(np.float32)
        mask[0, :, :, 0] = 0  # every row keeps a key ...
        mask[0, 1, 0] = -np.inf  # ... but this one, fully masked: NaN, or 0 with nan_to_zero
        mask[0, 2, -1] = -np.inf
        mask[0, 2, -1, -1] = 0  # one key left: its value, exactly
        scalar, got = both(lambda i: native.attention_with_past(q, k, v, pk, pv, scale=H ** -0.5, mask=mask,
                                                                nan_to_zero=nan_to_zero, isa=i)[0], isa)
        masked_row = got[0, 0, 1]  # output [B, S, N, H]: row 0 of head 1
        if nan_to_zero:
            assert (masked_row == 0).all()
        else:
            assert np.isnan(masked_row).all()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(scalar))
        assert np.isnan(got).sum() == (0 if nan_to_zero else H)
        np.testing.assert_array_equal(got[0, -1, 2], np.concatenate([pv, v], 2)[0, 1, -1])
        np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(scalar), rtol=ISA_RTOL, atol=ISA_ATOL,
                                   err_msg=f"{keys} keys")


def softmax_weights(args: np.ndarray, isa: str) -> np.ndarray:
    """The softmax weights of the score rows `args` [rows, T] (T <= 128) as the kernel
    computes them: q = 0 makes each score its mask value exactly, and one-hot values
    (key i's value is e_i) make output i the weight of key i."""
    rows, T = args.shape
    H = 128
    eye = np.zeros((1, 1, T, H), np.float32)
    eye[0, 0, np.arange(T), np.arange(T)] = 1
    q = np.zeros((1, rows, 1, H), np.float32)
    k = np.random.default_rng(0).standard_normal((1, 1, T, H)).astype(np.float32)
    out = native.attention_with_past(q, k[:, :, -1:], eye[:, :, -1:], k[:, :, :-1], eye[:, :, :-1], scale=0.5,
                                     mask=args.reshape(1, rows, 1, T), isa=isa)[0]
    assert native.last_kernel() == isa
    return out[0, 0, :, :T]


@pytest.mark.parametrize("isa", ISAS)
def test_the_vector_exp_gives_expf_s_weights_over_its_whole_range(isa):
    rng = np.random.default_rng(5)
    T = 128
    # Arguments x - max over [-106, 0]: the normal range, expf's subnormal range
    # (below ~-87.3), its last subnormals and its underflow to 0 (below ~-103.97); one
    # key per row at 0 (the max).
    args = -rng.uniform(0, 106, (64, T)).astype(np.float32)
    args[np.arange(64), rng.integers(0, T, 64)] = 0
    scalar, got = softmax_weights(args, "scalar"), softmax_weights(args, isa)
    np.testing.assert_allclose(got, scalar, rtol=EXP_RTOL, atol=SUBNORMAL_ATOL)
    normal = scalar >= np.finfo(np.float32).tiny
    np.testing.assert_allclose(got[normal], scalar[normal], rtol=EXP_RTOL, atol=0)
    assert (scalar[~normal] > 0).any() and (scalar[~normal] == 0).any()  # the range was covered

    # Far below: -inf (a masked key), float32's lowest, -200, -105: exactly 0, as expf
    # underflows; the other keys' weights unchanged.
    far = np.zeros((4, T), np.float32)
    far[:, 1:] = -40
    far[np.arange(4), [3, 5, 7, 9]] = [-np.inf, np.finfo(np.float32).min, -200, -105]
    scalar, got = softmax_weights(far, "scalar"), softmax_weights(far, isa)
    assert (scalar[np.arange(4), [3, 5, 7, 9]] == 0).all()
    assert (got[np.arange(4), [3, 5, 7, 9]] == 0).all()
    np.testing.assert_allclose(got, scalar, rtol=EXP_RTOL, atol=0)


@pytest.mark.parametrize("isa", ISAS)
def test_a_nan_score_or_a_row_all_at_minus_inf_is_a_nan_row_on_every_isa(isa):
    T = 40
    args = np.zeros((3, T), np.float32)
    args[0] = -np.inf  # every key masked
    args[1, 17] = np.nan  # a NaN score
    args[2, :] = np.finfo(np.float32).min  # float32's lowest fill: equal scores, uniform weights
    for name in ("scalar", isa):
        w = softmax_weights(args, name)
        assert np.isnan(w[:2]).all()
        np.testing.assert_allclose(w[2], np.full(T, 1 / T, np.float32), rtol=EXP_RTOL)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("G", [2, 3, 4, 5, 7, 8])
def test_a_row_group_gives_each_head_s_own_result_bit_for_bit(isa, G):
    """The query heads that read one kv head go through the table's row-group entries,
    OP_ATTN_ROWS (4) at a time (a smaller group repeats its last row); each head alone
    (one query head per kv head) takes the single-row entries: the same bits."""
    rng = np.random.default_rng(G)
    H = 80  # a 16-wide tail on AVX2's two-vector passes, a partial third vector on AVX-512
    for keys in (7, 257):
        inputs = gqa_inputs(rng, B=1, S=1, N=G, KN=1, H=H, lens=[keys], total=keys, past_len=keys - 1, rotary=True)
        q = inputs[0]
        grouped = native.group_query_attention(*inputs, num_heads=G, kv_num_heads=1, isa=isa)[0]
        assert native.last_kernel() == isa
        for h in range(G):
            alone = native.group_query_attention(q[..., h * H:(h + 1) * H], *inputs[1:], num_heads=1,
                                                 kv_num_heads=1, isa=isa)[0]
            np.testing.assert_array_equal(grouped[..., h * H:(h + 1) * H], alone, err_msg=f"head {h}, {keys} keys")

    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    S, P, H = 3, 38, 24
    q, k, v, pk, pv = f(1, G, S, H), f(1, 1, S, H), f(1, 1, S, H), f(1, 1, P, H), f(1, 1, P, H)
    mask = np.where(rng.random((1, G, S, P + S)) < 0.3, -np.inf, 0).astype(np.float32)
    mask[0, G - 1, 1] = -np.inf  # a fully masked row in the last group
    grouped = native.attention_with_past(q, k, v, pk, pv, scale=0.3, mask=mask, isa=isa)[0]
    assert np.isnan(grouped[0, 1, G - 1]).all() and np.isnan(grouped).sum() == H
    for h in range(G):
        alone = native.attention_with_past(q[:, h:h + 1], k, v, pk, pv, scale=0.3, mask=mask[:, h:h + 1], isa=isa)[0]
        np.testing.assert_array_equal(grouped[:, :, h:h + 1], alone, err_msg=f"masked head {h}")


@pytest.mark.parametrize("H, keys, rotary", [(64, 1030, True), (128, 257, True), (80, 1030, False)])
def test_long_pasts_match_onnx_runtime(H, keys, rotary):
    """The active ISA's kernel (the runtime's) over pasts longer than test_native_gqa's,
    at its tolerances (measured <= 4.2e-7 on AVX-512)."""
    ort_or_skip()
    inputs = gqa_inputs(np.random.default_rng(keys), B=1, S=1, N=8, KN=2, H=H, lens=[keys], total=keys,
                        past_len=keys - 1, rotary=rotary)
    attrs = attrs_of(8, 2, rotary, False)
    assert_matches(ours(inputs, attrs), ort_gqa(inputs, attrs))
    assert native.last_kernel() == native.active_isa()
