"""Append buffers (core/ops/append_buffer.py): a KV-cache Concat writes only the new rows,
never a row it handed out before, and its values are np.concatenate's."""
from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np
import pytest

from onnx_prep.core.ops import append_buffer, run_counters
from onnx_prep.core.ops.append_buffer import MIN_ROOM, concat
from onnx_prep.core.runtime.stats import Counters

rng = np.random.default_rng(7)


@contextmanager
def counted():
    """A run's counters installed on this thread, as a session does for a run."""
    c = Counters()
    with run_counters.counting(c):
        yield c


def _kv(seq: int, batch: int = 1) -> np.ndarray:
    return rng.standard_normal((batch, 2, seq, 8)).astype(np.float32)


def test_second_step_appends_into_the_first_steps_buffer():
    past0, new1, new2 = _kv(0), _kv(3), _kv(1)
    p1 = concat([past0, new1], 2)
    np.testing.assert_array_equal(p1, np.concatenate([past0, new1], 2))
    assert p1.base.shape[2] == 3 + MIN_ROOM  # room after the rows
    keep = p1.copy()
    with counted() as c:
        p2 = concat([p1, new2], 2)
    assert c.snapshot() == {"kv_appended_in_place": 1}
    concat([p1, new2], 2)  # outside a run: counted nowhere (a copy: p1 is not the claim now)
    assert c.snapshot() == {"kv_appended_in_place": 1}
    assert p2.base is p1.base and np.shares_memory(p1, p2)  # the same buffer, extended
    np.testing.assert_array_equal(p2, np.concatenate([keep, new2], 2))
    np.testing.assert_array_equal(p1, keep)  # the rows handed out before did not change


def test_two_continuations_of_one_past_never_share_rows():
    p1 = concat([_kv(0), _kv(4)], 2)
    a, b = _kv(1), _kv(1)
    pa = concat([p1, a], 2)  # claims the room
    pb = concat([p1, b], 2)  # same past again: must not write over pa's row
    np.testing.assert_array_equal(pa, np.concatenate([p1, a], 2))
    np.testing.assert_array_equal(pb, np.concatenate([p1, b], 2))
    assert np.shares_memory(pa, p1) and not np.shares_memory(pb, pa)
    # re-running an older step (a shorter prefix of the same buffer) copies too
    p_short = p1[:, :, :2]
    ps = concat([p_short, a], 2)
    assert not np.shares_memory(ps, pa)
    np.testing.assert_array_equal(pa, np.concatenate([p1, a], 2))


def test_the_view_handed_out_last_and_any_other_prefix_view_extend_alike():
    """The past a decode step feeds back is the very view the step before handed out
    (the claim knows it without reading its geometry); another view object of the same
    prefix extends the same way, and an older view still gets a copy."""
    p1 = concat([_kv(0, batch=2), _kv(3, batch=2)], 2)
    new = _kv(1, batch=2)
    claim = append_buffer._claims[id(p1.base)]
    assert claim.view() is p1
    with counted() as c:
        p2 = concat([p1, new], 2)  # p1: the view handed out last
        assert claim.view() is p2
        p3 = concat([p2[:, :, :], new], 2)  # the same prefix, another view object
        assert claim.view() is p3
        old = concat([p1, new], 2)  # handed out before: its rows are claimed, a copy
    assert c.snapshot() == {"kv_appended_in_place": 2, "kv_copied": 1}
    assert p2.base is p1.base is p3.base and old.base is not p1.base
    np.testing.assert_array_equal(p3, np.concatenate([p1, new, new], 2))
    np.testing.assert_array_equal(old, np.concatenate([p1, new], 2))


def test_many_steps_equal_plain_concat_and_copy_rarely():
    past, want = _kv(0, batch=3), _kv(0, batch=3)
    buffers = set()
    for step in range(300):
        new = _kv(5 if step == 0 else 1, batch=3)
        past = concat([past, new], 2)
        want = np.concatenate([want, new], 2)
        buffers.add(id(past.base))
        np.testing.assert_array_equal(past, want)
    # room grows by 1.5x (at least MIN_ROOM): 5 -> 69 -> ... -> past 304 rows in a few buffers
    assert len(buffers) <= 5, len(buffers)


