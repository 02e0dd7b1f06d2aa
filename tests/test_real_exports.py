"""Real exports (fixtures/real_exports.py): the onnxruntime-genai builder's and
MatMulNBitsQuantizer's output on tiny random Llama / Qwen2 checkpoints.

Every test here skips, saying which tools are missing, without the ``exports`` extra
(conftest ``builder_export`` / ``quantizer_export``). What they prove today: I/O
discovery needs no io-map for either exporter, ``run --runtime ort`` decodes each
export exactly as a hand-written ONNX Runtime greedy loop does, and ``resolve`` says
precisely what it cannot take yet (``EXPECTED_RESOLVE``, edited as kernels land).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import ort_or_skip, real_export
from onnx_prep.cli.app import app
from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.decode.export_hints import ExportHints
from onnx_prep.core.errors import EXIT_OK, EXIT_UNUSABLE
from onnx_prep.fixtures.real_exports import EXPORTS, LLAMA

cli = CliRunner()
HEAD_DIM = LLAMA.hidden // LLAMA.heads
# What resolve says of each export today: the set of unsupported ops it lists, or
# ("refused", text) where it refuses the model before listing any. Edit a row when a
# kernel or a conformance fix lands; the test then holds the new answer.
# The builder's Llama graphs resolve completely (GroupQueryAttention, the norms and
# RotaryEmbedding have native kernels; SimplifiedLayerNormalization in the default
# domain and the builder's scalar-declared Constants pass conformance, as in ONNX
# Runtime). The tied Qwen2's embedding is a GatherBlockQuantized whose data is a
# Reshape of the LM head's weight, folded at resolve (core/model/weight_views.py).
EXPECTED_RESOLVE = {
    "builder-llama-acc4-b32": set(),
    "builder-llama-acc1-b32-zp": set(),
    "builder-llama-acc4-b128-zp": set(),
    "builder-llama-qdq-b32": set(),
    "builder-qwen2-acc4-b32": set(),
    "quantizer-llama-nbits-sym": set(),
    "quantizer-llama-nbits-asym": set(),
    "quantizer-llama-qdq-sym": set(),
    "quantizer-llama-qdq-asym": set(),
}


def _name(path) -> str:
    """The EXPORTS name of a cached export (its folder is ``<name>-<key>``)."""
    return path.parent.name.rsplit("-", 1)[0]


def test_expected_resolve_table_covers_every_export():
    assert set(EXPECTED_RESOLVE) == set(EXPORTS)


def _check_discovered(path):
    io = DecoderIO.from_model(path)
    assert io.input_ids.name == "input_ids"
    assert io.attention_mask is not None and io.attention_mask.name == "attention_mask"
    assert io.position_ids is None  # neither exporter takes them: both derive positions from the mask
    assert io.logits == "logits" and io.vocab_size == LLAMA.vocab
    assert io.kv_layout == "bhsd"
    assert [p.layer for p in io.kv] == list(range(LLAMA.layers))
    for p in io.kv:
        assert (p.past_key.name, p.past_value.name) == (f"past_key_values.{p.layer}.key",
                                                        f"past_key_values.{p.layer}.value")
        assert (p.present_key, p.present_value) == (f"present.{p.layer}.key", f"present.{p.layer}.value")
        assert (p.kv_heads, p.key_head_dim, p.value_head_dim) == (LLAMA.kv_heads, HEAD_DIM, HEAD_DIM)
    return io


def test_builder_export_discovered_without_io_map(builder_export):
    io = _check_discovered(builder_export)
    # seqlens_k / total_sequence_length are computed inside the builder's graph from the mask
    assert dict(io.extras) == {}
    shape = io.kv[0].past_key.shape
    assert isinstance(shape[3], str), "the builder's head dim is symbolic: the hints gave it"


def test_builder_hints_from_config_and_graph_agree(builder_export):
    import onnx

    by_config = ExportHints.for_model(builder_export)
    assert by_config.source.endswith("genai_config.json")
    assert (by_config.kv_heads, by_config.head_dim, by_config.context_length) == (
        LLAMA.kv_heads, HEAD_DIM, LLAMA.context)
    graph = onnx.load(builder_export, load_external_data=False).graph
    by_graph = ExportHints.for_model(None, graph=graph)
    assert by_graph.source.startswith("graph (GroupQueryAttention")
    assert (by_graph.kv_heads, by_graph.head_dim) == (LLAMA.kv_heads, HEAD_DIM)


def test_quantizer_export_discovered_without_io_map(quantizer_export):
    io = _check_discovered(quantizer_export)
    assert dict(io.extras) == {}


def _ort_greedy(path, prompt: np.ndarray, tokens: int) -> np.ndarray:
    """The oracle: ONNX Runtime fed by hand as both exporters expect (int64 ids and a
    mask of ones over past + new tokens, an empty past of (batch, kv heads, 0, head
    dim), present fed back as past), greedy on the last position's logits."""
    ort = ort_or_skip()
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    batch = prompt.shape[0]
    past = {f"past_key_values.{i}.{k}": np.zeros((batch, LLAMA.kv_heads, 0, HEAD_DIM), np.float32)
            for i in range(LLAMA.layers) for k in ("key", "value")}
    ids, out = prompt.astype(np.int64), []
    for _ in range(tokens):
        total = ids.shape[1] + next(iter(past.values())).shape[2]
        feeds = {"input_ids": ids, "attention_mask": np.ones((batch, total), np.int64), **past}
        names = [o.name for o in sess.get_outputs()]
        res = dict(zip(names, sess.run(names, feeds)))
        nxt = res["logits"][:, -1, :].argmax(-1)
        out.append(nxt)
        ids = nxt[:, None].astype(np.int64)
        past = {n: res[n.replace("past_key_values", "present")] for n in past}
    return np.stack(out, axis=1)


