"""PreparedObjectStore: the registry and state machine of prepared (packed) objects.

docs/design.md, "Prepared-object store". Each :data:`PreparedKey` has one entry that moves through

    absent ──> loading ──> preparing ──> resident ──> evicting ──> persisted | absent
      ^  ^        │  └───────────────────────^            │
      │  └────────┴──> failed (retry: ──> loading)        │
      └───────────────────────────────────────────────────┘  (persisted ──> loading)

``loading -> resident`` directly is legal (a persisted packed payload needs no prepack);
``loading|preparing -> absent|persisted`` is an *abandoned* (cancelled) load, back to where
it started. Every other transition raises :class:`PreparedStateError`.

The store does NOT allocate. A materializer hands it a *buffer*: any object with
``.nbytes`` (int) and ``.release()`` (returns the memory to its arena / slot). The session
backs it with ``onnx_prep.native.StableSlot`` plus a ``Reservation`` of the PREPARED arena;
tests use plain objects. ``evict`` calls ``buffer.release()`` exactly once.

Contract (stable)
-----------------

``PreparedObjectStore()``
    The store keeps residency, pins and generations; it never decides what to evict.
    Its owner does (a session: ``eviction_policy.EvictionPolicy``, by the plan's next
    uses, under the PREPARED arena's limit) and calls ``evict``.

Queries: ``state(key)``, ``generation(key)`` (0 = never materialized), ``info(key) -> EntryInfo``,
``is_resident(key)``, ``resident_bytes``, ``epoch``, ``keys()``, ``pins(key)``, ``total_pins``.

Load protocol (what a session's READ/PREPACK tasks call):
    ``begin_load(key, *, device="cpu") -> (Materialization, owner: bool)`` — if resident or
    in flight, returns the current generation's future and ``owner=False`` (requests share
    one in-flight load); otherwise starts a new generation (``loading``) and the caller
    owns it. The owner then calls ``mark_preparing(key, gen)`` (optional),
    ``publish(key, gen, buffer, *, persisted=False, location=None) -> ResidentObject``, or
    ``fail(key, gen, error)``, or ``abandon(key, gen)`` (cancelled). Waiters see the outcome
    through the :class:`Materialization` (``wait``, ``result``, ``add_done_callback``).

Pins: ``pin_many(keys) -> PinSet | None`` (a cold-path step's objects, atomically
all-or-nothing), ``ReadinessView.pin_if_ready()`` (the hot path's run-level lease).
An object with pins is never evicted: ``evict`` refuses (returns ``False``).

Eviction: ``evict(key) -> bool`` removes residency, never identity: the entry keeps its
key, generation count and persisted location; the next consumer re-materializes
(new generation). A publish with ``persisted=True`` records that a packed copy exists in
the cache tier (eviction then goes to ``persisted``, and the next load starts there).

Readiness epoch: ``epoch`` increments whenever any key leaves residency. ``readiness(keys)``
returns a :class:`ReadinessView` whose ``is_ready()`` is O(1) while nothing has been evicted
since it last saw every key resident, and whose ``pin_if_ready() -> PinSet | None`` takes a
run-level *lease* on the whole set in O(1) (the hot path's one pin; ``PinSet.objects`` maps
each key to its resident object, cached per epoch). Keep one view per plan, not per run.

Thread-safe: one lock; buffer ``release()`` and done-callbacks run outside it.
"""
from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from onnx_prep.core.errors import EXIT_INTERNAL, CancelledError, OnnxPrepError, Where, log_exception
from onnx_prep.core.model.prepared_key import PreparedKey


__all__ = [
    "PreparedObjectStore", "ResidencyState", "ResidentObject", "EntryInfo", "Materialization",
    "PinSet", "ReadinessView", "PreparedBuffer", "PreparedStateError",
]


class PreparedStateError(OnnxPrepError):
    """An illegal residency transition or misuse of the store (a bug in the caller)."""

    # NOTE: lives here rather than in core/errors.py (owned by another module); it is an
    # internal-contract violation, hence EXIT_INTERNAL.
    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message, Where(tensor=key), exit_code=EXIT_INTERNAL)


class ResidencyState(enum.Enum):
    ABSENT = "absent"
    LOADING = "loading"
    PREPARING = "preparing"
    RESIDENT = "resident"
    EVICTING = "evicting"
    PERSISTED = "persisted"
    FAILED = "failed"


