"""Slot pools: where prepared objects live, one stable address range per key.

A pool reserves an address range per prepared key once and commits memory under it
when the key is materialized; eviction decommits the pages and the next
materialization commits them again at the SAME address, so the views made once over
it (the hot path's binding, the cold path's values) stay valid.

Contract (what the materializer and the session rely on; the device pool, reserving
device virtual addresses, implements the same: core/cuda/device_slot_pool.py, whose
views are device addresses):

``reserve(key, capacity, *, shared=False)``  reserve (and open) the key's range ahead of
    any work. ``shared``: a small object resident for the session may share its memory
    with others (the device pool places it in a granule it shares; the host pool ignores
    it: its slots commit whole pages of their own, 4 KiB ones by default).
``map_file(key, nbytes, fd, offset) -> view``  (host pool) the key's bytes are a
    read-only mapping of a file range at the key's address: nothing copied.
``commit(key, nbytes, typed_as=None) -> view``  commit ``nbytes`` under the key's range
    (a reserved range if it is large enough, else a new one) and return its stable
    view: uint8 bytes, or the typed weight ``typed_as`` describes (a raw weight).
    The same key always commits the same size (a different one raises).
``decommit(key)``  give the key's pages back; its range (and views) keep their address,
    and touching them faults until the next commit.
``buffer(key, nbytes, reservation) -> SlotBuffer``  the store's buffer for one resident
    generation: ``release()`` decommits the key and returns the reservation.
``view(key)``  the stable view made at the key's first commit.
``committed_bytes(key=None)``  pages committed under one key's range, or all of them.

The host pool backs each key with ``onnx_prep.native.StableSlot`` and can warm reserved
slots (commit their pages ahead of their prepack) from an idle thread; see :meth:`warm`.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from onnx_prep.core.errors import OnnxPrepError, Where
from onnx_prep.core.io.external_data import as_array
from onnx_prep.core.model.prepared_key import PreparedKey

__all__ = ["SlotPool", "HostSlotPool", "SlotBuffer", "WARM_STEP_BYTES"]

# The warmer commits a slot in steps of this size, so a prepack that wants the slot
# waits for at most one step (~1 ms) before it commits the rest itself.
WARM_STEP_BYTES = 4 << 20


class SlotPool(Protocol):
    def reserve(self, key: PreparedKey, capacity: int, *, shared: bool = False) -> None: ...

    def commit(self, key: PreparedKey, nbytes: int, typed_as: Any = None) -> np.ndarray: ...

    def decommit(self, key: PreparedKey) -> None: ...

    def buffer(self, key: PreparedKey, nbytes: int, reservation: Any) -> SlotBuffer: ...

    def view(self, key: PreparedKey) -> np.ndarray: ...

    def committed_bytes(self, key: PreparedKey | None = None) -> int: ...


class SlotBuffer:
    """The store's buffer for one resident generation: committed pages of the key's
    slot in ``pool`` plus the PREPARED-arena reservation that pays for them."""

    __slots__ = ("pool", "key", "nbytes", "reservation")

    def __init__(self, pool: SlotPool, key: PreparedKey, nbytes: int, reservation) -> None:
        self.pool = pool
        self.key = key
        self.nbytes = nbytes
        self.reservation = reservation

    @property
    def committed_bytes(self) -> int:
        return self.pool.committed_bytes(self.key)

    def release(self) -> None:
        self.pool.decommit(self.key)
        if self.reservation is not None:
            self.reservation.release()


@dataclass
class _Residency:
    """Per key: its stable slot, and the view made once over it (stable address)."""

    slot: Any
    nbytes: int
    view: np.ndarray  # what kernels consume: uint8 packed bytes or the typed raw weight


class _Warming:
    """A reserved slot the warmer is committing: ``lock`` is held for each step of it,
    and a commit that wants the slot sets ``wanted`` (under the pool lock) and then
    takes ``lock`` once, after which the warmer commits no more of it."""

    __slots__ = ("lock", "wanted")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.wanted = False


def to_idle_priority() -> bool:
    """Put the calling thread in the OS's idle class (it runs only on a CPU that would
    otherwise idle). False where the OS has no such per-thread class (not Linux)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread (Linux)
        return True
    except (AttributeError, OSError):
        return False


