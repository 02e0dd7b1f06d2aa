"""The attention of the Hugging Face exports fused (core/model/attention_pattern.py's
masked form, ``onnx_prep.fused::MaskedAttention`` on the gqa kernel's C code,
core/ops/attention.py ``masked_attention``).

On the torch-exported Llama that ``MatMulNBitsQuantizer`` quantizes (conftest
``quantizer_export``; skipped without the ``exports`` extra): resolve fuses one
attention per layer and lists no attention near-miss; greedy decode fused, ``--no-fuse``
and ONNX Runtime agree for 16 tokens at batch 1 and 2, every attention on the native
kernel; a left-padded batch (two prompts of different lengths, attention_mask zeros)
and a decode step after it agree with both. Crafted graphs (onnx.helper) of the same
form against ONNX Runtime (repeat shapes fed, the regular ones and others that take
the numpy formula), the fixtures' spelling with a mask the causal proof refuses, and
one crafted graph per near-miss reason.

Tolerances: the kernel folds the exports' two √scale factors into one scale, so its
scores differ from the ops' by that product's rounding (a few float32 ulps); outputs
OUT_ATOL / OUT_RTOL of test_native_gqa, whole models LOGIT_RTOL of the logit range
(test_fusion).
"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from conftest import ort_or_skip
from test_attention_fusion import attention_feeds, attention_graph
from test_fusion import LOGIT_RTOL, _const, _run, _save, _vi
from test_native_gqa import OUT_ATOL, OUT_RTOL

import onnx_prep.native as native_module
from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.decode.generation import greedy_decode
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.runtime.session import Session

F32, I64 = TensorProto.FLOAT, TensorProto.INT64
TOKENS = 16
LAYERS = 2  # fixtures/real_exports.py's Checkpoint
# the op types of one attention of the quantizer exports (fused_from), in order
HF_CHAIN = ("Unsqueeze", "Expand", "Reshape", "Transpose", "Mul", "Mul", "MatMul", "Add", "Softmax", "IsNaN",
            "Where", "Unsqueeze", "Expand", "Reshape", "Shape", "MatMul")


@pytest.fixture
def kernel_calls(monkeypatch):
    """The calls the fused nodes make to the native kernel (it still runs: a spy)."""
    calls = []
    real = native_module.attention_over_cache

    def spy(*args, **kw):
        calls.append((args[0].shape, args[1].shape, np.shape(kw["mask"])))
        return real(*args, **kw)

    monkeypatch.setattr(native_module, "attention_over_cache", spy)
    return calls


# ------------------------------------------------------------------ the quantizer exports

def test_every_attention_of_the_quantizer_exports_is_fused(quantizer_export):
    fused, plain = resolve_model(quantizer_export), resolve_model(quantizer_export, fuse=False)
    attention = [f for f in fused.fusions if f.pattern == "attention"]
    assert len(attention) == LAYERS
    assert [m for m in fused.near_misses if m.pattern == "attention"] == []
    op_of = {n.name: n.op_type for n in plain.nodes}
    for f in attention:
        assert tuple(op_of[name] for name in f.fused_from) == HF_CHAIN
    ops = lambda r: [n.op_type for n in r.nodes]  # noqa: E731
    assert ops(fused).count("MaskedAttention") == LAYERS and "Softmax" not in ops(fused)
    assert ops(plain).count("Softmax") == LAYERS
    # each layer's 16 nodes become one; the mask (shared by the layers) stays
    assert len(plain.nodes) - len(resolve_model(quantizer_export).nodes) >= LAYERS * 15


def _decode(path, prompts, fuse):
    with Session.open(path, fuse=fuse) as s:
        return greedy_decode(s, DecoderIO.from_model(path), prompts, TOKENS, keep_logits=True)


@pytest.mark.parametrize("batch", [1, 2])
def test_fused_hf_attention_decodes_as_unfused_and_onnxruntime(quantizer_export, batch, kernel_calls):
    ort_or_skip()
    from onnx_prep.core.decode.ort_runner import OrtRunner, like_for_like_config

    prompts = np.array([[1, 2, 3, 4, 5, 6, 7, 8], [100, 31, 400, 5, 77, 300, 12, 9]])[:batch]
    fused = _decode(quantizer_export, prompts, True)
    assert len(kernel_calls) == LAYERS * TOKENS  # every attention of every step on the kernel
    assert kernel_calls[0] == ((batch, 4, 8, 32), (batch, 2, 8, 32), (batch, 1, 8, 8))
    plain = _decode(quantizer_export, prompts, False)
    theirs = greedy_decode(OrtRunner(quantizer_export, threads=1, session_config=like_for_like_config()),
                           DecoderIO.from_model(quantizer_export), prompts, TOKENS, keep_logits=True)
    for other in (plain, theirs):
        np.testing.assert_array_equal(fused.tokens, other.tokens)
        for step in range(TOKENS):
            d = np.abs(fused.logits[step] - other.logits[step]).max(axis=-1)
            assert (d <= LOGIT_RTOL * other.logit_range[:, step]).all(), (step, d)


def _padded_feeds(batch_ids, mask, past=None):
    B = batch_ids.shape[0]
    feeds = {"input_ids": batch_ids, "attention_mask": mask}
    for i in range(LAYERS):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = np.zeros((B, 2, 0, 32), np.float32) if past is None \
                else past[f"present.{i}.{kind}"]
    return feeds


@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract")  # numpy's Softmax, unfused: -inf rows
def test_a_left_padded_batch_matches_unfused_and_onnxruntime(quantizer_export, kernel_calls):
    """Two prompts of 8 and 5 tokens, the short one left-padded (attention_mask 0): its
    three padding query rows see no key (every score -inf: the exports' IsNaN -> Where
    makes them 0), then one decode step over the padded cache."""
    ort = ort_or_skip()
    ids = np.array([[1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 100, 31, 400, 5, 77]])
    mask = np.array([[1] * 8, [0, 0, 0, 1, 1, 1, 1, 1]])
    from onnx_prep.core.decode.ort_runner import like_for_like_config

    options = ort.SessionOptions()
    for key, value in like_for_like_config().items():  # the QDQ exports' MatMuls as ours (fp32)
        options.add_session_config_entry(key, value)
    theirs = ort.InferenceSession(str(quantizer_export), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in theirs.get_outputs()]
    results = {}
    for who in ("fused", "plain", "ort"):
        if who == "ort":
            run = lambda feeds: dict(zip(names, theirs.run(None, feeds)))  # noqa: E731
        else:
            session = Session.open(quantizer_export, fuse=who == "fused")
            run = session.run
        first = run(_padded_feeds(ids, mask))
        nxt = first["logits"][:, -1].argmax(-1)[:, None]
        second = run(_padded_feeds(nxt, np.concatenate([mask, [[1], [1]]], axis=1), first))
        results[who] = (first, second)
        if who != "ort":
            session.close()
    assert len(kernel_calls) == 2 * LAYERS
    for who in ("plain", "ort"):
        for ours, other in zip(results["fused"], results[who]):
            span = np.ptp(other["logits"])
            np.testing.assert_allclose(ours["logits"], other["logits"], rtol=0, atol=LOGIT_RTOL * span)
            for name in ("present.0.key", "present.1.value"):  # fused RMSNorm / rotary: last bits differ
                np.testing.assert_allclose(ours[name], other[name], rtol=1e-5, atol=1e-5)
    assert np.isfinite(results["fused"][0]["logits"]).all()


# ------------------------------------------------------------------- crafted graphs

def hf_attention_graph(tmp_path, *, nan_fill=0.0, repeat="both", axes=2, allowzero=0, reread=None,
                       scales=(0.42, 0.42), name="hf"):
    """q [B, 4, S, 8]; key / value caches Concat(past [B, 2, P, 8], new [B, 2, S, 8]) (graph
    outputs); the kv heads repeated by ``Reshape(Expand(Unsqueeze(cache, [axes]),
    key_expand), key_shape)`` (shapes fed; ``repeat``: both, keys only or neither with
    four kv heads), Q and K scaled apart, an additive ``mask`` fed, Softmax, ``Where(IsNaN(p),
    nan_fill, p)``, the context [B, 4, S, 8] and the repeated values' Shape as outputs."""
    kv = 2 if repeat != "none" else 4
    n = helper.make_node
    nodes = [n("Concat", ["past_key", "k"], ["present_key"], name="k_cache", axis=-2),
             n("Concat", ["past_value", "v"], ["present_value"], name="v_cache", axis=-2),
             _const("axes", np.array([axes])), _const("qs", np.float32(scales[0])), _const("ks", np.float32(scales[1])),
             _const("nan_fill", np.float32(nan_fill))]
    inputs = [_vi("q", ["B", 4, "S", 8]), _vi("k", ["B", kv, "S", 8]), _vi("v", ["B", kv, "S", 8]),
              _vi("past_key", ["B", kv, "P", 8]), _vi("past_value", ["B", kv, "P", 8]), _vi("mask", None)]
    caches = {}
    for kind in ("key", "value"):
        if repeat == "none" or (repeat == "keys" and kind == "value"):
            caches[kind] = f"present_{kind}"
            continue
        inputs += [_vi(f"{kind}_expand", [5], I64), _vi(f"{kind}_shape", [4], I64)]
        nodes += [n("Unsqueeze", [f"present_{kind}", "axes"], [f"{kind}_5d"], name=f"{kind}_unsqueeze"),
                  n("Expand", [f"{kind}_5d", f"{kind}_expand"], [f"{kind}_wide"], name=f"{kind}_expand"),
                  n("Reshape", [f"{kind}_wide", f"{kind}_shape"], [f"{kind}_rep"], name=f"{kind}_repeat",
                    allowzero=allowzero)]
        caches[kind] = f"{kind}_rep"
    nodes += [n("Transpose", [caches["key"]], ["kt"], name="k_transpose", perm=[0, 1, 3, 2]),
              n("Mul", ["kt", "ks"], ["kt_scaled"], name="k_scale"), n("Mul", ["q", "qs"], ["q_scaled"], name="q_scale"),
              n("MatMul", ["q_scaled", "kt_scaled"], ["scores"], name="scores"),
              n("Add", ["scores", "mask"], ["masked"], name="add_mask"),
              n("Softmax", ["masked"], ["probs"], name="softmax", axis=-1),
              n("IsNaN", ["probs"], ["nan"], name="isnan"),
              n("Where", ["nan", "nan_fill", "probs"], ["weights"], name="nan_to_zero"),
              n("MatMul", ["weights", caches["value"]], ["context"], name="context"),
              n("Shape", [caches["value"]], ["value_rep_shape"], name="value_rep_shape")]
    outputs = [_vi("context", None), _vi("present_key", None), _vi("present_value", None),
               _vi("value_rep_shape", None, I64)]
    if reread:
        nodes.append(n("Identity", [reread], ["side"], name="side_reader"))
        outputs.append(_vi("side", None))
    return _save(tmp_path, nodes, inputs, outputs, {}, name=name)


