"""Weight views folded at resolve (core/model/weight_views.py): the onnxruntime-genai
builder's tied embedding, GatherBlockQuantized over a Reshape of the LM head's
MatMulNBits weight, resolves to one source read and one prepared object (the matmul
layout, core/kernels/tied_embedding.py) and computes what ONNX Runtime computes; a view chain folds; what
cannot be folded without reading bytes is refused in one line naming the node."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from conftest import ort_or_skip
from onnx_prep.cli.app import app
from onnx_prep.core.errors import EXIT_UNUSABLE, ModelFormatError
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.model.weight_views import DATA_VIEW
from onnx_prep.core.runtime.session import Session
from test_resolve_models import MS, Tensor, from_array, rng, write_model

VOCAB, HIDDEN, BS = 64, 64, 32
KB = HIDDEN // BS
cli = CliRunner()


def _shape_constant(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=f"{name}.const",
                            value=numpy_helper.from_array(np.array(value, np.int64), name))


def builder_tied_model(out_dir, view: str = "reshape"):
    """input_ids -> GatherBlockQuantized(<view of W>, quantize_axis=1, scales [V, kb])
    -> MatMulNBits(W [V, kb, bs/2], the same scales) -> logits: the builder's tied Qwen2.
    ``view``: "reshape" (a Constant shape, as the builder writes it), "chain" (Identity,
    then Unsqueeze, Flatten, Reshape by an inline initializer with 0 and -1), or an
    unfoldable producer: "transpose", "computed-shape", "external-shape"."""
    r = rng(7)
    w = r.integers(0, 256, size=(VOCAB, KB, BS // 2), dtype=np.uint8)
    scales = r.uniform(0.01, 0.05, size=(VOCAB, KB)).astype(np.float32)
    tensors = [Tensor("W", TensorProto.UINT8, w.shape, w.tobytes()), from_array("scales", scales)]
    nodes = []
    if view == "reshape":
        nodes += [_shape_constant("shape", [VOCAB, HIDDEN // 2]),
                  helper.make_node("Reshape", ["W", "shape"], ["data"], name="embed.reshape")]
    elif view == "chain":
        tensors.append(from_array("shape", np.array([0, -1], np.int64), external=False))
        nodes += [helper.make_node("Identity", ["W"], ["w1"], name="v.identity"),
                  _shape_constant("axes", [0]),
                  helper.make_node("Unsqueeze", ["w1", "axes"], ["w2"], name="v.unsqueeze"),
                  helper.make_node("Flatten", ["w2"], ["w3"], name="v.flatten", axis=2),
                  helper.make_node("Reshape", ["w3", "shape"], ["data"], name="v.reshape")]
    elif view == "transpose":
        nodes += [helper.make_node("Transpose", ["W"], ["wt"], name="v.transpose", perm=[0, 2, 1]),
                  _shape_constant("shape", [VOCAB, HIDDEN // 2]),
                  helper.make_node("Reshape", ["wt", "shape"], ["data"], name="embed.reshape")]
    elif view == "computed-shape":
        nodes += [helper.make_node("Shape", ["scales"], ["shape"], name="v.shape"),
                  helper.make_node("Reshape", ["W", "shape"], ["data"], name="embed.reshape")]
    elif view == "external-shape":
        tensors.append(from_array("shape", np.array([VOCAB, HIDDEN // 2], np.int64)))
        nodes += [helper.make_node("Reshape", ["W", "shape"], ["data"], name="embed.reshape")]
    nodes += [
        helper.make_node("GatherBlockQuantized", ["data", "input_ids", "scales"], ["hidden"], name="embed",
                         domain=MS, bits=4, block_size=BS, gather_axis=0, quantize_axis=1),
        helper.make_node("MatMulNBits", ["hidden", "W", "scales"], ["logits"], name="lm_head",
                         domain=MS, K=HIDDEN, N=VOCAB, bits=4, block_size=BS),
    ]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", VOCAB])]
    return write_model(out_dir, nodes, tensors, inputs, outputs, opsets={"": 21, MS: 1})


@pytest.mark.parametrize("view", ["reshape", "chain"])
def test_the_view_folds_to_one_source_read_and_one_prepared_object(tmp_path, view):
    path = builder_tied_model(tmp_path, view)
    r = resolve_model(path)
    assert r.unsupported == ()
    embed = next(n for n in r.nodes if n.name == "embed")
    assert embed.kernel == "int4_gather" and embed.inputs[0] == "W"
    assert tuple(embed.attributes[DATA_VIEW]) == (VOCAB, HIDDEN // 2)
    assert [n.name for n in r.nodes] == ["embed", "lm_head"]  # the view nodes are pruned
    [fold] = r.folded_views
    assert (fold.node, fold.source, fold.source_dims, fold.dims) == ("embed", "W", (VOCAB, KB, BS // 2),
                                                                     (VOCAB, HIDDEN // 2))
    assert [op for op, _ in fold.through] == (["Reshape"] if view == "reshape" else
                                              ["Identity", "Unsqueeze", "Flatten", "Reshape"])
    # one source descriptor, one prepared object (the matmul layout, the tied gather's too)
    assert [d.name for d in r.manifest] == ["W", "scales"]
    [req] = r.requests.values()
    assert req.source_lineage == ("W", "scales") and req.layout.split(".")[0] == "int4mm"
    assert embed.requirements == (req,)


def test_the_folded_tie_computes_what_onnxruntime_computes_reading_w_once(tmp_path):
    ort = ort_or_skip()
    path = builder_tied_model(tmp_path)
    ids = np.array([[0, 5, 63, 17], [9, 9, 1, 40]], np.int64)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input_ids": ids})[0]
    with Session.open(path) as s:
        got = s.run({"input_ids": ids})["logits"]
        counters = s.reader.counters.snapshot()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.ptp(want)))
    w = resolve_model(path).weights["W"]
    read = counters["per_tensor"].get("W", 0) + counters["mapped_per_tensor"].get("W", 0)
    assert read == w.length  # one read fed both prepacks


def test_resolve_shows_the_fold_in_one_line_and_in_the_record(tmp_path):
    path = builder_tied_model(tmp_path)
    doc = json.loads(cli.invoke(app, ["resolve", str(path), "--json"]).stdout)
    assert doc["folded_views"] == [{"node": "embed", "source": "W", "source_dims": [VOCAB, KB, BS // 2],
                                    "dims": [VOCAB, HIDDEN // 2],
                                    "through": [{"op_type": "Reshape", "node": "embed.reshape"}]}]
    [req] = doc["requirements"]
    assert req["source_lineage"] == ["W", "scales"] and req["consumers"] == ["embed", "lm_head"]
    result = cli.invoke(app, ["resolve", str(path)])
    assert result.exit_code == 0, result.output
    # one row of the summary (rich wraps it to the terminal's width)
    [line] = [ln for ln in result.output.splitlines() if "folded view" in ln]
    assert "embed reads W [64, 2, 16] as [64, 32]" in line
    text = " ".join(w for w in result.output.replace("│", " ").split())
    assert "(Reshape 'embed.reshape' folded: a view, no bytes read)" in text


@pytest.mark.parametrize("view,why", [
    ("transpose", "computed by Transpose 'v.transpose', which cannot be folded without reading the weight's "
                  "bytes (not a view)"),
    ("computed-shape", "computed by Reshape 'embed.reshape', which cannot be folded without reading the "
                       "weight's bytes (its input 'shape' is not a constant)"),
    ("external-shape", "(its input 'shape' is stored as external data)"),
])
def test_an_unfoldable_producer_is_refused_naming_the_node(tmp_path, view, why):
    path = builder_tied_model(tmp_path, view)
    with pytest.raises(ModelFormatError) as exc:
        resolve_model(path)
    assert why in exc.value.message and exc.value.where.node == "embed"
    assert exc.value.where.model == str(path)
    result = cli.invoke(app, ["resolve", str(path)])
    assert result.exit_code == EXIT_UNUSABLE
    line = result.output.strip()
    assert "\n" not in line and "Traceback" not in line and "embed" in line and why in line
