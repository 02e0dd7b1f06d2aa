"""Greedy decode loop: KV-cached decoding equals re-running the whole prefix, on toy
decoders of every naming/layout convention and on the INT4 fixture, through ONNX Runtime."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import ort_or_skip
from decoder_toys import build_toy_decoder, prefix_recompute_greedy, prefix_recompute_logits
from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.errors import ModelFormatError, ModelIOError, UsageError
from onnx_prep.core.decode.generation import (GenerationResult, Runner, StepEvent, compare_generations,
                                       greedy_decode, step_feeds)

ort_or_skip()
from onnx_prep.core.decode.ort_runner import OrtRunner  # noqa: E402  (after the skip)

# Fixture tokens are compared with the prefix-recompute oracle while its top-2 margin
# exceeds this (float reassociation between prefill and decode shapes is far smaller).
MARGIN = 1e-4
PROMPTS = np.array([[1, 2, 3, 4, 5], [7, 3, 11, 2, 9]])


def _toy(tmp_path, **kw):
    path = build_toy_decoder(tmp_path / "toy.onnx", **kw)
    return OrtRunner(path), DecoderIO.from_model(path)


@pytest.mark.parametrize("kw", [
    dict(), dict(kv_names="flat", layout="bshd"), dict(kv_names="dot", kv_dtype=10),
    dict(kv_names="underscore", extras=("seqlens_k", "total_sequence_length", "cache_position")),
    dict(mask_name=None), dict(pos_name=None),
], ids=["hf-bhsd", "flat-bshd", "dot-fp16", "gqa-extras", "no-mask", "no-positions"])
def test_cached_decode_equals_prefix_recompute_on_toys(tmp_path, kw):
    runner, io = _toy(tmp_path, **kw)
    result = greedy_decode(runner, io, PROMPTS, 12)
    ref, margins = prefix_recompute_greedy(runner, io, PROMPTS, 12)
    assert margins.min() > MARGIN  # the toy has no near ties, so exact agreement is required
    np.testing.assert_array_equal(result.tokens, ref)
    assert len(set(result.tokens.ravel().tolist())) > 2  # the toy does not collapse to one token


def test_the_toy_detects_wrong_feeds(tmp_path):
    # Guards the test above: a loop that got positions, mask or past wrong would be caught.
    runner, io = _toy(tmp_path, extras=("seqlens_k", "total_sequence_length"))
    prompt = PROMPTS[:1]
    out = runner.run(step_feeds(io, prompt, io.empty_past(1), 0))
    past = {p.past_key.name: out[p.present_key] for p in io.kv}
    past.update({p.past_value.name: out[p.present_value] for p in io.kv})
    nxt = np.array([[3]])
    good = runner.run(step_feeds(io, nxt, past, 5))["logits"][:, -1]
    np.testing.assert_allclose(good, prefix_recompute_logits(runner, io, np.concatenate([prompt, nxt], 1)),
                               rtol=1e-5, atol=1e-5)
    shifted = step_feeds(io, nxt, past, 5)
    shifted["position_ids"] = shifted["position_ids"] + 1
    assert np.abs(runner.run(shifted)["logits"][:, -1] - good).max() > 1e-3
    short_mask = step_feeds(io, nxt, past, 5)
    short_mask["attention_mask"] = short_mask["attention_mask"][:, 1:]
    assert np.abs(runner.run(short_mask)["logits"][:, -1] - good).max() > 1e-3
    stale = step_feeds(io, nxt, {k: v[:, :, 1:] for k, v in past.items()}, 5)
    assert np.abs(runner.run(stale)["logits"][:, -1] - good).max() > 1e-3


def test_decoder_without_kv_recomputes_the_prefix(tmp_path):
    runner, io = _toy(tmp_path, layers=0)
    assert io.kv == ()
    result = greedy_decode(runner, io, PROMPTS, 6)
    np.testing.assert_array_equal(result.tokens, prefix_recompute_greedy(runner, io, PROMPTS, 6)[0])


def test_batch_rows_equal_batch_one_on_toy(tmp_path):
    runner, io = _toy(tmp_path, layout="bshd", kv_names="flat")
    both = greedy_decode(runner, io, PROMPTS, 10, keep_logits=True)
    for i in range(2):
        one = greedy_decode(runner, io, PROMPTS[i:i + 1], 10, keep_logits=True)
        np.testing.assert_array_equal(both.tokens[i], one.tokens[0])
        np.testing.assert_allclose(both.logits[-1][i], one.logits[-1][0], rtol=1e-5, atol=1e-5)


def test_result_shape_timings_and_step_events(tmp_path):
    runner, io = _toy(tmp_path)
    assert isinstance(runner, Runner)
    events: list[StepEvent] = []
    result = greedy_decode(runner, io, PROMPTS, 5, on_step=events.append, keep_logits=True)
    assert isinstance(result, GenerationResult)
    assert result.tokens.shape == (2, 5) and result.tokens.dtype == np.int64
    assert [e.index for e in events] == [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(np.stack([e.token_ids for e in events], 1), result.tokens)
    assert len(result.step_ms) == 5 and all(t > 0 for t in result.step_ms)
    assert result.first_output_ms == result.step_ms[0]
    assert result.decode_steps_per_s > 0 and result.decode_tokens_per_s == pytest.approx(2 * result.decode_steps_per_s)
    assert len(result.logits) == 5 and result.logits[0].shape == (2, 32)
    np.testing.assert_array_equal(result.first_logits, result.logits[0])
    np.testing.assert_array_equal(np.argmax(np.stack(result.logits, 1), -1), result.tokens)
    assert (result.top2_margin >= 0).all() and (result.logit_range >= result.top2_margin).all()
    assert greedy_decode(runner, io, PROMPTS, 1).decode_steps_per_s is None  # prefill only
    timings = result.timings_json()
    assert timings["step_ms"] == list(result.step_ms) and timings["total_ms"] == pytest.approx(sum(result.step_ms))


@pytest.mark.parametrize("prompt, tokens, match", [
    (np.array([1, 2, 3]), 4, "batch, prompt_len"),
    (np.zeros((1, 0), np.int64), 4, "batch, prompt_len"),
    (np.array([[1, -2]]), 4, "non-negative"),
    (np.array([[1.5, 2]]), 4, "non-negative integers"),
    (np.array([[1, 2]]), 0, "at least 1"),
    (np.array([[1, 32]]), 4, "outside the vocabulary"),
])
def test_bad_requests_are_usage_errors(tmp_path, prompt, tokens, match):
    runner, io = _toy(tmp_path)
    with pytest.raises(UsageError, match=match):
        greedy_decode(runner, io, prompt, tokens)


def test_wrong_layout_is_a_model_io_error(tmp_path):
    path = build_toy_decoder(tmp_path / "m.onnx", layout="bhsd")
    io = DecoderIO.from_model(path, {"kv_layout": "bshd", "kv_heads": 2})
    with pytest.raises(ModelIOError, match="onnxruntime rejected") as err:
        greedy_decode(OrtRunner(path), io, PROMPTS, 3)
    assert "\n" not in str(err.value)


class _TruncatingRunner:
    """ONNX Runtime with one fault: the first present output loses its last position."""

    def __init__(self, inner, name):
        self.inner, self.name = inner, name

    def run(self, feeds):
        out = self.inner.run(feeds)
        out[self.name] = out[self.name][:, :, :-1]
        return out


def test_present_of_the_wrong_length_is_reported(tmp_path):
    runner, io = _toy(tmp_path)
    with pytest.raises(ModelIOError, match="expected sequence length 5") as err:
        greedy_decode(_TruncatingRunner(runner, "present.0.key"), io, PROMPTS, 3)
    assert "present.0.key" in str(err.value)


def test_ort_runner_errors(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ModelFormatError, match="onnxruntime cannot load"):
        OrtRunner(bad)
    with pytest.raises(UsageError, match="--threads"):
        OrtRunner(build_toy_decoder(tmp_path / "m.onnx"), threads=0)


def test_compare_generations_reports_divergence_and_near_ties(tmp_path):
    runner, io = _toy(tmp_path)
    a = greedy_decode(runner, io, PROMPTS, 6)
    same = compare_generations(a, greedy_decode(OrtRunner(runner.model_path, threads=1), io, PROMPTS, 6))
    assert same.identical and same.agrees and same.first_divergence_step is None
    assert same.first_step_max_abs_logit_diff < 1e-4 and same.first_step_logit_range > 1
    tokens = a.tokens.copy()
    tokens[1, 3] += 1
    b = GenerationResult(a.prompt_ids, tokens, a.step_ms, a.top2_margin, a.logit_range, a.first_logits)
    real = compare_generations(b, a)
    assert not real.identical and (real.first_divergence_step, real.first_divergence_row) == (3, 1)
    assert real.reference_margin == a.top2_margin[1, 3] and not real.near_tie and not real.agrees
    tie_margin = a.top2_margin.copy()
    tie_margin[1, 3] = 1e-6
    tied = GenerationResult(a.prompt_ids, a.tokens, a.step_ms, tie_margin, a.logit_range, a.first_logits)
    assert compare_generations(b, tied).near_tie and compare_generations(b, tied).agrees


# ---------------------------------------------------------------- the INT4 fixture

@pytest.mark.parametrize("fixture", ["small_llm_path", "tiny_zp_llm_path"])
def test_fixture_decode_is_deterministic_and_matches_prefix_recompute(request, fixture):
    # small_llm_path's row 0 settles on one token; tiny_zp_llm_path's output does not
    # collapse (conftest), so the comparison also sees many distinct tokens.
    path = request.getfixturevalue(fixture)
    runner, io = OrtRunner(path), DecoderIO.from_model(path)
    tokens = 12
    first = greedy_decode(runner, io, PROMPTS, tokens)
    again = greedy_decode(OrtRunner(path), io, PROMPTS, tokens)
    np.testing.assert_array_equal(first.tokens, again.tokens)
    ref, margins = prefix_recompute_greedy(runner, io, PROMPTS, tokens)
    # every step is decided (smallest margins: 5.7e-2 and 1.2e-2 of a logit), so every
    # token must be equal; a near tie is reported with its margin
    assert margins.min() > MARGIN, f"near ties at (row, step) {np.argwhere(margins <= MARGIN).tolist()}"
    np.testing.assert_array_equal(first.tokens, ref)


def test_fixture_batch_two_rows_equal_batch_one(small_llm_path):
    runner, io = OrtRunner(small_llm_path), DecoderIO.from_model(small_llm_path)
    both = greedy_decode(runner, io, PROMPTS, 8, keep_logits=True)
    for i in range(2):
        one = greedy_decode(runner, io, PROMPTS[i:i + 1], 8, keep_logits=True)
        np.testing.assert_array_equal(both.tokens[i], one.tokens[0])
        np.testing.assert_allclose(both.first_logits[i], one.first_logits[0], rtol=1e-4, atol=1e-4)
