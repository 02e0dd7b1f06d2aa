"""ExecutionHandle: the one handle type returned by ``prepare_async()`` and ``run_async()``.

docs/design.md, "Sessions and handles". A handle tracks one *submission*: the scheduler
tasks it owns (invocation tasks, created for it alone) and the shared session tasks it
consumes (prepared-object producers that other submissions may consume too).

Contract (stable)
-----------------

``ExecutionHandle(owned=(), shared=(), *, name="", keepalive=None, stats=None)``
    Takes ``owned`` :class:`TaskHandle`\\ s and ``shared`` ones; calls ``retain()`` on each
    shared task (a consumer reference). ``add(task, *, shared=False)`` adds more while the
    submission is live (a cold-path continuation adds its next steps from inside one of
    the submission's running tasks, so the submission cannot finish in between).
    ``keepalive`` holds borrowed objects (the RuntimeContext, caller inputs) for as long
    as the handle lives.

``ExecutionHandle.completed(*, name="", error=None, failing_task=None)``
    An already-finished handle with no scheduler task (the hot path: zero submissions).

``wait(timeout=None) -> None``
    Returns only when every task of the submission is terminal. Raises
    :class:`TaskFailedError` chained (``__cause__``) to the first error (earliest failing
    task), :class:`CancelledError` when the submission was cancelled (or lost a task to
    cancellation) without a failure, :class:`TimeoutError` if ``timeout`` expires first.
    Priority inheritance: the tasks it still waits for (and their producers) are raised
    to DEMANDED, so they may use every worker, not only the ones left to speculative work.
``is_ready() -> bool`` — every task terminal (non-blocking).
``cancel() -> None`` — a no-op once the submission is finished; else cooperative: cancels
    the owned tasks (queued ones never run, running ones see their token), then releases
    this submission's interest in each shared task; a shared task is cancelled only when
    no other consumer (handle or live dependent) remains. Idempotent.
``status() -> ExecutionStatus`` — state (RUNNING / DONE / FAILED / CANCELLED), failing task,
    its error, suppressed task names (cancelled because of the failure), cancelled task
    names, counts per task state.

Known gap: when an owned task fails, the handle still waits for the shared tasks it
retained (they are not cancelled: the session will want them); only ``cancel()`` lets
them go early.

``stats() -> RuntimeStats | None`` — once the submission is done, the record over it
    (core/runtime/stats.py; a session's ``run_async`` and ``prepare_async`` handles give
    one), None for a handle that records none; a UsageError while it is running. Its
    figures are taken before ``wait()`` can return, so it is there once ``wait()`` returns.
    The submitter's part: ``ExecutionHandle(..., stats=fn)``: ``fn()`` takes the figures,
    called once when the submission becomes terminal, before anyone waiting can see it
    finish, and returns the record or (cheaper for a run nobody asks about) a function
    that makes it on the first ``stats()``; ``completed(stats=...)`` likewise for an
    already-finished handle.

``add_finalizer(fn)`` — ``fn()`` runs once, when the submission becomes terminal (on the
    thread completing its last task, or at once). Use it for run-level cleanup such as
    unpinning; it must not reference the handle (see below).

Destroying a live handle WAITS (docs/design.md, "Sessions and handles"): tasks may still
reference the RuntimeContext and caller-owned inputs, so ``__del__`` blocks until every
task is terminal, ignoring errors (call ``wait()`` to see them). Exception: on a thread of
the scheduler itself (a worker or an inline task) or inside the scheduler's lock (a GC
run), where waiting could deadlock, ``__del__`` cancels instead (from a short-lived helper
thread, so it never takes a lock the collecting thread holds). Prefer
``with session.run_async(ctx) as h:`` — ``__exit__`` waits and raises the submission's
error unless another exception is already propagating. Internal callbacks reference only
the handle's tracker, never the handle, so dropping the last reference does trigger
``__del__``.
"""
from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from onnx_prep.core.errors import (
    EXIT_INTERNAL,
    CancelledError,
    OnnxPrepError,
    TaskFailedError,
    UsageError,
    Where,
    log_exception,
)
from onnx_prep.core.runtime.scheduler import TaskHandle, TaskState, _call

