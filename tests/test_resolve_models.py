"""Small hand-built ONNX models with REAL external data files, for the resolution and
external-data tests (imported by test_resolve*.py and test_external_data*.py), and the
tests proving each builder makes a model ONNX Runtime accepts and computes as intended.

Every builder writes ``<dir>/model.onnx`` + ``<dir>/model.onnx.data`` (4 KiB aligned
offsets) and returns the model path.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import ort_or_skip

MS = "com.microsoft"
ALIGN = 4096
DATA = "model.onnx.data"


@dataclass
class Tensor:
    """An initializer to write: ``raw`` bytes with an ONNX type and dims."""

    name: str
    onnx_type: int
    dims: tuple[int, ...]
    raw: bytes
    external: bool = True


def from_array(name: str, a: np.ndarray, *, external: bool = True) -> Tensor:
    t = numpy_helper.from_array(np.ascontiguousarray(a), name)
    return Tensor(name, t.data_type, tuple(a.shape), np.ascontiguousarray(a).tobytes(), external)


def int4_tensor(name: str, dims: tuple[int, ...], packed: np.ndarray, *, signed: bool) -> Tensor:
    return Tensor(name, TensorProto.INT4 if signed else TensorProto.UINT4, dims,
                  np.ascontiguousarray(packed, dtype=np.uint8).tobytes())


def write_model(out_dir: Path, nodes: list, tensors: list[Tensor], inputs: list, outputs: list, *,
                digest: str | None = "sha256", opsets: dict[str, int] | None = None,
                functions: list | None = None, data_name: str = DATA) -> Path:
    """Write the model and its external data. ``digest``: "sha256" (per-tensor
    metadata_props), "checksum" (SHA-1 of the whole file in external_data), "both" or None."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = bytearray()
    protos = []
    for t in tensors:
        proto = TensorProto(name=t.name, data_type=t.onnx_type, dims=list(t.dims))
        if t.external:
            data.extend(b"\0" * (-len(data) % ALIGN))
            offset = len(data)
            data.extend(t.raw)
            proto.data_location = TensorProto.EXTERNAL
            for k, v in (("location", data_name), ("offset", str(offset)), ("length", str(len(t.raw)))):
                proto.external_data.add(key=k, value=v)
            if digest in ("sha256", "both"):
                proto.metadata_props.add(key="onnx_prep.sha256", value="sha256:" + hashlib.sha256(t.raw).hexdigest())
        else:
            proto.raw_data = t.raw
        protos.append(proto)
    if digest in ("checksum", "both"):
        sha1 = hashlib.sha1(bytes(data)).hexdigest()
        for proto in protos:
            if proto.data_location == TensorProto.EXTERNAL:
                proto.external_data.add(key="checksum", value=sha1)
    (out_dir / data_name).write_bytes(bytes(data))
    opsets = opsets or {"": 21}
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=protos)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()],
                              ir_version=10, functions=functions or [])
    path = out_dir / "model.onnx"
    onnx.save(model, str(path))
    return path


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# ----------------------------------------------------------------- reference numerics