def hf_feeds(rng, *, B, S, P, fill=-np.inf, mask_shape=None, key_expand=None, key_shape=None, kv=2):
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    T = P + S
    feeds = {"q": f(B, 4, S, 8), "k": f(B, kv, S, 8), "v": f(B, kv, S, 8), "past_key": f(B, kv, P, 8),
             "past_value": f(B, kv, P, 8)}
    causal = np.arange(T)[None, :] <= P + np.arange(S)[:, None]
    mask = np.where(causal, np.float32(0), np.float32(fill)).astype(np.float32)
    mask = np.broadcast_to(mask, (B, 1, S, T)).copy()
    if B > 1:
        mask[1, :, :, : min(2, T)] = fill  # row 1 left-padded: its first query rows see nothing
    feeds["mask"] = mask if mask_shape is None else mask[tuple(slice(0, d) for d in mask_shape)]
    if kv == 2:
        for kind in ("key", "value"):
            feeds[f"{kind}_expand"] = np.array(key_expand if key_expand is not None else [B, 2, 2, T, 8], np.int64)
            feeds[f"{kind}_shape"] = np.array(key_shape if key_shape is not None else [B, 4, T, 8], np.int64)
    return feeds


@pytest.mark.parametrize("B, S, P, kw", [
    (2, 1, 5, {}),                                        # a decode step, row 1's first keys masked
    (2, 4, 0, {}),                                        # a left-padded first prompt: fully masked rows
    (2, 3, 4, {"fill": np.finfo(np.float32).min}),        # float32's lowest: uniform weights, no NaN
    (1, 3, 2, {"mask_shape": (1, 1, 3, 5)}),              # one batch row
    (2, 2, 3, {"key_expand": [1, 1, 2, 1, 1], "key_shape": [0, -1, 5, 8]}),  # other spellings, same repeat
    (2, 2, 3, {"key_shape": [2, 1, 20, 8], "mask_shape": (2, 1, 2, 1)}),  # one head of 4T rows: the formula
])
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract")  # numpy's Softmax, unfused: -inf rows
def test_crafted_hf_attention_fuses_and_matches_onnxruntime(tmp_path, B, S, P, kw, kernel_calls):
    ort = ort_or_skip()
    path = hf_attention_graph(tmp_path)
    resolved = resolve_model(path)
    assert [(f.pattern, f.node) for f in resolved.fusions] == [("attention", "context")]
    assert [n.op_type for n in resolved.nodes if n.op_type in ("Softmax", "MaskedAttention")] == ["MaskedAttention"]
    feeds = hf_feeds(np.random.default_rng(S * 10 + P), B=B, S=S, P=P, **kw)
    theirs = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    for fuse in (True, False):
        ours = _run(path, feeds, fuse)
        if fuse:  # the regular repeat on the kernel, the other one by the ops' formula
            assert len(kernel_calls) == (0 if kw.get("key_shape") == [2, 1, 20, 8] else 1)
        np.testing.assert_array_equal(np.isnan(ours["context"]), np.isnan(theirs[0]))
        np.testing.assert_allclose(ours["context"], theirs[0], rtol=OUT_RTOL, atol=OUT_ATOL)
        np.testing.assert_array_equal(ours["value_rep_shape"], theirs[3])


