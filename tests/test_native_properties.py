"""Property-based tests (hypothesis, profiles in conftest.py) over shapes of the INT4
matmul and the packed Gemm: every ISA path equals the scalar reference bit for bit,
the scalar reference matches numpy, and any column split composes to the full result."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from onnx_prep import native
from test_native_matmul_nbits import check_against_numpy
from test_native_reference import (
    ALL_ISAS,
    FP32_UNIT_ROUNDOFF,
    KERNEL_MODES,
    SIMD_ISAS,
    assert_close_rel,
    mm_mode,
    random_matmul_nbits,
)

shapes = st.tuples(
    st.integers(1, 20),                    # M (covers the 8-, 4- and 1..3-row chunks)
    st.integers(1, 700),                   # K
    st.integers(1, 70),                    # N
    st.sampled_from([16, 32, 64, 128]),    # block_size
)


@pytest.mark.parametrize("isa", SIMD_ISAS)
@given(shape=shapes, zp=st.sampled_from(["none", "u4", "float"]), level=st.sampled_from(KERNEL_MODES),
       seed=st.integers(0, 2**32 - 1), bias=st.booleans())
def test_matmul_nbits_properties(isa, shape, zp, level, seed, bias):
    M, K, N, bs = shape
    rng = np.random.default_rng(seed)
    B, s, z = random_matmul_nbits(rng, K=K, N=N, block_size=bs, zp=zp)
    A = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32) if bias else None
    packed_level = 1 if level == "fma" else level
    packed = native.prepack_matmul_nbits(B, s, z, K=K, N=N, block_size=bs, accuracy_level=packed_level)
    assert packed.tobytes() == native.prepack_matmul_nbits(B, s, z, K=K, N=N, block_size=bs,
                                                           accuracy_level=packed_level).tobytes()
    ref = mm_mode(A, packed, level, bias=b, isa="scalar")
    check_against_numpy(ref, A, B, s, z, b, K=K, N=N, bs=bs, level=level)
    np.testing.assert_array_equal(mm_mode(A, packed, level, bias=b, isa=isa), ref, err_msg=isa)


@pytest.mark.parametrize("isa", ALL_ISAS)
@given(shape=shapes, cuts=st.lists(st.integers(0, 70), max_size=4), seed=st.integers(0, 2**32 - 1))
def test_any_column_split_composes(isa, shape, cuts, seed):
    M, K, N, bs = shape
    rng = np.random.default_rng(seed)
    B, s, z = random_matmul_nbits(rng, K=K, N=N, block_size=bs, zp="u4")
    A = rng.standard_normal((M, K)).astype(np.float32)
    packed = native.prepack_matmul_nbits(B, s, z, K=K, N=N, block_size=bs)
    edges = sorted({0, N, *(c for c in cuts if c <= N)})
    out = np.full((M, N), np.nan, np.float32)
    for cb, ce in zip(edges, edges[1:]):
        native.matmul_nbits(A, packed, out=out, col_begin=cb, col_end=ce, isa=isa)
    np.testing.assert_array_equal(out, native.matmul_nbits(A, packed, isa="scalar"), err_msg=isa)


@pytest.mark.parametrize("isa", SIMD_ISAS)
@given(M=st.integers(1, 9), K=st.integers(1, 300), N=st.integers(1, 70), trans_b=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_gemm_properties(isa, M, K, N, trans_b, seed):
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((M, K)).astype(np.float32)
    B = rng.standard_normal((K, N)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    packed = native.prepack_gemm_b(np.ascontiguousarray(B.T) if trans_b else B, trans_b=trans_b)
    ref = native.gemm(A, packed, bias=bias, alpha=1.5, beta=0.5, isa="scalar")
    want = 1.5 * (A.astype(np.float64) @ B) + 0.5 * bias
    mag = 1.5 * (np.abs(A.astype(np.float64)) @ np.abs(B)) + 0.5 * np.abs(bias)
    assert_close_rel(ref, want, mag, (K + 4) * FP32_UNIT_ROUNDOFF, "gemm")
    np.testing.assert_array_equal(native.gemm(A, packed, bias=bias, alpha=1.5, beta=0.5, isa=isa), ref)