def test_other_axes_and_layouts():
    # [batch, seq, heads, dim] with the sequence on axis 1, batch 2 (prefix is strided)
    x = rng.standard_normal((2, 0, 3, 4)).astype(np.float32)
    want = x
    for n in (2, 1, 1):
        new = rng.standard_normal((2, n, 3, 4)).astype(np.float32)
        x = concat([x, new], 1)
        want = np.concatenate([want, new], 1)
        np.testing.assert_array_equal(x, want)
    assert x.base is not None and x.base.shape[1] > 4


def test_bad_shapes_raise_numpys_error_and_claim_nothing():
    p1 = concat([_kv(0), _kv(2)], 2)
    with pytest.raises(ValueError):
        concat([p1, np.zeros((1, 3, 1, 8), np.float32)], 2)  # heads differ
    new = _kv(1)
    p2 = concat([p1, new], 2)
    assert np.shares_memory(p1, p2)  # the failed call took no rows
    np.testing.assert_array_equal(p2, np.concatenate([p1, new], 2))


def test_mixed_dtypes_take_the_plain_path():
    p1 = concat([_kv(0), _kv(2)], 2)
    new = _kv(1).astype(np.float64)
    out = concat([p1, new], 2)
    assert out.dtype == np.float64 and not np.shares_memory(out, p1)
    np.testing.assert_array_equal(out, np.concatenate([p1, new], 2))


def test_concurrent_appends_to_one_past_get_one_winner():
    p1 = concat([_kv(0), _kv(4)], 2)
    news = [_kv(1) for _ in range(8)]
    outs: list = [None] * 8
    start = threading.Barrier(8)

    def go(i):
        start.wait()
        outs[i] = concat([p1, news[i]], 2)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(8):
        np.testing.assert_array_equal(outs[i], np.concatenate([p1, news[i]], 2))
    assert sum(np.shares_memory(o, p1) for o in outs) == 1


def test_only_past_to_present_concats_are_marked(tiny_llm_path):
    from onnx_prep.core.runtime.action_program import ActionProgram
    from onnx_prep.core.ops.attributes import APPEND_IN_PLACE
    from onnx_prep.core.model.resolution import resolve_model

    resolved = resolve_model(tiny_llm_path, fuse=False)  # the KV Concats as the graph spells them
    program = ActionProgram.compile(resolved)
    marked = {a.name for a in program.actions if a.attrs.get(APPEND_IN_PLACE)}
    concats = [a for a in program.actions if a.op_type == "Concat"]
    kv = {a.name for a in concats if program.resolved.nodes[a.node_index].outputs[0].startswith("present.")}
    assert marked == kv and len(kv) == 2 * 4  # K and V of 4 blocks; rotary concats not marked
    # each marked Concat has its own position among them: its share of the room
    marks = sorted(a.attrs[APPEND_IN_PLACE] for a in program.actions if a.attrs.get(APPEND_IN_PLACE))
    assert marks == [(i, 8) for i in range(8)]
    plain = ActionProgram.compile(resolved, append_in_place=False)
    assert not any(a.attrs.get(APPEND_IN_PLACE) for a in plain.actions)
    # fused, each block's attention node writes both its presents: the 4 of them are marked
    fused = ActionProgram.compile(resolve_model(tiny_llm_path))
    marked = [a for a in fused.actions if a.attrs.get(APPEND_IN_PLACE)]
    assert {a.op_type for a in marked} == {"Attention"} and len(marked) == 4
    assert sorted(a.attrs[APPEND_IN_PLACE] for a in marked) == [(i, 4) for i in range(4)]


