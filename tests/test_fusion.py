"""Pattern fusion at resolve (core/model/fusion.py): what resolve lists on the fixtures and
the torch-exported Llamas, fused against unfused through our runtime and against ONNX
Runtime, greedy tokens, and one crafted graph (onnx.helper) per near-miss reason.

Tolerances: a fused RMSNorm differs from the standard ops only by the native kernel's
summation order (RMSNORM_RTOL of test_native_norm, relative to |y| + max|gamma|); a
fused rotary by a few ulps of max|x| (ROTARY_ATOL_ULPS of test_native_rotary). Whole
models: logits within LOGIT_RTOL of the step's logit range (as test_greedy_tokens_ort).
"""
from __future__ import annotations

import json
from collections import Counter

import jsonschema
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from conftest import ort_or_skip
from onnx_prep.cli.app import app
from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.decode.generation import greedy_decode
from onnx_prep.core.io.external_data import ExternalDataReader
from onnx_prep.core.kernels.prepack import prepack_all, source_loader
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.model.resolution_report import resolution_report, schema_path
from onnx_prep.core.runtime.action_program import ActionProgram
from onnx_prep.core.runtime.session import Session, SessionOptions
from test_native_norm import RMSNORM_RTOL
from test_native_rotary import ROTARY_ATOL_ULPS

LOGIT_RTOL = 1e-5
TOKENS = 16
F32, I64 = TensorProto.FLOAT, TensorProto.INT64
H, D = 64, 8  # crafted graphs: hidden size, head size
# the fixtures' causal mask and the constants only it (and the attention scale) read
MASK_NODES = {"const.attn_scale", "const.axes_0", "const.neg_large", "const.one_i64", "const.zero_f32",
              "const.zero_i64", "mask.additive", "mask.allowed", "mask.key_positions", "mask.key_row",
              "mask.query_col", "mask.query_positions"}


def patterns(resolved) -> Counter:
    return Counter(f.pattern for f in resolved.fusions)


# ------------------------------------------------------------------ what resolve lists

def test_tiny_llm_fuses_every_norm_and_rotary_into_native_kernels(tiny_llm_path):
    fused, plain = resolve_model(tiny_llm_path), resolve_model(tiny_llm_path, fuse=False)
    assert patterns(fused) == {"rms_norm": 9, "rotary": 8, "attention": 4, "silu": 4} and not fused.near_misses
    assert (len(plain.nodes), len(fused.nodes)) == (255, 111)
    assert not plain.fusions and not plain.near_misses and not plain.fusion_enabled
    by_name = {n.name: n for n in fused.nodes}
    norm = by_name["layers.0.input_norm.scale"]  # named for the pattern's last node
    assert (norm.op_type, norm.kernel, dict(norm.attributes)) == (
        "SimplifiedLayerNormalization", "row_norm", {"axis": -1, "epsilon": pytest.approx(1e-5)})
    assert norm.inputs == ("embed_tokens.reshape/out", "layers.0.input_norm.weight")
    assert norm.fused_from == tuple(f"layers.0.input_norm.{s}" for s in (
        "square", "mean", "add_eps", "sqrt", "reciprocal", "normalize", "scale"))
    silu = by_name["layers.0.mlp.silu"]
    assert (silu.domain, silu.op_type, silu.kernel, dict(silu.attributes)) == (
        "com.microsoft", "QuickGelu", "activation", {"alpha": 1.0})
    assert silu.fused_from == ("layers.0.mlp.sigmoid", "layers.0.mlp.silu")
    rope = by_name["layers.0.attn.q_rope.add"]
    assert (rope.domain, rope.op_type, rope.kernel) == ("onnx_prep.fused", "RotaryEmbedding", "rotary")
    assert rope.inputs == ("layers.0.attn.q_heads.transpose/out", "rotary.cos_heads/out", "rotary.sin_heads/out")
    assert set(rope.fused_from) == {f"layers.0.attn.q_rope.{s}" for s in (
        "split", "neg", "rotate_half", "mul_cos", "mul_sin", "add")}
    # every node a fusion replaced is gone, and no other
    gone = {n for f in fused.fusions for n in f.fused_from} - set(by_name)
    # and the causal mask's nodes, which only the fused attention read (test_attention_fusion)
    assert {n.name for n in plain.nodes} - set(by_name) - gone == {"const.rms_eps", "const.split_half", *MASK_NODES}


