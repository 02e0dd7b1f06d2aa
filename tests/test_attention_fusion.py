"""The ``attention`` fusion pattern (core/model/attention_pattern.py) and the op it makes,
``onnx_prep.fused::Attention`` on the gqa kernel's C code (core/ops/attention.py,
native/attention.py ``attention_with_past``).

What resolve makes of the fixtures (one node per block for the nine of its attention,
the shared causal mask pruned), decodes through our runtime fused against ``--no-fuse``
and ONNX Runtime at batch 1 and 2 (the fixtures take no attention_mask: every row of a
batch has the prompt's length, no padding), crafted graphs (onnx.helper) fused against
ONNX Runtime for decode steps, prompts with and without a past, one kv head, a Div
scale and masks bounds fed as inputs (the broadcast ones take the numpy formula), one
crafted graph per near-miss reason, and the kernel against the numpy formula on random
shapes (hypothesis) and each ISA against the scalar twin.

Tolerances: OUT_ATOL / OUT_RTOL and ISA_ATOL / ISA_RTOL of test_native_gqa (the same
kernel: fp32 dot products summed in another order than numpy's matmul); whole models
LOGIT_RTOL of the step's logit range (test_fusion).
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from conftest import ort_or_skip
from gil_release import run_checking_gil_release
from test_fusion import LOGIT_RTOL, MASK_NODES, _const, _run, _save, _vi
from test_native_gqa import ISA_ATOL, ISA_RTOL, OUT_ATOL, OUT_RTOL

from onnx_prep import native
from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.decode.generation import greedy_decode
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.ops.attention import reference_attention
from onnx_prep.core.runtime.session import Session

F32, I64 = TensorProto.FLOAT, TensorProto.INT64
TOKENS = 16
BLOCK = ("k_cache", "v_cache", "k_transpose", "scores", "scale", "mask", "softmax", "context", "context_transpose")
ISAS = [i for i in ("avx2", "avx512") if native.unavailable_reason(i) is None] or \
    [pytest.param("avx2", marks=pytest.mark.skip(reason="no SIMD ISA on this CPU/build"))]


@pytest.fixture(scope="module")
def medium_graph_path(tmp_path_factory):
    """The medium preset's graph (16 blocks) at small widths (as test_fusion's)."""
    from onnx_prep.fixtures import FixtureConfig, generate

    cfg = FixtureConfig.preset("medium").replace(hidden=128, intermediate=256, heads=4, vocab=512)
    return generate(cfg, tmp_path_factory.mktemp("medium-graph"))


# ------------------------------------------------------------------ what resolve makes

@pytest.mark.parametrize("model, blocks, nodes", [("tiny_llm_path", 4, (155, 111)),
                                                   ("medium_graph_path", 16, (515, 375))])
def test_every_attention_of_the_fixtures_becomes_one_node(model, blocks, nodes, request):
    path = request.getfixturevalue(model)
    fused = resolve_model(path)
    without = resolve_model(path, fuse=False)
    assert Counter(f.pattern for f in fused.fusions)["attention"] == blocks and not fused.near_misses
    # nodes per decode step: rms_norm, rotary and silu fused alone, then attention too: 8 fewer
    # per block and the 12 of the shared mask (6 nodes, 6 constants) only attention read
    # (those two pruned the two constants only they read: const.rms_eps, const.split_half)
    others = sum(len(f.fused_from) - 1 for f in fused.fusions if f.pattern != "attention") + 2
    assert (len(without.nodes) - others, len(fused.nodes)) == nodes
    assert nodes[0] - nodes[1] == 8 * blocks + len(MASK_NODES)
    assert not {n.name for n in fused.nodes} & MASK_NODES
    for i in range(blocks):
        node = next(n for n in fused.nodes if n.name == f"layers.{i}.attn.context_transpose")
        assert (node.domain, node.op_type, node.kernel) == ("onnx_prep.fused", "Attention", "gqa")
        assert node.fused_from == tuple(f"layers.{i}.attn.{s}" for s in BLOCK)
        assert node.inputs == (f"layers.{i}.attn.q_rope.add/out", f"layers.{i}.attn.k_rope.add/out",
                               f"layers.{i}.attn.v_heads.transpose/out", f"past_key_values.{i}.key",
                               f"past_key_values.{i}.value", "mask.past_len/out", "mask.total_len/out")
        # the KV cache's present outputs are the fused node's: decode I/O is unchanged
        assert node.outputs == (f"layers.{i}.attn.context_transpose/out", f"present.{i}.key", f"present.{i}.value")
        head = 128 // 4 if blocks == 16 else 512 // 8
        assert node.attributes["scale"] == pytest.approx(1 / np.sqrt(head))
        assert node.attributes["mask_fill"] == float(np.finfo(np.float32).min)
    assert [v.name for v in fused.outputs] == [v.name for v in without.outputs]


# ------------------------------------------------------------ fused = unfused = ONNX Runtime

def _decode(path, prompts, fuse):
    io = DecoderIO.from_model(path)
    with Session(resolve_model(path, fuse=fuse)) as s:
        return greedy_decode(s, io, prompts, TOKENS, keep_logits=True)


PROMPTS = {1: np.array([[11, 5, 300, 7, 42, 9, 120, 3, 77, 18, 6, 250]]),
           2: np.array([[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 31, 409, 5, 77, 80, 12]])}


@pytest.mark.parametrize("model", ["tiny_zp_llm_path", "medium_graph_path"])
@pytest.mark.parametrize("batch", [1, 2])
def test_fused_attention_decodes_as_unfused_and_onnxruntime_for_16_tokens(model, batch, request):
    ort_or_skip()
    from onnx_prep.core.decode.ort_runner import OrtRunner

    path = request.getfixturevalue(model)
    prompts = PROMPTS[batch]
    fused, plain = _decode(path, prompts, True), _decode(path, prompts, False)
    ref = greedy_decode(OrtRunner(path, threads=1), DecoderIO.from_model(path), prompts, TOKENS, keep_logits=True)
    for step in range(TOKENS):  # step 0: the prompt (past empty), then decode steps over a past
        for row in range(batch):
            scale = LOGIT_RTOL * ref.logit_range[row, step]
            assert np.abs(fused.logits[step][row] - plain.logits[step][row]).max() <= scale, (row, step)
            assert np.abs(fused.logits[step][row] - ref.logits[step][row]).max() <= scale, (row, step)
    np.testing.assert_array_equal(fused.tokens, ref.tokens)
    np.testing.assert_array_equal(plain.tokens, ref.tokens)
    assert len({int(t) for t in ref.tokens.reshape(-1)}) > 3  # the tokens discriminate
    # the native kernel ran (the numpy formula appends nothing): every block's two
    # present buffers after the first step were appended in place
    blocks = sum(f.pattern == "attention" for f in resolve_model(path).fusions)
    assert fused.counters["kv_appended_in_place"] == 2 * blocks * (TOKENS - 1)


def test_fused_attention_reads_a_continued_prompt_over_a_past(medium_graph_path):
    """A prompt in two chunks at batch 2 (5 tokens over a past of 7): the causal mask
    inside a chunk and the past both count; fused within LOGIT_RTOL of unfused."""
    ids = np.array([[11, 5, 300, 7, 42, 9, 120, 3, 77, 18, 6, 250]] * 2)
    ids[1] = ids[1, ::-1]
    got = {}
    for fuse in (True, False):
        with Session(resolve_model(medium_graph_path, fuse=fuse)) as s:
            first = s.run(_feeds(ids[:, :7], None))
            got[fuse] = s.run(_feeds(ids[:, 7:], first))
    assert got[True]["present.15.key"].shape == (2, 4, 12, 32)
    for name in ("logits", "present.15.key", "present.15.value"):
        np.testing.assert_allclose(got[True][name], got[False][name], rtol=0,
                                   atol=LOGIT_RTOL * float(np.ptp(got[False][name])))


def _feeds(ids, previous, blocks=16, heads=4, head=32):
    """The medium graph's feeds for ``ids`` after ``previous`` outputs (None: an empty past)."""
    B, S = ids.shape
    past = 0 if previous is None else previous["present.0.key"].shape[2]
    feeds = {"input_ids": ids, "position_ids": np.tile(np.arange(past, past + S, dtype=np.int64), (B, 1))}
    for i in range(blocks):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = (np.zeros((B, heads, 0, head), np.float32) if previous is None
                                                     else previous[f"present.{i}.{kind}"])
    return feeds


