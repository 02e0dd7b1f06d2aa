"""The runtime scheduler: a persistent worker pool with resource queues, priorities,
priority inheritance, memory admission and cooperative cancellation.

docs/design.md, "Task resources and scheduling". The
scheduler runs *functions with dependencies*; it knows nothing about models, plans or
prepared objects (the session maps plan descriptors onto :meth:`Scheduler.submit`).

Why one module of ~1,000 lines (a fifth of it this contract): the queues, the task
handles' states, priority inheritance, memory admission and cancellation all change
under ONE lock, and their invariants are stated against each other (a handle's state
moves only with its queue entry; a waiter's priority is lent to exactly the tasks it
waits on). Split across modules, each part would reach into the others' guarded state.

Contract (stable)
-----------------

``Scheduler(io_workers=2, cpu_workers=None, device_queues=0, *, map_workers=2, budget=None, sequential=False, name="onnx-prep")``
    Starts the worker threads at once (the MAPPED queue's with its first task: a scheduler
    that maps nothing has no threads for it); they live until :meth:`close`. ``cpu_workers=None``
    means ``os.cpu_count()``. ``budget`` is the :class:`MemoryBudget` used for admission
    (an unlimited one by default). ``sequential=True`` runs every task — INLINE and DEVICE
    included — on ONE worker thread in priority order: the same task set, one at a time,
    for comparisons.

``submit(fn, *, resource=CPU, priority=CRITICAL, deps=(), mem=None, name="", group=None,
meta=None, promote_deps=False, kind=None, log=None) -> TaskHandle``
    ``fn(ctx: TaskContext) -> result``. The task becomes READY when every handle in
    ``deps`` is DONE; if any dependency FAILED or was CANCELLED it becomes CANCELLED (cause =
    the root failing task) without running. ``mem`` (``{Arena: bytes}``) is reserved in the
    budget before dispatch and released when the task ends, except what the task moves out
    with ``ctx.detach(arena)``. A ``mem`` that can never fit makes the task FAILED at once
    with :class:`BudgetError` (naming arena and sizes) — ``submit`` itself does not raise.
    ``group`` (a :class:`TaskGroup`) gets the task added. ``meta`` is opaque caller data.
    ``promote_deps=True`` promotes the not-yet-done producers to CRITICAL (inheritance).
    ``kind`` (a :class:`TaskKind`) is recorded in the task's event; ``log`` (a
    ``Timeline``, core/runtime/timeline.py) gets the event too, so an owner (a session)
    has its own tasks' timeline and totals on a scheduler it shares.
    ``submit`` never blocks on other tasks. It raises :class:`UsageError` after ``close()``
    or for DEVICE work without device queues.

``promote(handle, priority=CRITICAL) -> int``
    Priority inheritance: raises ``handle`` and all its not-yet-terminal transitive
    producers to ``priority`` (re-queued in place; never lowers one); returns how many
    changed. ``ExecutionHandle.wait()`` raises what it waits for to DEMANDED.

``submissions`` — number of ``submit`` calls so far (the hot path must add zero).
``events()`` — list of :class:`TaskEvent`, one per terminal task, in completion order
(task id, name, kind, resource, priority, worker thread, submit/ready/start/end
``perf_counter_ns`` timestamps, thread CPU time, state, cause): enough to draw a trace.
``clear_events()`` empties it.
``wait_idle(timeout=None) -> bool`` — until no task is live and every done-callback returned.
``close(cancel_pending=True)`` — cancels queued/pending tasks (or lets them drain),
waits for running ones, joins every worker thread. Also a context manager.

Execution rules
---------------

- Known gap: DEVICE is one plain worker queue (``device_queues`` threads); there are no
  per-stream events yet, so a copy overlaps a kernel only across different workers.
- Queues: one priority queue per resource (IO, MAPPED, CPU, DEVICE), ordered by (priority class,
  submission sequence). INLINE tasks run on the thread that made them ready (the
  submitting thread, or the thread completing the last dependency), through a per-thread
  trampoline so long inline chains do not recurse.
- Reserved critical capacity: with ``n >= 2`` workers on a queue, speculative tasks
  (PREFETCH, BACKGROUND) may occupy at most ``n - 1`` of them, so one CPU worker and one
  I/O slot are always free for CRITICAL work. DEMANDED tasks (a caller is blocked on
  them, or an in-flight run consumes them soon) may use every CPU worker: a worker held
  idle while someone waits is pure loss. They still queue after CRITICAL work, so a run
  that arrives meanwhile waits at most for the running tasks to finish, never for the
  queued ones. On the I/O queue only CRITICAL passes the cap (one storage device reads
  no faster from two threads: see the note at ``_exempt``). The MAPPED queue (a
  persisted payload mapped into its slot and checked: page-table work and a checksum
  over the page cache, not a storage read) has its own workers and the CPU queue's rule,
  so mapped reads run in parallel and never queue behind source reads. (NOTE: with a single worker
  on a queue there is nothing to reserve; a critical task then waits for the running one.)
- Memory admission happens before dispatch, under the picking worker: if the task's
  ``mem`` is not available it is parked (not holding a worker) and retried whenever the
  budget releases bytes. CRITICAL tasks may use the budget's critical headroom; others
  may not (see ``arenas.py``).
- Cancellation is cooperative: ``handle.cancel()`` on a PENDING/READY task makes it
  CANCELLED at once (it never runs); on a RUNNING task it sets ``ctx.token`` and the task
  ends CANCELLED if it raises :class:`CancelledError` (``ctx.raise_if_cancelled()``),
  else with its real outcome.
- Failure propagates to dependents only: they become CANCELLED with ``cause`` = the
  failing task; independent tasks continue. Every submitted task reaches exactly one
  terminal state (DONE, FAILED, CANCELLED).
- Shared tasks: ``handle.retain()`` / ``handle.release()`` count consumers. ``release``
  cancels the task only when no consumer remains AND no live dependent needs it; it then
  walks up to its producers and cancels each one that is left with no consumer and no
  live dependent (a read whose only prepack was just cancelled), so nothing orphaned runs.
- Callbacks (``add_done_callback``) run outside the scheduler lock on the completing
  thread; an exception in one is logged, never propagated.
- A task's result stays referenced by its handle; call ``discard_result()`` from the
  consumer to free a large buffer early.
"""
from __future__ import annotations

