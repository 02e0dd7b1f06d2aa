"""Allocation domains (arenas) under one global memory budget.

docs/design.md, "Task resources and scheduling": four arenas share one global budget,
each with its own limit, so speculative loading cannot consume memory an active
inference needs.

- ``PREPARATION`` — source buffers and scratch used while reading / packing / persisting;
  returned when the consuming task completes.
- ``PREPARED`` — resident prepared (packed) objects; retained, evictable.
- ``EXECUTION`` — invocation-local intermediates and workspaces.
- ``IO`` — final outputs and staged inputs that cross the runtime boundary.

This module does *accounting and admission*, not allocation: a :class:`Reservation` is
the right to hold ``n`` bytes in an arena; whoever allocates the real buffer holds the
reservation beside it and releases it when the buffer goes.

Contract (stable):

``MemoryBudget(global_limit=None, limits=None, *, critical_reserve=None, global_critical_reserve=0)``
    ``None`` means unlimited. ``limits`` maps :class:`Arena` to bytes (missing = unlimited).
    ``critical_reserve`` maps an arena to headroom bytes that only *critical* reservations
    may use (``global_critical_reserve`` likewise for the global limit).

``try_reserve(arena, nbytes, *, critical=True, label="") -> Reservation | None``
``try_reserve_many({arena: bytes}, *, critical=True, label="") -> Reservation | None``
    Non-blocking. ``None`` means "not now, may fit later". A request that can NEVER fit
    (bigger than its arena limit or the global limit) raises :class:`BudgetError` naming
    the arena and the sizes — it never returns ``None``. Multi-arena requests are atomic
    (all or nothing), so admission never holds one arena while waiting for another.

``reserve(...)`` / ``reserve_many(...)`` (same arguments plus ``timeout=None``)
    Blocking admission on a condition variable. A timeout raises :class:`BudgetError`.

``Reservation``: ``amounts`` (``{arena: bytes}``), ``nbytes``, ``release()`` (idempotent),
    ``detach(arena) -> Reservation`` (moves one arena's bytes to a new reservation, e.g. to
    hand a task's output bytes to the object that outlives the task), ``shrink(arena, n)``,
    context manager (releases on exit).

Statistics: ``live(arena)``, ``peak(arena)``, ``limit(arena)``, ``global_live``,
``global_peak``, ``max_in_flight_bytes`` (= ``global_peak``: the most bytes held at once
across all arenas), ``snapshot()``, ``reset_peaks()``. ``watch_peaks()`` opens a
:class:`PeakWatch`: the peaks from now on (a session's, a run's), apart from the budget's
own and from other watches; ``close()`` it when done. ``trace_live()`` opens a
:class:`LiveTrace`: what every arena holds after each change from now on, timestamped
(the profiler's counters of arena bytes over time, core/profile/chrome_trace.py).

``add_release_listener(fn)``: ``fn()`` is called (outside the budget's lock, on the
releasing thread) after any bytes are returned; the scheduler uses it to retry tasks
that are waiting for memory without occupying a worker.

Admission rule (NOTE: design decision). A request is admitted when, for every arena in
it and for the global total, ``live + n <= ceiling`` where ``ceiling`` is the limit for
critical requests and ``limit - critical_reserve`` for non-critical ones. One exception
keeps eager preparation deadlock-free under a tight budget: a non-critical request too
large for its non-critical ceiling (but within the limit) is admitted when the arena
(resp. the whole budget) holds nothing else.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from onnx_prep.core.errors import BudgetError
from onnx_prep.core.plan.task import Arena  # the plan's vocabulary; budgets are kept here

__all__ = ["Arena", "ArenaStats", "BudgetSnapshot", "LiveTrace", "MemoryBudget", "PeakWatch", "Reservation"]


def _fmt(n: int | None) -> str:
    return "unlimited" if n is None else f"{n:,} bytes"


@dataclass(frozen=True)
class ArenaStats:
    arena: Arena
    limit: int | None
    live: int
    peak: int


@dataclass(frozen=True)
class BudgetSnapshot:
    global_limit: int | None
    global_live: int
    global_peak: int
    arenas: dict[Arena, ArenaStats]

    def to_json(self) -> dict:
        return {
            "global_limit": self.global_limit,
            "global_live": self.global_live,
            "global_peak": self.global_peak,
            "arenas": {a.value: {"limit": s.limit, "live": s.live, "peak": s.peak} for a, s in self.arenas.items()},
        }


class Reservation:
    """The right to hold ``amounts[arena]`` bytes in each arena. Release exactly once
    (``release()`` is idempotent). Not thread-safe by itself: one owner at a time."""

    __slots__ = ("_budget", "_amounts", "label")

    def __init__(self, budget: MemoryBudget, amounts: dict[Arena, int], label: str = "") -> None:
        self._budget = budget
        self._amounts = amounts
        self.label = label

    @property
    def amounts(self) -> dict[Arena, int]:
        return dict(self._amounts)

    @property
    def nbytes(self) -> int:
        return sum(self._amounts.values())

    @property
    def released(self) -> bool:
        return not self._amounts

    def release(self) -> None:
        amounts, self._amounts = self._amounts, {}
        if amounts:
            self._budget._give_back(amounts)

    def detach(self, arena: Arena) -> Reservation:
        """Move this reservation's bytes in ``arena`` to a new reservation (no budget change)."""
        n = self._amounts.pop(arena, 0)
        return Reservation(self._budget, {arena: n} if n else {}, self.label)

    def shrink(self, arena: Arena, nbytes: int) -> None:
        """Lower the held bytes in ``arena`` to ``nbytes`` (e.g. the real size was smaller)."""
        held = self._amounts.get(arena, 0)
        if nbytes < 0 or nbytes > held:
            raise ValueError(f"cannot shrink {arena.value} reservation of {held} bytes to {nbytes}")
        if nbytes == held:
            return
        if nbytes:
            self._amounts[arena] = nbytes
        else:
            del self._amounts[arena]
        self._budget._give_back({arena: held - nbytes})

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        parts = ", ".join(f"{a.value}={n}" for a, n in self._amounts.items())
        return f"Reservation({parts or 'released'})"


