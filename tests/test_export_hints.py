"""ExportHints (core/decode/export_hints.py) on the small fixture with its declared
shapes edited the way exporters write them: a symbolic head dim given by a
``genai_config.json`` beside the model, a fixed batch or sequence dim, a context length.
Needs no extra: the real exports' own tests are in test_real_exports.py."""
from __future__ import annotations

import json

import onnx
import pytest
from typer.testing import CliRunner

from onnx_prep.cli.app import app
from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.decode.export_hints import ExportHints
from onnx_prep.core.errors import EXIT_OK, EXIT_UNUSABLE, ModelIOError

cli = CliRunner()
KV_HEADS, HEAD_DIM = 4, 32  # the small fixture: hidden 128, 4 heads


def _edit_inputs(path, edit) -> None:
    """Rewrite the model file's graph inputs in place (its data file is untouched)."""
    proto = onnx.load(path, load_external_data=False)
    for vi in proto.graph.input:
        edit(vi.name, vi.type.tensor_type.shape.dim)
    path.write_bytes(proto.SerializeToString())


def _symbolic_head_dim(name, dims):
    if name.startswith("past_key_values"):
        dims[3].Clear()
        dims[3].dim_param = "kv_cache_dim"


def _genai_config(path, **decoder) -> None:
    doc = {"model": {"context_length": decoder.pop("context_length", 64),
                     "decoder": {"filename": path.name, "num_key_value_heads": KV_HEADS,
                                 "head_size": HEAD_DIM, **decoder}}}
    (path.parent / "genai_config.json").write_text(json.dumps(doc))


def test_symbolic_head_dim_needs_a_hint(small_llm_copy):
    _edit_inputs(small_llm_copy, _symbolic_head_dim)
    with pytest.raises(ModelIOError, match="no static heads/head_dim"):
        DecoderIO.from_model(small_llm_copy)


def test_symbolic_head_dim_from_genai_config(small_llm_copy):
    _edit_inputs(small_llm_copy, _symbolic_head_dim)
    _genai_config(small_llm_copy)
    io = DecoderIO.from_model(small_llm_copy)
    assert {(p.kv_heads, p.key_head_dim, p.value_head_dim) for p in io.kv} == {(KV_HEADS, HEAD_DIM, HEAD_DIM)}
    assert io.empty_past(2)["past_key_values.0.key"].shape == (2, KV_HEADS, 0, HEAD_DIM)


def test_genai_config_of_another_file_is_ignored(small_llm_copy):
    _genai_config(small_llm_copy, filename="other.onnx")
    assert ExportHints.for_model(small_llm_copy).source is None  # the graph (no GQA) says nothing


def test_io_map_wins_over_the_hints(small_llm_copy):
    _edit_inputs(small_llm_copy, _symbolic_head_dim)
    _genai_config(small_llm_copy, head_size=HEAD_DIM * 2)
    io = DecoderIO.from_model(small_llm_copy, io_map={"head_dim": HEAD_DIM})
    assert io.kv[0].key_head_dim == HEAD_DIM


def test_run_with_symbolic_head_dim_decodes_as_the_original(small_llm_path, small_llm_copy):
    """The hinted model decodes the same tokens as the untouched fixture."""
    pytest.importorskip("onnxruntime", reason="onnxruntime not installed: run --runtime ort skipped")
    _edit_inputs(small_llm_copy, _symbolic_head_dim)
    _genai_config(small_llm_copy)
    docs = []
    for path in (small_llm_path, small_llm_copy):
        result = cli.invoke(app, ["run", str(path), "--runtime", "ort", "--tokens", "6", "--json"])
        assert result.exit_code == EXIT_OK, result.output
        docs.append(json.loads(result.stdout))
    assert docs[0]["tokens"] == docs[1]["tokens"]


def _refused(path, *args) -> str:
    result = cli.invoke(app, ["run", str(path), *args])
    assert result.exit_code == EXIT_UNUSABLE, result.output
    line = result.output.strip()
    assert "\n" not in line and "Traceback" not in line
    return line


def test_fixed_batch_refused_before_loading(small_llm_copy):
    def fix_batch(name, dims):
        dims[0].Clear()
        dims[0].dim_value = 1
    _edit_inputs(small_llm_copy, fix_batch)
    line = _refused(small_llm_copy, "--batch", "2", "--tokens", "4")
    assert "fixes the batch at 1" in line and "'input_ids'" in line and "--batch 1" in line


def test_fixed_sequence_refused_before_loading(small_llm_copy):
    def fix_seq(name, dims):
        if name in ("input_ids", "position_ids"):
            dims[1].Clear()
            dims[1].dim_value = 1
    _edit_inputs(small_llm_copy, fix_seq)
    line = _refused(small_llm_copy, "--prompt-ids", "1,2,3", "--tokens", "4")
    assert "fixes the sequence length at 1" in line and "a step of 3 token(s)" in line


def test_context_length_refused_before_loading(small_llm_copy):
    _genai_config(small_llm_copy, context_length=8)
    line = _refused(small_llm_copy, "--prompt-ids", "1,2,3", "--tokens", "7")
    assert "need 9 positions" in line and "context length 8" in line and "genai_config.json" in line


def _scramble_payload(path) -> None:
    """Every payload byte changed, the size kept: a run that loaded anything would fail
    on it (a digest, or an op's numbers), so a refusal naming a dim came first."""
    data = path.parent / f"{path.name}.data"
    data.write_bytes(bytes(b ^ 0x5A for b in data.read_bytes()))


def _fix(names, axis, value):
    def edit(name, dims):
        if name in names:
            dims[axis].Clear()
            dims[axis].dim_value = value
    return edit


@pytest.mark.parametrize("name,role", [("position_ids", "position ids"),
                                       ("past_key_values.1.value", "past value of layer 1")])