# How often a main thread that waits without a timeout wakes to run its signal handlers
# (Ctrl-C ends the process within this, docs/cli.md).
SIGNAL_POLL_S = 0.1


__all__ = ["ExecutionHandle", "ExecutionStatus", "SubmissionState"]


class SubmissionState(enum.Enum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class ExecutionStatus:
    state: SubmissionState
    failing_task: str | None = None
    error: BaseException | None = None
    suppressed: tuple[str, ...] = ()
    cancelled: tuple[str, ...] = ()
    counts: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "state": self.state.value,
            "failing_task": self.failing_task,
            "error": None if self.error is None else f"{type(self.error).__name__}: {self.error}",
            "suppressed": list(self.suppressed),
            "cancelled": list(self.cancelled),
            "counts": dict(self.counts),
        }


class _Tracker:
    """The mutable part of a handle, referenced by task callbacks (never the handle)."""

    def __init__(self) -> None:
        # Taken as ``with self.lock``, never ``with self.cond``: Condition.__enter__ is
        # Python code, so a Ctrl-C raised in it right after its acquire (the main thread
        # waiting in wait()) leaves the lock held, and every worker that ends a task of
        # the submission blocked on it for good; a C lock's ``with`` has no such gap.
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.members: dict[int, tuple[TaskHandle, bool]] = {}  # id -> (task, shared)
        self.pending: set[int] = set()
        self.held: dict[int, TaskHandle] = {}  # shared tasks whose interest we hold
        self.finalizers: list[Callable[[], None]] = []
        self.building = True  # no finishing while the constructor is still adding tasks
        self.finishing = False  # the last task ended: taking the record, then finished
        self.finished = False
        self.capture: Callable[[], Any] | None = None  # makes the submission's stats record
        self.stats: Any = None
        self.cancel_requested = False

    def add(self, task: TaskHandle, shared: bool) -> None:
        with self.lock:
            if self.finished or self.finishing:
                raise UsageError(f"task {task.name!r} added to a finished submission")
            if task.id in self.members:
                return
            self.members[task.id] = (task, shared)
            self.pending.add(task.id)
            if shared:
                self.held[task.id] = task
        if shared:
            task.retain()
        task.add_done_callback(self.on_done)

    def on_done(self, task: TaskHandle) -> None:
        with self.lock:
            self.pending.discard(task.id)
        self.check_finish()

    def drop(self, task: TaskHandle) -> None:
        """Stop waiting for a shared task we released without cancelling it."""
        with self.lock:
            self.members.pop(task.id, None)
            self.pending.discard(task.id)
        self.check_finish()

    def check_finish(self) -> None:
        """Finish once every member is terminal: release held interest, run finalizers."""
        with self.lock:
            if self.pending or self.finished or self.finishing or self.building:
                return
            self.finishing = True
            capture = self.capture
        if capture is not None:  # before any waiter sees the end, outside the condition's lock
            try:
                stats = capture()
            except Exception:  # a record that cannot be made must not keep the handle running
                log_exception(__name__, "stats of a submission could not be taken")
                stats = None
        with self.lock:
            if capture is not None:
                self.stats = stats
            self.finished = True
            self.cond.notify_all()
            held, self.held = list(self.held.values()), {}
            finalizers, self.finalizers = self.finalizers, []
        for t in held:
            t.release(cancel_if_unused=False)  # terminal anyway: keep the counts honest
        for fn in finalizers:
            _call(fn)

    def tasks(self) -> list[TaskHandle]:
        with self.lock:
            return [t for t, _ in self.members.values()]


