"""The whole fixture decoder through ActionProgram against ONNX Runtime.

16-token prefill, then decode steps up to 32 generated tokens, at batch 1 and 4.
Tolerance: per step, max |ours - ORT| over the logits <= LOGIT_RTOL x the step's logit
range (max - min). Both sides compute in fp32 from the same INT4 weights; only the
summation order and our kernels' per-block folding differ: the worst measured here is
1.1e-6 of the range (tiny fixture, seed 1), and LOGIT_RTOL leaves ~9x above it. The
negative controls (test_tolerance_fails_a_wrong_weight) show one scale 1% off, or one
block's zero point off by one, in one projection fails it (1e-3, the bound before,
passed every one-scale fault: 0.2-0.55 of it).

Greedy tokens: a token can differ only where ORT's top-2 margin is at most twice the
step's observed max logit difference d (|ours - ORT| <= d everywhere keeps the argmax
when margin > 2d), so our argmax must equal ORT's wherever the margin exceeds 2d; steps
at or under it are reported, never silently passed. Both runs consume ORT's token
(teacher forcing) so every step compares the same inputs; when every step compared, the
two free-running greedy sequences are identical for all 32 tokens. Random-weight models
have near ties: ORT's smallest top-2 margin here is about 1.3e-3 of a logit, still ~100x
the observed difference d.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

from conftest import ort_or_skip
from onnx_prep.core.runtime.action_program import ActionProgram
from onnx_prep.core.io.external_data import ExternalDataReader
from onnx_prep.core.kernels.prepack import packed_size, packing_nodes, prepack_all, source_loader
from onnx_prep.core.model.resolution import resolve_model

LOGIT_RTOL = 1e-5
PREFILL = 16
GENERATED = 32


class Decoder:
    """One fixture model: resolved, compiled, prepacked; and its ORT session."""

    def __init__(self, path, backend: str, alter: Callable[[str, np.ndarray], np.ndarray] | None = None) -> None:
        """``alter(name, array)``: the source our side uses instead (a deliberate fault)."""
        ort = ort_or_skip()
        self.resolved = resolve_model(path)
        self.reader = ExternalDataReader.for_model(self.resolved)
        read = source_loader(self.resolved, self.reader)

        def load(name):
            return read(name) if alter is None else alter(name, read(name))

        self.program = ActionProgram.compile(self.resolved)
        self.prepared = prepack_all(self.resolved, load, backend=backend)
        self.binding = self.program.bind_prepared(self.prepared)
        self.weights = {n: load(n) for n in self.program.weight_names}
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        self.ort = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.ort_outputs = [o.name for o in self.ort.get_outputs()]
        kv = [v for v in self.resolved.inputs if v.name.startswith("past_key_values.")]
        self.kv_names = [v.name for v in kv]
        self.heads, self.head_dim = kv[0].shape[1], kv[0].shape[3]

    def feeds(self, ids, start, past):
        b, s = ids.shape
        f = {"input_ids": ids, "position_ids": np.tile(np.arange(start, start + s, dtype=np.int64), (b, 1))}
        for name in self.kv_names:
            f[name] = past.get(name) if past else np.zeros((b, self.heads, 0, self.head_dim), np.float32)
        return f

    def ours(self, feeds):
        return self.program.run(feeds, self.binding, weights=self.weights)

    def theirs(self, feeds):
        return dict(zip(self.ort_outputs, self.ort.run(None, feeds)))


def _next_past(out):
    return {n.replace("present.", "past_key_values."): v for n, v in out.items() if n.startswith("present.")}


def compare_generation(dec: Decoder, batch: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    vocab = dec.resolved.outputs[0].shape[-1]
    ids = rng.integers(0, vocab, size=(batch, PREFILL)).astype(np.int64)
    past_o = past_t = None
    pos, worst, min_margin, skipped, steps = 0, 0.0, np.inf, [], 0
    for step in range(GENERATED):
        ours = dec.ours(dec.feeds(ids, pos, past_o))
        theirs = dec.theirs(dec.feeds(ids, pos, past_t))
        lo, lt = ours["logits"], theirs["logits"]
        assert lo.shape == lt.shape
        tol = LOGIT_RTOL * float(lt.max() - lt.min())
        diff = float(np.abs(lo - lt).max())
        worst = max(worst, diff / tol)
        assert diff <= tol, f"step {step}: max abs logit diff {diff:.3g} > {tol:.3g}"
        for name in dec.kv_names:  # the caches agree too
            p = name.replace("past_key_values.", "present.")
            np.testing.assert_allclose(ours[p], theirs[p], atol=tol, rtol=0)
        last_o, last_t = lo[:, -1], lt[:, -1]
        top2 = np.sort(last_t, axis=-1)[:, -2:]
        margin = top2[:, 1] - top2[:, 0]
        d = np.abs(last_o - last_t).max(axis=-1)
        for row in range(batch):
            if margin[row] > 2 * d[row]:
                assert last_o[row].argmax() == last_t[row].argmax(), (step, row, float(margin[row]))
            else:
                skipped.append((step, row, float(margin[row]), float(d[row])))
        min_margin = min(min_margin, float(margin.min()))
        ids = last_t.argmax(-1).astype(np.int64)[:, None]  # teacher forcing: ORT's token
        pos += lo.shape[1]
        past_o, past_t = _next_past(ours), _next_past(theirs)
        steps += 1
    return {"steps": steps, "worst_diff_over_tol": worst, "min_margin": min_margin, "skipped": skipped}


@pytest.fixture(scope="module")
def small_native(small_llm_path):
    return Decoder(small_llm_path, "native")


@pytest.fixture(scope="module")
def tiny_native(tiny_llm_path):
    return Decoder(tiny_llm_path, "native")


@pytest.mark.parametrize("batch", [1, 4])
def test_small_fixture_matches_ort(small_native, batch):
    r = compare_generation(small_native, batch)
    assert r["steps"] == GENERATED and not r["skipped"], r


@pytest.mark.parametrize("batch", [1, 4])
def test_tiny_fixture_matches_ort(tiny_native, batch):
    r = compare_generation(tiny_native, batch, seed=1)
    assert r["steps"] == GENERATED and not r["skipped"], r


def _one_scale_off(target):
    """The first scale of ``target`` 1% off."""
    def alter(name, a):
        if name != target:
            return a
        a = a.copy()
        a.reshape(-1)[0] *= np.float32(1.01)
        return a
    return alter


def _one_zero_point_off(target):
    """Block 0 of output 0 of ``target`` dequantized with zero point 9, not 8: its codes
    one lower (q - 9 == (q - 1) - 8; a code 0 stays, the fixture's blocks hold few)."""
    def alter(name, a):
        if name != target:
            return a
        a = a.copy()
        lo, hi = a[0, 0] & 0xF, a[0, 0] >> 4
        a[0, 0] = np.maximum(lo, 1) - 1 | (np.maximum(hi, 1) - 1) << 4
        return a
    return alter


@pytest.mark.parametrize("fault", [
    _one_scale_off("layers.1.mlp.down.scales"), _one_scale_off("layers.1.attn.out.scales"),
    _one_zero_point_off("layers.1.attn.out.weight_q4"), _one_zero_point_off("layers.0.attn.qkv.weight_q4"),
], ids=["down-scale", "out-scale", "out-zero-point", "qkv-zero-point"])
def test_tolerance_fails_a_wrong_weight(small_llm_path, fault):
    """Negative control: one wrong scale or zero point in one projection of the last
    blocks (their faults reach the logits least) must fail the logit tolerance."""
    with pytest.raises(AssertionError, match="max abs logit diff"):
        compare_generation(Decoder(small_llm_path, "native", alter=fault), 1)


def _isas():
    from onnx_prep import native

    return native.available_isas()


@pytest.mark.parametrize("isa", _isas())
def test_small_fixture_matches_ort_on_every_isa(small_native, isa, monkeypatch):
    from onnx_prep import native

    monkeypatch.setenv(native.ENV_VAR, isa)
    assert native.active_isa() == isa
    r = compare_generation(small_native, 4, seed=4)
    assert r["steps"] == GENERATED and not r["skipped"], r


def test_small_fixture_reference_backend_matches_ort(small_llm_path):
    r = compare_generation(Decoder(small_llm_path, "reference"), 4, seed=2)
    assert not r["skipped"], r


def test_row_of_batch_equals_batch_one(small_native):
    dec = small_native
    ids = np.random.default_rng(3).integers(0, 512, size=(4, PREFILL)).astype(np.int64)
    b4 = dec.ours(dec.feeds(ids, 0, None))
    for row in range(4):
        b1 = dec.ours(dec.feeds(ids[row:row + 1], 0, None))
        for k in b1:
            np.testing.assert_array_equal(b1[k][0], b4[k][row])


def test_packed_size_is_exact(small_native):
    dec = small_native
    packers = packing_nodes(dec.resolved.nodes)
    for key, req in dec.resolved.requests.items():
        node = packers[key]
        assert packed_size(node.kernel, req, dec.resolved) == dec.prepared[key].nbytes, key
        assert packed_size(node.kernel, req, dec.resolved, backend="reference") is not None


def test_reads_only_manifest_and_each_source_once(small_llm_path):
    dec = Decoder(small_llm_path, "native")
    c = dec.reader.counters.snapshot()
    # prepack + raw weights read every external entry of the manifest once, the tied INT4
    # data too: the embedding reads the LM head's one prepared object.
    want = {e.name: e.length for e in dec.resolved.manifest}
    assert c["per_tensor"] == want
    assert c["reads"] == len(want)
    assert c["bytes_read"] == dec.resolved.manifest.total_bytes