def _run_json(path, *args) -> dict:
    result = cli.invoke(app, ["run", str(path), "--runtime", "ort", "--tokens", "8", *args, "--json"])
    assert result.exit_code == EXIT_OK, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("prompts", [[[1, 2, 3]], [[1, 2, 3], [7, 40, 9]]], ids=["batch1", "batch2"])
def test_run_ort_builder_matches_direct_ort_loop(builder_export, prompts):
    args = [a for row in prompts for a in ("--prompt-ids", ",".join(map(str, row)))]
    doc = _run_json(builder_export, *args)
    assert doc["io"]["source"] == "discovered"
    assert doc["tokens"] == _ort_greedy(builder_export, np.array(prompts), 8).tolist()


@pytest.mark.parametrize("prompts", [[[1, 2, 3]], [[1, 2, 3], [7, 40, 9]]], ids=["batch1", "batch2"])
def test_run_ort_quantizer_matches_direct_ort_loop(quantizer_export, prompts):
    args = [a for row in prompts for a in ("--prompt-ids", ",".join(map(str, row)))]
    doc = _run_json(quantizer_export, *args)
    assert doc["tokens"] == _ort_greedy(quantizer_export, np.array(prompts), 8).tolist()


def test_builder_context_length_refused_before_loading(builder_export):
    result = cli.invoke(app, ["run", str(builder_export), "--runtime", "ort", "--prompt-ids", "1,2,3",
                              "--tokens", str(LLAMA.context)])
    assert result.exit_code == EXIT_UNUSABLE
    line = result.output.strip()
    assert "\n" not in line and "Traceback" not in line
    assert f"context length {LLAMA.context}" in line and "genai_config.json" in line


def _check_resolve(path):
    result = cli.invoke(app, ["resolve", str(path), "--json"])
    expected = EXPECTED_RESOLVE[_name(path)]
    if isinstance(expected, tuple):
        assert result.exit_code == EXIT_UNUSABLE, result.output
        assert expected[1] in result.output
        return
    # an op with no kernel is exit 2, after the full record on stdout (docs/resolve.md)
    assert result.exit_code == (EXIT_UNUSABLE if expected else EXIT_OK), result.output
    unsupported = {u["op_type"] if isinstance(u, dict) else u for u in json.loads(result.stdout)["unsupported"]}
    assert unsupported == expected


