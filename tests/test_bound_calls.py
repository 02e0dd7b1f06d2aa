"""Bound calls (an op's ``bind``, core/runtime/action_program.py): a session decoding
with the calls its ops bound to their nodes gives every step's logits bit for bit as
the general ops do, and the bound calls are the ones that ran."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from onnx_prep import native
from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.decode.generation import greedy_decode
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.ops import intra_op
from onnx_prep.core.runtime.session import Session


def _unbind(session: Session) -> Counter:
    """Every action of ``session`` back to the general op; the op types that were bound."""
    bound = [a for a in session.program.actions if hasattr(a.fn, "unbound")]
    for a in bound:
        object.__setattr__(a, "fn", a.fn.unbound)  # Action is frozen
    return Counter(a.op_type for a in bound)


@pytest.mark.parametrize("batch", [1, 2])
def test_bound_calls_give_the_general_ops_logits_at_every_step(tiny_llm_path, monkeypatch, batch):
    """The tiny fixture (fused Attention over append buffers, its units shared with the
    run's helpers, MatMulNBits split through the run's mailbox, both once their
    thresholds are lowered; RMSNorms): bound and general sessions
    decode the same tokens with equal logits at every step; the bound attention step and
    the bound GEMV did run (a general call in their place would not be counted)."""
    monkeypatch.setattr(intra_op, "MIN_SPLIT_WORK", 1)  # every INT4 matmul splits
    monkeypatch.setattr(intra_op, "MIN_ATTENTION_SPLIT_BYTES", 0)  # every attention step shares its units
    ran = {"attention": 0, "gemv": 0}
    separate, through = native.GqaStep.separate, native.MatmulSplit.through

    def counted_separate(self, *a):
        out = separate(self, *a)
        ran["attention"] += out is not None
        return out

    def counted_through(self, *a):
        ran["gemv"] += 1
        return through(self, *a)

    monkeypatch.setattr(native.GqaStep, "separate", counted_separate)
    monkeypatch.setattr(native.MatmulSplit, "through", counted_through)
    r = resolve_model(tiny_llm_path)
    io = DecoderIO.for_resolved(r)
    prompt = np.tile(np.arange(3, 11, dtype=np.int64)[None, :], (batch, 1))
    with Session(r, cpu_workers=2, intra_op_threads=2) as bound, \
            Session(r, cpu_workers=2, intra_op_threads=2) as general:
        got = greedy_decode(bound, io, prompt, 6, keep_logits=True)
        # the hot runs' attentions went through the mailbox (a cold run has none)
        shared = bound.stats().attention_splits
        assert 0 < shared <= 4 * 5 and shared % 4 == 0
        assert _unbind(general) == {"Attention": 4, "MatMulNBits": 17, "SimplifiedLayerNormalization": 9,
                                    "QuickGelu": 4}
        want = greedy_decode(general, io, prompt, 6, keep_logits=True)
    assert got.tokens.tolist() == want.tokens.tolist()
    for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        assert np.array_equal(a, b), f"step {step}"
    assert ran["attention"] == 4 * 5  # every decode step's (the prefill has no past)
    # the hot runs' (the first run loads: a cold run splits through the scheduler); a
    # run whose helpers were all busy splits none through a mailbox
    assert ran["gemv"] >= 17 and ran["gemv"] % 17 == 0
