"""The GIL-free chunk hand-off (native/handoff.c): a run's mailbox, served by helper
threads waiting in C, gives the same bits as a whole matmul whoever runs which chunk;
a mailbox nobody serves costs the caller nothing but its own chunks; and the runtime
lends its idle CPU workers to hot runs for it."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from onnx_prep import native
from onnx_prep.core.errors import NativeError
from onnx_prep.core.ops import intra_op

rng = np.random.default_rng(11)


def _packed(K: int, N: int, level: int = 4):
    kb = -(-K // 32)
    B = rng.integers(0, 256, (N, kb, 16), dtype=np.uint8)
    s = (rng.random(N * kb) * 0.02 + 0.001).astype(np.float32)
    return native.prepack_matmul_nbits(B, s, None, K=K, N=N, block_size=32, accuracy_level=level)


def _ranges(N: int, parts: int):
    return intra_op.column_ranges(N, parts, native.PANEL_N)


@pytest.mark.parametrize("level", [0, "fma", 4])
def test_a_served_mailbox_equals_a_whole_call_and_the_helper_takes_chunks(level):
    K, N = 300, 1000  # K not a multiple of the block, N not of the panel
    p = _packed(K, N, 1 if level == "fma" else level)
    compute = "fma" if level == "fma" else None
    box = native.Mailbox()
    helper = threading.Thread(target=box.serve)
    helper.start()
    try:
        for i in range(2000):  # until the helper has run chunks (it spins in C, so soon)
            A = rng.standard_normal((1 + i % 3, K)).astype(np.float32)
            bias = rng.standard_normal(N).astype(np.float32) if i % 2 else None
            y, batch = native.matmul_nbits_batch(A, p, _ranges(N, 4), bias=bias, compute=compute)
            box.fork_join(batch)
            np.testing.assert_array_equal(y, native.matmul_nbits(A, p, bias=bias, compute=compute))
            if box.chunks_by_helpers and i >= 20:
                break
    finally:
        box.stop()
        helper.join()
    assert box.chunks_by_helpers > 0


def test_a_mailbox_nobody_serves_runs_every_chunk_on_the_caller():
    K, N = 256, 640
    p = _packed(K, N)
    A = rng.standard_normal((2, K)).astype(np.float32)
    box = native.Mailbox()
    y, batch = native.matmul_nbits_batch(A, p, _ranges(N, 5))
    box.fork_join(batch)
    np.testing.assert_array_equal(y, native.matmul_nbits(A, p))
    assert box.chunks_by_helpers == 0
    y2, batch2 = native.matmul_nbits_batch(A, p, _ranges(N, 3))
    batch2.run_here()
    np.testing.assert_array_equal(y2, y)


@pytest.mark.parametrize("level", [0, "fma", 4])
def test_many_chunks_share_one_prepared_a_and_equal_a_whole_call(level):
    # the mailbox prepares A once for every chunk of a batch (handoff.c): any number of
    # chunks, rows, a K past the last whole block and a bias give the whole call's bits
    K, N = 300, 1000
    p = _packed(K, N, 1 if level == "fma" else level)
    compute = "fma" if level == "fma" else None
    box = native.Mailbox()
    for rows, chunks in ((1, 16), (3, 7), (2, 1)):
        A = rng.standard_normal((rows, K)).astype(np.float32)
        bias = rng.standard_normal(N).astype(np.float32)
        y, batch = native.matmul_nbits_batch(A, p, _ranges(N, chunks), bias=bias, compute=compute)
        box.fork_join(batch)
        np.testing.assert_array_equal(y, native.matmul_nbits(A, p, bias=bias, compute=compute))


def test_a_mailbox_counts_its_batches_solo_batches_and_the_callers_wait():
    K, N = 256, 1280
    p = _packed(K, N)
    A = rng.standard_normal((1, K)).astype(np.float32)
    alone = native.Mailbox()  # nobody serves: every batch is the caller's alone, no wait
    for _ in range(3):
        alone.fork_join(native.matmul_nbits_batch(A, p, _ranges(N, 4))[1])
    assert (alone.batches, alone.solo_batches, alone.wait_ns, alone.chunks_by_helpers) == (3, 3, 0, 0)
    box = native.Mailbox()
    helper = threading.Thread(target=box.serve)
    helper.start()
    published = 0
    try:
        while published < 2000 and not (box.chunks_by_helpers and published >= 20):
            box.fork_join(native.matmul_nbits_batch(A, p, _ranges(N, 4))[1])
            published += 1
    finally:
        box.stop()
        helper.join()
    assert box.batches == published
    assert box.solo_batches < published  # the helper took chunks of some batch...
    # ...at least one of every batch the caller did not run alone
    assert box.chunks_by_helpers >= published - box.solo_batches
    assert box.wait_ns >= 0


def test_a_batch_whose_a_cannot_be_prepared_fails_before_it_is_published():
    K, N = 256, 640
    p = _packed(K, N).copy()
    A = rng.standard_normal((1, K)).astype(np.float32)
    out = np.zeros((1, N), np.float32)
    _, batch = native.matmul_nbits_batch(A, p, _ranges(N, 4), out=out)
    p[:8] = 0  # the packed header, after the batch's checks
    box = native.Mailbox()
    with pytest.raises(NativeError):
        box.fork_join(batch)
    assert box.batches == 0 and not out.any()  # nothing published, no chunk ran


def test_a_split_built_once_serves_every_call_and_holds_its_weight_weakly():
    import gc

    K, N = 300, 1000
    p = _packed(K, N)
    released = []
    split = native.MatmulSplit(p, _ranges(N, 4), on_release=released.append)
    box = native.Mailbox()
    for rows in (1, 3, 1):
        A = rng.standard_normal((rows, K)).astype(np.float32)
        bias = rng.standard_normal(N).astype(np.float32)
        y, batch = split.batch(A, bias=bias)
        box.fork_join(batch)
        np.testing.assert_array_equal(y, native.matmul_nbits(A, p, bias=bias))
    with pytest.raises(ValueError):
        split.batch(np.zeros((1, K + 1), np.float32))  # A is checked per call
    del p, batch, y
    gc.collect()
    assert split.weight() is None and len(released) == 1  # the split kept nothing alive
    with pytest.raises(ValueError, match="released"):
        split.batch(np.zeros((1, K), np.float32))


def test_the_int4_op_reuses_a_weights_split_and_drops_it_with_the_weight(monkeypatch):
    import gc

    from onnx_prep.core.ops import int4

    monkeypatch.setattr(intra_op, "MIN_SPLIT_WORK", 1)  # this small matmul splits

    K, N = 256, 1280
    p = _packed(K, N)
    box = native.Mailbox()
    attrs = {"K": K, "N": N, "block_size": 32, "bits": 4}
    A = rng.standard_normal((1, 1, K)).astype(np.float32)
    splits = []
    with intra_op.using(lambda *a, **k: 0, parts=2, mailbox=intra_op.LazyMailbox(lambda: box)):
        for _ in range(3):
            y = int4.matmul_nbits([A, None, None, None], attrs, {1: p})[0]
            np.testing.assert_array_equal(y, native.matmul_nbits(A, p))
            splits.append(int4._SPLITS[id(p)])
    assert box.batches == 3 and splits[0] is splits[1] is splits[2]
    key = id(p)
    del p, splits
    gc.collect()
    assert key not in int4._SPLITS


def test_serve_returns_once_stopped_even_if_stopped_first():
    box = native.Mailbox()
    box.stop()
    assert box.serve() == 0  # returns at once: no batch, no spinning
    box2 = native.Mailbox()
    t = threading.Thread(target=box2.serve)
    t.start()
    box2.stop()
    t.join(timeout=30)
    assert not t.is_alive()


def _thread_cpu_ns(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[0])  # time on a CPU, ns


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="needs /proc schedstat (Linux)")
def test_an_idle_helper_sleeps_costs_no_cpu_and_wakes_for_the_next_batch():
    K, N = 256, 640
    p = _packed(K, N)
    box = native.Mailbox(spin_ns=200_000)  # sleeps after 0.2 ms without a batch
    helper = threading.Thread(target=box.serve)
    helper.start()
    try:
        deadline = time.monotonic() + 30
        while box.sleepers == 0:  # the condition itself, not a timed wait
            assert time.monotonic() < deadline, "the helper never went to sleep"
        assert box.sleeps >= 1
        # asleep: it takes no CPU while the caller works (spinning, it would take ~all
        # of a core for the whole window)
        cpu0, t0 = _thread_cpu_ns(helper.native_id), time.perf_counter()
        A = rng.standard_normal((4, K)).astype(np.float32)
        while time.perf_counter() - t0 < 0.2:
            ref = native.matmul_nbits(A, p)
        assert _thread_cpu_ns(helper.native_id) - cpu0 < 20_000_000
        # a publish wakes it: it runs chunks again, same bits
        for i in range(2000):
            y, batch = native.matmul_nbits_batch(A, p, _ranges(N, 8))
            box.fork_join(batch)
            np.testing.assert_array_equal(y, ref)
            if box.chunks_by_helpers:
                break
        assert box.wakes >= 1 and box.chunks_by_helpers > 0
        while box.sleepers == 0:  # idle again: asleep again
            assert time.monotonic() < deadline, "the helper never went back to sleep"
    finally:
        box.stop()  # wakes a sleeping helper
        helper.join(timeout=30)
    assert not helper.is_alive()
    with pytest.raises(ValueError, match="spin_ns"):
        native.Mailbox(spin_ns=-1)


def test_a_lingering_helper_serves_while_batches_come_and_goes_back_on_its_own():
    K, N = 256, 640
    p = _packed(K, N)
    A = rng.standard_normal((1, K)).astype(np.float32)
    ref = native.matmul_nbits(A, p)
    box = native.Mailbox(spin_ns=100_000, linger_ns=20_000_000)
    helper = threading.Thread(target=box.serve)
    helper.start()
    try:
        deadline = time.monotonic() + 30
        while box.serving == 0:  # started
            assert time.monotonic() < deadline
        end = time.monotonic() + 0.1  # five lingers long, a batch at a time: it stays
        while time.monotonic() < end:
            y, batch = native.matmul_nbits_batch(A, p, _ranges(N, 8))
            box.fork_join(batch)
            np.testing.assert_array_equal(y, ref)
        assert helper.is_alive() and box.serving == 1
    finally:
        helper.join(timeout=30)  # no stop: no batch for 20 ms, and it returns by itself
    assert not helper.is_alive() and box.serving == 0 and box.chunks_by_helpers > 0
    with pytest.raises(ValueError, match="linger_ns"):
        native.Mailbox(linger_ns=-1)


def test_hot_runs_keep_their_helpers_until_a_pause_a_release_or_the_close(tiny_llm_path, monkeypatch):
    """Consecutive hot runs that split publish to one lent helper (lent once, not at
    every run: each lend woke a worker that each run's end put back to sleep); the helper
    goes back after HELPER_LINGER_NS without a batch, or when the session releases it
    (a cold run does), or at the close. Outputs equal the run without helpers."""
    from onnx_prep.core.decode.decoder_io import DecoderIO
    from onnx_prep.core.decode.generation import step_feeds
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.core.runtime import run_loop
    from onnx_prep.core.runtime.session import Session

    r = resolve_model(tiny_llm_path)
    io = DecoderIO.discover(r.inputs, r.outputs)
    feeds = step_feeds(io, np.arange(3, 11, dtype=np.int64).reshape(1, 8), io.empty_past(1), 0)
    monkeypatch.setattr(run_loop, "HELPER_LINGER_NS", 200_000_000)
    with Session(r, intra_op=False) as whole:
        whole.prepare()
        ref = whole.run(feeds)
    with Session(r) as s:
        s.prepare()
        lends = []
        lend = s.scheduler.lend
        monkeypatch.setattr(s.scheduler, "lend", lambda fn, n=1: lends.append(n) or lend(fn, n))
        monkeypatch.setattr(intra_op, "MIN_SPLIT_WORK", 1)  # every tiny matmul splits
        for _ in range(10):
            out = s.run(feeds)
            assert all(np.array_equal(out[k], ref[k]) for k in ref)
        if s.stats().runs_lending == 0:
            pytest.skip("no idle CPU worker to lend on this machine")
        assert len(lends) == 1 and s.stats().runs_lending == 10  # lent once, used by every run
        box = s.runs._kept[0]
        assert box.serving == 1
        s.runs.release_helpers()  # what a cold run does first
        assert box.serving == 0 and s.runs._kept is None
        s.run(feeds)
        assert len(lends) == 2
        box = s.runs._kept[0]
        deadline = time.monotonic() + 30
        while box.serving:  # no batch for the linger: it goes back by itself
            assert time.monotonic() < deadline, "the helper never went back"
        out = s.run(feeds)  # the next run lends again
        assert len(lends) == 3 and all(np.array_equal(out[k], ref[k]) for k in ref)
        box = s.runs._kept[0]
    assert box.serving == 0  # the close took it back


def test_batch_arguments_are_checked_before_any_c_call():
    p = _packed(128, 128)
    A = np.zeros((1, 128), np.float32)
    with pytest.raises(ValueError, match="col"):
        native.matmul_nbits_batch(A, p, [(0, 64), (64, 129)])
    with pytest.raises(ValueError):
        native.matmul_nbits_batch(np.zeros((1, 127), np.float32), p, [(0, 128)])
    with pytest.raises(NativeError):  # not a packed buffer
        native.matmul_nbits_batch(A, np.zeros(64, np.uint8), [(0, 128)])


def test_hot_runs_lend_idle_workers_and_keep_every_bit(tiny_llm_path, monkeypatch):
    """Three sessions: no split, fork_join hand-off (spin_helpers=False), and the default
    (helpers lent to hot runs, waiting in C). Equal outputs; only the default hands
    chunks over through a mailbox, and no offer of it is left untaken."""
    from onnx_prep.core.decode.decoder_io import DecoderIO
    from onnx_prep.core.decode.generation import step_feeds
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.core.runtime.session import Session

    r = resolve_model(tiny_llm_path)
    io = DecoderIO.discover(r.inputs, r.outputs)
    feeds = step_feeds(io, np.arange(3, 11, dtype=np.int64).reshape(1, 8), io.empty_past(1), 0)
    with Session(r, intra_op=False) as whole, Session(r, spin_helpers=False) as wake, Session(r) as spin:
        for s in (whole, wake, spin):
            s.prepare()
        ref = whole.run(feeds)
        monkeypatch.setattr(intra_op, "MIN_SPLIT_WORK", 1)  # every tiny matmul splits
        for _ in range(5):
            out = wake.run(feeds)
            assert all(np.array_equal(out[k], ref[k]) for k in ref)
        assert wake.stats().matmul_splits > 0 and wake.stats().chunks_by_helpers == 0  # fork_join only
        for i in range(200):  # until a lent helper has run a chunk (it waits in C, so soon)
            out = spin.run(feeds)
            assert all(np.array_equal(out[k], ref[k]) for k in ref)
            if spin.stats().chunks_by_helpers > 0 and i >= 5:
                break
        assert spin.stats().chunks_by_helpers > 0
        assert wake.stats().chunks_by_helpers == 0 and whole.stats().matmul_splits == 0  # each its own
        sched = spin.scheduler
        assert not sched._side  # every offer taken back or finished
        assert spin.stats().hot_runs >= 6


def test_a_run_that_splits_nothing_lends_nothing(tiny_llm_path, monkeypatch):
    """Helpers are lent at a run's first split (or at its start when the run before
    split): the tiny fixture's decode, which splits no matmul, never lends a worker;
    a prefill made to split lends, and the next run lends at its start."""
    from onnx_prep.core.decode.decoder_io import DecoderIO
    from onnx_prep.core.decode.generation import step_feeds
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.core.runtime.session import Session

    r = resolve_model(tiny_llm_path)
    io = DecoderIO.discover(r.inputs, r.outputs)
    prefill = step_feeds(io, np.arange(3, 11, dtype=np.int64).reshape(1, 8), io.empty_past(1), 0)
    with Session(r) as s:
        s.prepare()
        out = s.run(prefill)
        past = {p.name: out[pres] for kv in io.kv
                for pres, p in ((kv.present_key, kv.past_key), (kv.present_value, kv.past_value))}
        decode = step_feeds(io, np.array([[5]], dtype=np.int64), past, 8)
        monkeypatch.setattr(intra_op, "MIN_SPLIT_WORK", 1 << 40)  # nothing splits
        s.run(decode)  # may lend at its start: the prefill before it split
        assert not s.runs._lend_at_start  # it split nothing: the next runs lend only if they split
        lent0, splits0 = s.stats().runs_lending, s.stats().matmul_splits
        for _ in range(5):
            s.run(decode)
        assert s.stats().matmul_splits == splits0
        assert s.stats().runs_lending == lent0  # no worker was lent
        assert not s.runs._lend_at_start

        monkeypatch.setattr(intra_op, "MIN_SPLIT_WORK", 1)  # every matmul splits
        ref = s.run(prefill)
        if s.stats().runs_lending == lent0:  # no worker was idle at that split
            pytest.skip("no idle CPU worker to lend on this machine")
        assert s.runs._lend_at_start  # it split: the next run lends at its start
        out = s.run(prefill)
        assert all(np.array_equal(out[k], ref[k]) for k in ref)
        assert s.stats().runs_lending >= lent0 + 2


@pytest.mark.parametrize("level", [0, 4])
def test_the_bound_int4_op_gives_the_general_ops_bits_through_a_served_mailbox(level, monkeypatch):
    """A MatMulNBits node's bound call (MatmulSplit.through) computes a decode GEMV in
    one call: the general op's bits, a batch published per call, a split counted, the
    weight's split reused; a bias, a float16 or strided A, or no mailbox take the
    general op (the same bits)."""
    from collections import Counter

    from onnx_prep.core.ops import int4, run_counters

    class Sink(Counter):
        def add(self, name, n=1):
            self[name] += n

    monkeypatch.setattr(intra_op, "MIN_SPLIT_WORK", 1)
    K, N = 300, 1000
    counts = Sink()
    p = _packed(K, N, level)
    attrs = {"K": K, "N": N, "block_size": 32, "bits": 4}
    bound = int4.matmul_nbits.bind(attrs)
    assert bound is not int4.matmul_nbits and bound.unbound is int4.matmul_nbits
    box = native.Mailbox()
    helper = threading.Thread(target=box.serve)
    helper.start()
    try:
        with intra_op.using(lambda *a, **k: 0, parts=2, mailbox=intra_op.LazyMailbox(lambda: box)), \
                run_counters.counting(counts):
            for rows in (1, 1, 3):
                A = rng.standard_normal((1, rows, K)).astype(np.float32)
                got = bound([A, None, None, None], attrs, {1: p})[0]
                assert got.shape == (1, rows, N)
                np.testing.assert_array_equal(got, native.matmul_nbits(A, p))
            assert box.batches == 3 and counts["matmul_splits"] == 3
            bias = rng.standard_normal(N).astype(np.float32)
            A = rng.standard_normal((1, 2 * K)).astype(np.float32)[:, ::2]
            for inputs in ([A[:, :K].copy(), None, None, None, None, bias], [A.astype(np.float16), None, None],
                           [A, None, None]):
                np.testing.assert_array_equal(bound(inputs, attrs, {1: p})[0],
                                              int4.matmul_nbits(inputs, attrs, {1: p})[0])
    finally:
        box.stop()
        helper.join()
    A = rng.standard_normal((1, K)).astype(np.float32)
    np.testing.assert_array_equal(bound([A, None, None], attrs, {1: p})[0], native.matmul_nbits(A, p))
    assert int4.matmul_nbits.bind({"K": K, "N": N, "block_size": 32, "bits": 8}) is int4.matmul_nbits


def test_a_splits_bound_call_refuses_an_a_it_would_read_past_and_keeps_few_templates():
    """MatmulSplit.through checks what the C call reads (float32, last dimension K,
    rows): anything else is a ValueError before any C call; it keeps a batch template
    per decode-sized row count only (memory bounded whatever the prompt lengths)."""
    from onnx_prep.native import handoff

    K, N = 256, 640
    p = _packed(K, N)
    split = native.MatmulSplit(p, _ranges(N, 2))
    box = native.Mailbox()  # nobody serves it: the caller runs every chunk
    for bad in (np.zeros((1, K), np.float64), np.zeros((1, K - 1), np.float32), np.zeros((0, K), np.float32),
                np.zeros((2, K), np.int8)):
        with pytest.raises(ValueError, match="float32"):
            split.through(box, bad)
    assert box.batches == 0
    for rows in (1, 2, 1, handoff._TEMPLATE_ROWS + 1, handoff._TEMPLATE_ROWS + 7):
        A = rng.standard_normal((rows, K)).astype(np.float32)
        np.testing.assert_array_equal(split.through(box, A), native.matmul_nbits(A, p))
    assert sorted(split._templates) == [1, 2]
