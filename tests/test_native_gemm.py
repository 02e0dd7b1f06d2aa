"""Packed fp32 Gemm/MatMul: both transB values, bias broadcasting, alpha/beta, column
ranges, every ISA path vs the scalar reference."""
from __future__ import annotations

import numpy as np
import pytest

from onnx_prep import native

from test_native_reference import FP32_UNIT_ROUNDOFF, SIMD_ISAS, expected_kernel

TRANS_B = [False, True]
SHAPES = [(1, 1, 1), (1, 300, 17), (5, 64, 48), (33, 129, 70)]
BIAS_SHAPES = [None, "N", "1N", "MN", "M1", "scalar"]


def _ref(A, B, bias, alpha, beta):
    y = alpha * (A.astype(np.float64) @ B.astype(np.float64))
    mag = abs(alpha) * (np.abs(A.astype(np.float64)) @ np.abs(B.astype(np.float64)))
    if bias is not None:
        y = y + beta * np.broadcast_to(bias, y.shape)
        mag = mag + abs(beta) * np.abs(np.broadcast_to(bias, y.shape))
    return y, mag


def _case(trans_b, M, K, N, bias_shape):
    rng = np.random.default_rng(M * 1000 + K + N)
    A = rng.standard_normal((M, K)).astype(np.float32)
    B = rng.standard_normal((K, N)).astype(np.float32)
    bias = {None: None, "N": rng.standard_normal(N), "1N": rng.standard_normal((1, N)),
            "MN": rng.standard_normal((M, N)), "M1": rng.standard_normal((M, 1)),
            "scalar": np.float32(0.75)}[bias_shape]
    bias = None if bias is None else np.asarray(bias, np.float32)
    packed = native.prepack_gemm_b(np.ascontiguousarray(B.T) if trans_b else B, trans_b=trans_b)
    return A, B, bias, packed


@pytest.mark.parametrize("trans_b", TRANS_B)
@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("bias_shape", BIAS_SHAPES)
def test_gemm_matches_numpy(trans_b, M, K, N, bias_shape):
    A, B, bias, packed = _case(trans_b, M, K, N, bias_shape)
    assert native.packed_header(packed).trans_b == trans_b
    want, mag = _ref(A, B, bias, 0.5, 2.0)
    got = native.gemm(A, packed, bias=bias, alpha=0.5, beta=2.0, isa="scalar")
    # one rounding per term of the k chain, then alpha, beta * bias
    err = np.abs(got - want) / ((K + 4) * FP32_UNIT_ROUNDOFF * mag + 1e-30)
    assert err.max() <= 1.0


@pytest.mark.parametrize("isa", SIMD_ISAS)
def test_gemm_isa_paths_equal_scalar_bit_for_bit(isa):
    for trans_b in TRANS_B:
        for M, K, N in SHAPES:
            for bias_shape in BIAS_SHAPES:
                A, _, bias, packed = _case(trans_b, M, K, N, bias_shape)
                ref = native.gemm(A, packed, bias=bias, alpha=0.5, beta=2.0, isa="scalar")
                got = native.gemm(A, packed, bias=bias, alpha=0.5, beta=2.0, isa=isa)
                what = f"{isa} trans_b={trans_b} {(M, K, N)} bias {bias_shape}"
                assert native.last_kernel() == expected_kernel(isa, "fp32"), what
                np.testing.assert_array_equal(got, ref, err_msg=what)


def test_gemm_packing_is_deterministic_and_trans_b_packs_the_same_matrix_alike_but_flagged():
    rng = np.random.default_rng(0)
    B = rng.standard_normal((40, 21)).astype(np.float32)
    p0 = native.prepack_gemm_b(B, trans_b=False)
    assert p0.tobytes() == native.prepack_gemm_b(B.copy(), trans_b=False).tobytes()
    p1 = native.prepack_gemm_b(np.ascontiguousarray(B.T), trans_b=True)
    # Same logical B: identical tiles, different header flag (the layout key differs).
    assert p0[64:].tobytes() == p1[64:].tobytes() and p0[:64].tobytes() != p1[:64].tobytes()


def test_gemm_column_ranges_and_leading_dims():
    rng = np.random.default_rng(1)
    A = rng.standard_normal((2, 3, 50)).astype(np.float32)
    B = rng.standard_normal((50, 40)).astype(np.float32)
    packed = native.prepack_gemm_b(B, trans_b=False)
    full = native.gemm(A, packed)
    assert full.shape == (2, 3, 40)
    out = np.zeros((2, 3, 40), np.float32)
    for cb, ce in [(0, 7), (7, 32), (32, 40)]:
        native.gemm(A, packed, out=out, col_begin=cb, col_end=ce)
    np.testing.assert_array_equal(out, full)


def test_gemm_bias_that_does_not_broadcast_is_rejected():
    packed = native.prepack_gemm_b(np.ones((4, 6), np.float32), trans_b=False)
    with pytest.raises(ValueError, match="broadcast"):
        native.gemm(np.ones((3, 4), np.float32), packed, bias=np.ones(5, np.float32))