_S = ResidencyState
_LEGAL: dict[ResidencyState, frozenset[ResidencyState]] = {
    _S.ABSENT: frozenset({_S.LOADING}),
    _S.PERSISTED: frozenset({_S.LOADING}),
    _S.FAILED: frozenset({_S.LOADING}),
    _S.LOADING: frozenset({_S.PREPARING, _S.RESIDENT, _S.FAILED, _S.ABSENT, _S.PERSISTED}),
    _S.PREPARING: frozenset({_S.RESIDENT, _S.FAILED, _S.ABSENT, _S.PERSISTED}),
    _S.RESIDENT: frozenset({_S.EVICTING}),
    _S.EVICTING: frozenset({_S.PERSISTED, _S.ABSENT}),
}
_IN_FLIGHT = frozenset({_S.LOADING, _S.PREPARING})


class PreparedBuffer(Protocol):
    """What a materializer returns: the resident bytes' allocation handle."""

    nbytes: int

    def release(self) -> None: ...


@dataclass(frozen=True)
class ResidentObject:
    """One resident generation of a prepared object."""

    key: PreparedKey
    generation: int
    buffer: Any  # PreparedBuffer
    nbytes: int
    device: str


@dataclass(frozen=True)
class EntryInfo:
    key: PreparedKey
    state: ResidencyState
    generation: int
    nbytes: int
    pins: int
    persisted: bool
    location: str | None
    device: str
    error: BaseException | None


