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

@pytest.mark.parametrize("model, blocks, nodes", [("tiny_llm_path", 4, (159, 115)),
                                                   ("medium_graph_path", 16, (531, 391))])
def test_every_attention_of_the_fixtures_becomes_one_node(model, blocks, nodes, request):
    path = request.getfixturevalue(model)
    fused = resolve_model(path)
    without = resolve_model(path, fuse=False)
    assert Counter(f.pattern for f in fused.fusions)["attention"] == blocks and not fused.near_misses
    # nodes per decode step: rms_norm and rotary fused alone, then attention too: 8 fewer
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
