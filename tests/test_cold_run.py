"""Cold runs under pressure: what a step holds while it executes, what a cancel stops,
and what the memory budget counts, checked against the real allocations. Real fixture
models with real external data, the real scheduler, store, stable slots and kernels;
Event-gated hooks (the reader's ``before_read``, the run's ``before_step``), no sleeps."""
from __future__ import annotations

import os

import threading

import numpy as np
import pytest

from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.decode.generation import step_feeds
from onnx_prep.core.errors import CancelledError
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.runtime.arenas import Arena, MemoryBudget
from onnx_prep.core.runtime.execution_handle import SubmissionState
from onnx_prep.core.runtime.prepared_store import ResidencyState
from onnx_prep.core.runtime.scheduler import TaskState
from onnx_prep.core.runtime.session import RuntimeContext, Session

PAGE = os.sysconf("SC_PAGESIZE")

T = 30  # a blocked hook gives up after this (a failing test, not a hang)


def _feeds(path, ids) -> tuple[DecoderIO, dict]:
    r = resolve_model(path)
    io = DecoderIO.discover(r.inputs, r.outputs)
    ids = np.asarray(ids)
    return io, step_feeds(io, ids, io.empty_past(ids.shape[0]), 0)


def _step_keys(s: Session, si: int) -> tuple:
    return s.plan.by_id[s.plan.steps[si].task_id].prepared_requirements


def _reference(path, feeds) -> dict:
    with Session.open(path) as s:
        return s.run(feeds)


def _assert_pinned(s: Session, si: int) -> None:
    """The objects step ``si`` consumes are pinned. Checked before anything is evicted:
    touching an evicted (decommitted) slot faults, so a step that lost its pins must
    fail here, not crash the test process."""
    unpinned = [k for k in _step_keys(s, si) if s.store.pins(k) == 0]
    assert not unpinned, f"step {si} is about to execute with unpinned objects: {unpinned}"


def test_a_cold_step_keeps_what_it_consumes_pinned_until_it_has_executed(small_llm_path):
    io, feeds = _feeds(small_llm_path, [[1, 2, 3]])
    ref = _reference(small_llm_path, feeds)
    refused: dict[int, list[bool]] = {}
    inside, release = threading.Event(), threading.Event()
    with Session.open(small_llm_path) as s:
        held = next(st.index for st in s.plan.steps if st.index > 0 and _step_keys(s, st.index))

        def before_step(si):
            _assert_pinned(s, si)
            refused[si] = [not s.evict(k) for k in _step_keys(s, si)]
            if si == held:
                inside.set()
                assert release.wait(T)

        ctx = RuntimeContext(feeds, before_step=before_step)
        h = s.run_async(ctx)
        try:
            assert inside.wait(T)
            # seen from another thread while the step is blocked before executing
            keys = _step_keys(s, held)
            assert all(s.store.pins(k) >= 1 for k in keys)
            assert all(s.store.is_resident(k) for k in keys)
            assert s.store.total_pins >= 1
            assert not any(s.evict(k) for k in keys)
        finally:
            release.set()
        h.wait()
        assert s.store.total_pins == 0
        assert ctx.mode == "cold" and ctx.outputs is not None
        stepped = [si for si in range(len(s.plan.steps)) if _step_keys(s, si)]
        assert sorted(refused) == stepped and all(all(r) for r in refused.values())
        for name in ref:
            assert np.array_equal(ctx.outputs[name], ref[name]), name
        # once the run is over nothing is pinned: the same keys evict
        assert all(s.evict(k) for k in _step_keys(s, held))


def test_concurrent_cold_runs_evicting_everything_they_can_give_unconstrained_outputs(small_llm_path):
    """Two cold runs under a PREPARED limit of two steps' objects; before each step, each
    run evicts every prepared object that is not pinned. Run a holds its first weighted
    step until run b has evicted (so b's evictions meet a's pins). Both match an
    unconstrained run, and everything evicted was rebuilt."""
    io, feeds = _feeds(small_llm_path, [[9, 8, 7, 6]])
    ref = _reference(small_llm_path, feeds)
    with Session.open(small_llm_path) as probe:
        plan = probe.plan
        per_step = sorted(sum(plan.by_key[k].packed_bytes for k in _step_keys(probe, st.index))
                          for st in plan.steps)
    limit = per_step[-1] + per_step[-2] + 4096
    budget = MemoryBudget(limits={Arena.PREPARED: limit})
    b_evicted = threading.Event()
    with Session.open(small_llm_path, budget=budget, cpu_workers=2) as s:
        all_keys = [r.key for r in s.plan.requirements]
        a_waits_at = next(st.index for st in s.plan.steps if _step_keys(s, st.index))

        def evicting(name):
            def before_step(si):
                _assert_pinned(s, si)
                for k in all_keys:
                    s.evict(k)
                assert all(s.store.is_resident(k) for k in _step_keys(s, si))
                if name == "b":
                    b_evicted.set()
                elif si == a_waits_at:
                    assert b_evicted.wait(T)
            return before_step

        a = RuntimeContext(feeds, before_step=evicting("a"))
        b = RuntimeContext(feeds, before_step=evicting("b"))
        ha = s.run_async(a)
        hb = s.run_async(b)
        try:
            ha.wait()
            hb.wait()
        finally:
            b_evicted.set()
        assert s.stats().page_ins > 0
        assert budget.peak(Arena.PREPARED) <= limit
        assert s.store.total_pins == 0
        for ctx in (a, b):
            for name in ref:
                assert np.array_equal(ctx.outputs[name], ref[name]), name


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


