"""`onnx-prep run` on a model that is not a decoder, and on any model with --inputs /
--shape: one forward through the prepared runtime's Session, its outputs against ONNX
Runtime's on the same inputs (core/decode/graph_run.py, graph_feeds.py, model_kind.py).

The model is made here: a small MLP with a float input named ``input`` (the name a
decoder's token ids may have), a float MatMul and an INT4 MatMulNBits (the native
kernel), a second input, and an integer output (ArgMax); every weight in a real
external data file written by onnx's own writer, as exporters write it."""
from __future__ import annotations

import json
import zlib
from importlib import resources
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from conftest import ort_or_skip
from onnx_prep.cli.app import app
from onnx_prep.core.decode import run_record
from onnx_prep.core.decode.graph_feeds import (GENERATED_INT_HIGH, parse_input_files, parse_shape_bindings)
from onnx_prep.core.decode.graph_run import FLOAT_RTOL, compare_output, summarize
from onnx_prep.core.decode.model_kind import model_kind
from onnx_prep.core.errors import EXIT_FINDINGS, EXIT_OK, EXIT_UNUSABLE, UsageError
from onnx_prep.core.model.resolved_model import ValueInfo
from onnx_prep.fixtures.int4_weights import block_scales, int4_codes, tensor_rng

cli = CliRunner()
HIDDEN, WIDTH, OUT, BLOCK = 16, 32, 8, 16