def unpack_u4(packed: np.ndarray) -> np.ndarray:
    """uint8 -> two uint4 codes per byte, low nibble first (last axis doubles)."""
    lo, hi = packed & 0x0F, packed >> 4
    return np.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequant_rows(b: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MatMulNBits / GatherBlockQuantized (uint8 data, implicit zero point 8) rows:
    b [N, kb, bs/2] uint8, scales [N, kb] -> [N, kb*bs] fp32."""
    codes = unpack_u4(b).astype(np.float32) - 8.0  # [N, kb, bs]
    return (codes * scales[:, :, None]).reshape(b.shape[0], -1)


# --------------------------------------------------------------------------- builders

def tied_int4_model(out_dir: Path, *, vocab: int = 64, hidden: int = 64, bs: int = 32,
                    digest: str | None = "sha256", with_dead_branch: bool = True) -> Path:
    """input_ids -> GatherBlockQuantized(W) -> Reshape -> MatMulNBits(W) -> logits: the tied
    embedding / LM head as real INT4 exports write it (one uint8 W read by both ops, each
    with its own scales). A dead branch
    (Mul of an external 'dead.weight', not reaching an output) and an inline Reshape shape."""
    r = rng(1)
    kb = hidden // bs
    w = r.integers(0, 256, size=(vocab, kb, bs // 2), dtype=np.uint8)
    gscales = r.uniform(0.01, 0.05, size=(vocab, kb, 1)).astype(np.float32)
    mscales = r.uniform(0.01, 0.05, size=(vocab * kb,)).astype(np.float32)
    tensors = [
        Tensor("W", TensorProto.UINT8, w.shape, w.tobytes()),
        from_array("embed.scales", gscales),
        from_array("head.scales", mscales),
        from_array("shape_bsh", np.array([0, 0, hidden], dtype=np.int64), external=False),
    ]
    nodes = [
        helper.make_node("GatherBlockQuantized", ["W", "input_ids", "embed.scales"], ["emb4"], name="embed",
                         domain=MS, bits=4, block_size=bs, gather_axis=0, quantize_axis=2),
        helper.make_node("Reshape", ["emb4", "shape_bsh"], ["hidden"], name="embed.reshape"),
        helper.make_node("MatMulNBits", ["hidden", "W", "head.scales"], ["logits"], name="lm_head",
                         domain=MS, K=hidden, N=vocab, bits=4, block_size=bs),
    ]
    if with_dead_branch:
        tensors.append(from_array("dead.weight", r.standard_normal((4, hidden)).astype(np.float32)))
        nodes.append(helper.make_node("MatMul", ["hidden", "dead.weight.T"], ["dead.out"], name="dead.matmul"))
        nodes.append(helper.make_node("Transpose", ["dead.weight"], ["dead.weight.T"], name="dead.transpose"))
        nodes[-2], nodes[-1] = nodes[-1], nodes[-2]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", vocab])]
    return write_model(out_dir, nodes, tensors, inputs, outputs, digest=digest,
                       opsets={"": 21, MS: 1})


def single_weight_model(out_dir: Path, *, digest: str | None = "sha256", n: int = 8) -> Path:
    """Y = X + W with one external fp32 weight: the base the bad-input tests corrupt."""
    w = np.arange(n, dtype=np.float32)
    nodes = [helper.make_node("Add", ["X", "W"], ["Y"], name="add")]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, [n])]
    outputs = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [n])]
    return write_model(out_dir, nodes, [from_array("W", w)], inputs, outputs, digest=digest)


def qdq_matmul_model(out_dir: Path, *, k: int = 64, n: int = 32, bs: int = 32, signed: bool = True,
                     zero_points: bool = False, scale_dtype=np.float32, shared: bool = False) -> Path:
    """Y = MatMul(A, DequantizeLinear(W int4|uint4 [K, N], s [K/bs, N], axis=0, block_size)),
    what ONNX Runtime's quantizer emits in QDQ mode. ``shared``: two MatMuls read the DQ."""
    r = rng(2)
    kb = -(-k // bs)
    packed = r.integers(0, 256, size=(k * n // 2,), dtype=np.uint8)
    s = r.uniform(0.01, 0.05, size=(kb, n)).astype(scale_dtype)
    tensors = [int4_tensor("W", (k, n), packed, signed=signed), from_array("W.scales", s)]
    dq_in = ["W", "W.scales"]
    if zero_points:
        zp = r.integers(0, 256, size=(kb * n // 2,), dtype=np.uint8)
        tensors.append(int4_tensor("W.zp", (kb, n), zp, signed=signed))
        dq_in.append("W.zp")
    elem = TensorProto.FLOAT if scale_dtype == np.float32 else TensorProto.FLOAT16
    nodes = [helper.make_node("DequantizeLinear", dq_in, ["W.deq"], name="W.dq", axis=0, block_size=bs),
             helper.make_node("MatMul", ["A", "W.deq"], ["Y"], name="mm")]
    outputs = [helper.make_tensor_value_info("Y", elem, [1, n])]
    if shared:
        nodes.append(helper.make_node("MatMul", ["A", "W.deq"], ["Y2"], name="mm2"))
        outputs.append(helper.make_tensor_value_info("Y2", elem, [1, n]))
    inputs = [helper.make_tensor_value_info("A", elem, [1, k])]
    return write_model(out_dir, nodes, tensors, inputs, outputs, opsets={"": 21})


def matmul_nbits_model(out_dir: Path, *, k: int = 64, n: int = 32, bs: int = 32,
                       zero_points: bool = False) -> Path:
    r = rng(3)
    kb = k // bs
    b = r.integers(0, 256, size=(n, kb, bs // 2), dtype=np.uint8)
    s = r.uniform(0.01, 0.05, size=(n * kb,)).astype(np.float32)
    tensors = [Tensor("B", TensorProto.UINT8, b.shape, b.tobytes()), from_array("B.scales", s)]
    ins = ["A", "B", "B.scales"]
    if zero_points:
        zp = r.integers(0, 256, size=(n * ((kb + 1) // 2),), dtype=np.uint8)
        tensors.append(Tensor("B.zp", TensorProto.UINT8, zp.shape, zp.tobytes()))
        ins.append("B.zp")
    nodes = [helper.make_node("MatMulNBits", ins, ["Y"], name="mm", domain=MS, K=k, N=n, bits=4, block_size=bs)]
    return write_model(out_dir, nodes, tensors,
                       [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, k])],
                       [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, n])], opsets={"": 21, MS: 1})


def gemm_model(out_dir: Path) -> Path:
    """Gemm(A, B1, transB=1), MatMul(A, B2) with constant fp32 B (gemm_packed), MatMul of two
    graph inputs (numpy), a second Gemm on B1 with the same transB (same prepared object),
    and an initializer overridable as a graph input (not constant: no prepack)."""
    r = rng(4)
    b1 = r.standard_normal((8, 16)).astype(np.float32)  # [N, K] for transB=1
    b2 = r.standard_normal((16, 8)).astype(np.float32)
    b3 = r.standard_normal((16, 8)).astype(np.float32)
    tensors = [from_array("B1", b1), from_array("B2", b2), from_array("B3", b3)]
    nodes = [
        helper.make_node("Gemm", ["A", "B1"], ["Y1"], name="gemm1", transB=1),
        helper.make_node("Gemm", ["A", "B1"], ["Y1b"], name="gemm1b", transB=1),
        helper.make_node("MatMul", ["A", "B2"], ["Y2"], name="mm2"),
        helper.make_node("MatMul", ["A", "C"], ["Y3"], name="mm_dynamic"),
        helper.make_node("MatMul", ["A", "B3"], ["Y4"], name="mm_overridable"),
    ]
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("A", f, [2, 16]), helper.make_tensor_value_info("C", f, [16, 8]),
              helper.make_tensor_value_info("B3", f, [16, 8])]
    outputs = [helper.make_tensor_value_info(n, f, None) for n in ("Y1", "Y1b", "Y2", "Y3", "Y4")]
    return write_model(out_dir, nodes, tensors, inputs, outputs)


def custom_op_model(out_dir: Path) -> Path:
    """Relu -> custom.ops::Frobnicate (no kernel anywhere) -> Gelu (reference kernel)."""
    w = np.ones(4, dtype=np.float32)
    nodes = [
        helper.make_node("Relu", ["X"], ["r"], name="relu"),
        helper.make_node("Frobnicate", ["r", "W"], ["f"], name="frob1", domain="custom.ops"),
        helper.make_node("Frobnicate", ["f", "W"], ["g"], name="frob2", domain="custom.ops"),
        helper.make_node("Gelu", ["g"], ["Y"], name="gelu"),
    ]
    return write_model(out_dir, nodes, [from_array("W", w)],
                       [helper.make_tensor_value_info("X", TensorProto.FLOAT, [4])],
                       [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [4])],
                       opsets={"": 21, "custom.ops": 1})


def edit_external(path: Path, tensor: str, **kv: str | None) -> Path:
    """Rewrite external_data keys of ``tensor`` in place (None deletes a key)."""
    model = onnx.load(str(path), load_external_data=False)
    t = next(t for t in model.graph.initializer if t.name == tensor)
    entries = {e.key: e.value for e in t.external_data}
    for k, v in kv.items():
        if v is None:
            entries.pop(k, None)
        else:
            entries[k] = v
    del t.external_data[:]
    for k, v in entries.items():
        t.external_data.add(key=k, value=v)
    onnx.save(model, str(path))
    return path


# ------------------------------------------------------------ the builders are valid

def test_tied_model_runs_in_onnxruntime_as_the_numpy_reference(tmp_path):
    ort = ort_or_skip()
    path = tied_int4_model(tmp_path, with_dead_branch=False)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = np.array([[3, 17, 63]], dtype=np.int64)
    (logits,) = sess.run(None, {"input_ids": ids})
    init = {t.name: t for t in onnx.load(str(path)).graph.initializer}
    w = numpy_helper.to_array(init["W"])
    emb = dequant_rows(w, numpy_helper.to_array(init["embed.scales"])[:, :, 0])
    head = dequant_rows(w, numpy_helper.to_array(init["head.scales"]).reshape(w.shape[0], -1))
    expected = emb[ids] @ head.T
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("signed,zero_points", [(True, False), (False, True)])
def test_qdq_model_runs_in_onnxruntime_as_numpy_dequant(tmp_path, signed, zero_points):
    """The QDQ builder makes what ONNX Runtime reads as int4 [K, N] with blocks along K."""
    ort = ort_or_skip()
    path = qdq_matmul_model(tmp_path / "qdq", signed=signed, zero_points=zero_points)
    init = {t.name: t for t in onnx.load(str(path)).graph.initializer}
    w = numpy_helper.to_array(init["W"]).astype(np.int32)  # [K, N] values
    s = numpy_helper.to_array(init["W.scales"])
    zp = numpy_helper.to_array(init["W.zp"]).astype(np.int32) if zero_points else 0
    k, n = w.shape
    deq = (w - np.repeat(zp, 32, axis=0)[:k] if zero_points else w) * np.repeat(s, 32, axis=0)[:k]
    a = rng(9).standard_normal((1, k)).astype(np.float32)
    opts = ort.SessionOptions()
    # ORT would fuse DQ+MatMul into MatMulNBits at accuracy level 4 (int8 A): keep exact DQ.
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    (y,) = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"]).run(None, {"A": a})
    np.testing.assert_allclose(y, a @ deq, rtol=1e-4, atol=1e-4)