# ------------------------------------------------------------------- crafted graphs

def attention_graph(tmp_path, *, kv_heads=4, cond="LessOrEqual", key_start=0, axis=-1, fill=None,
                    scale="mul", reread=None, bounds="shapes", name="attn"):
    """q [B, 4, S, 8], k / v [B, kv_heads, S, 8], past key / value [B, kv_heads, P, 8] ->
    attention over Concat(past, new) with the fixtures' causal mask, y [B, S, 4, 8] and
    the presents. ``bounds``: the mask's start / end from the shapes (past length, past
    + sequence) or fed as the graph inputs ``start``, ``end``; ``reread``: a value an
    Identity also reads (to a second output)."""
    Hd = 8
    fill = np.finfo(np.float32).min if fill is None else fill
    n = helper.make_node
    nodes = [n("Concat", ["past_key", "k"], ["present_key"], name="k_cache", axis=2),
             n("Concat", ["past_value", "v"], ["present_value"], name="v_cache", axis=2),
             n("Transpose", ["present_key"], ["kt"], name="k_transpose", perm=[0, 1, 3, 2]),
             n("MatMul", ["q", "kt"], ["scores"], name="scores")]
    if scale == "mul":
        nodes += [_const("alpha", np.float32(1 / np.sqrt(Hd))), n("Mul", ["scores", "alpha"], ["scaled"], name="scale")]
    else:
        nodes += [_const("root", np.float32(np.sqrt(Hd))), n("Div", ["scores", "root"], ["scaled"], name="scale")]
    inputs = [_vi("q", ["B", 4, "S", Hd]), _vi("k", ["B", kv_heads, "S", Hd]), _vi("v", ["B", kv_heads, "S", Hd]),
              _vi("past_key", ["B", kv_heads, "P", Hd]), _vi("past_value", ["B", kv_heads, "P", Hd])]
    if bounds == "shapes":
        nodes += [n("Shape", ["past_key"], ["p_shape"], name="past_shape", start=2, end=3),
                  n("Squeeze", ["p_shape"], ["start"], name="past_len"),
                  n("Shape", ["q"], ["s_shape"], name="seq_shape", start=2, end=3),
                  n("Squeeze", ["s_shape"], ["seq"], name="seq_len"),
                  n("Add", ["start", "seq"], ["end"], name="total_len")]
    else:
        inputs += [_vi("start", [], I64), _vi("end", [], I64)]
    nodes += [_const("zero", np.int64(key_start)), _const("one", np.int64(1)),
              _const("axes_0", np.array([0])), _const("axes_last", np.array([-1])),
              _const("zero_f", np.float32(0)), _const("fill", np.float32(fill)),
              n("Range", ["zero", "end", "one"], ["keys"], name="key_positions"),
              n("Range", ["start", "end", "one"], ["queries"], name="query_positions"),
              n("Unsqueeze", ["keys", "axes_0"], ["key_row"], name="key_row"),
              n("Unsqueeze", ["queries", "axes_last"], ["query_col"], name="query_col"),
              n(cond, ["key_row", "query_col"], ["allowed"], name="allowed"),
              n("Where", ["allowed", "zero_f", "fill"], ["mask"], name="additive"),
              n("Add", ["scaled", "mask"], ["masked"], name="mask"),
              n("Softmax", ["masked"], ["probs"], name="softmax", axis=axis),
              n("MatMul", ["probs", "present_value"], ["context"], name="context"),
              n("Transpose", ["context"], ["y"], name="context_transpose", perm=[0, 2, 1, 3])]
    outputs = [_vi("y", None), _vi("present_key", None), _vi("present_value", None)]
    if reread:
        nodes.append(n("Identity", [reread], ["side"], name="side_reader"))
        outputs.append(_vi("side", None))
    return _save(tmp_path, nodes, inputs, outputs, {}, name=name)


