"""The ``tiny-gqa`` fixture (issue #20): a decoder whose attention is com.microsoft
GroupQueryAttention in the onnxruntime-genai builder's form, generated without an
exporter, so that the device decoder's KV cache and decode-step capture have a model
on a machine with no torch (tests/test_cuda_device_decode.py decodes it on the fake).

- the graph has the builder's conventions: inputs input_ids, attention_mask and past KV
  ``[batch, kv_heads, past, head_dim]`` (no position ids); per layer one
  GroupQueryAttention over the packed QKV with rotary inside (``do_rotary=1``, the
  cos_cache / sin_cache initializers) and the builder's mask subgraph (seqlens_k =
  ReduceSum(mask) - 1 as int32, total_sequence_length = the mask's width as int32);
  what the export hints and the device KV cache read from it;
- it resolves with no unsupported op, each GroupQueryAttention on the ``gqa`` kernel;
- ``onnx-prep run --compare ort`` (CPU, the prepared runtime): 16 greedy tokens at batch
  1 and 2 identical to ONNX Runtime's, the first step's logits within LOGIT_RTOL of their
  range (ONNX Runtime as the oracle; skipped without it).
The generator's semantics (ONNX Runtime against an independent numpy forward with KV
head grouping, the KV cache against one prefill, byte-identical files) are in
tests/test_fixture.py, parametrized over the gqa attention.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import helper
from typer.testing import CliRunner

from onnx_prep.cli.app import app
from onnx_prep.fixtures import PRESETS, generate
from onnx_prep.fixtures.decoder_weights import GQA_CONTEXT_LENGTH

TOKENS = 16
LOGIT_RTOL = 1e-5  # x the first step's logit range: fp32 against fp32 (1.9e-5 / 22.7 = 8e-7 measured)
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]]
cli = CliRunner()


@pytest.fixture(scope="module")
def tiny_gqa(tmp_path_factory):
    return generate("tiny-gqa", tmp_path_factory.mktemp("tiny-gqa"))


def test_the_graph_has_the_builders_inputs_and_one_group_query_attention_per_layer(tiny_gqa):
    cfg = PRESETS["tiny-gqa"]
    onnx.checker.check_model(str(tiny_gqa))
    model = onnx.load(str(tiny_gqa), load_external_data=False)
    g = model.graph
    dims = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim] for v in (*g.input, *g.output)}
    assert [v.name for v in g.input][:2] == ["input_ids", "attention_mask"] and "position_ids" not in dims
    assert dims["attention_mask"] == ["batch", "total_seq"]
    assert dims["past_key_values.3.value"] == ["batch", 2, "past_seq", 64]
    assert dims["present.0.key"] == ["batch", 2, "total_seq", 64]
    producers = {o: n for n in g.node for o in n.output}
    gqa = [n for n in g.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == cfg.layers and all(n.domain == "com.microsoft" for n in gqa)
    attrs = {a.name: helper.get_attribute_value(a) for a in gqa[0].attribute}
    assert attrs == {"num_heads": 8, "kv_num_heads": 2, "do_rotary": 1, "rotary_interleaved": 0,
                     "local_window_size": -1, "scale": pytest.approx(1 / 8)}
    ins = list(gqa[1].input)
    assert ins[1:5] == ["", "", "past_key_values.1.key", "past_key_values.1.value"]  # packed QKV, past apart
    assert ins[7:] == ["cos_cache", "sin_cache"]
    assert list(gqa[1].output[1:]) == ["present.1.key", "present.1.value"]
    qkv = producers[ins[0]]
    assert qkv.op_type == "MatMulNBits" and helper.get_attribute_value(qkv.attribute[1]) == (8 + 2 * 2) * 64
    # the builder's mask subgraph: seqlens_k = int32(ReduceSum(mask) - 1), total = int32(width)
    chain = []
    name = ins[5]
    while name in producers and producers[name].op_type != "Constant":
        chain.append(producers[name].op_type)
        name = producers[name].input[0]
    assert (chain, name) == (["Cast", "Sub", "ReduceSum"], "attention_mask")
    assert [producers[ins[6]].op_type, producers[producers[ins[6]].input[0]].op_type] == ["Cast", "Gather"]
    init = {t.name: t for t in g.initializer}
    for table in ("cos_cache", "sin_cache"):  # weights like every other: external, in the data file
        assert list(init[table].dims) == [GQA_CONTEXT_LENGTH, 32]
        assert init[table].data_location == onnx.TensorProto.EXTERNAL


def test_it_resolves_with_no_unsupported_op_its_kv_kept_on_the_device(tiny_gqa):
    from onnx_prep.core.cuda.device_kv_cache import kv_pairs
    from onnx_prep.core.decode.export_hints import ExportHints
    from onnx_prep.core.model.resolution import resolve_model

    resolved = resolve_model(tiny_gqa)
    assert resolved.unsupported == ()
    kernels = {n.name: n.kernel for n in resolved.nodes if n.op_type == "GroupQueryAttention"}
    assert kernels == {f"layers.{i}.attn.gqa": "gqa" for i in range(4)}
    pairs, ids, why = kv_pairs(resolved)  # what DeviceDecoder asks before keeping the KV on the device
    assert why == "" and ids == "input_ids" and len(pairs) == 8
    assert pairs[0] == ("past_key_values.0.key", "present.0.key")
    hints = ExportHints.for_model(tiny_gqa)  # the graph states the KV geometry, as a builder export's does
    assert (hints.kv_heads, hints.head_dim) == (2, 64)


@pytest.mark.parametrize("batch", [1, 2])
def test_onnx_prep_run_decodes_onnx_runtimes_tokens(tiny_gqa, batch):
    from conftest import ort_or_skip

    ort_or_skip()
    args = ["run", str(tiny_gqa), "--tokens", str(TOKENS), "--compare", "ort", "--cache-policy", "disabled", "--json"]
    for row in PROMPTS[:batch]:
        args += ["--prompt-ids", ",".join(map(str, row))]
    out = cli.invoke(app, args)
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    cmp = doc["compare"]
    assert doc["io"]["attention_mask"] == "attention_mask" and doc["io"]["position_ids"] is None
    assert np.shape(doc["tokens"]) == (batch, TOKENS)
    assert cmp["identical"] and doc["tokens"] == cmp["tokens"], cmp
    assert cmp["first_step_max_abs_logit_diff"] <= LOGIT_RTOL * cmp["first_step_logit_range"], cmp
    for row in doc["tokens"]:  # guards the comparison: a collapsed output would agree by accident
        assert len(set(row)) >= TOKENS // 2, row
    if batch == 2:
        assert doc["tokens"][0] != doc["tokens"][1]  # two prompts, two continuations