class ExecutionHandle:
    """See the module docstring for the contract."""

    def __init__(self, owned: Iterable[TaskHandle] = (), shared: Iterable[TaskHandle] = (), *,
                 name: str = "", keepalive: Any = None, stats: Callable[[], Any] | None = None) -> None:
        self.name = name
        self.keepalive = keepalive
        self._tracker = _Tracker()
        self._tracker.capture = stats
        self._scheduler = None
        self._preset: ExecutionStatus | None = None
        for t in owned:
            self.add(t)
        for t in shared:
            self.add(t, shared=True)
        self._tracker.building = False
        self._tracker.check_finish()  # an empty (or already terminal) submission finishes now

    @classmethod
    def completed(cls, *, name: str = "", error: BaseException | None = None,
                  failing_task: str | None = None, stats: Any = None) -> ExecutionHandle:
        h = cls(name=name)
        h._tracker.stats = stats
        if error is not None:
            h._preset = ExecutionStatus(SubmissionState.FAILED, failing_task or name, error)
        return h

    # -- building -------------------------------------------------------------------------

    def add(self, task: TaskHandle, *, shared: bool = False) -> None:
        if self._scheduler is None:
            self._scheduler = task._sched
        self._tracker.add(task, shared)

    def stats(self):
        """The submission's RuntimeStats once it is done (None if it records none)."""
        tracker = self._tracker
        with tracker.lock:
            if not tracker.finished:
                raise UsageError(f"submission {self.name!r} is still running: its stats come when it is done",
                                 hint="wait() first")
            if callable(tracker.stats):  # figures taken at the end: the record is made once, now
                tracker.stats = tracker.stats()
            return tracker.stats

    def add_finalizer(self, fn: Callable[[], None]) -> None:
        tracker = self._tracker
        with tracker.lock:
            if not tracker.finished:
                tracker.finalizers.append(fn)
                return
        _call(fn)

    # -- observation ------------------------------------------------------------------------

    def is_ready(self) -> bool:
        return self._tracker.finished

    def _wait_terminal(self, timeout: float | None) -> bool:
        tracker = self._tracker
        if timeout is None and threading.current_thread() is threading.main_thread():
            # A lock wait without a timeout is not woken by SIGINT when the signal lands on
            # a worker thread (the main thread would run the handler only once the task
            # ends, after a long op: never, for a huge Loop). Waking every SIGNAL_POLL_S
            # lets the main thread run its handler, so Ctrl-C raises here within that.
            with tracker.lock:
                while not tracker.cond.wait_for(lambda: tracker.finished, SIGNAL_POLL_S):
                    pass
                return True
        with tracker.lock:
            return tracker.cond.wait_for(lambda: tracker.finished, timeout)

    def wait(self, timeout: float | None = None) -> None:
        try:
            if not self._tracker.finished:
                self._inherit_priority()
            finished = self._wait_terminal(timeout)
        except KeyboardInterrupt:
            # Ctrl-C while waiting: what has not started never will; a running reference
            # op notices the cancellation between its iterations (core/ops/reference.py).
            self.cancel()
            raise
        if not finished:
            raise TimeoutError(f"submission {self.name!r} not finished after {timeout}s")
        st = self.status()
        if st.state is SubmissionState.FAILED:
            raise _task_failed(st)
        if st.state is SubmissionState.CANCELLED:
            first = st.cancelled[0] if st.cancelled else None
            raise CancelledError(f"submission {self.name!r} was cancelled"
                                 + (f" (first cancelled task: {first!r})" if first else ""))

    def _inherit_priority(self) -> None:
        """Priority inheritance for a blocked caller: what this handle still waits for
        (and its producers) runs at least at DEMANDED, so it may use every worker."""
        from onnx_prep.core.plan.task import Priority

        for t in self._tracker.tasks():
            if not t.state.terminal and t.priority > Priority.DEMANDED:
                t.promote(Priority.DEMANDED)

    def status(self) -> ExecutionStatus:
        if self._preset is not None:
            return self._preset
        tracker = self._tracker
        tasks = tracker.tasks()
        counts = {s.value: 0 for s in TaskState}
        failed: list[TaskHandle] = []
        suppressed: list[str] = []
        cancelled: list[str] = []
        for t in tasks:
            counts[t.state.value] += 1
            if t.state is TaskState.FAILED:
                failed.append(t)
            elif t.state is TaskState.CANCELLED:
                if t.cause is not None and t.cause.state is TaskState.FAILED:
                    suppressed.append(t.name)
                    failed.append(t.cause)  # a producer outside the submission failed
                else:
                    cancelled.append(t.name)
        with tracker.lock:
            finished = tracker.finished
            cancel_requested = tracker.cancel_requested
        if not finished:
            return ExecutionStatus(SubmissionState.RUNNING, counts=counts, suppressed=tuple(suppressed),
                                   cancelled=tuple(cancelled))
        if failed:
            first = min(failed, key=lambda t: (t.end_ns or 0, t.id))
            return ExecutionStatus(SubmissionState.FAILED, first.name, first._exc,
                                   tuple(suppressed), tuple(cancelled), counts)
        if cancelled or cancel_requested:
            return ExecutionStatus(SubmissionState.CANCELLED, None, None, (), tuple(cancelled), counts)
        return ExecutionStatus(SubmissionState.DONE, counts=counts)

    @property
    def tasks(self) -> list[TaskHandle]:
        return self._tracker.tasks()

    # -- control -----------------------------------------------------------------------------

    def cancel(self) -> None:
        _cancel_submission(self._tracker)

    # -- lifetime ----------------------------------------------------------------------------

    def __enter__(self) -> ExecutionHandle:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.wait()
        else:
            self._wait_terminal(None)

    def __del__(self) -> None:
        try:
            tracker = self._tracker
        except AttributeError:  # __init__ failed
            return
        try:
            if tracker.finished or tracker.building:
                return  # (building: the constructor raised, a Ctrl-C say; it never finishes)
            sched = self._scheduler
            if sched is not None and sched.is_worker_thread():
                # Cannot wait here (a worker, an inline task, or the GC inside a scheduler
                # lock): cancel from a short-lived thread that holds no lock.
                threading.Thread(target=_cancel_submission, args=(tracker,), daemon=True,
                                 name=f"{sched.name}-handle-cancel").start()
                return
            self._wait_terminal(None)
        except Exception:  # pragma: no cover - never raise from a finalizer
            pass

    def __repr__(self) -> str:
        return f"ExecutionHandle({self.name!r}, {self.status().state.value})"