def attention_feeds(rng, *, B, S, P, kv_heads=4, start=None, end=None):
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    feeds = {"q": f(B, 4, S, 8), "k": f(B, kv_heads, S, 8), "v": f(B, kv_heads, S, 8),
             "past_key": f(B, kv_heads, P, 8), "past_value": f(B, kv_heads, P, 8)}
    if start is not None:
        feeds |= {"start": np.array(start, np.int64), "end": np.array(end, np.int64)}
    return feeds


@pytest.mark.parametrize("B, S, P, kw", [
    (2, 1, 5, {}),                                  # a decode step
    (2, 4, 3, {}),                                  # a prompt continued over a past
    (1, 5, 0, {}),                                  # a first prompt
    (2, 3, 6, {"kv_heads": 1, "scale": "div"}),     # one kv head for four query heads, a Div scale
    (2, 3, 4, {"bounds": "inputs", "start": 4, "end": 7}),  # bounds fed: the causal case
    (2, 1, 4, {"bounds": "inputs", "start": 0, "end": 1}),  # a [1, 1] mask broadcast: the formula
    (2, 3, 4, {"bounds": "inputs", "start": 6, "end": 7}),  # a one-row mask broadcast: the formula
])
def test_crafted_attention_fuses_and_matches_onnxruntime(tmp_path, B, S, P, kw):
    ort = ort_or_skip()
    graph_kw = {k: v for k, v in kw.items() if k in ("kv_heads", "scale", "bounds")}
    path = attention_graph(tmp_path, **graph_kw)
    resolved = resolve_model(path)
    assert [(f.pattern, f.node) for f in resolved.fusions] == [("attention", "context_transpose")]
    assert [n.op_type for n in resolved.nodes if n.op_type in ("Softmax", "Attention")] == ["Attention"]
    feeds = attention_feeds(np.random.default_rng(S * 10 + P), B=B, S=S, P=P, kv_heads=kw.get("kv_heads", 4),
                            start=kw.get("start"), end=kw.get("end"))
    theirs = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    for fuse in (True, False):
        ours = _run(path, feeds, fuse)
        np.testing.assert_allclose(ours["y"], theirs[0], rtol=OUT_RTOL, atol=OUT_ATOL)
        np.testing.assert_array_equal(ours["present_key"], theirs[1])
        np.testing.assert_array_equal(ours["present_value"], theirs[2])