def test_resolve_builder_export_lists_what_is_unsupported(builder_export):
    _check_resolve(builder_export)


def test_resolve_quantizer_export_lists_what_is_unsupported(quantizer_export):
    _check_resolve(quantizer_export)


def test_export_is_cached_by_content(builder_export):
    """A second ask serves the same files from the cache: nothing regenerated."""
    from onnx_prep.fixtures.real_exports import ensure_export

    before = builder_export.stat().st_mtime_ns
    assert ensure_export(_name(builder_export)) == builder_export
    assert builder_export.stat().st_mtime_ns == before


def test_generation_is_deterministic(tmp_path, monkeypatch):
    """Generated again into an empty cache, a builder export has the same bytes, and
    its producer_version is the builder's release, not the commit of the checkout its
    venv lies in (which would change the bytes with every commit here)."""
    first = real_export("builder-llama-acc4-b32")
    monkeypatch.setenv("ONNX_PREP_CACHE", str(tmp_path / "cache"))
    again = real_export("builder-llama-acc4-b32")
    assert again != first
    for name in ("model.onnx", "model.onnx.data"):
        assert (again.parent / name).read_bytes() == (first.parent / name).read_bytes(), name
    import onnx
    import onnxruntime_genai

    stamped = onnx.load(again, load_external_data=False).producer_version
    assert stamped.endswith(f"+{onnxruntime_genai.__commit__[:7]}"), stamped


def test_fixture_command_writes_a_real_export(quantizer_export, tmp_path):
    out = tmp_path / "out"
    result = cli.invoke(app, ["fixture", _name(quantizer_export), str(out), "--json"])
    assert result.exit_code == EXIT_OK, result.output
    doc = json.loads(result.stdout)
    assert doc["model"] == str(out / "model.onnx") and doc["cached"] == str(quantizer_export)
    assert (out / "model.onnx.data").read_bytes() == (quantizer_export.parent / "model.onnx.data").read_bytes()


def test_fixture_command_refuses_an_unknown_export_and_shape_options(tmp_path):
    result = cli.invoke(app, ["fixture", "builder-nope", str(tmp_path)])
    assert result.exit_code == EXIT_UNUSABLE and "unknown real export 'builder-nope'" in result.output
    result = cli.invoke(app, ["fixture", "builder-llama-acc4-b32", str(tmp_path), "--layers", "3"])
    assert result.exit_code == EXIT_UNUSABLE and "synthetic presets" in result.output


def test_the_tied_qwen2_weight_is_one_read_and_one_prepack():
    """The builder's Reshape-fed GatherBlockQuantized folded (core/model/weight_views.py):
    the LM head's int4 weight and its scales are each read once by the plan, each read
    feeding one prepack, the matmul layout the gather reads too
    (core/kernels/tied_embedding.py), as for the synthetic fixture's tie."""
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.core.plan.execution_plan import build_prepared_execution_plan
    from onnx_prep.core.plan.task import TaskKind

    path = real_export("builder-qwen2-acc4-b32")
    resolved = resolve_model(path)
    [fold] = resolved.folded_views
    assert (fold.node, fold.source) == ("/model/embed_tokens/GatherBlockQuantized", "lm_head.MatMul.weight_Q4")
    assert (fold.source_dims, fold.dims) == ((LLAMA.vocab, LLAMA.hidden // 32, 16), (LLAMA.vocab, LLAMA.hidden // 2))
    assert [op for op, _ in fold.through] == ["Reshape"]
    plan = build_prepared_execution_plan(resolved)
    for weight in ("lm_head.MatMul.weight_Q4", "lm_head.MatMul.weight_scales"):
        read = f"S.read_source:{weight}"
        [prepack] = [t for t in plan.session_tasks if read in t.dependencies]  # one object for both nodes
        assert prepack.kind is TaskKind.PREPACK
        assert plan.by_key[prepack.publishes].request.layout.split(".")[0] == "int4mm"
