"""MemoryBudget: per-arena limits under a global limit, critical headroom, admission."""
from __future__ import annotations

import random
import threading

import pytest

from onnx_prep.core.runtime.arenas import Arena, MemoryBudget
from onnx_prep.core.errors import BudgetError


def test_reserve_release_tracks_live_and_peak():
    b = MemoryBudget(1000, {Arena.PREPARATION: 600})
    r1 = b.reserve(Arena.PREPARATION, 400)
    r2 = b.try_reserve(Arena.EXECUTION, 300)
    assert r2 is not None
    assert b.live(Arena.PREPARATION) == 400 and b.global_live == 700
    r1.release()
    r1.release()  # idempotent
    assert b.live(Arena.PREPARATION) == 0 and b.peak(Arena.PREPARATION) == 400
    with r2:
        pass
    assert b.global_live == 0 and b.max_in_flight_bytes == 700
    snap = b.snapshot().to_json()
    assert snap["arenas"]["preparation"] == {"limit": 600, "live": 0, "peak": 400}
    b.reset_peaks()
    assert b.peak(Arena.PREPARATION) == 0


def test_never_fitting_request_raises_naming_arena_and_sizes():
    b = MemoryBudget(10_000, {Arena.PREPARED: 1000})
    with pytest.raises(BudgetError) as ei:
        b.try_reserve(Arena.PREPARED, 1500, label="prepack W3")
    msg = str(ei.value)
    assert "prepared" in msg and "1,500" in msg and "1,000" in msg and "prepack W3" in msg
    with pytest.raises(BudgetError) as ei:
        b.reserve_many({Arena.EXECUTION: 6000, Arena.IO: 5000})
    msg = str(ei.value)
    assert "11,000" in msg and "10,000" in msg and "global" in msg
    assert b.global_live == 0


def test_try_reserve_none_only_when_it_may_fit_later():
    b = MemoryBudget(None, {Arena.IO: 100})
    held = b.reserve(Arena.IO, 80)
    assert b.try_reserve(Arena.IO, 30) is None
    held.release()
    r = b.try_reserve(Arena.IO, 30)
    assert r is not None and r.nbytes == 30


def test_multi_arena_reservation_is_atomic():
    b = MemoryBudget(None, {Arena.PREPARATION: 100, Arena.PREPARED: 100})
    held = b.reserve(Arena.PREPARED, 90)
    assert b.try_reserve_many({Arena.PREPARATION: 50, Arena.PREPARED: 50}) is None
    assert b.live(Arena.PREPARATION) == 0  # nothing half-taken
    held.release()
    r = b.try_reserve_many({Arena.PREPARATION: 50, Arena.PREPARED: 50})
    assert r.amounts == {Arena.PREPARATION: 50, Arena.PREPARED: 50}
    out = r.detach(Arena.PREPARED)
    r.release()
    assert b.live(Arena.PREPARED) == 50 and b.live(Arena.PREPARATION) == 0
    out.shrink(Arena.PREPARED, 20)
    assert b.live(Arena.PREPARED) == 20
    out.release()
    assert b.global_live == 0


def test_critical_headroom_and_the_alone_exception():
    b = MemoryBudget(None, {Arena.PREPARATION: 100}, critical_reserve={Arena.PREPARATION: 30})
    spec = b.try_reserve(Arena.PREPARATION, 60, critical=False)
    assert spec is not None
    assert b.try_reserve(Arena.PREPARATION, 20, critical=False) is None  # would eat the headroom
    crit = b.try_reserve(Arena.PREPARATION, 40, critical=True)  # critical may use it
    assert crit is not None
    crit.release()
    spec.release()
    # A speculative request larger than limit - headroom runs only when the arena is empty.
    other = b.reserve(Arena.PREPARATION, 1)
    assert b.try_reserve(Arena.PREPARATION, 90, critical=False) is None
    other.release()
    big = b.try_reserve(Arena.PREPARATION, 90, critical=False)
    assert big is not None
    big.release()


def test_blocking_reserve_times_out_with_sizes_and_wakes_on_release():
    b = MemoryBudget(None, {Arena.EXECUTION: 100})
    held = b.reserve(Arena.EXECUTION, 70)
    with pytest.raises(BudgetError) as ei:
        b.reserve(Arena.EXECUTION, 50, timeout=0.01)
    assert "execution" in str(ei.value) and "50" in str(ei.value) and "live 70" in str(ei.value)
    got = []
    th = threading.Thread(target=lambda: got.append(b.reserve(Arena.EXECUTION, 50, timeout=30)))
    th.start()
    held.release()
    th.join(30)
    assert got and got[0].nbytes == 50
    got[0].release()


def test_release_listener_runs_after_bytes_return():
    b = MemoryBudget(None, {Arena.IO: 10})
    seen = []
    b.add_release_listener(lambda: seen.append(b.live(Arena.IO)))
    b.reserve(Arena.IO, 10).release()
    assert seen == [0]


def test_concurrent_reservations_never_exceed_limits():
    b = MemoryBudget(1000, {Arena.PREPARATION: 600, Arena.PREPARED: 700})
    rng = random.Random(7)
    plans = [[(rng.choice([Arena.PREPARATION, Arena.PREPARED]), rng.randint(1, 500)) for _ in range(200)]
             for _ in range(4)]

    def worker(plan):
        for arena, n in plan:
            with b.reserve(arena, n, timeout=30):
                pass

    threads = [threading.Thread(target=worker, args=(p,)) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert b.global_live == 0
    assert b.peak(Arena.PREPARATION) <= 600 and b.peak(Arena.PREPARED) <= 700 and b.global_peak <= 1000
    assert b.peak(Arena.PREPARATION) > 0


def test_a_peak_watch_sees_only_what_happened_while_it_was_open():
    b = MemoryBudget()
    early = b.reserve(Arena.PREPARED, 500)
    early.release()  # the budget's peak: 500, before the watch
    held = b.reserve(Arena.IO, 100)
    with b.watch_peaks() as w:
        assert w.peaks()[Arena.IO] == 100 and w.peaks()[Arena.PREPARED] == 0  # what is held now
        r = b.reserve_many({Arena.EXECUTION: 300, Arena.IO: 50})
        r.release()
        other = b.watch_peaks()  # opened later: sees only from here
        b.reserve(Arena.EXECUTION, 200).release()
        assert w.peaks()[Arena.EXECUTION] == 300 and w.peaks()[Arena.IO] == 150 and w.global_peak == 450
        assert other.peaks()[Arena.EXECUTION] == 200 and other.global_peak == 300
    b.reserve(Arena.EXECUTION, 1000).release()  # after close: the watch's peaks stay as they were
    assert w.peaks()[Arena.EXECUTION] == 300 and other.peaks()[Arena.EXECUTION] == 1000
    assert b.peak(Arena.PREPARED) == 500
    held.release()