# A mask the causal proof refuses (a Less condition, a key Range from 1, a fill of -100)
# fuses as MaskedAttention, the mask an input: tests/test_hf_attention_fusion.py
@pytest.mark.parametrize("kw, reason", [
    ({"axis": 2}, "Softmax axis 2 is not -1 (the last axis)"),
    ({"reread": "present_key"}, "present_key is also read by node side_reader"),
    ({"reread": "probs"}, "intermediate probs is used by node side_reader"),
])
def test_each_attention_near_miss_names_its_reason(tmp_path, kw, reason):
    resolved = resolve_model(attention_graph(tmp_path, **kw))
    assert not resolved.fusions
    assert [(m.pattern, m.node, m.reason) for m in resolved.near_misses] == [("attention", "softmax", reason)]


# ------------------------------------------------------------------------- the kernel

@st.composite
def shapes(draw):
    kv = draw(st.sampled_from([1, 2, 4]))
    return dict(B=draw(st.integers(1, 3)), KN=kv, N=kv * draw(st.sampled_from([1, 2, 4])),
                H=draw(st.sampled_from([8, 12, 16, 24, 40, 64])), P=draw(st.integers(0, 24)),
                S=draw(st.integers(1, 6)), seed=draw(st.integers(0, 2 ** 16)))


def kernel_inputs(B, KN, N, H, P, S, seed):
    rng = np.random.default_rng(seed)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    return f(B, N, S, H), f(B, KN, S, H), f(B, KN, S, H), f(B, KN, P, H), f(B, KN, P, H)


def formula(q, k, v, pk, pv):
    """The unfused ops in numpy, kv heads repeated for the query heads that read them."""
    G = q.shape[1] // k.shape[1]
    rep = [np.repeat(x, G, axis=1) for x in (k, v, pk, pv)]
    out, _, _ = reference_attention(q, *rep, pk.shape[2], pk.shape[2] + q.shape[2], scale=1 / np.sqrt(q.shape[3]),
                                    divide=False, mask_fill=float(np.finfo(np.float32).min))
    return out, np.concatenate([pk, k], axis=2), np.concatenate([pv, v], axis=2)


@settings(deadline=None, max_examples=60)
@given(shapes())
def test_the_kernel_matches_the_formula_on_random_shapes(case):
    inputs = kernel_inputs(**case)
    out, pk, pv = native.attention_with_past(*inputs, scale=1 / np.sqrt(case["H"]))
    want = formula(*inputs)
    np.testing.assert_allclose(out, want[0], rtol=OUT_RTOL, atol=OUT_ATOL)
    np.testing.assert_array_equal(pk, want[1])  # copies, never computed
    np.testing.assert_array_equal(pv, want[2])