def _cancel_submission(tracker: _Tracker) -> None:
    with tracker.lock:
        if tracker.finished or tracker.finishing:
            return  # nothing left to stop; the outcome stands
        tracker.cancel_requested = True
        owned = [t for t, shared in tracker.members.values() if not shared]
        held, tracker.held = list(tracker.held.values()), {}
    for t in owned:  # first our own tasks, so they stop counting as live dependents
        t.cancel()
    for t in held:
        if not t.release() and not t.state.terminal:
            tracker.drop(t)  # someone else still needs it: not ours to wait for


def _task_failed(st: ExecutionStatus) -> TaskFailedError:
    """The error a wait raises for a failed submission. A task's own OnnxPrepError (bad
    input: a damaged cache entry, a changed source, a device call) says what is wrong
    and where in its own words, and is what the user reads; anything else is named with
    the task it broke. ``task`` (the failing task's name) and ``__cause__`` keep both
    for logs and ``--debug``."""
    err = st.error
    where = err.where if isinstance(err, OnnxPrepError) else Where()
    exit_code = err.exit_code if isinstance(err, OnnxPrepError) else EXIT_INTERNAL
    hint = err.hint if isinstance(err, OnnxPrepError) else None
    if isinstance(err, OnnxPrepError) and not isinstance(err, TaskFailedError):
        msg = err.message
    else:
        msg = f"task {st.failing_task!r} failed: {type(err).__name__}: "
        msg += err.message if isinstance(err, OnnxPrepError) else str(err)
        if st.suppressed:
            msg += f" ({len(st.suppressed)} dependent task(s) cancelled)"
    e = TaskFailedError(msg, where, hint=hint, exit_code=exit_code)
    e.task = st.failing_task
    e.__cause__ = err
    return e