class PeakWatch:
    """The most bytes each arena (and the budget as a whole) held at once since the
    watch opened (:meth:`MemoryBudget.watch_peaks`), counting every holder of the budget:
    on a budget shared by several sessions, what they held together. ``peaks()`` while
    open or after ``close()`` (then frozen)."""

    __slots__ = ("_budget", "_peak", "_global_peak")

    def __init__(self, budget: MemoryBudget, live: dict[Arena, int], global_live: int) -> None:
        self._budget = budget
        self._peak = dict(live)
        self._global_peak = global_live

    def _saw(self, live: dict[Arena, int], global_live: int) -> None:  # budget lock held
        peak = self._peak
        for a, n in live.items():
            if n > peak[a]:
                peak[a] = n
        if global_live > self._global_peak:
            self._global_peak = global_live

    def peaks(self) -> dict[Arena, int]:
        with self._budget._lock:
            return dict(self._peak)

    @property
    def global_peak(self) -> int:
        with self._budget._lock:
            return self._global_peak

    def close(self) -> None:
        """Stop watching (idempotent); the peaks stay readable."""
        self._budget._unwatch(self)

    def __enter__(self) -> PeakWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LiveTrace:
    """What each arena held after every change since the trace opened
    (:meth:`MemoryBudget.trace_live`): ``samples()`` is ``[(perf_counter_ns, {arena
    name: bytes})]``, the first taken at opening. Costs one small dict per change while
    open; ``close()`` stops it (idempotent)."""

    __slots__ = ("_budget", "_samples")

    def __init__(self, budget: MemoryBudget, live: dict[Arena, int]) -> None:
        self._budget = budget
        self._samples: list[tuple[int, dict[str, int]]] = []
        self._saw(live)

    def _saw(self, live: dict[Arena, int]) -> None:  # budget lock held
        self._samples.append((time.perf_counter_ns(), {a.value: n for a, n in live.items()}))

    def samples(self) -> list[tuple[int, dict[str, int]]]:
        with self._budget._lock:
            return list(self._samples)

    def close(self) -> None:
        self._budget._untrace(self)