def test_session_decode_appends_in_place_with_identical_logits(tiny_llm_path):
    """A real greedy decode through the prepared runtime: every decode step after the
    prefill extends its KV buffers in place, and the logits are bit-identical to the
    same program compiled without append buffers."""
    from onnx_prep.core.runtime.action_program import ActionProgram
    from onnx_prep.core.decode.decoder_io import DecoderIO
    from onnx_prep.core.io.external_data import ExternalDataReader
    from onnx_prep.core.decode.generation import greedy_decode
    from onnx_prep.core.kernels.prepack import prepack_all, source_loader
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.core.runtime.session import Session

    resolved = resolve_model(tiny_llm_path)
    io = DecoderIO.from_model(tiny_llm_path)
    prompt = np.array([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    with Session(resolved) as s:
        got = greedy_decode(s, io, prompt, 12, keep_logits=True)
    kv_concats = 2 * 4
    # prefill: one fresh buffer per KV concat; then 11 decode steps, each appending in place
    assert got.stats.kv_appended_in_place == 11 * kv_concats
    assert got.stats.kv_copied == kv_concats

    load = source_loader(resolved, ExternalDataReader.for_model(resolved))
    plain = ActionProgram.compile(resolved, append_in_place=False)
    binding = plain.bind_prepared(prepack_all(resolved, load))
    weights = {n: load(n) for n in plain.weight_names}

    class Plain:
        def run(self, feeds):
            return plain.run(feeds, binding, weights=weights)

    want = greedy_decode(Plain(), io, prompt, 12, keep_logits=True)
    assert got.tokens.tolist() == want.tokens.tolist()
    for a, b in zip(got.logits, want.logits):
        np.testing.assert_array_equal(a, b)


def test_room_hint_sizes_fresh_buffers_and_resets():
    assert append_buffer.room_hint() == 0
    with append_buffer.room_for(500):
        assert append_buffer.room_hint() == 500
        p = concat([_kv(0), _kv(3)], 2)
        assert p.base.shape[2] == 500
        with append_buffer.room_for(0):
            assert concat([_kv(0), _kv(3)], 2).base.shape[2] == 3 + MIN_ROOM
    assert append_buffer.room_hint() == 0
    q = concat([_kv(0), _kv(300)], 2)
    assert q.base.shape[2] == 450  # no hint: 1.5x


def test_session_carries_the_room_hint_to_its_worker_threads(tiny_llm_path):
    """The first run is cold (steps on worker threads), the second hot: both see the
    room announced on the caller's thread, through the RuntimeContext."""
    from onnx_prep.core.decode.decoder_io import DecoderIO
    from onnx_prep.core.decode.generation import step_feeds
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.core.runtime.session import RuntimeContext, Session

    io = DecoderIO.from_model(tiny_llm_path)
    feeds = step_feeds(io, np.array([[1, 2, 3]]), io.empty_past(1), 0)
    with Session(resolve_model(tiny_llm_path)) as s:
        for mode in ("cold", "hot"):
            with append_buffer.room_for(333):
                ctx = RuntimeContext(feeds)
            s.run_async(ctx).wait()
            assert ctx.mode == mode
            present = [v for k, v in ctx.outputs.items() if k.startswith("present.")]
            assert present and all(p.base.shape[2] == 333 for p in present)
            ctx.release()


def test_greedy_decode_sizes_the_cache_once(tiny_llm_path):
    from onnx_prep.core.decode.decoder_io import DecoderIO
    from onnx_prep.core.decode.generation import greedy_decode
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.core.runtime.session import Session

    io = DecoderIO.from_model(tiny_llm_path)
    kv_concats = 2 * 4
    with Session(resolve_model(tiny_llm_path)) as s:
        got = greedy_decode(s, io, np.array([[5, 6, 7, 8, 9]]), 90)  # past reaches 93 > 5 + MIN_ROOM
    assert got.kv_copied == kv_concats  # the prefill's buffers only
    assert got.kv_appended_in_place == 89 * kv_concats


def test_the_io_arena_counts_the_whole_kv_buffers(tiny_llm_path):
    from onnx_prep.core.runtime.arenas import Arena
    from onnx_prep.core.decode.decoder_io import DecoderIO
    from onnx_prep.core.decode.generation import step_feeds
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.core.runtime.session import RuntimeContext, Session

    io = DecoderIO.from_model(tiny_llm_path)
    feeds = step_feeds(io, np.array([[1, 2, 3]]), io.empty_past(1), 0)
    with Session(resolve_model(tiny_llm_path)) as s:
        s.prepare()
        with append_buffer.room_for(400):
            ctx = RuntimeContext(feeds)
        s.run_async(ctx).wait()
        kv = [v for k, v in ctx.outputs.items() if k.startswith("present.")]
        rest = [v for k, v in ctx.outputs.items() if not k.startswith("present.")]
        want = sum(v.base.nbytes for v in kv) + sum(v.nbytes for v in rest)
        assert want > sum(v.nbytes for v in ctx.outputs.values())  # the room is counted
        assert append_buffer.held_bytes(ctx.outputs.values()) == want
        assert s.budget.live(Arena.IO) == want
        ctx.release()
        assert s.budget.live(Arena.IO) == 0


def test_concurrent_session_runs_from_one_past_match_sequential_runs(tiny_llm_path):
    """Four runs in flight at once, each continuing the same past with a different
    token: each shared buffer is extended by exactly one of them, the others copy, and
    every output equals a run made alone afterwards (whose past is then an older
    prefix: a copy)."""
    from onnx_prep.core.decode.decoder_io import DecoderIO
    from onnx_prep.core.decode.generation import step_feeds
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.core.runtime.session import RuntimeContext, Session

    io = DecoderIO.from_model(tiny_llm_path)
    with Session(resolve_model(tiny_llm_path)) as s:
        first = s.run(step_feeds(io, np.array([[1, 2, 3]]), io.empty_past(1), 0))
        past = {p.past_key.name: first[p.present_key] for p in io.kv}
        past.update({p.past_value.name: first[p.present_value] for p in io.kv})
        before = s.stats()
        ctxs = [RuntimeContext(step_feeds(io, np.array([[10 + i]]), past, 3)) for i in range(4)]
        handles = [s.run_async(c) for c in ctxs]
        for h in handles:
            h.wait()
        after = s.stats().since(before)
        kv = 2 * len(io.kv)
        assert after.kv_appended_in_place == kv  # one run's worth
        assert after.kv_copied == 3 * kv
        # each run's record has its own ops' counts, whatever ran beside it
        per_run = sorted((h.stats().kv_appended_in_place, h.stats().kv_copied) for h in handles)
        assert per_run == [(0, kv)] * 3 + [(kv, 0)]
        for i, c in enumerate(ctxs):
            alone = s.run(step_feeds(io, np.array([[10 + i]]), past, 3))
            for name, value in alone.items():
                np.testing.assert_array_equal(c.outputs[name], value)


def test_room_after_spreads_the_room_around_the_default():
    assert append_buffer.room_after(5) == MIN_ROOM  # spread 0.5: the plain default
    assert append_buffer.room_after(300) == 150  # 1.5x
    rooms = [append_buffer.room_after(5, (i + 0.5) / 8) for i in range(8)]
    assert rooms == sorted(set(rooms))  # eight different rooms, growing with the spread
    assert rooms[0] >= 0.75 * MIN_ROOM and rooms[-1] <= 1.25 * MIN_ROOM
    assert abs(sum(rooms) / 8 - MIN_ROOM) <= 1  # the same mean room as without a spread
    assert concat([_kv(0), _kv(3)], 2, spread=0.0).base.shape[2] == 3 + 48
    assert concat([_kv(0), _kv(3)], 2, spread=1.0).base.shape[2] == 3 + 80


def test_without_a_hint_the_kv_buffers_grow_on_different_steps(tiny_llm_path):
    """A caller that announces no length (a step loop of its own): each KV buffer runs
    out of room on its own step, so no step copies more than one, and the values are
    those of the run that sized its buffers once."""
    from onnx_prep.core.decode.decoder_io import DecoderIO
    from onnx_prep.core.decode.generation import greedy_decode
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.core.runtime.session import RuntimeContext, Session

    io = DecoderIO.from_model(tiny_llm_path)
    prompt = np.array([[5, 6, 7, 8, 9]])
    copies_per_step: list[int] = []

    class NoHint:
        def __init__(self, session):
            self.session = session

        def run(self, feeds):
            with append_buffer.room_for(0):  # overrides greedy_decode's hint
                ctx = RuntimeContext(feeds)
            with self.session.run_async(ctx) as h:
                pass
            copies_per_step.append(h.stats().kv_copied)
            ctx.release()
            return ctx.outputs

    with Session(resolve_model(tiny_llm_path)) as s:
        got = greedy_decode(NoHint(s), io, prompt, 150, keep_logits=True)
        want = greedy_decode(s, io, prompt, 150, keep_logits=True)
    kv_concats = 2 * 4
    assert copies_per_step[0] == kv_concats  # the prefill makes every buffer
    growth = copies_per_step[1:]
    assert sum(growth) >= kv_concats  # past 154 rows > 5 + 1.25 * MIN_ROOM: each grew
    assert max(growth) == 1  # but never two on one step
    assert want.kv_copied == kv_concats  # with the hint: sized once
    assert got.tokens.tolist() == want.tokens.tolist()
    for a, b in zip(got.logits, want.logits):
        np.testing.assert_array_equal(a, b)