@pytest.mark.parametrize("what", ["run", "prepare"])
def test_cancel_with_reads_held_cancels_the_work_nobody_else_wants(small_llm_path, what):
    """Every source read is held in the reader's hook; then the submission is cancelled.
    The session tasks it held, and no one else, end CANCELLED (not failed) and never
    materialize; the run executes nothing; no consumer, pin, task or thread remains."""
    io, feeds = _feeds(small_llm_path, [[1, 2, 3]])
    baseline = _threads()
    gate, entered = threading.Event(), threading.Event()
    s = Session.open(small_llm_path)
    try:
        def before_read(desc):
            entered.set()
            gate.wait(T)

        s.reader.hooks.before_read = before_read
        ctx = RuntimeContext(feeds)
        try:
            h = s.prepare_async() if what == "prepare" else s.run_async(ctx)
            assert entered.wait(T)
            if what == "run":  # the first continuation has yielded: its producers are held
                first = h.tasks[0]
                assert first.wait(T) and first.state is TaskState.DONE
            held = [t for t in h.tasks if t.name.startswith("S.")]
            assert held and all(t.consumers == 1 for t in held)
            running = {t.name for t in held if t.state is TaskState.RUNNING}
            generations = {r.key: s.store.generation(r.key) for r in s.plan.requirements}
            published_by = {r.publisher: r.key for r in s.plan.requirements}
            h.cancel()
        finally:
            gate.set()
        with pytest.raises(CancelledError):
            h.wait()
        assert h.status().state is SubmissionState.CANCELLED
        assert s.scheduler.wait_idle(T)
        stopped = [t for t in held if t.name not in running]
        assert stopped, "some held task was still queued when the cancel came"
        for t in stopped:
            assert t.state is TaskState.CANCELLED, t
        for t in held:
            assert t.consumers == 0, t
            key = published_by.get(t.name)
            if key is not None and t.state is TaskState.CANCELLED:
                assert s.store.generation(key) == generations[key], key  # never materialized
                assert not s.store.is_resident(key)
        owned = [t for t in h.tasks if not t.name.startswith("S.")]
        assert all(t.state in (TaskState.DONE, TaskState.CANCELLED) for t in owned)
        if what == "run":
            assert owned[-1].state is TaskState.CANCELLED
            assert ctx.outputs is None and ctx.step_log == []
        # what did materialize is resident: no load was started and dropped
        resident = sum(s.store.is_resident(r.key) for r in s.plan.requirements)
        assert s.stats().materializations == resident
        assert all(s.store.state(r.key) in (ResidencyState.ABSENT, ResidencyState.RESIDENT)
                   for r in s.plan.requirements)
        assert s.store.total_pins == 0
        assert s.scheduler.live_tasks() == 0
        s.reader.hooks.before_read = None
        assert s.run(feeds)[io.logits].shape[-1] == 512  # the session still works
    finally:
        gate.set()
        s.close()
    assert _threads() <= baseline


def _resident_buffers(s: Session) -> dict:
    """The published buffer of every resident object (through a pin, released at once;
    again if one was evicted between the look and the pin)."""
    while True:
        keys = [r.key for r in s.plan.requirements if s.store.is_resident(r.key)]
        pins = s.store.pin_many(keys)
        if pins is not None:
            with pins:
                return {k: pins[k].buffer for k in keys}


def test_prepared_reservations_are_the_plan_sizes_and_cover_the_slots(tiny_llm_path):
    """Each prepared object's PREPARED-arena reservation is the plan's packed size and
    the bytes it published; its slot commits those bytes (whole pages); the arena's
    live and peak bytes are the sum of what is resident."""
    budget = MemoryBudget()
    with Session.open(tiny_llm_path, budget=budget) as s:
        s.prepare()
        bufs = _resident_buffers(s)
        assert len(bufs) == len(s.plan.requirements)
        for k, buf in bufs.items():
            planned = s.plan.by_key[k].packed_bytes
            assert buf.nbytes == planned, k
            assert buf.reservation.amounts == {Arena.PREPARED: planned}, k
            assert buf.committed_bytes == -(-planned // PAGE) * PAGE, k  # whole pages
        real = sum(b.nbytes for b in bufs.values())
        assert s.store.resident_bytes == real
        assert budget.live(Arena.PREPARED) == real
        assert budget.peak(Arena.PREPARED) == real  # nothing was evicted: the peak is all of it


def test_tight_budget_accounts_for_every_resident_byte(tiny_llm_path):
    """Under a PREPARED limit that forces evictions, before every step the arena's live
    bytes cover the published buffers' bytes (what the slots hold), and the peak covers
    the largest such sum and stays under the limit."""
    io, feeds = _feeds(tiny_llm_path, [[5, 6, 7]])
    ref = _reference(tiny_llm_path, feeds)[io.logits]
    with Session.open(tiny_llm_path) as probe:
        plan = probe.plan
        largest_step = max(sum(plan.by_key[k].packed_bytes for k in _step_keys(probe, st.index))
                           for st in plan.steps)
    limit = largest_step + 4096
    budget = MemoryBudget(limits={Arena.PREPARED: limit, Arena.PREPARATION: 4 << 20})
    seen: list[tuple[int, int]] = []
    with Session.open(tiny_llm_path, budget=budget) as s:
        def before_step(si):
            real = sum(b.nbytes for b in _resident_buffers(s).values())
            seen.append((real, budget.live(Arena.PREPARED)))

        for _ in range(2):
            ctx = RuntimeContext(feeds, before_step=before_step)
            s.run_async(ctx).wait()
            ctx.release()
            assert np.array_equal(ctx.outputs[io.logits], ref)
        assert s.stats().evictions > 0
    assert seen and all(live >= real for real, live in seen), seen
    assert max(real for real, _ in seen) <= budget.peak(Arena.PREPARED) <= limit