@pytest.fixture(scope="module")
def medium_graph_path(tmp_path_factory):
    """The medium preset's graph (16 blocks) at small widths: the same 891 nodes per step."""
    from onnx_prep.fixtures import FixtureConfig, generate

    cfg = FixtureConfig.preset("medium").replace(hidden=128, intermediate=256, heads=4, vocab=512)
    return generate(cfg, tmp_path_factory.mktemp("medium-graph"))


def test_the_medium_graph_lists_33_norms_32_rotaries_16_attentions_and_16_silus(medium_graph_path):
    path = medium_graph_path
    fused, plain = resolve_model(path), resolve_model(path, fuse=False)
    assert patterns(fused) == {"rms_norm": 33, "rotary": 32, "attention": 16, "silu": 16} and not fused.near_misses
    assert (len(plain.nodes), len(fused.nodes)) == (891, 375)
    doc = resolution_report(fused)
    assert doc["fusion"]["patterns"] == [
        {"pattern": "rms_norm", "count": 33, "nodes": [f.node for f in fused.fusions if f.pattern == "rms_norm"]},
        {"pattern": "rotary", "count": 32, "nodes": [f.node for f in fused.fusions if f.pattern == "rotary"]},
        {"pattern": "attention", "count": 16,
         "nodes": [f"layers.{i}.attn.context_transpose" for i in range(16)]},
        {"pattern": "silu", "count": 16, "nodes": [f"layers.{i}.mlp.silu" for i in range(16)]}]
    assert doc["nodes"]["total"] == doc["nodes"]["kept"] + doc["nodes"]["pruned"] + doc["nodes"]["fused_away"]
    assert doc["nodes"]["fused_away"] == 33 * 6 + 32 * 5 + 16 * 8 + 16 * 1


def test_quantizer_exports_fuse_both_rmsnorm_spellings_and_the_sliced_rotary(quantizer_export):
    fused, plain = resolve_model(quantizer_export), resolve_model(quantizer_export, fuse=False)
    # their attention masks padding too (attention_mask): the masked form (test_hf_attention_fusion.py)
    assert patterns(fused) == {"rms_norm": 5, "rotary": 4, "attention": 2, "silu": 2}
    assert fused.near_misses == ()
    assert len(fused.nodes) == len(plain.nodes) - 193  # 624 -> 431 nodes per step (471 without attention)
    norm = next(n for n in fused.nodes if n.name == "/model/model/layers.0/input_layernorm/Mul_1")
    assert [n.rsplit("/", 1)[1] for n in norm.fused_from] == ["Pow", "ReduceMean", "Add", "Sqrt", "Div", "Mul",
                                                               "Cast_1", "Mul_1"]
    assert norm.inputs[1] == "model.model.layers.0.input_layernorm.weight"  # the initializer, not its Identity


# --------------------------------------------------------- fused = unfused = ONNX Runtime

def _decode(path, prompts, fuse):
    io = DecoderIO.from_model(path)
    with Session(resolve_model(path, fuse=fuse)) as s:
        return greedy_decode(s, io, prompts, TOKENS, keep_logits=True)


def _assert_same_decode(ours, ref):
    for step in range(TOKENS):
        for row in range(ref.tokens.shape[0]):
            d = float(np.abs(ours.logits[step][row] - ref.logits[step][row]).max())
            assert d <= LOGIT_RTOL * ref.logit_range[row, step], (row, step, d)
    np.testing.assert_array_equal(ours.tokens, ref.tokens)


PROMPTS = np.array([[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 31, 409, 5, 77, 80, 12]])


@pytest.mark.parametrize("model", ["tiny_zp_llm_path", "medium_graph_path"])
def test_fused_decode_equals_unfused_and_onnxruntime_for_16_tokens(model, request):
    _check_decode(request.getfixturevalue(model))


def test_fused_quantizer_export_decodes_as_unfused_and_onnxruntime_for_16_tokens(quantizer_export):
    _check_decode(quantizer_export)


