"""Greedy tokens of the prepared runtime against ONNX Runtime, on several prompts of a
fixture whose output does not collapse (conftest.tiny_zp_llm_path).

Tokens must be identical wherever the margin allows: with d the step's max |ours - ORT|
over the logits, a step whose ORT top-2 margin exceeds 2d cannot change its argmax, so
every step up to the first one at or under 2d must agree exactly; such a step (a near
tie numerical noise may break either way) is reported with its margin, and on this
fixture there is none: the smallest margin is ~100x d. Logits: within LOGIT_RTOL of the
step's logit range, as in test_action_program_ort.py (measured 1.7e-6 here).
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import ort_or_skip
from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.decode.generation import compare_generations, greedy_decode
from onnx_prep.core.runtime.session import Session

ort_or_skip()
from onnx_prep.core.decode.ort_runner import OrtRunner  # noqa: E402  (after the skip)

LOGIT_RTOL = 1e-5
TOKENS = 32
PROMPTS = np.array([
    [1, 2, 3, 4, 5, 6, 7, 8], [100, 2000, 31, 4096, 5, 77, 8000, 12],
    [4242, 17, 923, 6001, 35, 8191, 0, 250], [9, 8, 7, 6, 5, 4, 3, 2],
    [3000, 3001, 3002, 3003, 3004, 3005, 3006, 3007], [55, 1234, 5678, 42, 8000, 999, 17, 256],
])


@pytest.fixture(scope="module")
def decoded(tiny_zp_llm_path):
    io = DecoderIO.from_model(tiny_zp_llm_path)
    ref = greedy_decode(OrtRunner(tiny_zp_llm_path, threads=1), io, PROMPTS, TOKENS, keep_logits=True)
    with Session.open(tiny_zp_llm_path) as s:
        ours = greedy_decode(s, io, PROMPTS, TOKENS, keep_logits=True)
    return ours, ref


def test_the_fixture_output_does_not_collapse(decoded):
    # Guards the comparison below: a few repeated tokens would agree by accident.
    _, ref = decoded
    for row in ref.tokens:
        assert len(set(row.tolist())) >= 20 and np.bincount(row).max() <= 6, row.tolist()


def test_greedy_tokens_equal_onnxruntime_wherever_the_margin_decides(decoded):
    ours, ref = decoded
    undecided = []  # (row, step, ORT's margin, 2d): steps where noise could flip the argmax
    for row in range(len(PROMPTS)):
        for step in range(TOKENS):
            d = float(np.abs(ours.logits[step][row] - ref.logits[step][row]).max())
            assert d <= LOGIT_RTOL * ref.logit_range[row, step], (row, step, d, ref.logit_range[row, step])
            if ref.top2_margin[row, step] <= 2 * d:
                undecided.append((row, step, float(ref.top2_margin[row, step]), 2 * d))
                break  # from here on the two decode different sequences
            assert ours.tokens[row, step] == ref.tokens[row, step], (row, step, ref.top2_margin[row, step], d)
    assert not undecided, f"near ties (row, step, margin, 2d): {undecided}"
    cmp = compare_generations(ours, ref)
    assert cmp.identical and cmp.first_divergence_step is None, cmp.to_json()
