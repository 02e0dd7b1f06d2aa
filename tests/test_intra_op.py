"""Intra-op parallelism: Scheduler.fork_join (parts offered to idle CPU workers, never
waiting for a busy one) and the runtime's split INT4 matmuls (equal bit for bit to the
whole op). Real threads, no sleeps: parts are held with threading.Event."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from onnx_prep.core.ops import intra_op
from onnx_prep.core.runtime.scheduler import Scheduler
from onnx_prep.core.plan.task import ResourceClass

T = 30


@pytest.fixture
def sched():
    s = Scheduler(io_workers=1, cpu_workers=2, name="fj-test")
    yield s
    s.close()


def test_an_idle_worker_takes_a_part_while_the_caller_runs_its_own(sched):
    """Part 0 (the caller) waits until part 1 has started elsewhere: only a worker can
    have started it, so the parts ran at the same time on two threads."""
    started1 = threading.Event()
    where = {}

    def part0():
        where[0] = threading.current_thread().name
        assert started1.wait(T), "no idle worker took part 1"

    def part1():
        where[1] = threading.current_thread().name
        started1.set()

    assert sched.fork_join([part0, part1]) == 1
    assert where[0] == threading.current_thread().name
    assert where[1].startswith("fj-test-cpu-")
    assert sched.side_jobs_run == 1 and sched.submissions == 0  # no task was submitted


def test_busy_workers_never_hold_the_caller_up(sched):
    """With every CPU worker held by a task, the caller runs every part itself."""
    release = threading.Event()
    running = threading.Semaphore(0)

    def hold(ctx):
        running.release()
        assert release.wait(T)

    tasks = [sched.submit(hold, resource=ResourceClass.CPU, name=f"hold{i}") for i in range(2)]
    for _ in tasks:
        assert running.acquire(timeout=T)
    ran = []
    assert sched.fork_join([lambda i=i: ran.append((i, threading.current_thread().name)) for i in range(3)]) == 0
    me = threading.current_thread().name
    assert sorted(ran) == [(0, me), (1, me), (2, me)]
    release.set()
    assert all(t.wait(T) for t in tasks)


def test_fork_join_from_a_task_and_the_first_error_by_part(sched):
    """Called from a worker's task (the cold path) it returns once every part ran, and
    re-raises the lowest-numbered part's error."""
    ran = []
    lock = threading.Lock()

    def ok(i):
        with lock:
            ran.append(i)

    def bad(i):
        ok(i)
        raise ValueError(f"part {i}")

    def task(ctx):
        sched.fork_join([lambda: ok(0), lambda: bad(1), lambda: ok(2), lambda: bad(3)])

    h = sched.submit(task, resource=ResourceClass.CPU, name="caller")
    assert h.wait(T)
    with pytest.raises(ValueError, match="part 1"):
        h.result(T)
    assert sorted(ran) == [0, 1, 2, 3]


def test_column_ranges_cover_panels_exactly():
    assert intra_op.column_ranges(100, 2, 64) == [(0, 64), (64, 100)]
    assert intra_op.column_ranges(64, 2, 64) == [(0, 64)]  # one panel: no split
    assert intra_op.column_ranges(32000, 3, 64) == [(0, 10688), (10688, 21376), (21376, 32000)]
    for n, p in [(1, 2), (639, 4), (5632, 2), (5633, 7)]:
        rs = intra_op.column_ranges(n, p, 64)
        assert rs[0][0] == 0 and rs[-1][1] == n and len(rs) <= p
        assert all(a[1] == b[0] and a[1] % 64 == 0 for a, b in zip(rs, rs[1:]))


def test_split_matmuls_equal_whole_ones_bit_for_bit(tiny_llm_path, monkeypatch):
    """The tiny fixture's matmuls are below the split threshold; lowered, every one
    splits, and a prefill's logits and KV equal the unsplit session's exactly."""
    from onnx_prep.core.decode.decoder_io import DecoderIO
    from onnx_prep.core.decode.generation import step_feeds
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.core.runtime.session import RuntimeContext, Session

    r = resolve_model(tiny_llm_path)
    io = DecoderIO.discover(r.inputs, r.outputs)
    feeds = step_feeds(io, np.arange(3, 19, dtype=np.int64).reshape(1, 16), io.empty_past(1), 0)
    with Session(r, intra_op=False) as whole, Session(r) as split:
        whole.prepare()
        split.prepare()
        ref = whole.run(feeds)
        monkeypatch.setattr(intra_op, "MIN_SPLIT_WORK", 1)
        before = split.stats().matmul_splits
        hot = split.run(feeds)  # hot path: parts on the caller and idle workers
        assert split.stats().matmul_splits > before
        assert split.evict(split.plan.requirements[-1].key)
        with split.run_async(RuntimeContext(feeds)) as h:  # cold path: parts from a worker
            pass
        cold = h.keepalive.outputs
        rec = h.stats()
        assert rec.cold_runs == 1 and rec.matmul_splits > 0 and rec.split_parts >= 2 * rec.matmul_splits
        assert whole.stats().matmul_splits == 0  # the other session's splits are not its own
    for name in ref:
        assert np.array_equal(hot[name], ref[name]), name
        assert np.array_equal(cold[name], ref[name]), name


def test_decode_gemvs_are_cut_into_chunks_of_about_chunk_work_prefill_into_one_per_part():
    mib = 1 << 20
    # one row: ~CHUNK_WORK chunks, at least one and at most MAX_CHUNKS_PER_PART per part
    assert intra_op.chunk_count(int(2.4 * mib), 1, 2) == 2
    assert intra_op.chunk_count(13 * mib, 1, 2) == 6
    assert intra_op.chunk_count(36 * mib, 1, 2) == 2 * intra_op.MAX_CHUNKS_PER_PART
    # a multiple of the parts: 3 chunks over 2 threads would leave one a third alone
    assert intra_op.chunk_count(int(7.9 * mib), 1, 2) == 4  # the medium QKV: ~3 chunks of CHUNK_WORK
    assert intra_op.chunk_count(int(14.4 * mib), 1, 2) == 8  # gate-up: ~7
    assert intra_op.chunk_count(int(7.9 * mib), 1, 3) == 3 and intra_op.chunk_count(13 * mib, 1, 4) == 8
    # two rows (decode at batch 2) as one; more rows: one chunk per part
    assert intra_op.chunk_count(13 * mib, 2, 2) == 6
    assert intra_op.chunk_count(36 * mib, 3, 2) == intra_op.chunk_count(36 * mib, 8, 2) == 2
