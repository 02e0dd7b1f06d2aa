"""The onnxruntime-genai builder's other architectures (fixtures/real_exports.py
``FAMILIES``: Gemma, Gemma 2, Qwen3, Mistral, Phi, Granite, OLMo, SmolLM3), each a tiny
random checkpoint at accuracy level 1 (fp32 compute on both sides): every one resolves
with no unsupported op and ``run --compare ort`` decodes it as ONNX Runtime does, at
batch 1 and 2.

Kept apart from conftest's ``builder_export`` (the Llama / Qwen2 variants every
real-export test runs over) so the suite pays one run per family, not every test's:
generating the nine exports costs ~80 s once per machine (cached by content), the tests
here ~3 s (2 vCPUs).

Tolerance: ``FP32_RTOL`` of test_real_export_runs (1e-4 of the step's logit range; fp32
MatMulNBits on both sides; measured <= 2e-7 here). Gemma 2 carries what the others do
not: a sliding window of 4 (layer 0) and softcap 1 in GroupQueryAttention, and the final
logit softcap (Div / Tanh / Mul); its checkpoint's larger init (std 0.2) makes both
matter (without the softcap its first logits move by ~10% of their range, without the
window ~14%), and its logits are compared at every step of 32, as its greedy tokens
repeat (Gemma's tied, scaled embedding copies the last token at this init).

The builder's default for a sliding-window layer, window-sized KV buffers
(``sliding_window_cache = 1``, ``builder-gemma2-windowed-cache``), needs its past at a
capacity of at least the window from the first step on (an empty past is refused in one
line by both runtimes): the decode loop feeds it one (docs/run.md, "Sliding-window
caches"), and it decodes as ONNX Runtime does, evictions included; fed a larger cache
by hand, too.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import ort_or_skip, real_export
from test_real_export_runs import FP32_RTOL, _check_against_ort

from onnx_prep.cli.app import app
from onnx_prep.core.errors import EXIT_OK, EXIT_UNUSABLE
from onnx_prep.fixtures.real_exports import FAMILIES, GEMMA2

cli = CliRunner()
DECODED = sorted(n for n in FAMILIES if n != "builder-gemma2-windowed-cache")
PROMPTS = {1: [[1, 2, 3, 4, 5, 6, 7, 8]], 2: [[1, 2, 3, 4, 5, 6, 7, 8], [100, 31, 400, 5, 77, 300, 12, 9]]}
WINDOW = dict(GEMMA2.config)["sliding_window"]


@pytest.fixture(scope="session", params=DECODED)
def family_export(request):
    return real_export(request.param)


def test_resolve_lists_no_unsupported_op(family_export):
    from onnx_prep.core.model.resolution import resolve_model

    resolved = resolve_model(family_export)
    assert resolved.unsupported == ()
    assert {n.kernel for n in resolved.nodes if n.op_type == "GroupQueryAttention"} == {"gqa"}


@pytest.mark.parametrize("batch", [1, 2])
def test_run_compare_ort_gives_its_tokens_and_first_logits(family_export, batch):
    args = [a for row in PROMPTS[batch] for a in ("--prompt-ids", ",".join(map(str, row)))]
    result = cli.invoke(app, ["run", str(family_export), "--tokens", "8", *args, "--compare", "ort", "--json"])
    assert result.exit_code == EXIT_OK, result.output
    compare = json.loads(result.stdout)["compare"]
    assert compare["identical"] and compare["first_divergence_step"] is None, compare["tokens"]
    first = compare["first_step_max_abs_logit_diff"] / compare["first_step_logit_range"]
    assert first <= FP32_RTOL, f"first-step logits {first:.2e} of the range, tolerance {FP32_RTOL:.0e}"


def test_gemma2_s_window_and_softcaps_are_in_the_graph_and_decode_as_onnx_runtime():
    """The export carries a window that cuts the prompt, softcap in both attentions and
    the final logit softcap; 32 greedy steps at batch 2, every step's logits compared."""
    import onnx

    from onnx_prep.core.decode.decoder_io import DecoderIO
    from onnx_prep.core.decode.generation import greedy_decode
    from onnx_prep.core.decode.ort_runner import OrtRunner, like_for_like_config
    from onnx_prep.core.runtime.session import Session

    ort_or_skip()
    path = real_export("builder-gemma2-acc1-b32")
    graph = onnx.load(path, load_external_data=False).graph
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
             for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert [a.get("local_window_size") for a in attrs] == [WINDOW, -1]
    assert all(a.get("softcap") == 1.0 and "sliding_window_cache" not in a for a in attrs)
    assert {"Div", "Tanh"} <= {n.op_type for n in graph.node}  # the final logit softcap
    prompts = np.array(PROMPTS[2])
    io = DecoderIO.from_model(path)
    ref = greedy_decode(OrtRunner(path, threads=1, session_config=like_for_like_config()), io, prompts, 32,
                        keep_logits=True)
    with Session.open(path) as s:
        ours = greedy_decode(s, io, prompts, 32, keep_logits=True)
    assert _check_against_ort(ours, ref, FP32_RTOL) is None  # no near tie: all 32 steps compared