def _check_decode(path):
    ort_or_skip()
    from onnx_prep.core.decode.ort_runner import OrtRunner

    assert resolve_model(path).fusions
    fused, plain = _decode(path, PROMPTS, True), _decode(path, PROMPTS, False)
    ref = greedy_decode(OrtRunner(path, threads=1), DecoderIO.from_model(path), PROMPTS, TOKENS, keep_logits=True)
    _assert_same_decode(fused, plain)
    # Against ONNX Runtime, fusion moves no logit further than our unfused run is (the
    # QDQ exports differ by ~5e-3 either way: ONNX Runtime computes their fused
    # DequantizeLinear+MatMul in int8, we in fp32), and the tokens are the same.
    for step in range(TOKENS):
        for row in range(len(PROMPTS)):
            plain_d = float(np.abs(plain.logits[step][row] - ref.logits[step][row]).max())
            fused_d = float(np.abs(fused.logits[step][row] - ref.logits[step][row]).max())
            assert fused_d <= plain_d + LOGIT_RTOL * ref.logit_range[row, step], (row, step, fused_d, plain_d)
    np.testing.assert_array_equal(fused.tokens, ref.tokens)
    assert len({int(t) for t in ref.tokens.reshape(-1)}) > 4  # the tokens discriminate


def test_session_options_turn_fusion_off(small_llm_path):
    with Session.open(small_llm_path, SessionOptions(fuse=False)) as s:
        assert not s.resolved.fusions and not s.resolved.fusion_enabled
    with Session.open(small_llm_path) as s:
        assert patterns(s.resolved) == {"rms_norm": 5, "rotary": 4, "attention": 2, "silu": 2}


# ------------------------------------------------------------------- crafted graphs

def _save(tmp_path, nodes, inputs, outputs, inits, *, opset=17, name="g", inline_below=0):
    g = helper.make_graph(nodes, name, inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    path = tmp_path / f"{name}.onnx"
    onnx.save(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=f"{name}.data",
              size_threshold=inline_below)
    return path


def _const(name, value):
    return helper.make_node("Constant", [], [name], name=f"c_{name}", value=numpy_helper.from_array(
        np.asarray(value), name=""))


def _vi(name, shape, t=F32):
    return helper.make_tensor_value_info(name, t, shape)


def rms_graph(tmp_path, *, spelling="reciprocal", eps="const", axes=(-1,), exponent=2.0, weight="init",
              extra=None, output_too=None):
    """x [2, S, H] -> RMSNorm -> y. ``extra``: an intermediate that an Identity also reads
    (to a second output); ``output_too``: an intermediate that is also a graph output."""
    rng = np.random.default_rng(5)
    inits = {"w": rng.uniform(0.5, 1.5, H).astype(np.float32)}
    nodes, inputs = [], [_vi("x", [2, "S", H])]
    opset = 17
    src = "x"
    if spelling == "torch":  # Cast, Pow, axes as input, 1 / sqrt, Cast, weight through Identity
        opset = 18
        nodes += [helper.make_node("Cast", ["x"], ["xc"], name="cast_in", to=F32), _const("two", np.float32(exponent)),
                  helper.make_node("Pow", ["xc", "two"], ["sq"], name="square"), _const("axes", np.array(axes)),
                  helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], name="mean", keepdims=1)]
        src = "xc"
    else:
        nodes += [helper.make_node("Mul", ["x", "x"], ["sq"], name="square"),
                  helper.make_node("ReduceMean", ["sq"], ["ms"], name="mean", axes=list(axes), keepdims=1)]
    if eps == "const":
        nodes.append(_const("eps", np.float32(1e-5)))
    elif eps == "inline":
        inits["eps"] = np.array(1e-5, np.float32)
    else:
        inputs.append(_vi("eps", []))
    nodes += [helper.make_node("Add", ["ms", "eps"], ["var"], name="add_eps"),
              helper.make_node("Sqrt", ["var"], ["root"], name="sqrt")]
    if spelling == "divide":
        nodes.append(helper.make_node("Div", [src, "root"], ["normed"], name="normalize"))
    elif spelling == "torch":
        nodes += [_const("one", np.float32(1.0)), helper.make_node("Div", ["one", "root"], ["inv"], name="inverse"),
                  helper.make_node("Mul", [src, "inv"], ["n0"], name="normalize"),
                  helper.make_node("Cast", ["n0"], ["normed"], name="cast_out", to=F32)]
    else:
        nodes += [helper.make_node("Reciprocal", ["root"], ["inv"], name="inverse"),
                  helper.make_node("Mul", ["x", "inv"], ["normed"], name="normalize")]
    w = "w"
    if weight == "identity":
        nodes.append(helper.make_node("Identity", ["w"], ["w_alias"], name="alias"))
        w = "w_alias"
    elif weight == "input":
        del inits["w"]
        inputs.append(_vi("w", [H]))
    nodes.append(helper.make_node("Mul", [w, "normed"] if spelling == "torch" else ["normed", w], ["y"],
                                  name="scale"))
    outputs = [_vi("y", [2, "S", H])]
    if extra:
        nodes.append(helper.make_node("Identity", [extra], ["side"], name="side_reader"))
        outputs.append(_vi("side", None))
    if output_too:
        outputs.append(_vi(output_too, None))
    return _save(tmp_path, nodes, inputs, outputs, inits, opset=opset, inline_below=100)  # eps inline, w not