class Materialization:
    """Completion of one generation's load (shared by every requester of that generation)."""

    def __init__(self, key: PreparedKey, generation: int) -> None:
        self.key = key
        self.generation = generation
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._obj: ResidentObject | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Materialization], None]] = []
        self._waiters = 0
        self._waiters_cond = threading.Condition(self._lock)

    @property
    def waiters(self) -> int:
        """Threads currently blocked in :meth:`result` (diagnostics: who shares this load)."""
        return self._waiters

    def wait_for_waiters(self, n: int, timeout: float | None = None) -> bool:
        """Block until at least ``n`` threads wait in :meth:`result` (tests, diagnostics)."""
        with self._lock:
            return self._waiters_cond.wait_for(lambda: self._waiters >= n, timeout)

    def _settle(self, obj: ResidentObject | None, error: BaseException | None) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._obj, self._error = obj, error
            callbacks, self._callbacks = self._callbacks, []
            self._event.set()
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                log_exception(__name__, "materialization callback %r raised", fn)

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def result(self, timeout: float | None = None) -> ResidentObject:
        """The published object; raises the load's error (``CancelledError`` if abandoned)."""
        if not self._event.is_set():
            with self._lock:
                self._waiters += 1
                self._waiters_cond.notify_all()
            try:
                self._event.wait(timeout)
            finally:
                with self._lock:
                    self._waiters -= 1
        if not self._event.is_set():
            raise TimeoutError(f"prepared object {self.key!r} not ready after {timeout}s")
        if self._error is not None:
            raise self._error
        assert self._obj is not None
        return self._obj

    def exception(self) -> BaseException | None:
        return self._error

    def add_done_callback(self, fn: Callable[[Materialization], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)


class _Entry:
    __slots__ = ("key", "state", "generation", "buffer", "nbytes", "persisted", "location",
                 "error", "future", "device", "origin")

    def __init__(self, key: PreparedKey) -> None:
        self.key = key
        self.state = _S.ABSENT
        self.generation = 0
        self.buffer: Any = None
        self.nbytes = 0
        self.persisted = False
        self.location: str | None = None
        self.error: BaseException | None = None
        self.future: Materialization | None = None
        self.device = "cpu"
        self.origin = _S.ABSENT  # resting state the current load started from


class PinSet:
    """A run-level pin on every key of a :class:`ReadinessView` (a *lease*): while it is
    held none of those objects can be evicted. O(1) to take and release, whatever the
    number of keys. ``objects`` maps each key to its pinned :class:`ResidentObject`.
    ``release()`` is idempotent; also a context manager."""

    __slots__ = ("_store", "_view", "objects")

    def __init__(self, store: PreparedObjectStore, view: ReadinessView,
                 objects: dict[PreparedKey, ResidentObject]) -> None:
        self._store = store
        self._view: ReadinessView | None = view
        self.objects = objects

    def __getitem__(self, key: PreparedKey) -> ResidentObject:
        return self.objects[key]

    @property
    def released(self) -> bool:
        return self._view is None

    def release(self) -> None:
        view, self._view = self._view, None
        if view is not None:
            self._store._end_lease(view)

    def __enter__(self) -> PinSet:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class ReadinessView:
    """O(1) "everything in ``keys`` is resident and nothing was evicted since" check, and
    the O(1) run-level pin of those keys (:meth:`pin_if_ready`)."""

    def __init__(self, store: PreparedObjectStore, keys: Iterable[PreparedKey]) -> None:
        self._store = store
        self.keys = tuple(dict.fromkeys(keys))
        self.keyset = frozenset(self.keys)
        self._ready_epoch = -1
        self._objects: dict[PreparedKey, ResidentObject] = {}

    def is_ready(self) -> bool:
        store = self._store
        if self._ready_epoch == store._epoch:
            return True
        with store._lock:
            return self._recheck_locked()

    def _recheck_locked(self) -> bool:
        store = self._store
        if self._ready_epoch == store._epoch:
            return True
        entries = store._entries
        objects = {}
        for k in self.keys:
            e = entries.get(k)
            if e is None or e.state is not _S.RESIDENT:
                return False
            objects[k] = store._resident_obj(e)
        # Generations only change through eviction, which moves the epoch: the cached
        # objects stay exact for as long as the epoch does.
        self._objects = objects
        self._ready_epoch = store._epoch
        return True

    def pin_if_ready(self) -> PinSet | None:
        """Pin every key when all are resident (atomically, O(1) when the epoch is
        unchanged); ``None`` otherwise, pinning nothing."""
        store = self._store
        with store._lock:
            if self._ready_epoch != store._epoch and not self._recheck_locked():
                return None
            store._leases[self] = store._leases.get(self, 0) + 1
            return PinSet(store, self, self._objects)


class PreparedObjectStore:
    """See the module docstring for the contract."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # entered as `with self._lock`, not `with self._cond` (execution_handle._Tracker says why)
        self._cond = threading.Condition(self._lock)
        self._entries: dict[PreparedKey, _Entry] = {}
        self._resident_bytes = 0
        self._epoch = 0
        self.materializations = 0  # loads started (generations created), for tests and stats
        self._leases: dict[ReadinessView, int] = {}  # active run-level pins per view

    # -- queries ---------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def resident_bytes(self) -> int:
        return self._resident_bytes

    def keys(self) -> list[PreparedKey]:
        with self._lock:
            return list(self._entries)

    def state(self, key: PreparedKey) -> ResidencyState:
        e = self._entries.get(key)
        return _S.ABSENT if e is None else e.state

    def generation(self, key: PreparedKey) -> int:
        e = self._entries.get(key)
        return 0 if e is None else e.generation

    def is_resident(self, key: PreparedKey) -> bool:
        return self.state(key) is _S.RESIDENT

    def pins(self, key: PreparedKey) -> int:
        """Pins on ``key``: the active leases of views that contain it."""
        with self._lock:
            return self._leased_locked(key)

    @property
    def total_pins(self) -> int:
        """Active leases (each counts once, whatever its number of keys)."""
        with self._lock:
            return sum(self._leases.values())

    def _leased_locked(self, key: PreparedKey) -> int:
        return sum(n for v, n in self._leases.items() if key in v.keyset)

    def _end_lease(self, view: ReadinessView) -> None:
        with self._lock:
            n = self._leases[view] - 1
            if n:
                self._leases[view] = n
            else:
                del self._leases[view]

    def info(self, key: PreparedKey) -> EntryInfo:
        with self._lock:
            e = self._entries.get(key) or _Entry(key)
            return EntryInfo(key, e.state, e.generation, e.nbytes, self._leased_locked(key), e.persisted, e.location,
                             e.device, e.error)

    def readiness(self, keys: Iterable[PreparedKey]) -> ReadinessView:
        return ReadinessView(self, keys)

    # -- state machine -----------------------------------------------------------------

    def _move(self, e: _Entry, to: ResidencyState) -> None:  # locked
        if to not in _LEGAL.get(e.state, frozenset()):
            raise PreparedStateError(f"illegal transition {e.state.value} -> {to.value} "
                                     f"for prepared object {e.key!r}", e.key)
        if e.state is _S.RESIDENT:
            self._epoch += 1  # leaving residency invalidates every readiness view
        e.state = to
        self._cond.notify_all()

    def _entry(self, key: PreparedKey) -> _Entry:  # locked
        e = self._entries.get(key)
        if e is None:
            e = self._entries[key] = _Entry(key)
        return e

    def _owned(self, key: PreparedKey, generation: int) -> _Entry:  # locked
        e = self._entries.get(key)
        if e is None or e.generation != generation or e.state not in _IN_FLIGHT:
            state = "unknown" if e is None else f"{e.state.value} generation {e.generation}"
            raise PreparedStateError(f"prepared object {key!r} generation {generation} is not loading "
                                     f"(it is {state})", key)
        return e

    def _resident_obj(self, e: _Entry) -> ResidentObject:
        return ResidentObject(e.key, e.generation, e.buffer, e.nbytes, e.device)

    def begin_load(self, key: PreparedKey, *, device: str = "cpu") -> tuple[Materialization, bool]:
        with self._lock:
            e = self._entry(key)
            while e.state is _S.EVICTING:  # short: the buffer is being released
                self._cond.wait()
            if e.state is _S.RESIDENT or e.state in _IN_FLIGHT:
                assert e.future is not None
                return e.future, False
            e.origin = e.state if e.state is _S.PERSISTED else _S.ABSENT
            self._move(e, _S.LOADING)
            e.generation += 1
            e.error = None
            e.device = device
            e.future = Materialization(key, e.generation)
            self.materializations += 1
            return e.future, True

    def mark_preparing(self, key: PreparedKey, generation: int) -> None:
        with self._lock:
            e = self._owned(key, generation)
            if e.state is _S.LOADING:
                self._move(e, _S.PREPARING)

    def publish(self, key: PreparedKey, generation: int, buffer: Any, *, persisted: bool = False,
                location: str | None = None) -> ResidentObject:
        """Make ``buffer`` the resident bytes of this generation (atomic: waiters see it
        only once the entry is resident)."""
        nbytes = int(buffer.nbytes)
        with self._lock:
            e = self._owned(key, generation)
            self._move(e, _S.RESIDENT)
            e.buffer, e.nbytes = buffer, nbytes
            e.persisted = e.persisted or persisted
            if location is not None:
                e.location = location
            self._resident_bytes += nbytes
            obj = self._resident_obj(e)
            fut = e.future
        assert fut is not None
        fut._settle(obj, None)
        return obj

    def fail(self, key: PreparedKey, generation: int, error: BaseException) -> None:
        with self._lock:
            e = self._owned(key, generation)
            self._move(e, _S.FAILED)
            e.error = error
            fut = e.future
        assert fut is not None
        fut._settle(None, error)

    def abandon(self, key: PreparedKey, generation: int) -> None:
        """A cancelled load: back to the resting state it started from; waiters get CancelledError."""
        with self._lock:
            e = self._owned(key, generation)
            self._move(e, e.origin)
            fut = e.future
        assert fut is not None
        fut._settle(None, CancelledError(f"load of prepared object {key!r} was cancelled"))

    # -- pins -------------------------------------------------------------------------------

    def pin_many(self, keys: Iterable[PreparedKey]) -> PinSet | None:
        """One-off run-level pin of ``keys`` (builds a view; keep a view to reuse the epoch)."""
        return self.readiness(keys).pin_if_ready()

    # -- eviction ---------------------------------------------------------------------------

    def evict(self, key: PreparedKey) -> bool:
        """Drop residency of ``key``. ``False`` (nothing done) when it is pinned or not resident."""
        with self._lock:
            e = self._entries.get(key)
            if e is None or e.state is not _S.RESIDENT or self._leased_locked(key):
                return False
            self._move(e, _S.EVICTING)
            buffer, e.buffer = e.buffer, None
        try:
            buffer.release()
        finally:
            with self._lock:
                self._resident_bytes -= e.nbytes
                self._move(e, _S.PERSISTED if e.persisted else _S.ABSENT)
        return True

    def clear(self) -> None:
        """Evict everything (session close). Raises if anything is still pinned or loading."""
        with self._lock:
            busy = [e.key for e in self._entries.values()
                    if e.state in _IN_FLIGHT or self._leased_locked(e.key)]
        if busy:
            raise PreparedStateError(f"cannot clear the store: {len(busy)} objects pinned or loading "
                                     f"(first: {busy[0]!r})", busy[0])
        for key in self.keys():
            self.evict(key)
