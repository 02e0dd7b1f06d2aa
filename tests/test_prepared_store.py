"""PreparedObjectStore: state machine, generations, shared in-flight loads, pins,
eviction, readiness epoch. (What to evict is the session's eviction policy:
tests/test_eviction_policy.py.)"""
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
    st.evict(k)
    assert st.pin_many([k]) is None  # not resident: nothing to pin
    fut, _ = st.begin_load(k)
    with pytest.raises(PreparedStateError, match="generation 1"):
        st.publish(k, fut.generation - 1, Buf(1))  # a stale generation's publish
    assert not st.evict("P:never|l|cpu")


def test_concurrent_loads_share_one_materialization():
    """A second requester of a key being loaded gets the same generation's future (not
    ownership) and sees the owner's buffer once it is published."""
    st = PreparedObjectStore()
    k = "P:w1|int4|cpu"
    fut, owner = st.begin_load(k)
    assert owner
    results, errors = [], []

    def waiter():
        f, own = st.begin_load(k)
        if own:
            errors.append("a second owner")
            return
        results.append(f.result(T))

    th = threading.Thread(target=waiter)
    th.start()
    assert fut.wait_for_waiters(1, T)  # the waiter is blocked on the in-flight load
    buf = Buf(64)
    published = st.publish(k, fut.generation, buf)
    th.join(T)
    assert not errors and st.materializations == 1
    assert len(results) == 1 and results[0].buffer is buf and results[0] == published


def test_failed_load_reaches_every_waiter_and_can_be_retried():
    st = PreparedObjectStore()
    k = "P:bad|l|cpu"
    fut, owner = st.begin_load(k)
    assert owner
    errors = []

    def waiter():
        f, own = st.begin_load(k)
        assert not own
        try:
            f.result(T)
        except OSError as e:
            errors.append(e)

    th = threading.Thread(target=waiter)
    th.start()
    assert fut.wait_for_waiters(1, T)
    st.fail(k, fut.generation, OSError("read failed"))
    th.join(T)
    assert len(errors) == 1 and "read failed" in str(errors[0])
    assert st.state(k) is S.FAILED and isinstance(st.info(k).error, OSError)
    obj = _load(st, k, 4)
    assert obj.generation == 2 and st.state(k) is S.RESIDENT and st.info(k).error is None


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
    fut, owner = st.begin_load(k)  # again, from where it rests
    assert owner and fut.generation == 3
    st.abandon(k, fut.generation)
    assert st.state(k) is S.PERSISTED


def test_pinned_objects_are_never_evicted():
    st = PreparedObjectStore()
    k = "P:w|l|cpu"
    buf = Buf(32)
    fut, _ = st.begin_load(k)
    st.publish(k, fut.generation, buf)
    one, two = st.pin_many([k]), st.pin_many([k])
    assert one[k].nbytes == 32 and one[k].generation == 1
    assert st.pins(k) == 2 and st.total_pins == 2 and st.info(k).pins == 2
    assert not st.evict(k) and buf.released == 0 and st.state(k) is S.RESIDENT
    one.release()
    assert not st.evict(k)
    two.release()
    assert st.evict(k) and buf.released == 1
    _load(st, "P:z|l|cpu", 4)
    held = st.pin_many(["P:z|l|cpu"])
    with pytest.raises(PreparedStateError, match="pinned or loading"):
        st.clear()
    held.release()
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


def test_concurrent_load_pin_evict_keeps_invariants():
    """Loads (the runtime's protocol: begin_load, then publish or wait), pins and
    evictions from four threads: one materialization per generation, nothing pinned
    ever evicted, the resident bytes exact."""
    st = PreparedObjectStore()
    keys = [f"P:k{i}|l|cpu" for i in range(6)]
    calls = {k: 0 for k in keys}
    lock = threading.Lock()
    errors = []

    def load(k):
        fut, owner = st.begin_load(k)
        if owner:
            with lock:
                calls[k] += 1
            st.publish(k, fut.generation, Buf(16))
        else:
            fut.wait(T)

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(300):
                k = rng.choice(keys)
                op = rng.random()
                if op < 0.5:
                    load(k)
                    pins = st.pin_many([k])  # None when evicted since
                    if pins is not None:
                        assert st.state(k) is S.RESIDENT and pins[k].nbytes == 16
                        assert not st.evict(k)
                        pins.release()
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