class MemoryBudget:
    """Per-arena limits under one global limit, with critical headroom. Thread-safe."""

    def __init__(
        self,
        global_limit: int | None = None,
        limits: Mapping[Arena, int | None] | None = None,
        *,
        critical_reserve: Mapping[Arena, int] | None = None,
        global_critical_reserve: int = 0,
    ) -> None:
        limits = dict(limits or {})
        for a, lim in limits.items():
            if not isinstance(a, Arena):
                raise TypeError(f"limits keys must be Arena, got {a!r}")
            if lim is not None and lim < 0:
                raise ValueError(f"negative limit for arena {a.value}: {lim}")
        if global_limit is not None and global_limit < 0:
            raise ValueError(f"negative global limit: {global_limit}")
        self._global_limit = global_limit
        self._limits: dict[Arena, int | None] = {a: limits.get(a) for a in Arena}
        reserve = dict(critical_reserve or {})
        self._reserve = {a: int(reserve.get(a, 0)) for a in Arena}
        self._global_reserve = int(global_critical_reserve)
        self._live = {a: 0 for a in Arena}
        self._peak = {a: 0 for a in Arena}
        self._global_live = 0
        self._global_peak = 0
        self._lock = threading.Lock()
        # entered as `with self._lock`, not `with self._cond` (execution_handle._Tracker says why)
        self._cond = threading.Condition(self._lock)
        self._listeners: list[Callable[[], None]] = []
        self._watches: list[PeakWatch] = []
        self._traces: list[LiveTrace] = []

    # -- configuration and statistics -------------------------------------------------

    def limit(self, arena: Arena) -> int | None:
        return self._limits[arena]

    @property
    def global_limit(self) -> int | None:
        return self._global_limit

    def live(self, arena: Arena) -> int:
        with self._lock:
            return self._live[arena]

    def peak(self, arena: Arena) -> int:
        with self._lock:
            return self._peak[arena]

    @property
    def global_live(self) -> int:
        with self._lock:
            return self._global_live

    @property
    def global_peak(self) -> int:
        with self._lock:
            return self._global_peak

    @property
    def max_in_flight_bytes(self) -> int:
        """The most bytes held at once, all arenas together."""
        return self.global_peak

    def snapshot(self) -> BudgetSnapshot:
        with self._lock:
            return BudgetSnapshot(
                self._global_limit, self._global_live, self._global_peak,
                {a: ArenaStats(a, self._limits[a], self._live[a], self._peak[a]) for a in Arena},
            )

    def reset_peaks(self) -> None:
        with self._lock:
            for a in Arena:
                self._peak[a] = self._live[a]
            self._global_peak = self._global_live

    def watch_peaks(self) -> PeakWatch:
        """Peaks from now on, apart from the budget's own (see :class:`PeakWatch`)."""
        with self._lock:
            w = PeakWatch(self, self._live, self._global_live)
            self._watches.append(w)
        return w

    def _unwatch(self, watch: PeakWatch) -> None:
        with self._lock:
            if watch in self._watches:
                self._watches.remove(watch)

    def trace_live(self) -> LiveTrace:
        """Every change of what the arenas hold from now on (see :class:`LiveTrace`)."""
        with self._lock:
            t = LiveTrace(self, self._live)
            self._traces.append(t)
        return t

    def _untrace(self, trace: LiveTrace) -> None:
        with self._lock:
            if trace in self._traces:
                self._traces.remove(trace)

    def add_release_listener(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(fn)

    def remove_release_listener(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if fn in self._listeners:
                self._listeners.remove(fn)

    # -- admission ----------------------------------------------------------------------

    def check_fits(self, request: Mapping[Arena, int], *, label: str = "") -> dict[Arena, int]:
        """Validate a request; raise :class:`BudgetError` if it can never fit. Returns it
        normalised (zero entries dropped)."""
        clean: dict[Arena, int] = {}
        for a, n in request.items():
            if not isinstance(a, Arena):
                raise TypeError(f"memory request keys must be Arena, got {a!r}")
            n = int(n)
            if n < 0:
                raise ValueError(f"negative memory request for arena {a.value}: {n}")
            if n:
                clean[a] = n
        who = f"{label}: " if label else ""
        for a, n in clean.items():
            lim = self._limits[a]
            if lim is not None and n > lim:
                raise BudgetError(
                    f"{who}allocation of {n:,} bytes in arena '{a.value}' can never fit: "
                    f"the arena limit is {_fmt(lim)}",
                    hint=f"raise the '{a.value}' arena limit above {n:,} bytes",
                )
        total = sum(clean.values())
        if self._global_limit is not None and total > self._global_limit:
            detail = ", ".join(f"'{a.value}' {n:,}" for a, n in clean.items())
            raise BudgetError(
                f"{who}allocation of {total:,} bytes ({detail}) can never fit: "
                f"the global memory budget is {_fmt(self._global_limit)}",
                hint=f"raise the global memory budget above {total:,} bytes",
            )
        return clean

    def _admissible(self, req: dict[Arena, int], critical: bool) -> bool:
        # Caller holds the lock.
        for a, n in req.items():
            lim = self._limits[a]
            if lim is None:
                continue
            ceiling = lim if critical else lim - self._reserve[a]
            if self._live[a] + n > ceiling:
                alone_ok = not critical and n > ceiling and self._live[a] == 0 and n <= lim
                if not alone_ok:
                    return False
        if self._global_limit is not None:
            total = sum(req.values())
            ceiling = self._global_limit if critical else self._global_limit - self._global_reserve
            if self._global_live + total > ceiling:
                alone_ok = (not critical and total > ceiling and self._global_live == 0
                            and total <= self._global_limit)
                if not alone_ok:
                    return False
        return True

    def _take(self, req: dict[Arena, int]) -> None:
        for a, n in req.items():
            live = self._live[a] + n
            self._live[a] = live
            if live > self._peak[a]:
                self._peak[a] = live
        self._global_live += sum(req.values())
        if self._global_live > self._global_peak:
            self._global_peak = self._global_live
        for w in self._watches:
            w._saw(self._live, self._global_live)
        for t in self._traces:
            t._saw(self._live)

    def try_reserve_many(self, request: Mapping[Arena, int], *, critical: bool = True,
                         label: str = "") -> Reservation | None:
        req = self.check_fits(request, label=label)
        if not req:
            return Reservation(self, {}, label)
        with self._lock:
            if not self._admissible(req, critical):
                return None
            self._take(req)
        return Reservation(self, req, label)

    def try_reserve(self, arena: Arena, nbytes: int, *, critical: bool = True,
                    label: str = "") -> Reservation | None:
        return self.try_reserve_many({arena: nbytes}, critical=critical, label=label)

    def reserve_many(self, request: Mapping[Arena, int], *, critical: bool = True,
                     timeout: float | None = None, label: str = "") -> Reservation:
        req = self.check_fits(request, label=label)
        if not req:
            return Reservation(self, {}, label)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not self._admissible(req, critical):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    detail = ", ".join(
                        f"'{a.value}' {n:,} (live {self._live[a]:,}, limit {_fmt(self._limits[a])})"
                        for a, n in req.items())
                    who = f"{label}: " if label else ""
                    raise BudgetError(
                        f"{who}timed out after {timeout}s waiting for memory: {detail}; "
                        f"global live {self._global_live:,} of {_fmt(self._global_limit)}",
                        hint="raise the memory budget or run fewer things at once",
                    )
                self._cond.wait(remaining)
            self._take(req)
        return Reservation(self, req, label)

    def reserve(self, arena: Arena, nbytes: int, *, critical: bool = True,
                timeout: float | None = None, label: str = "") -> Reservation:
        return self.reserve_many({arena: nbytes}, critical=critical, timeout=timeout, label=label)

    def _give_back(self, amounts: dict[Arena, int]) -> None:
        with self._lock:
            for a, n in amounts.items():
                self._live[a] -= n
                assert self._live[a] >= 0, f"arena {a.value} released more than it held"
            self._global_live -= sum(amounts.values())
            for t in self._traces:
                t._saw(self._live)
            self._cond.notify_all()
            listeners = list(self._listeners)
        for fn in listeners:
            fn()
