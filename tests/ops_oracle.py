"""Test helper: run one op through ONNX Runtime (the oracle) and through core/ops."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from onnx_prep.core.kernels.binding import get_op
from onnx_prep.core.ops.attributes import N_OUTPUTS, normalize_attributes

# Named tolerances per precision (float32 transcendental ops differ in the last bits
# between numpy and ORT's vectorised math).
F32_RTOL = 1e-5
F32_ATOL = 1e-6
F16_RTOL = 2e-3


def one_node_model(op_type: str, inputs: list, attrs: dict, *, opset: int, n_out: int = 1,
                   domain: str = "", constant_inputs: frozenset[int] = frozenset()) -> onnx.ModelProto:
    names = [f"x{i}" if x is not None else "" for i, x in enumerate(inputs)]
    node = helper.make_node(op_type, names, [f"y{j}" for j in range(n_out)], domain=domain, **attrs)
    graph_inputs, inits = [], []
    for i, x in enumerate(inputs):
        if x is None:
            continue
        if i in constant_inputs:
            inits.append(onnx.numpy_helper.from_array(np.asarray(x), names[i]))
        else:
            graph_inputs.append(helper.make_tensor_value_info(
                names[i], helper.np_dtype_to_tensor_dtype(np.asarray(x).dtype), np.asarray(x).shape))
    outs = [helper.make_empty_tensor_value_info(f"y{j}") for j in range(n_out)]
    g = helper.make_graph([node], "g", graph_inputs, outs, initializer=inits)
    opsets = [helper.make_opsetid("", opset)]
    if domain:
        opsets.append(helper.make_opsetid(domain, 1))
    m = helper.make_model(g, opset_imports=opsets)
    m.ir_version = 10
    return m


def run_ort(model: onnx.ModelProto, inputs: list, constant_inputs=frozenset()) -> list[np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = {f"x{i}": np.asarray(x) for i, x in enumerate(inputs) if x is not None and i not in constant_inputs}
    return s.run(None, feeds)


def run_ours(op_type: str, inputs: list, attrs: dict, *, opset: int, n_out: int = 1, domain: str = "",
             kernel: str = "numpy", prepared=None) -> list[np.ndarray]:
    # Attributes go through their protobuf form, as resolution reads them.
    protos = {k: helper.make_attribute(k, v) for k, v in attrs.items()}
    a = normalize_attributes(protos)
    a[N_OUTPUTS] = n_out
    fn = get_op(op_type, domain, kernel, opset)
    return fn([None if x is None else np.asarray(x) for x in inputs], a, prepared or {})[:n_out]


def assert_same(ours: list, theirs: list, *, rtol: float = F32_RTOL, atol: float = F32_ATOL) -> None:
    assert len(ours) == len(theirs)
    for o, t in zip(ours, theirs):
        o = np.asarray(o)
        assert o.shape == t.shape, (o.shape, t.shape)
        assert o.dtype == t.dtype, (o.dtype, t.dtype)
        if t.dtype.kind == "f":
            np.testing.assert_allclose(o, t, rtol=rtol, atol=atol)
        else:
            np.testing.assert_array_equal(o, t)


def check_against_ort(op_type: str, inputs: list, attrs: dict | None = None, *, opset: int = 17,
                      n_out: int = 1, domain: str = "", constant_inputs=frozenset(), kernel: str = "numpy",
                      rtol: float = F32_RTOL, atol: float = F32_ATOL) -> list[np.ndarray]:
    attrs = attrs or {}
    model = one_node_model(op_type, inputs, attrs, opset=opset, n_out=n_out, domain=domain,
                           constant_inputs=frozenset(constant_inputs))
    theirs = run_ort(model, inputs, frozenset(constant_inputs))
    ours = run_ours(op_type, inputs, attrs, opset=opset, n_out=n_out, domain=domain, kernel=kernel)
    assert_same(ours, theirs, rtol=rtol, atol=atol)
    return ours