def test_the_windowed_cache_export_decodes_as_onnx_runtime_through_run():
    """The loop feeds layer 0 (the window layer) a past of the window's size from the
    first step: 32 steps at batch 2, every step's logits against ONNX Runtime's on the
    same loop, through ``run`` too; an empty past stays refused in one line by both."""
    from onnx_prep.core.decode.decoder_io import DecoderIO
    from onnx_prep.core.decode.generation import greedy_decode, step_feeds
    from onnx_prep.core.decode.ort_runner import OrtRunner, like_for_like_config
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.core.runtime.session import Session

    ort_or_skip()
    path = real_export("builder-gemma2-windowed-cache")
    assert resolve_model(path).unsupported == ()
    io = DecoderIO.from_model(path)
    assert [p.capacity for p in io.kv] == [WINDOW, None]  # genai_config: window 4, layer 0, no slack
    prompts = np.array(PROMPTS[2])
    ref = greedy_decode(OrtRunner(path, threads=1, session_config=like_for_like_config()), io, prompts, 32,
                        keep_logits=True)
    with Session.open(path) as s:
        ours = greedy_decode(s, io, prompts, 32, keep_logits=True)
        empty = {n: a[:, :, :0] for n, a in io.empty_past(2).items()}
        with pytest.raises(Exception, match=f"must be at least local_window_size \\({WINDOW}\\)"):
            s.run(step_feeds(io, prompts, empty, 0))
    assert _check_against_ort(ours, ref, FP32_RTOL) is None  # every step's logits within tolerance
    result = cli.invoke(app, ["run", str(path), "--tokens", "12", "--prompt-ids", "1,2,3,4,5,6,7,8",
                              "--compare", "ort", "--json"])
    assert result.exit_code == EXIT_OK, result.output
    doc = json.loads(result.stdout)
    assert [k["capacity"] for k in doc["io"]["kv"]] == [WINDOW, None] and doc["compare"]["identical"]


@pytest.mark.parametrize("capacity", [WINDOW, WINDOW + 3])
def test_the_windowed_cache_export_decodes_as_onnx_runtime_given_a_window_sized_cache(capacity):
    """A hand-written loop feeds layer 0 (the sliding-window layer) a past of ``capacity``
    rows from the first step (the other layer a growing one) and each step's presents
    back, to our Session and to ONNX Runtime alike: 20 steps past the capacity, so the
    cache evicts (every step at capacity = window, three positions every third step
    above it); every step's logits within FP32_RTOL, greedy tokens identical."""
    from onnx_prep.core.runtime.session import Session

    ort = ort_or_skip()
    path = real_export("builder-gemma2-windowed-cache")
    prompts = np.array(PROMPTS[2], np.int64)
    B, kv_heads, head_dim = prompts.shape[0], GEMMA2.kv_heads, GEMMA2.hidden // GEMMA2.heads
    oracle = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def past(layer: int) -> dict:
        rows = capacity if layer == 0 else 0
        return {f"past_key_values.{layer}.{kind}": np.zeros((B, kv_heads, rows, head_dim), np.float32)
                for kind in ("key", "value")}

    with Session.open(path) as session:
        states = [{**past(0), **past(1)} for _ in range(2)]  # ours, ONNX Runtime's
        ids, total = [prompts, prompts], prompts.shape[1]
        for step in range(20):
            feeds = [{"input_ids": ids[i], "attention_mask": np.ones((B, total), np.int64), **states[i]}
                     for i in range(2)]
            got = session.run(feeds[0])
            want = dict(zip([o.name for o in oracle.get_outputs()], oracle.run(None, feeds[1])))
            mine, theirs = got["logits"][:, -1], want["logits"][:, -1]
            spread = theirs.max(axis=-1) - theirs.min(axis=-1)
            assert (np.abs(mine - theirs).max(axis=-1) <= FP32_RTOL * spread).all(), f"step {step}"
            assert np.array_equal(mine.argmax(-1), theirs.argmax(-1)), f"step {step}"
            assert got["present.0.key"].shape[2] == capacity  # the window's buffer keeps its size
            ids = [theirs.argmax(-1)[:, None].astype(np.int64)] * 2
            states = [{n: out[n.replace("past_key_values", "present")] for n in states[0]} for out in (got, want)]
            total += 1
    assert total > capacity + 8


def test_the_memory_estimate_counts_a_window_cache_at_its_capacity():
    """A sliding-window layer's past and present hold its capacity from the first step:
    the run's estimate counts that, and equals the last step's past and present."""
    from onnx_prep.core.decode.decoder_io import DecoderIO
    from onnx_prep.core.decode.generation import greedy_decode
    from onnx_prep.core.decode.ort_runner import OrtRunner
    from onnx_prep.core.decode.run_memory import estimate_run_memory

    ort_or_skip()
    path = real_export("builder-gemma2-windowed-cache")
    io = DecoderIO.from_model(path)
    outputs = []

    class Recording:
        def __init__(self, inner):
            self.inner = inner

        def run(self, feeds):
            out = self.inner.run(feeds)
            outputs.append({n: a.nbytes for n, a in out.items()})
            return out

    batch, plen, tokens = 2, 2, 2  # 3 positions at the last step: the window layer holds its 4 anyway
    greedy_decode(Recording(OrtRunner(path)), io, np.full((batch, plen), 3), tokens)
    presents = {n for p in io.kv for n in (p.present_key, p.present_value)}
    assert estimate_run_memory(io, batch, plen, tokens).kv_cache == 2 * sum(
        n for name, n in outputs[-1].items() if name in presents)