import enum
import heapq
import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from onnx_prep.core.runtime.arenas import Arena, MemoryBudget, Reservation
from onnx_prep.core.errors import BudgetError, CancelledError, UsageError, log_exception
from onnx_prep.core.plan.task import Priority, ResourceClass, TaskKind


__all__ = ["Scheduler", "TaskHandle", "TaskContext", "TaskGroup", "TaskEvent", "TaskState", "CancelToken"]


class TaskState(enum.Enum):
    PENDING = "pending"  # waiting for dependencies
    READY = "ready"  # dependencies done; queued for a worker and memory
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({TaskState.DONE, TaskState.FAILED, TaskState.CANCELLED})


_lazy_lock = threading.Lock()  # creation of lazily-made Events (rare: only when someone blocks)


class CancelToken:
    """Cooperative cancellation flag handed to a running task (``ctx.token``)."""

    # NOTE: a plain flag; the Event behind wait() is created only if someone waits, since
    # a threading.Event costs more than the rest of a task's bookkeeping.
    __slots__ = ("_flag", "_event")

    def __init__(self) -> None:
        self._flag = False
        self._event: threading.Event | None = None

    def cancel(self) -> None:
        self._flag = True
        with _lazy_lock:
            event = self._event
        if event is not None:
            event.set()

    @property
    def cancelled(self) -> bool:
        return self._flag

    def raise_if_cancelled(self, what: str = "task") -> None:
        if self._flag:
            raise CancelledError(f"{what} cancelled")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until cancelled (or timeout); for tasks that wait on something cancellable."""
        with _lazy_lock:
            if self._event is None:
                self._event = threading.Event()
                if self._flag:
                    self._event.set()
            event = self._event
        return event.wait(timeout)


class TaskContext:
    """What a task function receives.

    ``token`` (:class:`CancelToken`), ``inputs`` (results of ``deps`` in order), ``handle``
    (its own :class:`TaskHandle`), ``reservation`` (the admitted memory, or ``None``),
    ``worker`` (thread name).
    """

    __slots__ = ("token", "inputs", "handle", "reservation", "worker")

    def __init__(self, handle: TaskHandle, inputs: tuple, reservation: Reservation | None, worker: str):
        self.handle = handle
        self.token = handle.token
        self.inputs = inputs
        self.reservation = reservation
        self.worker = worker

    @property
    def cancelled(self) -> bool:
        return self.token.cancelled

    def raise_if_cancelled(self) -> None:
        self.token.raise_if_cancelled(f"task {self.handle.name!r}")

    def detach(self, arena: Arena) -> Reservation:
        """Take this task's reserved bytes in ``arena`` out of the automatic release at
        task end; the caller now owns (and must release) the returned reservation."""
        if self.reservation is None:
            raise UsageError(f"task {self.handle.name!r} reserved no memory to detach")
        return self.reservation.detach(arena)


@dataclass(frozen=True)
class TaskEvent:
    """One terminal task. ``task_id`` is the scheduler's number; ``name`` is the
    submitter's id for it (a session task's plan id, ``run-N:stepK`` for a run's
    continuation); ``kind`` what it did (None when the submitter did not say)."""

    task_id: int
    name: str
    resource: ResourceClass
    priority: Priority
    worker: str | None
    submit_ns: int
    ready_ns: int | None
    start_ns: int | None
    end_ns: int
    state: TaskState
    cause: str | None
    cpu_ns: int | None = None  # CPU time of the running thread (wall minus waiting); None if it never ran
    kind: TaskKind | None = None

    def to_json(self) -> dict:
        return {
            "task_id": self.task_id, "name": self.name,
            "kind": None if self.kind is None else self.kind.value, "resource": self.resource.value,
            "priority": self.priority.name.lower(), "worker": self.worker,
            "submit_ns": self.submit_ns, "ready_ns": self.ready_ns, "start_ns": self.start_ns,
            "end_ns": self.end_ns, "cpu_ns": self.cpu_ns, "state": self.state.value, "cause": self.cause,
        }


class TaskHandle:
    """The runtime state of one submitted task. Created only by :meth:`Scheduler.submit`."""

    def __init__(self, sched: Scheduler, fn: Callable[[TaskContext], Any], *, resource: ResourceClass,
                 priority: Priority, deps: tuple[TaskHandle, ...], mem: dict[Arena, int], name: str,
                 meta: Any, kind: TaskKind | None = None, log: Any = None) -> None:
        self._sched = sched
        self._fn: Callable[[TaskContext], Any] | None = fn
        self.resource = resource
        self._priority = Priority(priority)
        self.deps = deps
        self.mem = mem
        self.name = name
        self.meta = meta
        self.kind = kind
        self._log = log  # a Timeline that records this task's event too
        self.id = 0
        self.token = CancelToken()
        self._state = TaskState.PENDING
        self._result: Any = None
        self._exc: BaseException | None = None
        self.cause: TaskHandle | None = None
        self._dependents: list[TaskHandle] = []
        self._pending = 0
        self._reservation: Reservation | None = None
        self._done: threading.Event | None = None  # made on first wait (see _done_event)
        self._callbacks: list[Callable[[TaskHandle], None]] = []
        self._signalled = False  # terminal and visible to waiters (set after the state)
        self._consumers = 0
        self._token_seq = 0  # heap entry validity
        self._blocked = False  # parked waiting for memory
        self._ran_critical = False
        self.submit_ns = time.perf_counter_ns()
        self.ready_ns: int | None = None
        self.start_ns: int | None = None
        self.cpu_ns: int | None = None
        self.end_ns: int | None = None
        self.worker: str | None = None

    # -- observation ---------------------------------------------------------------

    @property
    def state(self) -> TaskState:
        return self._state

    @property
    def priority(self) -> Priority:
        return self._priority

    def _done_event(self) -> threading.Event:
        with self._sched._lock:
            if self._done is None:
                self._done = threading.Event()
                if self._signalled:
                    self._done.set()
            return self._done

    def done(self) -> bool:
        return self._signalled

    def wait(self, timeout: float | None = None) -> bool:
        """Block until terminal; ``False`` on timeout."""
        if self._signalled:
            return True
        return self._done_event().wait(timeout)

    def result(self, timeout: float | None = None) -> Any:
        """The task's return value; raises its exception if FAILED, :class:`CancelledError` if
        CANCELLED, :class:`TimeoutError` on timeout."""
        if not self.wait(timeout):
            raise TimeoutError(f"task {self.name!r} not done after {timeout}s")
        if self._state is TaskState.DONE:
            return self._result
        if self._state is TaskState.FAILED:
            assert self._exc is not None
            raise self._exc
        raise self.cancelled_error()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.wait(timeout):
            raise TimeoutError(f"task {self.name!r} not done after {timeout}s")
        return self._exc

    def cancelled_error(self) -> CancelledError:
        if self.cause is not None:
            return CancelledError(f"task {self.name!r} cancelled: dependency {self.cause.name!r} "
                                  f"{self.cause.state.value}")
        return CancelledError(f"task {self.name!r} cancelled")

    def discard_result(self) -> None:
        """Drop the reference to the result (free a large buffer once consumed)."""
        self._result = None

    def add_done_callback(self, fn: Callable[[TaskHandle], None]) -> None:
        """``fn(handle)`` once terminal; at once (on this thread) if already terminal."""
        with self._sched._lock:
            if not self._state.terminal:
                self._callbacks.append(fn)
                return
        _call(fn, self)

    # -- control -------------------------------------------------------------------

    def cancel(self) -> bool:
        """Cancel (see module docstring). ``True`` if the task will not run or was asked to stop."""
        return self._sched._cancel(self)

    def promote(self, priority: Priority = Priority.CRITICAL) -> int:
        return self._sched.promote(self, priority)

    def retain(self) -> None:
        """Register one more consumer of this (shared) task."""
        with self._sched._lock:
            self._consumers += 1

    def release(self, *, cancel_if_unused: bool = True) -> bool:
        """Drop one consumer. Cancels the task (and producers shared only through it) when
        no consumer and no live dependent remains. Returns ``True`` if it cancelled it."""
        return self._sched._release(self, cancel_if_unused)

    @property
    def consumers(self) -> int:
        return self._consumers

    def __repr__(self) -> str:
        return f"TaskHandle(#{self.id} {self.name!r} {self.resource.value} {self._priority.name} {self._state.value})"


def _call(fn: Callable, *args) -> None:
    try:
        fn(*args)
    except Exception:  # a callback must not break the scheduler
        log_exception(__name__, "done-callback %r raised", fn)


class TaskGroup:
    """A set of tasks that can be waited for together (a submission's bookkeeping).

    ``add(handle)``, ``tasks``, ``done()``, ``wait(timeout=None) -> bool`` (all terminal),
    ``cancel() -> int``, ``failures()`` (FAILED handles, earliest end first).
    Thread-safe; callbacks hold the group, not its owner.
    """

    def __init__(self, tasks: Iterable[TaskHandle] = ()) -> None:
        self._cond = threading.Condition()
        self._tasks: list[TaskHandle] = []
        self._outstanding = 0
        for t in tasks:
            self.add(t)

    def add(self, task: TaskHandle) -> None:
        with self._cond:
            self._tasks.append(task)
            self._outstanding += 1
        task.add_done_callback(self._on_done)

    def _on_done(self, _task: TaskHandle) -> None:
        with self._cond:
            self._outstanding -= 1
            if self._outstanding == 0:
                self._cond.notify_all()

    @property
    def tasks(self) -> tuple[TaskHandle, ...]:
        with self._cond:
            return tuple(self._tasks)

    def done(self) -> bool:
        with self._cond:
            return self._outstanding == 0

    def wait(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._outstanding == 0, timeout)

    def cancel(self) -> int:
        return sum(1 for t in self.tasks if t.cancel())

    def failures(self) -> list[TaskHandle]:
        failed = [t for t in self.tasks if t.state is TaskState.FAILED]
        return sorted(failed, key=lambda t: (t.end_ns or 0, t.id))


_SEQ_QUEUE = "all"  # queue key of sequential mode


class _ForkJoin:
    """The chunks of one fork_join, pulled in index order by every participant."""

    __slots__ = ("fns", "_next", "errors", "remote", "_lock")

    def __init__(self, fns: Sequence[Callable[[], Any]]) -> None:
        self.fns = fns
        self._next = itertools.count()  # next() is atomic under the GIL
        self.errors: list[tuple[int, BaseException]] = []
        self.remote = 0
        self._lock = threading.Lock()

    def _run(self, remote: bool) -> None:
        fns, n = self.fns, len(self.fns)
        while True:
            i = next(self._next)
            if i >= n:
                return
            try:
                fns[i]()
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller
                self.errors.append((i, e))
            if remote:
                with self._lock:
                    self.remote += 1

    def run_local(self) -> None:
        self._run(False)

    def run_remote(self) -> None:
        self._run(True)

    def result(self) -> int:
        if self.errors:
            raise min(self.errors, key=lambda ie: ie[0])[1]
        return self.remote


class _SideJob:
    """One fork_join part offered to idle CPU workers. State moves QUEUED -> TAKEN under
    the scheduler lock (by a worker or, reclaiming it, the caller); ``done`` is a lock
    held from the start and released when a worker finished it.

    NOTE: a lock, not an Event: Event.wait enters its Condition through Python code, so
    a Ctrl-C on the caller right after that acquire (a hot run reclaiming its helpers)
    left the Event's lock held and the worker's set() blocked on it for good, and the
    session's close joining that worker. A C lock's ``with`` has no such gap."""

    QUEUED, TAKEN = 0, 1
    __slots__ = ("fn", "state", "done")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn  # _ForkJoin.run_remote: it keeps chunk errors for the caller itself
        self.state = _SideJob.QUEUED
        self.done = threading.Lock()
        self.done.acquire()

    def run(self) -> None:
        try:
            self.fn()
        finally:
            self.done.release()


class Scheduler:
    """See the module docstring for the contract."""

    def __init__(self, io_workers: int = 2, cpu_workers: int | None = None, device_queues: int = 0, *,
                 map_workers: int = 2, budget: MemoryBudget | None = None, sequential: bool = False,
                 name: str = "onnx-prep", event_log_limit: int = 1_000_000) -> None:
        cpu_workers = (os.cpu_count() or 1) if cpu_workers is None else cpu_workers
        if io_workers < 1 or cpu_workers < 1 or map_workers < 1 or device_queues < 0:
            raise UsageError(f"bad worker counts: io={io_workers} cpu={cpu_workers} map={map_workers} "
                             f"device={device_queues}", hint="io, map and cpu workers must be >= 1")
        self.budget = budget if budget is not None else MemoryBudget()
        self.sequential = sequential
        self.name = name
        # NOTE: re-entrant only so that is_worker_thread() can tell whether this thread holds
        # it (a finalizer run by the GC inside a locked section must not block); the code
        # never re-enters it.
        self._lock = threading.RLock()
        # The conditions below share the lock and are entered through it (``with
        # self._lock``): Condition.__enter__ is Python code, and a Ctrl-C raised in it
        # right after its acquire would leave the lock held and every worker stopped.
        self._idle = threading.Condition(self._lock)
        self._tls = threading.local()
        self._seq = itertools.count(1)
        self._submissions = 0
        self._events: deque[TaskEvent] = deque(maxlen=event_log_limit)
        self._live: set[TaskHandle] = set()
        self._settling = 0  # terminal tasks whose done-callbacks have not finished yet
        self._mem_blocked: list[TaskHandle] = []
        self._closing = False
        self._stop = False
        if sequential:
            counts: dict[Any, int] = {_SEQ_QUEUE: 1}
        else:
            counts = {ResourceClass.IO: io_workers, ResourceClass.MAPPED: map_workers,
                      ResourceClass.CPU: cpu_workers}
            if device_queues:
                counts[ResourceClass.DEVICE] = device_queues
        self._heaps: dict[Any, list] = {q: [] for q in counts}
        self._cv = {q: threading.Condition(self._lock) for q in counts}
        self._workers_per_queue = dict(counts)
        # NOTE: reserve one worker per queue for CRITICAL work when there are >= 2.
        self._noncrit_cap = {q: (n - 1 if n >= 2 and not sequential else n) for q, n in counts.items()}
        # The lowest priority a queue lets past the cap: DEMANDED on CPU (and DEVICE), only
        # CRITICAL on I/O. NOTE: two threads populating one data file from a cold page
        # cache break its streaming readahead and spend ~50% more system time, while one
        # storage device reads no faster for them; the reserved I/O slot stays free for
        # CRITICAL reads. Medium fixture, cold, medians of 6, TTFO / init / sys ms: I/O
        # capped 400 / 469 / 240, uncapped 520 / 507 / 375 (docs/runtime.md). A mapped
        # payload (MAPPED) has no such device to share: DEMANDED passes its cap, as on CPU.
        self._exempt = {q: (Priority.CRITICAL if q is ResourceClass.IO else Priority.DEMANDED)
                        for q in counts}
        self._running = {q: 0 for q in counts}
        self._running_noncrit = {q: 0 for q in counts}
        self._waiting = {q: 0 for q in counts}  # workers asleep in cv.wait (idle)
        self._side: deque[_SideJob] = deque()  # fork_join parts offered to idle CPU workers
        self.side_jobs_run = 0  # fork_join offers a worker took (it then pulls chunks until none is left)
        self.futile_wakeups = 0  # times an idle worker woke, found nothing it could start, and slept again
        self._threads: list[threading.Thread] = []
        self._worker_idents: set[int] = set()
        # NOTE: the MAPPED queue's workers start with its first task (_push): only a
        # session with a prepared cache maps payloads, and most schedulers never do.
        self._unstarted = {ResourceClass.MAPPED} & set(counts)
        for q in counts:
            if q not in self._unstarted:
                self._start_workers(q)
        self.budget.add_release_listener(self._on_memory_released)

    def _start_workers(self, q: Any) -> None:  # at construction, or locked (_push)
        qname = q if isinstance(q, str) else q.value
        for i in range(self._workers_per_queue[q]):
            th = threading.Thread(target=self._worker, args=(q,), name=f"{self.name}-{qname}-{i}", daemon=True)
            self._threads.append(th)
            th.start()
            self._worker_idents.add(th.ident)  # type: ignore[arg-type]

    # -- public API ------------------------------------------------------------------

    @property
    def submissions(self) -> int:
        return self._submissions

    @property
    def worker_names(self) -> tuple[str, ...]:
        return tuple(th.name for th in self._threads)

    def workers(self, resource: ResourceClass) -> int:
        """Worker count serving ``resource`` (0 for INLINE; the single worker in sequential mode)."""
        if self.sequential:
            return 1
        return self._workers_per_queue.get(resource, 0)

    def fork_join(self, fns: Sequence[Callable[[], Any]], *, helpers: int | None = None) -> int:
        """Intra-op parallelism: run every ``fns[i]()`` (chunks of one op) on the calling
        thread together with up to ``helpers`` (default: as many as useful) CPU workers
        that are idle right now — no task, no submission, no queueing behind other work.
        Every participant pulls the next chunk in index order until none is left, so a
        worker that wakes late takes fewer chunks instead of making the caller wait; the
        caller never waits for a busy worker, only for chunks already running elsewhere,
        and it cannot deadlock (it may be called from a task). Re-raises the error of the
        lowest-numbered failing chunk after every chunk ran. Returns how many chunks
        other threads ran.

        NOTE: chunks must be self-contained kernel calls (no locks, no waiting on tasks):
        a worker runs them between tasks. Idle workers take them before queued tasks (a
        chunk belongs to work someone is waiting for)."""
        work = _ForkJoin(fns)
        want = len(fns) - 1 if helpers is None else min(int(helpers), len(fns) - 1)
        offered = self.lend(work.run_remote, want)
        work.run_local()
        self.reclaim(offered)  # nobody came: withdrawn; taken: its chunks finish first
        return work.result()

    def lend(self, fn: Callable[[], Any], workers: int = 1) -> list[_SideJob]:
        """Run ``fn()`` on up to ``workers`` CPU workers that are idle right now, as
        fork_join parts are run (no task, no submission; none if none is idle). For a
        run's helpers serving its native mailbox (``native.Mailbox.serve``); ``fn`` must
        return when the caller tells it to. Pass the result to :meth:`reclaim`."""
        q = ResourceClass.CPU
        if workers < 1 or self.sequential or q not in self._cv:  # a sequential scheduler lends none
            return []
        with self._lock:
            n = min(int(workers), self._waiting[q])
            if not n or self._stop:
                return []
            lent = [_SideJob(fn) for _ in range(n)]
            self._side.extend(lent)
            self._cv[q].notify(n)
        return lent

    def reclaim(self, lent: list[_SideJob]) -> int:
        """Take back what :meth:`lend` gave: an offer no worker took is withdrawn, one
        taken is waited for (its ``fn`` must be returning). Returns how many ran."""
        taken = []
        with self._lock:
            for j in lent:
                if j.state == _SideJob.QUEUED:
                    j.state = _SideJob.TAKEN
                    self._side.remove(j)
                else:
                    taken.append(j)
        for j in taken:
            with j.done:  # released when its worker finished it (see _SideJob)
                pass
        return len(taken)

    def is_worker_thread(self) -> bool:
        """True on one of this scheduler's workers, while running an inline task here, or
        while this thread holds the scheduler's lock (a GC finalizer): places where blocking
        on this scheduler's tasks could deadlock."""
        return (threading.get_ident() in self._worker_idents or getattr(self._tls, "draining", False)
                or self._lock._is_owned())  # type: ignore[attr-defined]

    def events(self) -> list[TaskEvent]:
        with self._lock:
            return list(self._events)

    def clear_events(self) -> None:
        with self._lock:
            self._events.clear()

    def live_tasks(self) -> int:
        with self._lock:
            return len(self._live)

    def _quiescent(self) -> bool:  # locked
        return not self._live and not self._settling

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Until no task is live and every done-callback has returned."""
        with self._lock:  # not `with self._idle` (see __init__)
            return self._idle.wait_for(self._quiescent, timeout)

    def submit(self, fn: Callable[[TaskContext], Any], *, resource: ResourceClass = ResourceClass.CPU,
               priority: Priority = Priority.CRITICAL, deps: Iterable[TaskHandle] = (),
               mem: Mapping[Arena, int] | None = None, name: str = "", group: TaskGroup | None = None,
               meta: Any = None, promote_deps: bool = False, kind: TaskKind | None = None,
               log: Any = None) -> TaskHandle:
        resource = ResourceClass(resource)
        if resource is ResourceClass.DEVICE and not self.sequential and ResourceClass.DEVICE not in self._heaps:
            raise UsageError(f"task {name!r} needs a device queue but the scheduler has none",
                             hint="create the Scheduler with device_queues >= 1")
        deps = tuple(deps)
        budget_error: BudgetError | None = None
        clean_mem: dict[Arena, int] = {}
        try:
            clean_mem = self.budget.check_fits(mem or {}, label=name)
        except BudgetError as e:
            budget_error = e
        t = TaskHandle(self, fn, resource=resource, priority=priority, deps=deps, mem=clean_mem,
                       name=name, meta=meta, kind=None if kind is None else TaskKind(kind), log=log)
        finished: list[TaskHandle] = []
        inline: list[TaskHandle] = []
        with self._lock:
            if self._stop:
                raise UsageError(f"task {name!r} submitted to a closed scheduler")
            for d in deps:
                if d._sched is not self:
                    raise UsageError(f"task {name!r} depends on {d.name!r} from another scheduler")
            self._submissions += 1
            t.id = next(self._seq)
            if not t.name:
                t.name = f"task-{t.id}"
            self._live.add(t)
            dead = next((d for d in deps if d._state in (TaskState.FAILED, TaskState.CANCELLED)), None)
            if budget_error is not None:
                self._set_terminal(t, TaskState.FAILED, None, budget_error, None, finished)
            elif self._closing:
                t.token.cancel()
                self._set_terminal(t, TaskState.CANCELLED, None, None, None, finished)
            elif dead is not None:
                t.token.cancel()
                self._set_terminal(t, TaskState.CANCELLED, None, None, _root(dead), finished)
            else:
                pending = 0
                for d in deps:
                    if d._state is not TaskState.DONE:
                        d._dependents.append(t)
                        pending += 1
                t._pending = pending
                if promote_deps:
                    self._promote_locked(t)
                if pending == 0:
                    self._make_ready(t, inline)
        if group is not None:
            group.add(t)
        self._after(finished, inline)
        return t

    def promote(self, handle: TaskHandle, priority: Priority = Priority.CRITICAL) -> int:
        with self._lock:
            return self._promote_locked(handle, Priority(priority))

    def close(self, *, cancel_pending: bool = True, timeout: float | None = None) -> None:
        """Stop: cancel (or drain) outstanding work, wait for running tasks and their
        done-callbacks, join workers. Idempotent. Must not be called from a task or a
        done-callback of this scheduler."""
        if self.is_worker_thread():
            raise UsageError("Scheduler.close() called from one of its own tasks")
        finished: list[TaskHandle] = []
        with self._lock:
            if self._stop:
                return
            self._closing = True
            if cancel_pending:
                for t in sorted(self._live, key=lambda t: t.id):
                    if t._state in (TaskState.PENDING, TaskState.READY):
                        t.token.cancel()
                        self._set_terminal(t, TaskState.CANCELLED, None, None, None, finished)
                    elif t._state is TaskState.RUNNING:
                        t.token.cancel()
        self._after(finished, [])
        with self._lock:  # not `with self._idle` (see __init__)
            self._idle.wait_for(self._quiescent, timeout)
            self._stop = True
            for cv in self._cv.values():
                cv.notify_all()
        for th in self._threads:
            th.join(timeout)
        self.budget.remove_release_listener(self._on_memory_released)

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals (caller holds self._lock where noted) ---------------------------

    def _queue_of(self, t: TaskHandle) -> Any:
        return _SEQ_QUEUE if self.sequential else t.resource

    def _push(self, t: TaskHandle) -> None:  # locked
        q = self._queue_of(t)
        if q in self._unstarted and not self._stop:
            self._unstarted.discard(q)
            self._start_workers(q)
        t._token_seq += 1
        heapq.heappush(self._heaps[q], (int(t._priority), t.id, t._token_seq, t))
        self._cv[q].notify()

    def _make_ready(self, t: TaskHandle, inline: list[TaskHandle]) -> None:  # locked
        t._state = TaskState.READY
        t.ready_ns = time.perf_counter_ns()
        self._route(t, inline)

    def _route(self, t: TaskHandle, inline: list[TaskHandle]) -> None:  # locked
        """A READY task: an INLINE one starts now if its memory is admitted (else it parks
        until memory is released); any other goes to its resource queue."""
        if t.resource is ResourceClass.INLINE and not self.sequential:
            if self._admit(t):
                self._start(t, None)
                inline.append(t)
            else:
                t._blocked = True
                self._mem_blocked.append(t)
        else:
            self._push(t)

    def _admit(self, t: TaskHandle) -> bool:  # locked
        if not t.mem:
            return True
        res = self.budget.try_reserve_many(t.mem, critical=t._priority is Priority.CRITICAL, label=t.name)
        if res is None:
            return False
        t._reservation = res
        return True

    def _start(self, t: TaskHandle, q: Any) -> None:  # locked
        t._state = TaskState.RUNNING
        t._ran_critical = q is None or t._priority <= self._exempt[q]  # not counted against the cap
        if q is not None:
            self._running[q] += 1
            if not t._ran_critical:
                self._running_noncrit[q] += 1

    def _pick(self, q: Any) -> TaskHandle | None:  # locked
        heap = self._heaps[q]
        while heap:
            prio, _tid, tok, t = heap[0]
            if tok != t._token_seq or t._state is not TaskState.READY:
                heapq.heappop(heap)
                continue
            if prio > self._exempt[q] and self._running_noncrit[q] >= self._noncrit_cap[q]:
                return None  # the remaining entries are speculative too: keep the reserved slot
            heapq.heappop(heap)
            if not self._admit(t):
                t._blocked = True
                self._mem_blocked.append(t)
                continue
            return t
        return None

    def _worker(self, q: Any) -> None:
        cv = self._cv[q]
        me = threading.current_thread().name
        side = self._side if q is ResourceClass.CPU else None
        while True:
            job = None
            woke = False
            with self._lock:
                while True:
                    if side:
                        job = side.popleft()
                        job.state = _SideJob.TAKEN
                        self.side_jobs_run += 1
                        if self._heaps[q]:
                            cv.notify()  # a task's wake-up may have landed here: pass it on
                        break
                    t = self._pick(q)
                    if t is not None:
                        self._start(t, q)
                        break
                    if self._stop:
                        return
                    if woke:
                        self.futile_wakeups += 1
                    self._waiting[q] += 1
                    cv.wait()
                    self._waiting[q] -= 1
                    woke = True
            if job is not None:
                job.run()
                continue
            self._run(t, me, q)

    def _run(self, t: TaskHandle, worker: str, worker_queue: Any = None) -> None:
        t.worker = worker
        t.start_ns = time.perf_counter_ns()
        cpu0 = time.thread_time_ns()
        state, result, exc = TaskState.DONE, None, None
        fn = t._fn
        if t.token.cancelled or fn is None:
            state = TaskState.CANCELLED
        else:
            try:
                ctx = TaskContext(t, tuple(d._result for d in t.deps), t._reservation, worker)
                result = fn(ctx)
            except CancelledError as e:
                state, exc = TaskState.CANCELLED, e
            except BaseException as e:  # noqa: BLE001 - every task must reach a terminal state
                state, exc = TaskState.FAILED, e
        t.end_ns = time.perf_counter_ns()
        t.cpu_ns = time.thread_time_ns() - cpu0
        if t._reservation is not None:
            t._reservation.release()  # outside the lock: the release listener takes it
            t._reservation = None
        self._complete(t, state, result, exc, worker_queue)

    def _complete(self, t: TaskHandle, state: TaskState, result: Any, exc: BaseException | None,
                  worker_queue: Any = None) -> None:
        finished: list[TaskHandle] = []
        inline: list[TaskHandle] = []
        with self._lock:
            q = None if (t.resource is ResourceClass.INLINE and not self.sequential) else self._queue_of(t)
            if q is not None:
                self._running[q] -= 1
                if not t._ran_critical:
                    self._running_noncrit[q] -= 1
                # NOTE: a worker of q finishing here picks again itself, so the place it
                # frees needs no wake-up (tasks made ready below wake one worker each, in
                # _push). Waking every idle worker of q on every completion cost a cold
                # medium load ~470 wake-ups of the capped second I/O worker, each of which
                # found nothing it could start and preempted a CPU worker to find that out
                # (its timeslices per load, from schedstat: 460-480 before, 27-154 now).
                # Load times did not move measurably (A/B, 10 loads each).
                if worker_queue is not q:
                    self._cv[q].notify_all()
            self._set_terminal(t, state, result, exc if state is TaskState.FAILED else None, None, finished)
            if state is TaskState.DONE:
                for d in t._dependents:
                    if d._state is TaskState.PENDING:
                        d._pending -= 1
                        if d._pending == 0:
                            self._make_ready(d, inline)
            else:
                self._cascade_cancel(t, _root(t), finished)
        self._after(finished, inline)

    def _set_terminal(self, t: TaskHandle, state: TaskState, result: Any, exc: BaseException | None,
                      cause: TaskHandle | None, finished: list[TaskHandle]) -> None:  # locked
        t._state = state
        t._result = result
        t._exc = exc
        if cause is not None:
            t.cause = cause
        if t.end_ns is None:
            t.end_ns = time.perf_counter_ns()
        t._fn = None  # drop the closure: it may hold large buffers
        self._live.discard(t)
        self._settling += 1
        ev = TaskEvent(t.id, t.name, t.resource, t._priority, t.worker, t.submit_ns, t.ready_ns, t.start_ns,
                       t.end_ns, state, t.cause.name if t.cause is not None else None, t.cpu_ns, t.kind)
        self._events.append(ev)
        if t._log is not None:
            t._log.record(ev)
        finished.append(t)

    def _cascade_cancel(self, t: TaskHandle, root: TaskHandle, finished: list[TaskHandle]) -> None:  # locked
        stack = list(t._dependents)
        while stack:
            d = stack.pop()
            if d._state.terminal:
                continue
            d.token.cancel()
            if d._state is TaskState.RUNNING:  # cannot happen through dependencies; be safe
                continue
            self._set_terminal(d, TaskState.CANCELLED, None, None, root, finished)
            stack.extend(d._dependents)

    def _after(self, finished: list[TaskHandle], inline: list[TaskHandle]) -> None:
        """Outside the lock: signal completion, run callbacks, then run inline tasks."""
        for t in finished:
            with self._lock:
                callbacks, t._callbacks = t._callbacks, []
                t._signalled = True
                event = t._done
            if event is not None:
                event.set()
            for fn in callbacks:
                _call(fn, t)
            with self._lock:
                self._settling -= 1
                if not self._live and not self._settling:
                    self._idle.notify_all()
        if inline:
            self._run_inline(inline)

    def _run_inline(self, tasks: list[TaskHandle]) -> None:
        tls = self._tls
        if getattr(tls, "draining", False):
            tls.queue.extend(tasks)
            return
        tls.draining = True
        tls.queue = deque(tasks)
        me = threading.current_thread().name
        try:
            while tls.queue:
                self._run(tls.queue.popleft(), me)
        finally:
            tls.draining = False

    def _on_memory_released(self) -> None:
        inline: list[TaskHandle] = []
        with self._lock:
            if not self._mem_blocked:
                return
            blocked, self._mem_blocked = self._mem_blocked, []
            for t in blocked:
                if t._state is not TaskState.READY or not t._blocked:
                    continue
                t._blocked = False
                self._route(t, inline)
        if inline:
            self._run_inline(inline)

    def _promote_locked(self, handle: TaskHandle, to: Priority = Priority.CRITICAL) -> int:
        changed = 0
        stack = [handle]
        seen: set[int] = set()
        while stack:
            t = stack.pop()
            if t.id in seen or t._state.terminal:
                continue
            seen.add(t.id)
            if t._priority > to:
                t._priority = to
                changed += 1
                queued = t.resource is not ResourceClass.INLINE or self.sequential
                if t._state is TaskState.READY and queued:
                    # Re-queue at the new priority (the old heap entry goes stale); a task
                    # parked for memory is retried now, with the critical headroom.
                    t._blocked = False
                    self._push(t)
                # A parked INLINE task keeps waiting; the next release retries it as critical.
            stack.extend(t.deps)
        return changed

    def _cancel(self, t: TaskHandle) -> bool:
        finished: list[TaskHandle] = []
        with self._lock:
            ok = self._cancel_locked(t, finished)
        self._after(finished, [])
        return ok

    def _cancel_locked(self, t: TaskHandle, finished: list[TaskHandle]) -> bool:
        if t._state.terminal:
            return False
        t.token.cancel()
        if t._state is TaskState.RUNNING:
            return True
        self._set_terminal(t, TaskState.CANCELLED, None, None, None, finished)
        self._cascade_cancel(t, t, finished)
        return True

    def _release(self, t: TaskHandle, cancel_if_unused: bool) -> bool:
        finished: list[TaskHandle] = []
        cancelled_it = False
        with self._lock:
            if t._consumers > 0:
                t._consumers -= 1
            if cancel_if_unused:
                orphans: list[TaskHandle] = []
                marked: set[int] = set()
                stack = [t]
                while stack:
                    c = stack.pop()
                    if c.id in marked or c._state.terminal or c._consumers > 0:
                        continue
                    if any(not d._state.terminal and d.id not in marked for d in c._dependents):
                        continue
                    marked.add(c.id)
                    orphans.append(c)
                    stack.extend(c.deps)
                for c in orphans:
                    if self._cancel_locked(c, finished) and c is t:
                        cancelled_it = True
        self._after(finished, [])
        return cancelled_it


def _root(t: TaskHandle) -> TaskHandle:
    """The task whose failure or cancellation a CANCELLED task inherits."""
    return t.cause if t.cause is not None else t