def test_crafted_hf_attention_without_a_repeat_fuses(tmp_path):
    ort = ort_or_skip()
    path = hf_attention_graph(tmp_path, repeat="none")
    assert [f.node for f in resolve_model(path).fusions] == ["context"]
    feeds = hf_feeds(np.random.default_rng(1), B=2, S=2, P=3, kv=4)
    theirs = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(_run(path, feeds, True)["context"], theirs[0], rtol=OUT_RTOL, atol=OUT_ATOL)


@pytest.mark.parametrize("kw", [{"cond": "Less"}, {"fill": -100.0}])
def test_a_mask_the_causal_proof_refuses_is_taken_as_an_input(tmp_path, kw):
    """The fixtures' spelling with a mask that is not the proven causal one (a Less condition:
    no key for query row 0 of a first prompt; a fill of -100): fused as
    MaskedAttention over the caches (the Concats stay), the mask computed by its nodes."""
    ort = ort_or_skip()
    path = attention_graph(tmp_path, **kw)
    resolved = resolve_model(path)
    assert [(f.pattern, f.node) for f in resolved.fusions] == [("attention", "context")]
    assert resolved.near_misses == ()
    for B, S, P in ((2, 1, 5), (2, 3, 4)):
        feeds = attention_feeds(np.random.default_rng(S + P), B=B, S=S, P=P)
        theirs = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
        ours = _run(path, feeds, True)
        np.testing.assert_array_equal(np.isnan(ours["y"]), np.isnan(theirs[0]))
        np.testing.assert_allclose(ours["y"], theirs[0], rtol=OUT_RTOL, atol=OUT_ATOL)


@pytest.mark.parametrize("kw, reason", [
    ({"nan_fill": 1.0}, "Where nan_to_zero is not Where(IsNaN(weights), 0, weights)"),
    ({"repeat": "keys"}, "the kv heads of the keys and of the values are not repeated alike"),
    ({"axes": 1}, "Unsqueeze key_unsqueeze axes [1] are not [2] (a kv head repeat)"),
    ({"allowzero": 1}, "Reshape key_repeat has allowzero = 1"),
    ({"reread": "value_rep"}, "intermediate value_rep is used by node side_reader"),
    ({"reread": "key_wide"}, "intermediate key_wide is used by node side_reader"),
    ({"reread": "weights"}, "intermediate weights is used by node side_reader"),
])
def test_each_hf_attention_near_miss_names_its_reason(tmp_path, kw, reason):
    resolved = resolve_model(hf_attention_graph(tmp_path, **kw))
    assert not resolved.fusions
    assert [(m.pattern, m.node) for m in resolved.near_misses] == [("attention", "softmax")]
    assert resolved.near_misses[0].reason.endswith(reason)
