"""The native kernels against ONNX Runtime (the external oracle): one-node
MatMulNBits and GatherBlockQuantized models built in memory and run by ORT's CPU
provider, compared with the native result on the same sources."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from conftest import ort_or_skip
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx_prep import native
from test_native_reference import ALL_ISAS, dequantize_matmul_nbits, fold_weights, int8_rounded, random_matmul_nbits

ort = ort_or_skip()
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

# Tolerance: |ours - ORT| <= ORT_REL_TOL x the fold magnitude sum_k |a_k| (|q| + |z|) |s|
# per output (see test_native_reference.py), + FP16_ROUNDING x |ORT's Y| with fp16 scales.
# Measured worst cases (ORT 1.32, this suite) are in brackets; the negative controls
# in test_matmul_nbits_matches_onnxruntime show each bound fails a zero point off by one
# in one block, or scales 1% off (the smallest of them 2.8x over the bound).
# Every level, level 4 included: only the fp32 summation order differs (level 4's int8
# sums are exact on both sides) [1.1e-7 fp32; 6.8e-8 level 4].
ORT_REL_TOL = 1e-6
# fp16 scales: ORT rounds Y to fp16 once, |error| <= 2^-11 |Y| [0.97 of it].
FP16_ROUNDING = 2.0 ** -11
# Level 4 with float zero points: ORT falls back to fp32 compute (A as given) while we stay
# int8 (A rounded per block): the difference that rounding makes, (A8 - A) @ W, is
# computed exactly in float64 (int8_rounded) and taken off before the same ORT_REL_TOL
# applies [6.8e-8]. (Without it the bound must cover A's rounding itself, ~1e-2 of the
# magnitude, and a zero point off by one passed in 3 of 6 cases, scales 1% off in 6 of 6.)


def run_matmul_nbits(A, B, s, z, bias, *, K, N, bs, level):
    t = TensorProto.FLOAT16 if s.dtype == np.float16 else TensorProto.FLOAT
    f16 = t == TensorProto.FLOAT16
    inits = [numpy_helper.from_array(B, "B"), numpy_helper.from_array(s, "scales")]
    ins = ["A16" if f16 else "A", "B", "scales"]
    if z is not None:
        inits.append(numpy_helper.from_array(z, "zp"))
        ins.append("zp")
    if bias is not None:
        if z is None:
            ins.append("")
        ins += ["", "bias"]
        inits.append(numpy_helper.from_array(bias.astype(s.dtype), "bias"))
    nodes = []
    if f16:
        nodes.append(helper.make_node("Cast", ["A"], ["A16"], to=t))
    nodes.append(helper.make_node("MatMulNBits", ins, ["Y16" if f16 else "Y"], domain="com.microsoft",
                                  K=K, N=N, bits=4, block_size=bs, accuracy_level=level))
    if f16:
        nodes.append(helper.make_node("Cast", ["Y16"], ["Y"], to=TensorProto.FLOAT))
    graph = helper.make_graph(nodes, "mmnb", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", K])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", N])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"A": A})[0]


CASES = [  # (M, K, N, block_size): odd N, K not a multiple of the block, every block size
    (1, 256, 33, 16), (3, 100, 17, 32), (1, 200, 49, 64), (5, 300, 31, 128),
    (2, 4096 + 40, 7, 128), (9, 64, 65, 16),
]


def _one_zero_point_off(z, zp: str, A, *, K: int, N: int, bs: int):
    """The zero points with ONE wrong by one: output 0's, in the block where it changes
    the output least (the smallest |sum of a| over the block, across rows)."""
    kb = -(-K // bs)
    sums = np.abs(np.add.reduceat(A.astype(np.float64), np.arange(0, K, bs), axis=1)).max(axis=0)
    b = int(np.argmin(sums))
    if zp == "float":
        bad = z.copy()
        bad[b] = bad[b] + 1  # [N * kb], output 0's blocks first
        return bad
    bad = np.full((N, (kb + 1) // 2), 0x88, np.uint8) if z is None else z.copy()  # none: 8 explicit
    shift = 4 * (b % 2)
    code = (int(bad[0, b // 2]) >> shift) & 0xF
    code = code + 1 if code < 15 else code - 1
    bad[0, b // 2] = (int(bad[0, b // 2]) & (0xFF ^ (0xF << shift))) | (code << shift)
    return bad


@functools.lru_cache(maxsize=None)
def _matmul_case(M, K, N, bs, zp, f16, level):
    """One case's native inputs, ORT's output on the right sources and on the negative
    controls' wrong ones, and the check, made once for all the ISA paths compared."""
    scale_dtype = np.float16 if f16 else np.float32
    rng = np.random.default_rng(M * 7919 + K * 31 + N + bs)
    B, s, z = random_matmul_nbits(rng, K=K, N=N, block_size=bs, zp=zp, scale_dtype=scale_dtype)
    A = rng.standard_normal((M, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32) if N % 2 else None
    ort_level = 1 if level == "fma" else level
    want = run_matmul_nbits(A, B, s, z, bias, K=K, N=N, bs=bs, level=ort_level)
    A_used = A.astype(np.float16).astype(np.float32) if f16 else A  # what ORT multiplies
    bias_used = None if bias is None else bias.astype(scale_dtype).astype(np.float32)
    packed = native.prepack_matmul_nbits(B, s, z, K=K, N=N, block_size=bs, accuracy_level=ort_level)
    mag = np.abs(A_used.astype(np.float64)) @ fold_weights(B, s, z, K=K, N=N, block_size=bs)
    mag = mag + (0 if bias is None else np.abs(bias_used))
    offset = 0.0  # what ours computes differently from ORT, by design
    if level == 4 and zp == "float":
        W = dequantize_matmul_nbits(B, s, z, K=K, N=N, block_size=bs)
        offset = (int8_rounded(A_used, bs).astype(np.float64) - A_used) @ W

    def worst(got, ref):
        bound = ORT_REL_TOL * mag + (FP16_ROUNDING * np.abs(ref) if f16 else 0.0) + 1e-30
        return float(np.max(np.abs(got - ref - offset) / bound))

    # Negative controls: ORT on sources with one zero point off by one, or every scale 1%
    # off, must fail the same check against our (right) result.
    wrong = {what: run_matmul_nbits(A, B, ss, zs, bias, K=K, N=N, bs=bs, level=ort_level)
             for what, zs, ss in (("one zero point off by one", _one_zero_point_off(z, zp, A_used, K=K, N=N, bs=bs), s),
                                  ("scales 1% off", z, (s.astype(np.float64) * 1.01).astype(scale_dtype)))}
    return A_used, packed, bias_used, want, wrong, worst


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("M,K,N,bs", CASES)
@pytest.mark.parametrize("zp", ["none", "u4", "float"])
@pytest.mark.parametrize("scale_dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("level", [0, 1, 4, "fma"])  # "fma": our IEEE fp32 FMA chains vs ORT's level 1
def test_matmul_nbits_matches_onnxruntime(M, K, N, bs, zp, scale_dtype, level, isa):
    A_used, packed, bias_used, want, wrong, worst = _matmul_case(M, K, N, bs, zp, scale_dtype == np.float16, level)
    got = native.matmul_nbits(A_used, packed, bias=bias_used, isa=isa, compute="fma" if level == "fma" else None)
    assert worst(got, want) <= 1, f"{isa}: error {worst(got, want):.3g}x the tolerance"
    for what, ref in wrong.items():
        assert worst(got, ref) > 1, f"{what}: within the tolerance ({worst(got, ref):.3g}x)"


def run_gather_block_quantized(data, scales, zp, indices, bs):
    inits = [numpy_helper.from_array(data, "data"), numpy_helper.from_array(scales, "scales")]
    ins = ["data", "idx", "scales"]
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "zp"))
        ins.append("zp")
    st = TensorProto.FLOAT16 if scales.dtype == np.float16 else TensorProto.FLOAT
    node = helper.make_node("GatherBlockQuantized", ins, ["Y"], domain="com.microsoft", gather_axis=0,
                            quantize_axis=2, block_size=bs, bits=4)
    graph = helper.make_graph([node], "gbq", [helper.make_tensor_value_info("idx", TensorProto.INT64, None)],
                              [helper.make_tensor_value_info("Y", st, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"idx": indices})[0]


@pytest.mark.parametrize("bs", [16, 32, 64, 128])
@pytest.mark.parametrize("zp", [False, True])
@pytest.mark.parametrize("scale_dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_gather_block_quantized_matches_onnxruntime(bs, zp, scale_dtype):
    rng = np.random.default_rng(bs + zp)
    V, kb = 37, 3
    data = rng.integers(0, 256, (V, kb, bs // 2), dtype=np.uint8)
    scales = (rng.random((V, kb, 1)) * 0.1 + 0.01).astype(scale_dtype)
    z = rng.integers(0, 16, (V, kb, 1), dtype=np.uint8) if zp else None
    idx = np.array([[0, 36, 5], [5, 17, 1]], dtype=np.int64)
    want = run_gather_block_quantized(data, scales, z, idx, bs).astype(np.float32).reshape(2, 3, kb * bs)
    packed = native.prepack_gather_block_quantized(data, scales, z, block_size=bs)
    got = native.gather_block_quantized(idx, packed)
    if scale_dtype == np.float32:
        np.testing.assert_array_equal(got, want)  # (code - zero) * scale: one rounding, same order
    else:  # ORT rounds each value to fp16
        np.testing.assert_array_equal(got.astype(np.float16).astype(np.float32), want)


@settings(max_examples=40, deadline=None)
@given(V=st.integers(1, 70), kb=st.integers(1, 5), bs=st.sampled_from([16, 32, 64, 128]), zp=st.booleans(),
       f16=st.booleans(), idx_shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), seed=st.integers(0, 2**16),
       tied=st.booleans())
def test_gather_block_quantized_matches_onnxruntime_on_random_shapes(V, kb, bs, zp, f16, idx_shape, seed, tied):
    """Random tables (rows, blocks a row, block size, zero points or not, fp32 or fp16
    scales) and index tensors of rank 1-3 with negative indices, from a gather buffer and
    from the matmul buffer a tied embedding reads: ONNX Runtime's values, bit for bit
    (fp32: one rounding of (code - zero) x scale on both sides; fp16: ORT rounds each
    value to fp16, so ours rounded once the same way)."""
    rng = np.random.default_rng(seed)
    scale_dtype = np.float16 if f16 else np.float32
    data = rng.integers(0, 256, (V, kb, bs // 2), dtype=np.uint8)
    scales = (rng.random((V, kb, 1)) * 0.1 + 0.01).astype(scale_dtype)
    z = rng.integers(0, 16, (V, kb, 1), dtype=np.uint8) if zp else None
    idx = rng.integers(-V, V, idx_shape, dtype=np.int64)
    want = run_gather_block_quantized(data, scales, z, idx, bs).astype(np.float32).reshape(*idx_shape, kb * bs)
    if tied:  # the LM head's matmul buffer: row v is output column v (zero points packed two a byte there)
        zq = None if z is None else _pack_u4_rows(z.reshape(V, kb))
        packed = native.prepack_matmul_nbits(data, scales.reshape(-1), zq, K=kb * bs, N=V, block_size=bs)
    else:
        packed = native.prepack_gather_block_quantized(data, scales, z, block_size=bs)
    got = native.gather_block_quantized(idx, packed)
    if f16:
        got = got.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def _pack_u4_rows(z: np.ndarray) -> np.ndarray:
    """Per row, uint4 zero points two to a byte (low nibble first), rows padded to a byte:
    MatMulNBits' zero-point layout."""
    rows, n = z.shape
    padded = np.zeros((rows, n + n % 2), np.uint8)
    padded[:, :n] = z
    return (padded[:, 0::2] | (padded[:, 1::2] << 4)).reshape(-1)


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_level_4_rounds_exact_halves_as_onnxruntime(isa):
    """Rows that are small integers times one factor (a dequantized int4 row through a
    unit-weight RMSNorm: the genai builder's tied embedding feeding the first matmul) put
    a * 127 / max|a| on exact halves, where a multiplier one bit off rounds to the other
    integer. Level 4 must use MLAS' multiplier, 127 / max|a|: same tolerance as above,
    and the other multiplier's result is outside it on these rows."""
    K, N, bs = 128, 48, 32
    rng = np.random.default_rng(11)
    B, s, z = random_matmul_nbits(rng, K=K, N=N, block_size=bs)
    factors = rng.uniform(0.5, 2.0, (16, 1)).astype(np.float32)
    A = (rng.integers(-8, 9, (16, K)).astype(np.float32) * factors).astype(np.float32)
    A[:, ::bs] = 8 * factors  # max|a| = 8 x factor in every block: 4 x factor lands on 63.5
    moved = int8_rounded(A, bs, reciprocal_scale=True) != int8_rounded(A, bs)
    assert moved.sum() >= 16, "the rows must hold halves the two multipliers round apart"
    want = run_matmul_nbits(A, B, s, z, None, K=K, N=N, bs=bs, level=4)
    packed = native.prepack_matmul_nbits(B, s, z, K=K, N=N, block_size=bs, accuracy_level=4)
    got = native.matmul_nbits(A, packed, isa=isa)
    bound = ORT_REL_TOL * (np.abs(A.astype(np.float64)) @ fold_weights(B, s, z, K=K, N=N, block_size=bs))
    assert np.max(np.abs(got - want) / bound) <= 1
    W = dequantize_matmul_nbits(B, s, z, K=K, N=N, block_size=bs)
    other = (int8_rounded(A, bs, reciprocal_scale=True).astype(np.float64) - int8_rounded(A, bs)) @ W
    assert np.max(np.abs(got + other - want) / bound) > 1