def _run(path, feeds, fuse):
    resolved = resolve_model(path, fuse=fuse)
    load = source_loader(resolved, ExternalDataReader.for_model(resolved))
    program = ActionProgram.compile(resolved)
    prepared = prepack_all(resolved, load, backend="native")
    return program.run(feeds, prepared, weights={n: load(n) for n in program.weight_names})


@pytest.mark.parametrize("spelling, eps, weight", [("reciprocal", "const", "init"), ("torch", "const", "identity"),
                                                   ("divide", "inline", "init")])
def test_each_rmsnorm_spelling_fuses_and_matches_onnxruntime(tmp_path, spelling, eps, weight):
    ort = ort_or_skip()
    path = rms_graph(tmp_path, spelling=spelling, eps=eps, weight=weight)
    resolved = resolve_model(path)
    assert patterns(resolved) == {"rms_norm": 1} and not resolved.near_misses
    (node,) = [n for n in resolved.nodes if n.name != "cast_in"]
    assert (node.name, node.op_type, node.kernel, node.inputs) == (
        "scale", "SimplifiedLayerNormalization", "row_norm", ("xc" if spelling == "torch" else "x", "w"))
    assert node.attributes["epsilon"] == pytest.approx(1e-5)
    x = np.random.default_rng(6).standard_normal((2, 3, H)).astype(np.float32) * 3
    ours, plain = _run(path, {"x": x}, True)["y"], _run(path, {"x": x}, False)["y"]
    (theirs,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    bound = RMSNORM_RTOL * (np.abs(theirs) + 1.5)
    assert np.all(np.abs(ours - theirs) <= bound) and np.all(np.abs(ours - plain) <= bound)
    assert not np.all(np.abs(ours * 1.0001 - theirs) <= bound)  # negative control


@pytest.mark.parametrize("kw, reason", [
    ({"extra": "root"}, "intermediate root is used by node side_reader"),
    ({"output_too": "inv"}, "intermediate inv is a graph output"),
    ({"eps": "input"}, "epsilon eps is not a constant"),
    ({"axes": (1,)}, "ReduceMean axes [1] are not [-1] (the last axis)"),
    ({"spelling": "torch", "exponent": 3.0}, "Pow exponent 3 is not 2"),
    ({"weight": "input"}, "the normalized value is read by Mul scale, not a Mul by a constant 1-D float weight"),
])
def test_each_rmsnorm_near_miss_names_its_reason(tmp_path, kw, reason):
    path = rms_graph(tmp_path, **kw)
    resolved = resolve_model(path)
    assert not resolved.fusions
    assert [(m.pattern, m.node, m.reason) for m in resolved.near_misses] == [("rms_norm", "mean", reason)]
    assert len(resolved.nodes) == len(resolve_model(path, fuse=False).nodes)  # nothing changed


def rotary_graph(tmp_path, *, halves="split", sizes=(D // 2, D // 2), table="concat", rank=4, reread=False):
    """x [B, heads, S, D] (or [B, S, D]) -> x * cos + rotate_half(x) * sin, the tables
    computed from position ids as Concat(f, f) -> Cos / Sin (``table="input"``: given)."""
    inv_freq = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    inits = {"inv_freq": inv_freq}
    xshape = [2, 3, "S", D] if rank == 4 else [2, "S", D]
    inputs = [_vi("x", xshape), _vi("pos", ["P", "S"], I64)]
    nodes = []
    if table == "concat":
        nodes += [helper.make_node("Cast", ["pos"], ["posf"], name="cast_pos", to=F32), _const("last", [-1]),
                  helper.make_node("Unsqueeze", ["posf", "last"], ["pos3"], name="pos_col"),
                  helper.make_node("Mul", ["pos3", "inv_freq"], ["freqs"], name="freqs"),
                  helper.make_node("Concat", ["freqs", "freqs"], ["emb"], name="emb", axis=-1),
                  helper.make_node("Cos", ["emb"], ["cos3"], name="cos"), helper.make_node("Sin", ["emb"], ["sin3"],
                                                                                       name="sin"),
                  _const("scaling", np.float32(1.0)),
                  helper.make_node("Mul", ["cos3", "scaling"], ["cos_s"], name="cos_scale")]
        if rank == 4:
            nodes += [_const("heads_axis", [1]),
                      helper.make_node("Unsqueeze", ["cos_s", "heads_axis"], ["cos"], name="cos_heads"),
                      helper.make_node("Unsqueeze", ["sin3", "heads_axis"], ["sin"], name="sin_heads")]
        else:
            nodes += [helper.make_node("Identity", ["cos_s"], ["cos"], name="cos_id"),
                      helper.make_node("Identity", ["sin3"], ["sin"], name="sin_id")]
    else:
        inputs += [_vi("cos", [2, 1, "S", D]), _vi("sin", [2, 1, "S", D])]
    if halves == "split":
        nodes += [_const("sizes", np.array(sizes)),
                  helper.make_node("Split", ["x", "sizes"], ["x1", "x2"], name="split", axis=-1)]
    elif halves == "split_in_two":  # opset 18: no sizes, num_outputs 2
        nodes.append(helper.make_node("Split", ["x"], ["x1", "x2"], name="split", axis=-1, num_outputs=2))
    else:  # Slice: constant bounds, or half of Shape(x)[-1] as the torch export computes it
        nodes += [_const("zero", [0]), _const("big", [2 ** 63 - 1]), _const("axis", [-1])]
        if halves == "slice":
            nodes.append(_const("half", [D // 2]))
            lo_end = hi_start = "half"
        else:
            nodes += [helper.make_node("Shape", ["x"], ["shape"], name="shape"), _const("idx", np.int64(-1)),
                      helper.make_node("Gather", ["shape", "idx"], ["dim"], name="dim", axis=0),
                      _const("two", np.int64(2)), helper.make_node("Div", ["dim", "two"], ["h"], name="halve"),
                      _const("ax0", [0]),
                      helper.make_node("Unsqueeze", ["h", "ax0"], ["h_end"], name="h_end"),
                      helper.make_node("Unsqueeze", ["h", "ax0"], ["h_start"], name="h_start")]
            lo_end, hi_start = "h_end", "h_start"
        nodes += [helper.make_node("Slice", ["x", "zero", lo_end, "axis"], ["x1"], name="slice_lo"),
                  helper.make_node("Slice", ["x", hi_start, "big", "axis"], ["x2"], name="slice_hi")]
    nodes += [helper.make_node("Neg", ["x2"], ["neg"], name="neg"),
              helper.make_node("Concat", ["neg", "x1"], ["rot"], name="rotate_half", axis=-1),
              helper.make_node("Mul", ["x", "cos"], ["xc"], name="mul_cos"),
              helper.make_node("Mul", ["rot", "sin"], ["rs"], name="mul_sin"),
              helper.make_node("Add", ["xc", "rs"], ["y"], name="add")]
    outputs = [_vi("y", xshape)]
    if reread:
        outputs.append(_vi("rot", None))
    return _save(tmp_path, nodes, inputs, outputs, inits, opset=18 if halves == "split_in_two" else 17)


@pytest.mark.parametrize("halves, rank", [("split", 4), ("split_in_two", 4), ("slice", 4), ("shape_half", 4),
                                          ("split", 3)])
def test_rotary_spellings_fuse_and_match_onnxruntime(tmp_path, halves, rank):
    # rank 3: x [B, S, D] against [B, S, D] tables is not the native layout; the fused
    # node computes the formula it replaced.
    ort = ort_or_skip()
    path = rotary_graph(tmp_path, halves=halves, rank=rank)
    resolved = resolve_model(path)
    assert patterns(resolved) == {"rotary": 1} and not resolved.near_misses
    (node,) = [n for n in resolved.nodes if n.name == "add"]
    assert (node.domain, node.op_type, node.kernel, node.inputs[0]) == ("onnx_prep.fused", "RotaryEmbedding",
                                                                        "rotary", "x")
    rng = np.random.default_rng(7)
    s = 5
    x = rng.standard_normal((2, 3, s, D) if rank == 4 else (2, s, D)).astype(np.float32)
    feeds = {"x": x, "pos": np.array([np.arange(4, 4 + s), np.arange(20, 20 + s)], dtype=np.int64)}
    ours, plain = _run(path, feeds, True)["y"], _run(path, feeds, False)["y"]
    (theirs,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    atol = ROTARY_ATOL_ULPS * 2.0 ** -23 * float(np.abs(x).max())
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=atol)
    np.testing.assert_allclose(ours, plain, rtol=0, atol=atol)
    swapped = {**feeds, "pos": feeds["pos"][::-1].copy()}  # negative control: the other row's positions
    assert np.abs(_run(path, swapped, True)["y"] - theirs).max() > 100 * atol
    # one row of positions for both batch rows: tables [1, 1, S, D] broadcast over the batch
    shared = {**feeds, "pos": feeds["pos"][1:]}
    (theirs,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, shared)
    np.testing.assert_allclose(_run(path, shared, True)["y"], theirs, rtol=0, atol=atol)


@pytest.mark.parametrize("kw, reason", [
    ({"table": "input"}, "table cos: its halves are not equal by construction"),
    ({"sizes": (3, 5)}, "Split split sizes are not two equal constants"),
    ({"reread": True}, "intermediate rot is a graph output"),
])
def test_each_rotary_near_miss_names_its_reason(tmp_path, kw, reason):
    path = rotary_graph(tmp_path, **kw)
    resolved = resolve_model(path)
    assert not resolved.fusions
    [(pattern, node, why)] = [(m.pattern, m.node, m.reason) for m in resolved.near_misses]
    assert (pattern, node) == ("rotary", "add") and why.startswith(reason), why


def test_an_intermediate_with_a_second_consumer_is_not_fused(tmp_path):
    path = rms_graph(tmp_path, extra="sq")
    (miss,) = resolve_model(path).near_misses
    assert miss.reason == "intermediate sq is used by node side_reader"


# ------------------------------------------------------------------------------- SiLU

def silu_graph(tmp_path, *, order="x_first", scale=None, extra=None, gated=True):
    """x [2, S, H] -> x * Sigmoid(x) (or x * Sigmoid(x * scale)) -> * up -> y, as a SwiGLU
    MLP's gate. ``extra``: an intermediate an Identity also reads (to a second output)."""
    nodes, src = [], "x"
    if scale is not None:
        nodes += [_const("alpha", np.float32(scale)), helper.make_node("Mul", ["x", "alpha"], ["xs"], name="scale")]
        src = "xs"
    nodes.append(helper.make_node("Sigmoid", [src], ["sig"], name="sigmoid"))
    nodes.append(helper.make_node("Mul", ["x", "sig"] if order == "x_first" else ["sig", "x"], ["act"], name="silu"))
    outputs = [_vi("y", [2, "S", H])]
    if gated:
        nodes.append(helper.make_node("Mul", ["act", "up"], ["y"], name="gate"))
    else:
        nodes[-1].output[0] = "y"
    if extra:
        nodes.append(helper.make_node("Identity", [extra], ["side"], name="side_reader"))
        outputs.append(_vi("side", None))
    inputs = [_vi("x", [2, "S", H])] + ([_vi("up", [2, "S", H])] if gated else [])
    return _save(tmp_path, nodes, inputs, outputs, {})


@pytest.mark.parametrize("kw, alpha", [({}, 1.0), ({"order": "sig_first"}, 1.0), ({"scale": 1.702}, 1.702),
                                       ({"gated": False}, 1.0)])
def test_each_silu_spelling_fuses_into_quick_gelu_and_matches_onnxruntime(tmp_path, kw, alpha):
    ort = ort_or_skip()
    path = silu_graph(tmp_path, **kw)
    resolved = resolve_model(path)
    assert patterns(resolved) == {"silu": 1} and not resolved.near_misses
    node = next(n for n in resolved.nodes if n.op_type == "QuickGelu")
    assert (node.domain, node.kernel, node.inputs) == ("com.microsoft", "activation", ("x",))
    assert node.attributes["alpha"] == pytest.approx(alpha)
    assert {n.name for n in resolved.nodes} == ({"silu", "gate"} if kw.get("gated", True) else {"silu"})
    rng = np.random.default_rng(7)
    feeds = {"x": (rng.standard_normal((2, 3, H)) * 4).astype(np.float32)}
    if kw.get("gated", True):
        feeds["up"] = rng.standard_normal((2, 3, H)).astype(np.float32)
    ours, plain = _run(path, feeds, True)["y"], _run(path, feeds, False)["y"]
    (theirs,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    # ours within 2e-7 relative of the exact value; the unfused ops' tanh-based Sigmoid and
    # ONNX Runtime's logistic within ~2e-6 absolute of it (test_native_activation.py)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(ours, plain, rtol=1e-5, atol=2e-5)


def test_a_silu_whose_sigmoid_is_read_elsewhere_is_a_near_miss(tmp_path):
    resolved = resolve_model(silu_graph(tmp_path, extra="sig"))
    assert not resolved.fusions
    [(pattern, node, why)] = [(m.pattern, m.node, m.reason) for m in resolved.near_misses]
    assert (pattern, node, why) == ("silu", "sigmoid", "intermediate sig is used by node side_reader")
    resolved = resolve_model(silu_graph(tmp_path, scale=2.0, extra="xs"))
    [miss] = resolved.near_misses
    assert miss.reason == "intermediate xs is used by node side_reader"


def test_a_sigmoid_not_multiplied_by_its_input_is_left_alone(tmp_path):
    """Sigmoid(x) * up (a GLU, not a SiLU) is no anchor: no fusion, no near-miss."""
    nodes = [helper.make_node("Sigmoid", ["x"], ["sig"], name="sigmoid"),
             helper.make_node("Mul", ["sig", "up"], ["y"], name="glu")]
    path = _save(tmp_path, nodes, [_vi("x", [2, H]), _vi("up", [2, H])], [_vi("y", [2, H])], {})
    resolved = resolve_model(path)
    assert not resolved.fusions and not resolved.near_misses


# ---------------------------------------------------------------------------- the CLI

def test_resolve_json_lists_fusions_and_near_misses_and_no_fuse_turns_them_off(tmp_path):
    path = rms_graph(tmp_path, eps="input")
    schema = json.loads(schema_path().read_text())
    result = CliRunner().invoke(app, ["resolve", str(path), "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    jsonschema.validate(doc, schema)
    assert doc["fusion"] == {"enabled": True, "patterns": [], "near_misses": [
        {"pattern": "rms_norm", "node": "mean", "reason": "epsilon eps is not a constant"}]}
    text = CliRunner().invoke(app, ["resolve", str(path)]).stdout
    assert "fusion near-misses" in text and "epsilon eps is not a constant" in text
    off = json.loads(CliRunner().invoke(app, ["resolve", str(path), "--json", "--no-fuse"]).stdout)
    assert off["fusion"] == {"enabled": False, "patterns": [], "near_misses": []}


def test_run_decodes_with_and_without_fusion(small_llm_path):
    outs = {}
    for flag in ("--fuse", "--no-fuse"):
        result = CliRunner().invoke(app, ["run", str(small_llm_path), "--tokens", "4", "--json", flag])
        assert result.exit_code == 0, result.stderr
        outs[flag] = json.loads(result.stdout)["tokens"]
    assert outs["--fuse"] == outs["--no-fuse"]