class HostSlotPool:
    """Host memory: one ``StableSlot`` per key. Thread-safe: one lock for the maps; a
    key's commit runs outside it (the store's load protocol gives one thread a key's
    load at a time, so nothing else creates, fills or evicts that slot meanwhile)."""

    def __init__(self, *, huge_pages: bool | None = None) -> None:
        self.huge_pages = huge_pages  # StableSlot's: None is ONNX_PREP_HUGE_PAGES
        self._lock = threading.Lock()
        self._reserved: dict[PreparedKey, Any] = {}  # reserved, not yet committed by a load
        self._residency: dict[PreparedKey, _Residency] = {}
        self._warming: dict[PreparedKey, _Warming] = {}
        self._warmed = threading.Condition(self._lock)  # notified as bytes_warmed grows
        self.bytes_warmed = 0  # committed ahead of their load by warm()

    def reserve(self, key: PreparedKey, capacity: int, *, shared: bool = False) -> None:
        # ``shared`` is ignored here (the module docstring).
        # NOTE: reserving and opening change the process's memory map, which waits for
        # and blocks every other thread's page population: done per key by the workers,
        # two CPU workers committing slots spent ~40% of that time asleep
        # (docs/runtime.md). So a session reserves every slot before any worker runs.
        from onnx_prep.native import StableSlot

        slot = StableSlot(capacity, huge_pages=self.huge_pages)
        slot.open()
        with self._lock:
            self._reserved[key] = slot

    def reserved(self) -> dict[PreparedKey, int]:
        """Address of each reserved slot no load has taken yet."""
        with self._lock:
            return {k: s.address for k, s in self._reserved.items()}

    def commit(self, key: PreparedKey, nbytes: int, typed_as: Any = None) -> np.ndarray:
        return self._take(key, nbytes, typed_as, lambda slot: slot.commit(nbytes))

    def map_file(self, key: PreparedKey, nbytes: int, fd: int, offset: int, *,
                 checksum_bytes: int = 0) -> tuple[np.ndarray, Any]:
        """Like :meth:`commit`, but the key's bytes are ``nbytes`` of file ``fd`` from
        ``offset`` (page-aligned), mapped read-only at the key's stable address: no
        fresh page, no copy. The next :meth:`commit` or :meth:`decommit` of the key
        replaces the mapping by anonymous memory. Returns the view and what the mapping
        saw (``StableSlot.map_file``'s ``MappedFile``: the XXH3-64 of the first
        ``checksum_bytes``, whether the file shrank, its 2 MiB entries)."""
        seen = []

        def fill(slot) -> None:
            if slot.committed_bytes:  # pages warmed ahead of the load: not wanted here
                slot.decommit()
            seen.append(slot.map_file(fd, offset, nbytes, checksum_bytes=checksum_bytes))

        view = self._take(key, nbytes, None, fill)
        return view, seen[0]

    def _take(self, key: PreparedKey, nbytes: int, typed_as: Any, fill_slot) -> np.ndarray:
        from onnx_prep.native import StableSlot

        # NOTE: committing (page allocation and zeroing, up to tens of MiB) runs outside
        # the lock: under it, a 33 MB commit held every other task's bookkeeping up for
        # ~15 ms.
        with self._lock:
            r = self._residency.get(key)
            spare = self._reserved.pop(key, None) if r is None else None
            warming = self._warming.get(key) if spare is not None else None
            if warming is not None:
                warming.wanted = True
        if warming is not None:
            with warming.lock:  # the warmer's current step ends; it commits no more
                pass
        if r is None:
            slot = spare if spare is not None and spare.capacity >= nbytes else \
                StableSlot(max(nbytes, 1), huge_pages=self.huge_pages)
            fill_slot(slot)
            raw = slot.view(nbytes)
            view = as_array(typed_as, raw) if typed_as is not None else raw
            with self._lock:
                self._residency[key] = _Residency(slot, nbytes, view)
            return raw
        if r.nbytes != nbytes:
            raise OnnxPrepError(f"prepared object changed size ({r.nbytes} -> {nbytes})",
                                Where(tensor=key))
        fill_slot(r.slot)
        return r.slot.view(nbytes)

    def decommit(self, key: PreparedKey) -> None:
        self._residency[key].slot.decommit()

    def buffer(self, key: PreparedKey, nbytes: int, reservation: Any) -> SlotBuffer:
        return SlotBuffer(self, key, nbytes, reservation)

    def view(self, key: PreparedKey) -> np.ndarray:
        return self._residency[key].view

    def committed_bytes(self, key: PreparedKey | None = None) -> int:
        with self._lock:
            if key is not None:
                r = self._residency.get(key)
                slot = r.slot if r is not None else self._reserved.get(key)
                return 0 if slot is None else slot.committed_bytes
            return (sum(r.slot.committed_bytes for r in self._residency.values())
                    + sum(s.committed_bytes for s in self._reserved.values()))

    def nbytes(self, key: PreparedKey) -> int:
        """The bytes committed for ``key`` at its first commit."""
        return self._residency[key].nbytes

    # ---------------------------------------------------------------------- warming
    def warm(self, targets: Iterable[tuple[PreparedKey, int]], stop: Callable[[], bool],
             on_warmed: Callable[[int], None] | None = None) -> None:
        """Commit reserved slots' pages ahead of their loads, ``(key, bytes)`` in the
        given order, one step at a time, until done or ``stop()`` (asked before every
        step); ``on_warmed(bytes)`` after each step. A load that wants a slot being
        warmed takes it after the current step. Call from a thread in the OS's idle
        class (:func:`to_idle_priority`)."""
        for key, target in targets:
            if stop():
                return
            with self._lock:
                slot = self._reserved.get(key)
                if slot is None or slot.committed_bytes >= target:
                    continue  # its load took it, or nothing to do
                w = self._warming[key] = _Warming()
            try:
                n = slot.committed_bytes
                while n < target:
                    n = min(target, n + WARM_STEP_BYTES)
                    with w.lock:
                        if w.wanted or stop():
                            break
                        before = slot.committed_bytes
                        slot.commit(n)
                        added = slot.committed_bytes - before
                    if on_warmed is not None:
                        on_warmed(added)
                    with self._lock:
                        self.bytes_warmed += added
                        self._warmed.notify_all()
            except MemoryError:
                return  # the load commits (and reports) it itself
            finally:
                with self._lock:
                    self._warming.pop(key, None)

    def has_reserved(self) -> bool:
        with self._lock:
            return bool(self._reserved)

    def wait_warmed(self, nbytes: int, timeout: float | None = None) -> bool:
        """Block until at least ``nbytes`` were warmed (tests, diagnostics)."""
        with self._warmed:
            return self._warmed.wait_for(lambda: self.bytes_warmed >= nbytes, timeout)

    def close(self) -> None:
        """Give back the address ranges no load took (resident slots go with their views)."""
        with self._lock:
            self._reserved.clear()
