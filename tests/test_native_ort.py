"""The native kernels against ONNX Runtime (the external oracle): one-node
MatMulNBits and GatherBlockQuantized models built in memory and run by ORT's CPU
provider, compared with the native result on the same sources."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import ort_or_skip
from onnx_prep import native
from test_native_reference import fold_weights, random_matmul_nbits

ort = ort_or_skip()
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

# Tolerances, as a fraction of the fold magnitude sum_k |a_k| (|q| + |z|) |s| per output
# (see test_native_reference.py).
# Measured worst cases (ORT 1.32, this suite) are in brackets.
ORT_FP32_REL_TOL = 1e-6   # fp32 A and scales; only the summation order differs [1.1e-7]
ORT_INT8_REL_TOL = 1e-6   # level 4: both sides quantize A per block to int8 alike [5.6e-8]
# Level 4 with float zero points: ORT falls back to fp32 compute while we stay int8;
# bound = A's int8 rounding, <= (max|a| / 254) per element, about 3/254 of the sum [1.5e-3].
ORT_INT8_FALLBACK_REL_TOL = 1.2e-2
ORT_FP16_REL_TOL = 1e-3   # fp16 scales: ORT rounds Y to fp16 (2^-11 relative) [1.7e-4]
ISAS = native.kernel_variants()


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


@pytest.mark.parametrize("M,K,N,bs", CASES)
@pytest.mark.parametrize("zp", ["none", "u4", "float"])
@pytest.mark.parametrize("scale_dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("level", [0, 1, 4, "fma"])  # "fma": our IEEE fp32 FMA chains vs ORT's level 1
def test_matmul_nbits_matches_onnxruntime(M, K, N, bs, zp, scale_dtype, level):
    rng = np.random.default_rng(M * 7919 + K * 31 + N + bs)
    B, s, z = random_matmul_nbits(rng, K=K, N=N, block_size=bs, zp=zp, scale_dtype=scale_dtype)
    A = rng.standard_normal((M, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32) if N % 2 else None
    ort_level = 1 if level == "fma" else level
    want = run_matmul_nbits(A, B, s, z, bias, K=K, N=N, bs=bs, level=ort_level)
    f16 = scale_dtype == np.float16
    A_used = A.astype(np.float16).astype(np.float32) if f16 else A  # what ORT multiplies
    bias_used = None if bias is None else bias.astype(scale_dtype).astype(np.float32)
    packed = native.prepack_matmul_nbits(B, s, z, K=K, N=N, block_size=bs, accuracy_level=ort_level)
    mag = np.abs(A_used.astype(np.float64)) @ fold_weights(B, s, z, K=K, N=N, block_size=bs)
    mag = mag + (0 if bias is None else np.abs(bias_used))
    if level == 4:
        tol = ORT_INT8_FALLBACK_REL_TOL if zp == "float" else ORT_INT8_REL_TOL
    else:
        tol = ORT_FP32_REL_TOL
    if f16:
        tol += ORT_FP16_REL_TOL
    for isa in ISAS:
        got = native.matmul_nbits(A_used, packed, bias=bias_used, isa=isa,
                                  compute="fma" if level == "fma" else None)
        worst = float(np.max(np.abs(got - want) / (mag + 1e-30)))
        assert worst <= tol, f"{isa}: error {worst:.3g} of magnitude > {tol}"


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