def test_a_fixed_batch_of_any_decoder_input_refused_before_loading(small_llm_copy, name, role):
    """input_ids symbolic, another input fixing the batch: refused naming it, not failing
    inside an op."""
    _edit_inputs(small_llm_copy, _fix({name}, 0, 1))
    _scramble_payload(small_llm_copy)
    line = _refused(small_llm_copy, "--batch", "2", "--tokens", "4")
    assert f"fixes the batch at 1 (dim 0 of its {role} {name!r}); batch 2 asked" in line
    assert "--batch 1" in line


@pytest.fixture
def builder_copy(tmp_path):
    """A private copy of a builder export (it has an attention mask; the fixture has none)."""
    import shutil

    from conftest import real_export

    src = real_export("builder-llama-acc4-b32")
    shutil.copytree(src.parent, tmp_path / "m")
    return tmp_path / "m" / src.name


def test_a_fixed_mask_length_refused_before_loading(builder_copy):
    """A mask fixed at the prompt's length takes the prefill only: the first decode step
    feeds one position more."""
    _edit_inputs(builder_copy, _fix({"attention_mask"}, 1, 3))
    _scramble_payload(builder_copy)
    line = _refused(builder_copy, "--prompt-ids", "1,2,3", "--tokens", "4")
    assert ("fixes the sequence length at 3 (dim 1 of its attention mask 'attention_mask'); "
            "a step with 4 position(s) asked (a prompt of 3, 4 new tokens)") in line
    line = _refused(builder_copy, "--prompt-ids", "1,2,3,4", "--tokens", "1")
    assert "a step with 4 position(s) asked (a prompt of 4, 1 new tokens)" in line


def test_a_fixed_sequence_takes_a_request_that_fits_it(builder_copy):
    """The check refuses only what the dims cannot take: ids and mask fixed at the
    prompt's length, one new token, decodes as the untouched export does."""
    pytest.importorskip("onnxruntime", reason="onnxruntime not installed: run --runtime ort skipped")
    from conftest import real_export

    _edit_inputs(builder_copy, _fix({"attention_mask", "input_ids"}, 1, 3))
    docs = []
    for path in (real_export("builder-llama-acc4-b32"), builder_copy):
        result = cli.invoke(app, ["run", str(path), "--prompt-ids", "1,2,3", "--tokens", "1", "--json"])
        assert result.exit_code == EXIT_OK, result.output
        docs.append(json.loads(result.stdout))
    assert docs[0]["tokens"] == docs[1]["tokens"]


def test_the_batch_sweep_refuses_a_fixed_batch_before_loading(small_llm_copy):
    from onnx_prep.core.errors import UsageError
    from onnx_prep.core.profile.batch_sweep import SweepOptions, record_batch_sweep

    _edit_inputs(small_llm_copy, _fix({"input_ids"}, 0, 1))
    _scramble_payload(small_llm_copy)
    with pytest.raises(UsageError) as exc:
        record_batch_sweep(small_llm_copy, SweepOptions(batches=(1, 2), tokens=2, repeat=1))
    assert "fixes the batch at 1 (dim 0 of its token ids 'input_ids'); batch 2 asked" in exc.value.message


@pytest.mark.parametrize("window, expect", [
    ({"window_size": 4, "layers": [1], "cache_slack": 2}, {"past_key_values.1.key": 6, "past_key_values.1.value": 6}),
    ({"window_size": 4, "layers": [0]}, {"past_key_values.0.key": 4, "past_key_values.0.value": 4}),
    ({"window_size": 0, "layers": [1]}, {}),  # malformed: nothing said, the graph is not asked either
    ({"window_size": 4, "layers": ["1"]}, {}),
    ({"window_size": 4, "layers": [1], "cache_slack": -1}, {}),
])
def test_a_sliding_window_config_gives_its_layers_past_a_fixed_capacity(small_llm_copy, window, expect):
    _edit_inputs(small_llm_copy, _symbolic_head_dim)
    _genai_config(small_llm_copy, sliding_window=window)
    assert dict(ExportHints.for_model(small_llm_copy).kv_capacity) == expect
    io = DecoderIO.from_model(small_llm_copy)
    assert {p.past_key.name: p.capacity for p in io.kv if p.capacity} == \
        {k: v for k, v in expect.items() if k.endswith(".key")}
    past = io.empty_past(3)
    for name, capacity in expect.items():
        assert past[name].shape == (3, KV_HEADS, capacity, HEAD_DIM) and not past[name].any()
    for p in io.kv:  # the other layers grow from nothing
        if p.past_key.name not in expect:
            assert p.capacity is None and past[p.past_key.name].shape == (3, KV_HEADS, 0, HEAD_DIM)


def test_a_sliding_window_cache_in_the_graph_gives_its_past_inputs_a_capacity():
    # Without a config: each GroupQueryAttention with sliding_window_cache=1 says its
    # past inputs hold local_window_size positions
    from onnx import TensorProto, helper

    def gqa(layer, **attrs):
        return helper.make_node("GroupQueryAttention", ["q", "k", "v", f"past.{layer}.key", f"past.{layer}.value",
                                                        "seqlens_k", "total"], [f"o{layer}", f"pk{layer}", f"pv{layer}"],
                                domain="com.microsoft", num_heads=4, kv_num_heads=2, **attrs)

    graph = helper.make_graph([gqa(0, local_window_size=8, sliding_window_cache=1), gqa(1, local_window_size=8),
                               gqa(2)], "g", [], [helper.make_tensor_value_info("o0", TensorProto.FLOAT, None)])
    hints = ExportHints.for_model(None, graph=graph)
    assert dict(hints.kv_capacity) == {"past.0.key": 8, "past.0.value": 8}
