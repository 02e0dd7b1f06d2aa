"""native.last_kernel(): the kernel code that computed the last call on this thread, as
the kernels themselves record it. Every ISA path gives the scalar reference's bytes, so
equal results cannot show that SIMD code ran; these tests hold each kernel family to
the code its ISA must run (a dispatch entry pointing at another table fails here)."""
from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from onnx_prep import native
from onnx_prep.core.errors import NativeError
from onnx_prep.native.isa import ISAS, KERNEL_CODES
from test_native_reference import ALL_ISAS, expected_kernel, isa_params, random_matmul_nbits


def _matmul_source(K=200, N=70, bs=32, level=0):
    rng = np.random.default_rng(K + N)
    B, s, z = random_matmul_nbits(rng, K=K, N=N, block_size=bs, zp="u4")
    packed = native.prepack_matmul_nbits(B, s, z, K=K, N=N, block_size=bs, accuracy_level=level)
    return rng.standard_normal((3, K)).astype(np.float32), packed


def _gemm_source():
    rng = np.random.default_rng(5)
    return rng.standard_normal((3, 40)).astype(np.float32), native.prepack_gemm_b(
        rng.standard_normal((40, 33)).astype(np.float32), trans_b=False)


def _gather_source():
    rng = np.random.default_rng(6)
    data = rng.integers(0, 256, (20, 2, 16), dtype=np.uint8)
    scales = rng.random((20, 2, 1)).astype(np.float32)
    return data, scales


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_matmul_nbits_reports_the_kernel_its_isa_runs(isa):
    A, packed = _matmul_source()
    for level in (0, 1, 2, 3, 4):  # every level runs an integer path (bfp or int8)
        native.matmul_nbits(A, packed, accuracy_level=level, isa=isa)
        assert native.last_kernel() == expected_kernel(isa, "int"), f"level {level}"
    native.matmul_nbits(A, packed, compute="fma", isa=isa)
    assert native.last_kernel() == expected_kernel(isa, "fp32")
    # one row (the decode GEMV drivers) and a column range inside one panel
    native.matmul_nbits(A[:1], packed, col_begin=16, col_end=40, isa=isa)
    assert native.last_kernel() == expected_kernel(isa, "int")


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_gemm_reports_the_kernel_its_isa_runs(isa):
    A, packed = _gemm_source()
    for rows in (A[:1], A):
        native.gemm(rows, packed, isa=isa)
        assert native.last_kernel() == expected_kernel(isa, "fp32")


@pytest.mark.parametrize("isa", isa_params(ISAS))
def test_the_forced_isa_is_the_kernel_that_runs(isa, monkeypatch):
    """ONNX_PREP_ISA (no isa= argument: the runtime's way, through matmul_nbits_parts)."""
    monkeypatch.setenv("ONNX_PREP_ISA", isa)
    A, packed = _matmul_source()
    y, calls = native.matmul_nbits_parts(A, packed, [(0, 64), (64, 70)])
    for call in calls:
        native.gemm(*_gemm_source(), isa="scalar")  # something else ran last
        call()
        assert native.last_kernel() == expected_kernel(isa, "int")
    A, packed = _gemm_source()
    native.gemm(A, packed)
    assert native.last_kernel() == expected_kernel(isa, "fp32")


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_portable_kernels_report_scalar_after_a_simd_call(isa, monkeypatch):
    """Gather, prepack and erf have one portable implementation for every ISA; each
    call records it, so the query never repeats the matmul before it."""
    if isa in ISAS:
        monkeypatch.setenv("ONNX_PREP_ISA", isa)
    A, mm_packed = _matmul_source()
    data, scales = _gather_source()
    gather_packed = native.prepack_gather_block_quantized(data, scales, None, block_size=32)
    rng = np.random.default_rng(7)
    calls = {
        "gather": lambda: native.gather_block_quantized(np.array([0, 19, -1]), gather_packed),
        "gather from the matmul layout": lambda: native.gather_block_quantized(np.array([0, -1]), mm_packed),
        "prepack matmul": lambda: _matmul_source(),
        "prepack gather": lambda: native.prepack_gather_block_quantized(data, scales, None, block_size=32),
        "prepack gemm": lambda: native.prepack_gemm_b(np.ones((4, 5), np.float32), trans_b=True),
        "erf": lambda: native.erf(rng.standard_normal(9)),
    }
    for what, run in calls.items():
        native.matmul_nbits(A, mm_packed, isa=isa)
        assert native.last_kernel() == expected_kernel(isa, "int")
        run()
        assert native.last_kernel() == "scalar", what


def test_a_call_that_computes_nothing_reports_none():
    A, packed = _matmul_source()
    native.matmul_nbits(A, packed)
    assert native.last_kernel() in KERNEL_CODES
    native.matmul_nbits(A, packed, col_begin=5, col_end=5)  # empty range
    assert native.last_kernel() is None
    native.matmul_nbits(A, packed)
    bad = packed.copy()
    bad[56] ^= 1  # total_size: Python's quick check passes, the kernel's header check fails
    with pytest.raises(NativeError):
        native.matmul_nbits(A, bad)
    assert native.last_kernel() is None
    gather_packed = native.prepack_gather_block_quantized(*_gather_source(), None, block_size=32)
    assert native.last_kernel() == "scalar"
    with pytest.raises(IndexError, match="outside"):
        native.gather_block_quantized(np.array([99]), gather_packed)
    assert native.last_kernel() is None


def test_the_record_is_per_thread():
    simd = [i for i in native.kernel_variants() if i != "scalar"]
    if not simd:
        pytest.skip("no SIMD ISA on this CPU/build: " + str(native.unavailable_reason("avx2")))
    A, packed = _gemm_source()
    native.gemm(A, packed, isa=simd[0])
    seen = []

    def other():
        seen.append(native.last_kernel())  # nothing ran on this thread yet
        native.gemm(A, packed, isa="scalar")
        seen.append(native.last_kernel())

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == [None, "scalar"]
    assert native.last_kernel() == expected_kernel(simd[0], "fp32")


def test_erf_result_is_libm_and_reports_scalar():
    x = np.array([-1.5, 0.0, 0.3, 4.0])
    assert native.erf(x).tolist() == [math.erf(v) for v in x]
    assert native.last_kernel() == "scalar"