def build_mlp(folder: Path, *, seed: int = 0, scale_error: float = 0.0) -> Path:
    """input [batch, 16] -> MatMul W1 + b1 -> Relu -> MatMulNBits (INT4, K=32, N=8) -> * gain
    -> output [batch, 8]; label = ArgMax(output) [batch] int64. ``scale_error``: the INT4
    scales that much off (a negative control)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = tensor_rng(seed, "mlp")
    w1 = rng.standard_normal((HIDDEN, WIDTH)).astype(np.float32)
    b1 = rng.standard_normal(WIDTH).astype(np.float32)
    codes = int4_codes(rng, OUT, WIDTH, BLOCK, symmetric=True)
    scales = block_scales(rng, OUT, WIDTH, BLOCK, gain=4.0) * np.float32(1 + scale_error)
    inits = [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(b1, "b1"),
             numpy_helper.from_array(codes, "W2_q"), numpy_helper.from_array(scales.reshape(-1), "W2_scales")]
    nodes = [helper.make_node("MatMul", ["input", "W1"], ["h1"]),
             helper.make_node("Add", ["h1", "b1"], ["h2"]),
             helper.make_node("Relu", ["h2"], ["h3"]),
             helper.make_node("MatMulNBits", ["h3", "W2_q", "W2_scales"], ["y"], domain="com.microsoft",
                              K=WIDTH, N=OUT, bits=4, block_size=BLOCK),
             helper.make_node("Mul", ["y", "gain"], ["output"]),
             helper.make_node("ArgMax", ["output"], ["label"], axis=1, keepdims=0)]
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", HIDDEN]),
         helper.make_tensor_value_info("gain", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", OUT]),
         helper.make_tensor_value_info("label", TensorProto.INT64, ["batch"])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    path = folder / "mlp.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="mlp.onnx.data", size_threshold=0)
    return path


@pytest.fixture(scope="module")
def mlp(tmp_path_factory) -> Path:
    path = build_mlp(tmp_path_factory.mktemp("mlp"))
    assert (path.parent / "mlp.onnx.data").stat().st_size > 0  # the weights are external
    return path


def _ort(path: Path, feeds: dict) -> dict:
    ort = ort_or_skip()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def _schema(name: str) -> dict:
    return json.loads(resources.files("onnx_prep.core").joinpath(f"schemas/{name}.schema.json").read_text())


def _json(args: list[str], code: int = EXIT_OK) -> dict:
    jsonschema = pytest.importorskip("jsonschema")
    result = cli.invoke(app, ["run", *args, "--json"])
    assert result.exit_code == code, result.output
    doc = json.loads(result.stdout)
    schema = "graph-run" if doc["schema"].startswith("onnx-prep.graph-run/") else "run"
    jsonschema.validate(doc, _schema(schema))
    if schema == "graph-run" and doc["cache"] is not None:  # the same object as a decode's
        jsonschema.validate(doc["cache"], _schema("run")["properties"]["cache"])
    return doc


def _error(args: list[str]) -> str:
    result = cli.invoke(app, ["run", *args])
    assert result.exit_code == EXIT_UNUSABLE, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def _close(ours: np.ndarray, ref: np.ndarray) -> None:
    """The tolerance graph_run states for fp32 (1e-4 of the output's scale, + 1e-6)."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= FLOAT_RTOL * np.abs(ref).max() + 1e-6


# -- which models decode and which run one forward


def _vi(name: str, elem: int, shape) -> ValueInfo:
    return ValueInfo(name, elem, None if shape is None else tuple(shape))


@pytest.mark.parametrize("inputs, kind, says", [
    ([_vi("input", 1, ["batch", 16])], "graph", "'input' float32 [batch, 16]"),
    ([_vi("input_ids", 1, ["b", "s"])], "graph", "no int32/int64 token-ids input"),  # float ids are no ids
    ([_vi("input_ids", 7, ["b"])], "graph", "'input_ids' int64 [b]"),  # rank 1: not [batch, seq]
    ([_vi("x", 7, ["b", "s"]), _vi("y", 1, [2])], "graph", "'x' int64 [b, s], 'y' float32 [2]"),
    ([_vi("input_ids", 7, ["b", "s"])], "decoder", "token-ids input 'input_ids'"),
    ([_vi("tokens", 6, None)], "decoder", "token-ids input 'tokens'"),
    ([_vi("x", 1, [1]), _vi("past_key_values.0.key", 1, ["b", 2, "p", 4])], "decoder",
     "past KV input 'past_key_values.0.key'"),
])
def test_model_kind_says_decoder_or_graph_and_why(inputs, kind, says):
    k = model_kind(inputs)
    assert k.kind == kind and says in k.reason and k.is_decoder == (kind == "decoder")
    assert model_kind(inputs, io_map=True).is_decoder  # an io-map names decoder roles


def test_model_kind_of_the_real_models(mlp, small_llm_path):
    from onnx_prep.core.decode.decoder_io import value_infos_from_model

    assert model_kind(value_infos_from_model(mlp)[0]).kind == "graph"
    assert model_kind(value_infos_from_model(small_llm_path)[0]).kind == "decoder"


# -- the feeds


def test_option_parsing():
    files = parse_input_files(["a.npz", "input=x.npy", "gain=dir/g.npy", "/tmp/a=b/c.npz"])
    assert [(f.name, str(f.path)) for f in files] == [(None, "a.npz"), ("input", "x.npy"), ("gain", "dir/g.npy"),
                                                      (None, "/tmp/a=b/c.npz")]
    assert parse_shape_bindings(["batch=1,seq=8", "past=0"]) == {"batch": 1, "seq": 8, "past": 0}
    for bad, match in [(["x.npy"], "FILE.npz or NAME=FILE.npy"), (["=x.npy"], "FILE.npz or NAME=FILE.npy")]:
        with pytest.raises(UsageError, match=match):
            parse_input_files(bad)
    for bad, match in [(["batch"], "NAME=N pairs"), (["batch=-1"], "NAME=N pairs"), (["batch=1x"], "NAME=N"),
                       (["batch=1", "batch=2"], "binds 'batch' twice"), ([f"b={2**31}"], "at most")]:
        with pytest.raises(UsageError, match=match):
            parse_shape_bindings(bad)


def test_option_parsing_imports_neither_numpy_nor_onnx():
    # RunOptions checks --inputs and --shape before the load path is imported
    import subprocess
    import sys

    code = ("import sys; from onnx_prep.core.decode.graph_feeds import parse_input_files, parse_shape_bindings; "
            "parse_input_files(['a.npz', 'x=b.npy']); parse_shape_bindings(['batch=1']); "
            "print(sorted({'numpy', 'onnx'} & set(sys.modules)))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr


# -- one forward against ONNX Runtime


def _generated(name: str, shape, dtype=np.float32) -> np.ndarray:
    """The documented rule (graph_feeds.py), written out: a generator seeded by the name."""
    return np.random.default_rng(zlib.crc32(name.encode())).standard_normal(shape, dtype=np.float32).astype(dtype)


def test_generated_inputs_give_ort_outputs(mlp, tmp_path):
    out = tmp_path / "out.npz"
    doc = _json([str(mlp), "--shape", "batch=3", "--outputs-out", str(out)])
    assert doc["runtime"] == "prepared" and doc["kind"]["kind"] == "graph"
    assert "not a decoder" in doc["kind"]["reason"] and "'input' float32" in doc["kind"]["reason"]
    assert doc["inputs"] == [{"name": "input", "dtype": "float32", "shape": [3, HIDDEN], "source": "generated"},
                             {"name": "gain", "dtype": "float32", "shape": [1], "source": "generated"}]
    assert doc["shape"] == {"batch": 3} and doc["outputs_file"] == str(out)
    written = dict(np.load(out))
    assert sorted(written) == ["label", "output"] and not list(tmp_path.glob(".out.npz.*"))  # no temp file left
    feeds = {"input": _generated("input", (3, HIDDEN)), "gain": _generated("gain", (1,))}
    ref = _ort(mlp, feeds)
    _close(written["output"], ref["output"])
    assert np.array_equal(written["label"], ref["label"])
    for summary in doc["outputs"]:  # the printed summary is the written arrays'
        a = written[summary["name"]]
        assert summary["shape"] == list(a.shape) and summary["dtype"] == str(a.dtype)
        assert summary["min"] == float(a.min()) and summary["max"] == float(a.max())
        assert summary["mean"] == pytest.approx(float(a.astype(np.float64).mean())) and summary["non_finite"] == 0
    again = _json([str(mlp), "--shape", "batch=3", "--runtime", "ort"])  # deterministic: the same inputs
    assert again["outputs"][0]["max"] == pytest.approx(doc["outputs"][0]["max"], rel=1e-5)


def test_a_zero_size_dim_runs_as_in_onnx_runtime(mlp, tmp_path):
    """--shape batch=0 (documented as allowed): empty outputs of the right shapes, as ONNX
    Runtime gives, through the packed MatMul and the INT4 matmul alike."""
    out = tmp_path / "out.npz"
    doc = _json([str(mlp), "--shape", "batch=0", "--outputs-out", str(out)])
    written = dict(np.load(out))
    ref = _ort(mlp, {"input": np.zeros((0, HIDDEN), np.float32), "gain": _generated("gain", (1,))})
    for name in ("output", "label"):
        assert written[name].shape == ref[name].shape and written[name].dtype == ref[name].dtype
    assert written["output"].shape == (0, OUT) and [o["shape"] for o in doc["outputs"]] == [[0, OUT], [0]]


def test_npz_and_npy_inputs_give_ort_outputs(mlp, tmp_path):
    rng = np.random.default_rng(7)
    feeds = {"input": rng.standard_normal((5, HIDDEN)).astype(np.float32), "gain": np.array([0.5], np.float32)}
    np.savez(tmp_path / "in.npz", **feeds)
    for name, a in feeds.items():
        np.save(tmp_path / f"{name}.npy", a)
    ref = _ort(mlp, feeds)
    by_npz = _json([str(mlp), "--inputs", str(tmp_path / "in.npz"), "--outputs-out", str(tmp_path / "a.npz")])
    by_npy = _json([str(mlp), "--inputs", f"input={tmp_path / 'input.npy'}", "--inputs",
                    f"gain={tmp_path / 'gain.npy'}", "--outputs-out", str(tmp_path / "b.npz")])
    assert [i["source"] for i in by_npz["inputs"]] == [str(tmp_path / "in.npz")] * 2
    assert [i["source"] for i in by_npy["inputs"]] == [str(tmp_path / "input.npy"), str(tmp_path / "gain.npy")]
    a, b = dict(np.load(tmp_path / "a.npz")), dict(np.load(tmp_path / "b.npz"))
    _close(a["output"], ref["output"])
    assert np.array_equal(a["label"], ref["label"]) and a["output"].shape == (5, OUT)
    assert all(np.array_equal(a[k], b[k]) for k in a)  # the same inputs either way


def test_compare_ort_per_output(mlp):
    doc = _json([str(mlp), "--shape", "batch=2", "--compare", "ort"])
    cmp = doc["compare"]
    assert cmp["runtime"] == "ort" and cmp["agrees"]
    rows = {r["name"]: r for r in cmp["outputs"]}
    assert rows["label"]["limit"] == 0.0 and rows["label"]["max_abs_diff"] == 0.0  # integers: exact
    assert 0 <= rows["output"]["max_abs_diff"] <= rows["output"]["limit"] and rows["output"]["ok"]
    text = cli.invoke(app, ["run", str(mlp), "--shape", "batch=2", "--compare", "ort"])
    assert text.exit_code == EXIT_OK and "ort: outputs agree" in text.stdout
    assert "output 'output' float32 [2, 8]  min " in text.stdout and "input 'gain' float32 [1] generated" in text.stdout


def test_compare_ort_divergence_exits_1(mlp, tmp_path, monkeypatch):
    # Same I/O, other weights: the "runtime" is wrong on purpose.
    from onnx_prep.core.decode.ort_runner import OrtRunner

    other = build_mlp(tmp_path / "other", seed=1)
    monkeypatch.setattr(run_record, "open_prepared_runner", lambda resolved, **kw: OrtRunner(other))
    doc = _json([str(mlp), "--shape", "batch=2", "--compare", "ort"], code=EXIT_FINDINGS)
    rows = {r["name"]: r for r in doc["compare"]["outputs"]}
    assert not doc["compare"]["agrees"] and not rows["output"]["ok"]
    assert rows["output"]["max_abs_diff"] > rows["output"]["limit"] > 0
    text = cli.invoke(app, ["run", str(mlp), "--shape", "batch=2", "--compare", "ort"])
    assert text.exit_code == EXIT_FINDINGS and "ort: output 'output' DIVERGED" in text.stdout


def test_per_node_compares_every_value_of_the_forward(mlp):
    doc = _json([str(mlp), "--shape", "batch=2", "--compare", "ort", "--per-node"])
    pn = doc["compare"]["per_node"]
    # h1, h2, h3, y, output, label: every node's output, none fused away here
    assert pn["compared"] == 6 and pn["divergent"] == 0 and pn["first_divergence"] is None
    assert pn["tolerance_basis"] == "fp32" and pn["largest"]["relative_diff"] < 1e-5
    text = cli.invoke(app, ["run", str(mlp), "--shape", "batch=2", "--compare", "ort", "--per-node"])
    assert text.exit_code == EXIT_OK and "per node (the forward): all 6 values within 0.001" in text.stdout


def test_per_node_names_the_int4_matmul_where_a_forward_starts_to_differ(mlp, tmp_path, monkeypatch):
    # Ours computes on weights whose INT4 scales are 1% off: everything before the INT4
    # matmul agrees, its output is the first to differ, and everything after inherits it.
    from onnx_prep.core.model.resolution import resolve_model

    off = resolve_model(build_mlp(tmp_path / "off", scale_error=0.01))
    opener = run_record.open_prepared_runner
    monkeypatch.setattr(run_record, "open_prepared_runner", lambda resolved, **kw: opener(off, **kw))
    doc = _json([str(mlp), "--shape", "batch=2", "--compare", "ort", "--per-node"], code=EXIT_FINDINGS)
    pn = doc["compare"]["per_node"]
    d = pn["first_divergence"]
    assert (d["op_type"], d["value"], d["position"], d["reason"]) == ("MatMulNBits", "y", 3, "values")
    assert d["relative_diff"] > pn["tolerance"] and pn["divergent"] >= 2  # 'output' inherits it
    text = cli.invoke(app, ["run", str(mlp), "--shape", "batch=2", "--compare", "ort", "--per-node"])
    assert text.exit_code == EXIT_FINDINGS
    assert f"per node (the forward): FIRST DIVERGENCE at node '{d['node']}' (MatMulNBits, #3), value 'y'" in text.stdout


def test_a_forward_and_a_decode_share_the_per_node_schema():
    run, forward = _schema("run"), _schema("graph-run")
    for name in ("value_stats", "value_difference", "per_node"):
        assert forward["$defs"][name] == run["$defs"][name], name
    assert forward["properties"]["compare"]["oneOf"][1]["properties"]["per_node"] == {"$ref": "#/$defs/per_node"}


def test_the_tolerance_fails_int4_scales_one_percent_off(mlp, tmp_path):
    off = build_mlp(tmp_path / "off", scale_error=0.01)
    feeds = {"input": _generated("input", (4, HIDDEN)), "gain": np.ones(1, np.float32)}
    right, wrong = _ort(mlp, feeds)["output"], _ort(off, feeds)["output"]
    row = compare_output("output", wrong, right)
    assert not row["ok"] and row["max_abs_diff"] > 10 * row["limit"]


def test_compare_output_rules():
    a = np.array([1.0, 2.0, np.nan], np.float32)
    assert compare_output("x", a, a.copy())["ok"]  # NaN at the same places
    row = compare_output("x", a, np.array([1.0, np.nan, 3.0], np.float32))
    assert not row["ok"] and "NaN" in row["mismatch"] and row["max_abs_diff"] is None
    assert "shape" in compare_output("x", a, a[:2])["mismatch"]
    assert "dtype" in compare_output("x", a, a.astype(np.float64))["mismatch"]
    big = np.array([1000.0], np.float32)
    assert compare_output("x", big + 0.05, big)["ok"] and not compare_output("x", big + 0.2, big)["ok"]
    assert not compare_output("i", np.array([1, 2]), np.array([1, 3]))["ok"]
    assert compare_output("h", np.array([1.0], np.float16), np.array([1.002], np.float16))["ok"]  # 16-bit bound
    s = summarize("x", np.array([1.0, np.inf, -2.0, np.nan], np.float32))
    assert (s["min"], s["max"], s["mean"], s["non_finite"]) == (-2.0, 1.0, -0.5, 2)
    assert summarize("e", np.zeros((0, 3), np.float32))["min"] is None


def test_a_decoder_runs_one_forward_with_shape(small_llm_path):
    # --shape asks for one forward of any model: the INT4 decoder with a past of 3
    doc = _json([str(small_llm_path), "--shape", "batch=2,seq=4,past_seq=3", "--compare", "ort"])
    assert doc["kind"]["reason"].startswith("--shape given; a decoder by its past KV input")
    assert doc["compare"]["agrees"], doc["compare"]
    names = {i["name"]: i for i in doc["inputs"]}
    assert names["input_ids"]["shape"] == [2, 4] and names["past_key_values.0.key"]["shape"][2] == 3
    ids = np.random.default_rng(zlib.crc32(b"input_ids")).integers(0, GENERATED_INT_HIGH, size=(2, 4))
    assert ids.max() < GENERATED_INT_HIGH  # the documented rule; valid ids for any vocabulary of 16+
    logits = {o["name"]: o for o in doc["outputs"]}["logits"]
    assert logits["shape"] == [2, 4, 512] and logits["non_finite"] == 0


# -- unusable input: one line, exit 2


def test_unbound_symbolic_dim_names_the_input_and_dim(mlp):
    line = _error([str(mlp)])
    assert "input 'input' dim 0 is the symbolic 'batch'" in line and "--shape batch=N" in line


@pytest.mark.parametrize("array, says", [
    (np.zeros((2, HIDDEN), np.float64), "input 'input' is float64, expected float32"),
    (np.zeros((2, HIDDEN + 1), np.float32), "input 'input' has shape [2, 17], expected [batch, 16] (dim 1: 16)"),
    (np.zeros((HIDDEN,), np.float32), "expected [batch, 16] (rank 2)"),
    (np.zeros((4, HIDDEN), np.float32), "(dim 0: 2, --shape batch=2)"),
])
def test_a_given_array_that_does_not_fit_names_input_expected_and_got(mlp, tmp_path, array, says):
    np.save(tmp_path / "x.npy", array)
    np.save(tmp_path / "g.npy", np.ones(1, np.float32))
    line = _error([str(mlp), "--inputs", f"input={tmp_path / 'x.npy'}", "--inputs", f"gain={tmp_path / 'g.npy'}",
                   "--shape", "batch=2"])
    assert says in line and str(tmp_path / "x.npy") in line


@pytest.mark.parametrize("setup, args, says", [
    (lambda d: np.savez(d / "a.npz", input=np.zeros((1, HIDDEN), np.float32)), ["--inputs", "{d}/a.npz"],
     "no array for input(s) 'gain'"),
    (lambda d: np.savez(d / "a.npz", inputs=np.zeros(1)), ["--inputs", "{d}/a.npz"], "'inputs' is not an input"),
    (lambda d: None, ["--inputs", "input={d}/none.npy"], "--inputs file not found"),
    (lambda d: (d / "t.npy").write_text("not numpy"), ["--inputs", "input={d}/t.npy"], "not a .npy or .npz"),
    (lambda d: np.save(d / "o.npy", np.array([{}], dtype=object), allow_pickle=True), ["--inputs", "input={d}/o.npy"],
     "without pickle"),
    (lambda d: None, ["--inputs", "{d}/x.npy"], "--inputs takes FILE.npz or NAME=FILE.npy"),
    (lambda d: None, ["--shape", "batch=1,sq=3"], "--shape binds 'sq', which is no symbolic dim"),
    (lambda d: None, ["--shape", "batch=1", "--tokens", "4"], "--tokens applies only to decoding"),
    (lambda d: None, ["--tokens", "4"], "--tokens applies only to decoding; this model runs one forward"),
    (lambda d: None, ["--shape", "batch=1", "--logits-out", "{d}/l.npz"], "--logits-out writes a decode's logits"),
    (lambda d: None, ["--logits-out", "{d}/l.npz"], "this model runs one forward (not a decoder"),
    (lambda d: None, ["--shape", "batch=1", "--outputs-out", "{d}/no/o.npz"], "--outputs-out: no folder"),
    (lambda d: None, ["--shape", f"batch={2**30}", "--memory-budget", "64MiB"], "over the memory budget"),
])
def test_unusable_inputs_are_one_line(mlp, tmp_path, setup, args, says):
    setup(tmp_path)
    line = _error([str(mlp), *(a.replace("{d}", str(tmp_path)) for a in args)])
    assert says in line


def test_outputs_out_on_a_decode_is_refused(small_llm_path, tmp_path):
    line = _error([str(small_llm_path), "--outputs-out", str(tmp_path / "o.npz"), "--tokens", "2"])
    assert "this model is decoded (a decoder by its past KV input" in line and "--logits-out" in line
    assert "names a decoder's roles" in _error([str(small_llm_path), "--shape", "batch=1", "--io-map", "m.json"])


def test_a_builder_export_runs_once_on_npz_inputs(tmp_path):
    # What a real INT4 exporter writes (onnxruntime-genai's builder: GroupQueryAttention,
    # MatMulNBits, a symbolic head size): a prefill's feeds from a file, against ONNX Runtime
    from conftest import real_export
    from onnx_prep.core.decode.decoder_io import DecoderIO

    path = real_export("builder-llama-acc4-b32")
    io = DecoderIO.from_model(path)
    feeds = {"input_ids": np.array([[1, 5, 9, 2, 7]], np.int64), "attention_mask": np.ones((1, 5), np.int64),
             **io.empty_past(1)}
    np.savez(tmp_path / "prefill.npz", **feeds)
    doc = _json([str(path), "--inputs", str(tmp_path / "prefill.npz"), "--compare", "ort",
                 "--outputs-out", str(tmp_path / "out.npz")])
    assert doc["kind"]["reason"] == "--inputs given; a decoder by its past KV input 'past_key_values.0.key'"
    assert doc["compare"]["agrees"], doc["compare"]
    ref = _ort(path, feeds)
    with np.load(tmp_path / "out.npz") as out:
        assert sorted(out) == sorted(ref)
        for name in ref:
            _close(out[name], ref[name])
