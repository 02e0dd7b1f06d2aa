"""PreparedObjectStore: state machine, generations, shared in-flight loads, pins,
eviction, residency limit, readiness epoch."""
from __future__ import annotations

import random
import threading

import pytest

from onnx_prep.core.errors import CancelledError
from onnx_prep.core.runtime.prepared_store import (
    PreparedObjectStore,
    PreparedStateError,
    ResidencyState,
)

T = 30
S = ResidencyState


class Buf:
    """The store's buffer protocol: .nbytes and .release()."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.released = 0

    def release(self) -> None:
        self.released += 1


def _load(store, key, n, **kw):
    fut, owner = store.begin_load(key)
    assert owner
    store.mark_preparing(key, fut.generation)
    return store.publish(key, fut.generation, Buf(n), **kw)


def test_full_lifecycle_and_generations():
    st = PreparedObjectStore()
    k = "P:w0|int4|cpu"
    assert st.state(k) is S.ABSENT and st.generation(k) == 0
    fut, owner = st.begin_load(k)
    assert owner and st.state(k) is S.LOADING and fut.generation == 1
    st.mark_preparing(k, 1)
    assert st.state(k) is S.PREPARING
    buf = Buf(100)
    obj = st.publish(k, 1, buf)
    assert st.state(k) is S.RESIDENT and obj.generation == 1 and obj.buffer is buf
    assert fut.done() and fut.result() is not None and st.resident_bytes == 100
    # Requesting a resident key shares its completed future; no new generation.
    fut2, owner2 = st.begin_load(k)
    assert not owner2 and fut2 is fut
    assert st.evict(k) and buf.released == 1
    assert st.state(k) is S.ABSENT and st.resident_bytes == 0
    assert k in st.keys() and st.generation(k) == 1  # identity survives eviction
    obj2 = _load(st, k, 100)
    assert obj2.generation == 2 and st.materializations == 2


def test_illegal_transitions_raise():
    st = PreparedObjectStore()
    k = "P:a|l|cpu"
    with pytest.raises(PreparedStateError, match="not loading"):
        st.publish(k, 1, Buf(1))
    _load(st, k, 8)
    with pytest.raises(PreparedStateError, match="not loading"):
        st.mark_preparing(k, 1)
    with pytest.raises(PreparedStateError, match="not loading"):
        st.fail(k, 1, RuntimeError("x"))
    with pytest.raises(PreparedStateError):
        st.unpin(k)
    st.evict(k)
    with pytest.raises(PreparedStateError, match="cannot pin"):
        st.pin(k)
    fut, _ = st.begin_load(k)
    with pytest.raises(PreparedStateError, match="generation 1"):
        st.publish(k, fut.generation - 1, Buf(1))  # a stale generation's publish
    assert not st.evict("P:never|l|cpu")


def test_concurrent_acquires_share_one_materialization():
    st = PreparedObjectStore()
    k = "P:w1|int4|cpu"
    started, release = threading.Event(), threading.Event()
    calls = []

    def materialize(ctx):
        calls.append(ctx.generation)
        ctx.mark_preparing()
        started.set()
        assert release.wait(T)
        return Buf(64)

    results = []
    t1 = threading.Thread(target=lambda: results.append(st.acquire(k, materialize)))
    t1.start()
    assert started.wait(T)
    fut, owner = st.begin_load(k)
    assert not owner and not fut.done()
    t2 = threading.Thread(target=lambda: results.append(st.acquire(k, materialize, pin=True)))
    t2.start()
    assert fut.wait_for_waiters(1, T)  # t2 is blocked on the in-flight load
    release.set()
    t1.join(T)
    t2.join(T)
    assert calls == [1] and st.materializations == 1
    assert len(results) == 2 and results[0].buffer is results[1].buffer
    assert st.pins(k) == 1


def test_failed_load_reaches_every_waiter_and_can_be_retried():
    st = PreparedObjectStore()
    k = "P:bad|l|cpu"
    fut, owner = st.begin_load(k)
    assert owner
    errors = []

    def waiter():
        try:
            st.acquire(k, lambda ctx: pytest.fail("waiter must not materialize"))
        except OSError as e:
            errors.append(e)

    th = threading.Thread(target=waiter)
    th.start()
    assert fut.wait_for_waiters(1, T)
    st.fail(k, fut.generation, OSError("read failed"))
    th.join(T)
    assert len(errors) == 1 and "read failed" in str(errors[0])
    assert st.state(k) is S.FAILED and isinstance(st.info(k).error, OSError)
    obj = st.acquire(k, lambda ctx: Buf(4))
    assert obj.generation == 2 and st.state(k) is S.RESIDENT and st.info(k).error is None


def test_materializer_error_marks_failed_and_propagates():
    st = PreparedObjectStore()

    def boom(ctx):
        raise ValueError("bad layout")

    with pytest.raises(ValueError, match="bad layout"):
        st.acquire("P:x|l|cpu", boom)
    assert st.state("P:x|l|cpu") is S.FAILED


def test_abandoned_load_returns_to_origin_and_waiters_see_cancellation():
    st = PreparedObjectStore()
    k = "P:p|l|cpu"
    _load(st, k, 10, persisted=True, location="cache/p.bin")
    assert st.evict(k) and st.state(k) is S.PERSISTED and st.info(k).location == "cache/p.bin"
    fut, owner = st.begin_load(k)
    assert owner
    st.abandon(k, fut.generation)
    assert st.state(k) is S.PERSISTED
    with pytest.raises(CancelledError):
        fut.result(0)

    def cancelled(ctx):
        assert ctx.previous_state is S.PERSISTED and ctx.persisted
        raise CancelledError("stop")

    with pytest.raises(CancelledError):
        st.acquire(k, cancelled)
    assert st.state(k) is S.PERSISTED


def test_pinned_objects_are_never_evicted():
    st = PreparedObjectStore()
    k = "P:w|l|cpu"
    buf = Buf(32)
    fut, _ = st.begin_load(k)
    st.publish(k, fut.generation, buf)
    obj = st.pin(k, generation=1)
    st.pin(k)
    assert obj.nbytes == 32 and st.pins(k) == 2 and st.total_pins == 2
    assert not st.evict(k) and buf.released == 0 and st.state(k) is S.RESIDENT
    with pytest.raises(PreparedStateError, match="generation 7"):
        st.pin(k, generation=7)
    st.unpin(k)
    assert not st.evict(k)
    st.unpin(k)
    assert st.evict(k) and buf.released == 1
    with pytest.raises(PreparedStateError, match="cannot pin"):
        st.pin("P:none|l|cpu")
    _load(st, "P:z|l|cpu", 4)
    st.pin("P:z|l|cpu")
    with pytest.raises(PreparedStateError, match="pinned or loading"):
        st.clear()
    st.unpin("P:z|l|cpu")
    st.clear()
    assert st.resident_bytes == 0 and not st.is_resident("P:z|l|cpu")


def test_readiness_epoch_changes_only_when_residency_is_lost():
    st = PreparedObjectStore()
    keys = [f"P:w{i}|l|cpu" for i in range(3)]
    view = st.readiness(keys)
    assert not view.is_ready() and view.pin_if_ready() is None
    for k in keys[:2]:
        _load(st, k, 10)
    assert not view.is_ready()
    e0 = st.epoch
    _load(st, keys[2], 10)
    assert st.epoch == e0  # becoming resident does not move the epoch
    assert view.is_ready()
    pins = view.pin_if_ready()
    assert pins is not None and pins[keys[0]].generation == 1
    assert st.total_pins == 1 and all(st.pins(k) == 1 for k in keys)  # one run-level lease
    second = st.pin_many(keys[1:])  # another run's lease, overlapping
    assert st.pins(keys[1]) == 2 and st.pins(keys[0]) == 1
    assert not st.evict(keys[1])
    pins.release()
    pins.release()  # idempotent
    assert not st.evict(keys[2])  # still leased by the second run
    second.release()
    assert st.total_pins == 0
    _load(st, "P:other|l|cpu", 5)
    assert st.evict("P:other|l|cpu") and st.epoch == e0 + 1
    assert view.is_ready()  # re-checked: still all resident
    assert st.evict(keys[1]) and st.epoch == e0 + 2
    assert not view.is_ready() and view.pin_if_ready() is None and st.total_pins == 0
    _load(st, keys[1], 10)
    assert view.is_ready() and st.generation(keys[1]) == 2


def test_residency_limit_evicts_unpinned_persisted_lru():
    st = PreparedObjectStore(residency_limit=100)
    bufs = {}
    for name, persisted in [("a", True), ("b", True), ("c", False), ("d", True)]:
        fut, _ = st.begin_load(name)
        bufs[name] = Buf(30)
        st.publish(name, fut.generation, bufs[name], persisted=persisted)
    # 120 > 100 after d: 'a' (oldest, persisted, unpinned) goes.
    assert st.state("a") is S.PERSISTED and bufs["a"].released == 1 and st.resident_bytes == 90
    st.pin("b")
    st.pin("d")  # touches d, b
    fut, _ = st.begin_load("e")
    st.publish("e", fut.generation, Buf(40), persisted=True)
    # 130: b and d pinned, c not persisted, e just published: nothing evictable.
    assert st.resident_bytes == 130 and all(st.is_resident(k) for k in "bcde")
    st.unpin("b")
    st.unpin("d")
    lease = st.pin_many(["b"])  # a run-level lease protects b, the least recently used
    fut, _ = st.begin_load("f")
    st.publish("f", fut.generation, Buf(10), persisted=True)
    # 140: b is leased, so d then e (LRU order) go until 70 <= 100.
    assert st.is_resident("b") and st.state("d") is S.PERSISTED and st.state("e") is S.PERSISTED
    assert st.resident_bytes == 70
    lease.release()


def test_concurrent_acquire_pin_evict_keeps_invariants():
    st = PreparedObjectStore()
    keys = [f"P:k{i}|l|cpu" for i in range(6)]
    calls = {k: 0 for k in keys}
    lock = threading.Lock()
    errors = []

    def materialize(ctx):
        with lock:
            calls[ctx.key] += 1
        return Buf(16)

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(300):
                k = rng.choice(keys)
                op = rng.random()
                if op < 0.5:
                    obj = st.acquire(k, materialize, pin=True)
                    assert st.state(k) is S.RESIDENT and obj.nbytes == 16
                    st.unpin(k)
                elif op < 0.8:
                    st.evict(k)
                else:
                    pins = st.pin_many(keys[:3])
                    if pins is not None:
                        assert all(st.is_resident(x) for x in keys[:3])
                        pins.release()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(T)
    assert not errors
    assert st.total_pins == 0
    assert sum(calls.values()) == st.materializations == sum(st.generation(k) for k in keys)
    assert st.resident_bytes == 16 * sum(st.is_resident(k) for k in keys)
    st.clear()
    assert st.resident_bytes == 0
