"""The contrib-op kernels inside a compiled action program: a block shaped as the
onnxruntime-genai builder emits it around its projections (SkipSimplifiedLayerNormalization
using outputs 0 and 3, RotaryEmbedding on the projected heads, a final
SimplifiedLayerNormalization), saved with external data, resolved with no unsupported
op, and run against ONNX Runtime."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from conftest import ort_or_skip
from onnx_prep.core.io.external_data import ExternalDataReader
from onnx_prep.core.kernels.prepack import prepack_all, source_loader
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.runtime.action_program import ActionProgram
from test_native_norm import RMSNORM_RTOL
from test_native_rotary import ROTARY_ATOL_ULPS

MS = "com.microsoft"
HIDDEN, HEADS = 64, 4


def _block(tmp_path):
    rng = np.random.default_rng(11)
    f32 = TensorProto.FLOAT
    ang = np.outer(np.arange(32), 1.0 / 10000 ** (np.arange(8) / 8))
    inits = {
        "ln1": rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32),
        "ln2": rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32),
        "wq": (rng.standard_normal((HIDDEN, HIDDEN)) / 8).astype(np.float32),
        "cos": np.cos(ang).astype(np.float32), "sin": np.sin(ang).astype(np.float32),
    }
    nodes = [
        helper.make_node("SkipSimplifiedLayerNormalization", ["x", "res", "ln1"], ["h", "", "", "res_out"],
                         name="skip_ln", domain=MS, epsilon=1e-6),
        helper.make_node("MatMul", ["h", "wq"], ["q"], name="q_proj"),
        helper.make_node("RotaryEmbedding", ["q", "pos", "cos", "sin"], ["q_rot"], name="rope", domain=MS,
                         num_heads=HEADS, interleaved=0),
        helper.make_node("Add", ["q_rot", "res_out"], ["z"], name="add"),
        helper.make_node("SimplifiedLayerNormalization", ["z", "ln2"], ["y"], name="final_ln", epsilon=1e-6),
    ]
    g = helper.make_graph(nodes, "block",
                          [helper.make_tensor_value_info("x", f32, [1, "S", HIDDEN]),
                           helper.make_tensor_value_info("res", f32, [1, "S", HIDDEN]),
                           helper.make_tensor_value_info("pos", TensorProto.INT64, [1, "S"])],
                          [helper.make_tensor_value_info("y", f32, [1, "S", HIDDEN]),
                           helper.make_tensor_value_info("res_out", f32, [1, "S", HIDDEN])],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)])
    m.ir_version = 10
    path = tmp_path / "block.onnx"
    onnx.save(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="block.data",
              size_threshold=0)
    return path


def test_builder_shaped_block_runs_and_matches_onnxruntime(tmp_path):
    ort = ort_or_skip()
    path = _block(tmp_path)
    resolved = resolve_model(path)
    assert not resolved.unsupported
    kernels = {n.name: n.kernel for n in resolved.nodes}
    assert kernels == {"skip_ln": "row_norm", "q_proj": "gemm_packed", "rope": "rotary", "add": "numpy",
                       "final_ln": "row_norm"}
    load = source_loader(resolved, ExternalDataReader.for_model(resolved))
    program = ActionProgram.compile(resolved)
    prepared = prepack_all(resolved, load, backend="native")
    weights = {n: load(n) for n in program.weight_names}
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(12)
    for s in (5, 1):
        feeds = {"x": rng.standard_normal((1, s, HIDDEN)).astype(np.float32),
                 "res": rng.standard_normal((1, s, HIDDEN)).astype(np.float32),
                 "pos": np.arange(7, 7 + s, dtype=np.int64)[None]}
        ours = program.run(feeds, prepared, weights=weights)
        theirs = dict(zip(["y", "res_out"], sess.run(None, feeds)))
        np.testing.assert_array_equal(ours["res_out"], theirs["res_out"])
        # the steps' differences reach y through the final RMSNorm: one of each
        # tolerance, relative to the output and its scale (gamma <= 1.5) [measured:
        # 0.05 of this bound]
        bound = (RMSNORM_RTOL + ROTARY_ATOL_ULPS * 2.0 ** -23) * (np.abs(theirs["y"]) + 1.5)
        assert np.all(np.abs(ours["y"] - theirs["y"]) <= bound)
        # negative control: positions one step off fail the bound
        shifted = program.run({**feeds, "pos": feeds["pos"] + 1}, prepared, weights=weights)
        assert not np.all(np.abs(shifted["y"] - theirs["y"]) <= bound)
