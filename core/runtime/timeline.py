"""Timeline: the scheduler events of one owner's tasks (a session's), and their totals.

A session passes its timeline to every task it submits (``Scheduler.submit(log=...)``);
the scheduler records each task's :class:`~onnx_prep.core.runtime.scheduler.TaskEvent`
there as the task ends, as well as in its own log. So a session sharing a workspace's
scheduler with other sessions still has exactly its own tasks: the events (task id,
name, kind, resource, priority, worker, submit / ready / start / end times, CPU time,
state), enough to draw a trace, and their running totals by kind and by resource queue,
which the session's :class:`~onnx_prep.core.runtime.stats.RuntimeStats` reports
(:class:`TaskTotals`).
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class TaskTotals:
    """Scheduler tasks of one kind or one resource queue: ended (``tasks``), of which
    started on a worker (``ran``); for those, the time from ready (dependencies done) to
    start (a worker free and its memory admitted), start to end, and thread CPU time."""

    tasks: int = 0
    ran: int = 0
    queue_wait_ns: int = 0
    run_ns: int = 0
    cpu_ns: int = 0

    def since(self, earlier: TaskTotals) -> TaskTotals:
        return TaskTotals(self.tasks - earlier.tasks, self.ran - earlier.ran,
                          self.queue_wait_ns - earlier.queue_wait_ns, self.run_ns - earlier.run_ns,
                          self.cpu_ns - earlier.cpu_ns)

    def to_json(self) -> dict:
        return {"tasks": self.tasks, "ran": self.ran, "queue_wait_ns": self.queue_wait_ns,
                "run_ns": self.run_ns, "cpu_ns": self.cpu_ns}


class Timeline:
    """Events in completion order (the last ``limit`` of them; the totals count every
    one). Thread-safe."""

    def __init__(self, limit: int = 1_000_000) -> None:
        self._events: deque = deque(maxlen=limit)
        self._by_kind: dict[str, list[int]] = {}
        self._by_resource: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def record(self, ev) -> None:
        """Add one terminal task's event (the scheduler calls this under its own lock:
        appends and sums only)."""
        ran = ev.start_ns is not None
        row = (1, int(ran),
               ev.start_ns - (ev.ready_ns if ev.ready_ns is not None else ev.start_ns) if ran else 0,
               ev.end_ns - ev.start_ns if ran else 0,
               ev.cpu_ns or 0)
        kind = ev.kind.value if ev.kind is not None else "other"
        with self._lock:
            self._events.append(ev)
            for table, key in ((self._by_kind, kind), (self._by_resource, ev.resource.value)):
                acc = table.get(key)
                if acc is None:
                    acc = table[key] = [0] * len(row)
                for i, v in enumerate(row):
                    acc[i] += v

    def events(self) -> list:
        """The recorded events, oldest first."""
        with self._lock:
            return list(self._events)

    def by_kind(self) -> dict[str, TaskTotals]:
        """Totals per task kind ("read_source", "prepack", "execute", ...)."""
        with self._lock:
            return {k: TaskTotals(*v) for k, v in self._by_kind.items()}

    def by_resource(self) -> dict[str, TaskTotals]:
        """Totals per resource queue ("io", "cpu", ...): the queue waits."""
        with self._lock:
            return {k: TaskTotals(*v) for k, v in self._by_resource.items()}