@pytest.mark.parametrize("isa", ISAS)
def test_isa_paths_match_the_scalar_twin(isa):
    for case in (dict(B=2, KN=2, N=4, H=24, P=6, S=1), dict(B=1, KN=1, N=4, H=64, P=9, S=3),
                 dict(B=2, KN=4, N=4, H=136, P=0, S=4)):  # tails after 8 / 16 lanes, past the unroll
        inputs = kernel_inputs(**case, seed=7)
        scalar = native.attention_with_past(*inputs, scale=0.25, isa="scalar")
        assert native.last_kernel() == "scalar"
        got = native.attention_with_past(*inputs, scale=0.25, isa=isa)
        assert native.last_kernel() == isa
        np.testing.assert_allclose(got[0], scalar[0], rtol=ISA_RTOL, atol=ISA_ATOL)
        np.testing.assert_array_equal(got[1], scalar[1])
        np.testing.assert_array_equal(got[2], scalar[2])


def test_present_in_a_buffer_that_starts_at_the_past_gets_only_the_new_rows():
    q, k, v, pk, pv = kernel_inputs(B=2, KN=2, N=4, H=16, P=5, S=2, seed=3)
    buffers = [np.full((2, 2, 10, 16), np.nan, np.float32) for _ in range(2)]
    for buf, past in zip(buffers, (pk, pv)):
        buf[:, :, :5] = past
    views = tuple(b[:, :, :7] for b in buffers)
    out, got_k, got_v = native.attention_with_past(q, k, v, views[0][:, :, :5], views[1][:, :, :5], scale=0.25,
                                                   present=views)
    assert got_k is views[0] and got_v is views[1]
    np.testing.assert_array_equal(buffers[0][:, :, 5:7], k)
    assert np.isnan(buffers[0][:, :, 7:]).all()  # rows after the present untouched
    np.testing.assert_allclose(out, formula(q, k, v, pk, pv)[0], rtol=OUT_RTOL, atol=OUT_ATOL)


def test_the_kernel_releases_the_gil():
    inputs = kernel_inputs(B=2, KN=4, N=8, H=64, P=2048, S=4, seed=1)
    out, _, _ = run_checking_gil_release(lambda: native.attention_with_past(*inputs, scale=0.125))
    assert out.shape == (2, 4, 8, 64)


@pytest.mark.parametrize("change, needle", [
    (lambda x: x.__setitem__(0, x[0][0]), "must be 4-D (BNSH)"),
    (lambda x: x.__setitem__(1, x[1][:, :3]), "with KN dividing N"),
    (lambda x: x.__setitem__(3, x[3].astype(np.float16)), "every input must be float32"),
])
def test_inputs_the_kernel_cannot_take_are_one_line(change, needle):
    inputs = list(kernel_inputs(B=1, KN=4, N=4, H=8, P=2, S=1, seed=0))
    change(inputs)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")) as e:
        native.attention_with_past(*inputs, scale=1.0)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------- the CLI

def test_resolve_lists_attention_fusions_and_near_misses_in_text_and_json(tiny_llm_path, tmp_path):
    import json

    import jsonschema
    from typer.testing import CliRunner

    from onnx_prep.cli.app import app
    from onnx_prep.core.model.resolution_report import schema_path

    schema = json.loads(schema_path().read_text())
    result = CliRunner().invoke(app, ["resolve", str(tiny_llm_path), "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    jsonschema.validate(doc, schema)
    assert {"pattern": "attention", "count": 4,
            "nodes": [f"layers.{i}.attn.context_transpose" for i in range(4)]} in doc["fusion"]["patterns"]
    text = CliRunner().invoke(app, ["resolve", str(tiny_llm_path)]).stdout
    assert "4 attention" in text
    miss = attention_graph(tmp_path, axis=2)
    doc = json.loads(CliRunner().invoke(app, ["resolve", str(miss), "--json"]).stdout)
    jsonschema.validate(doc, schema)
    assert doc["fusion"]["near_misses"] == [{"pattern": "attention", "node": "softmax", "reason": (
        "Softmax axis 2 is not -1 (the last axis)")}]
    text = CliRunner().invoke(app, ["resolve", str(miss)]).stdout
    assert "fusion near-misses" in text and "is not -1" in text


def test_a_softmax_over_no_matmul_is_no_anchor(tmp_path):
    """A classifier's Softmax (over an input, not attention scores) lists no near-miss."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Softmax", ["r"], ["y"], name="softmax", axis=-1)]
    path = _save(tmp_path, nodes, [_vi("x", [2, 5])], [_vi("y", [2, 5])], {}, name="classifier")
    resolved = resolve_model(path)
    assert not resolved.fusions and not resolved.near_misses
