"""A load as a Chrome trace-event document (opens in https://ui.perfetto.dev and
chrome://tracing): the picture of one load and its first output, drawn from the
session's own timeline (docs/profile.md, "The trace").

- one process per resource class (``io``, ``mapped``, ``cpu``, ``inline``, ``device``), one thread
  (track) per scheduler worker within it: each task that ran is a complete event
  (``"ph": "X"``) named by its plan id (a run's continuation by its own name,
  ``run-N:stepK``), with args scope, kind, key (the prepared key it publishes),
  bytes (its estimated output bytes), queue wait and CPU time;
- the process ``run steps``: each invocation step of the first forward as a slice on
  the track of the worker that executed it, named by its plan id (``I.k:node``);
- flow events (``"ph": "s"`` / ``"f"``) for the plan's dependencies between tasks
  that ran: session task to session task, session task to the step that consumes
  what it publishes (a step's dependency on the step before is not drawn: the steps
  run in order);
- the process ``load``: session construction and the load as slices, instant events
  at the first step, first output and all session tasks ready, and one counter
  (``"ph": "C"``) per arena with the bytes it held after every change (the budget's
  ``LiveTrace``).

Times are microseconds from the start of session construction.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

__all__ = ["trace_document", "write_trace", "RESOURCE_PIDS"]

LOAD_PID = 1
STEPS_PID = 2
RESOURCE_PIDS = {"io": 3, "cpu": 4, "inline": 5, "device": 6, "mapped": 7}
_STEP_NAME = re.compile(r":step\d+$")


def _us(ns: int, base_ns: int) -> float:
    return (ns - base_ns) / 1e3


def _meta(pid: int, name: str, sort: int) -> list[dict]:
    return [{"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": name}},
            {"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": sort}}]


def trace_document(m: Any, *, label: str = "") -> dict:
    """The trace of a :class:`~onnx_prep.core.profile.load_sample.LoadMeasurement`."""
    base = m.base_ns
    plan = m.plan
    out: list[dict] = []
    for name, pid in (("load", LOAD_PID), ("run steps", STEPS_PID), *RESOURCE_PIDS.items()):
        out += _meta(pid, name, pid)
    tids: dict[tuple[int, str], int] = {}

    def tid(pid: int, worker: str) -> int:
        key = (pid, worker)
        if key not in tids:
            tids[key] = len(tids) + 1
            out.append({"ph": "M", "pid": pid, "tid": tids[key], "name": "thread_name",
                        "args": {"name": worker}})
        return tids[key]

    # where each task ran: plan id -> (pid, tid, start us, end us)
    placed: dict[str, tuple[int, int, float, float]] = {}
    for e in m.events:
        if e.start_ns is None:
            continue  # never ran (cancelled before it started): nothing to draw
        pid = RESOURCE_PIDS.get(e.resource.value, RESOURCE_PIDS["cpu"])
        t = tid(pid, e.worker or "?")
        desc = plan.by_id.get(e.name)
        args: dict[str, Any] = {"kind": None if e.kind is None else e.kind.value,
                                "scope": desc.scope.value if desc is not None else
                                ("invocation" if _STEP_NAME.search(e.name) else None),
                                "key": desc.publishes if desc is not None else None,
                                "bytes": desc.estimated_output_bytes if desc is not None else None,
                                "priority": e.priority.name.lower(),
                                "queue_wait_ms": (e.start_ns - (e.ready_ns or e.start_ns)) / 1e6,
                                "cpu_ms": None if e.cpu_ns is None else e.cpu_ns / 1e6,
                                "state": e.state.value}
        ts, end = _us(e.start_ns, base), _us(e.end_ns, base)
        out.append({"ph": "X", "cat": "task", "name": e.name, "pid": pid, "tid": t, "ts": ts,
                    "dur": max(end - ts, 0.0), "args": args})
        placed[e.name] = (pid, t, ts, end)
    for si, start, end, worker in m.step_log:
        step = plan.steps[si]
        t = tid(STEPS_PID, worker or "?")
        ts, te = _us(start, base), _us(end, base)
        out.append({"ph": "X", "cat": "step", "name": step.task_id, "pid": STEPS_PID, "tid": t, "ts": ts,
                    "dur": max(te - ts, 0.0),
                    "args": {"scope": "invocation", "kind": "execute", "step": si,
                             "actions": list(step.action_range), "node": step.label}})
        placed[step.task_id] = (STEPS_PID, t, ts, te)
    out += _flows(plan, placed)
    out += _load_track(m, base, label)
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"producer": "onnx-prep profile", "model": str(plan.resolved.model_path),
                          "configuration": label}}


def _flows(plan: Any, placed: dict) -> list[dict]:
    """An arrow per plan dependency between two placed tasks, from the producer's end to
    the consumer's start (each end bound to its slice: inside it by a hair)."""
    from onnx_prep.core.plan.task import TaskScope

    out = []
    n = 0
    for task in plan.tasks:
        if task.id not in placed:
            continue
        cpid, ctid, cts, cend = placed[task.id]
        for dep in task.dependencies:
            if dep not in placed or plan.by_id[dep].scope is TaskScope.INVOCATION:
                continue
            ppid, ptid, pts, pend = placed[dep]
            n += 1
            out.append({"ph": "s", "cat": "dependency", "name": "dependency", "id": n,
                        "pid": ppid, "tid": ptid, "ts": max(pts, pend - min(0.5, (pend - pts) / 2))})
            out.append({"ph": "f", "bp": "e", "cat": "dependency", "name": "dependency", "id": n,
                        "pid": cpid, "tid": ctid, "ts": cts + min(0.5, (cend - cts) / 2)})
    return out


def _load_track(m: Any, base: int, label: str) -> list[dict]:
    t = 1
    out = [{"ph": "M", "pid": LOAD_PID, "tid": t, "name": "thread_name", "args": {"name": "invocation"}},
           {"ph": "X", "cat": "load", "name": "session construction", "pid": LOAD_PID, "tid": t,
            "ts": 0.0, "dur": _us(m.t0_ns, base), "args": {"plan_ms": m.sample["plan_ms"]}},
           {"ph": "X", "cat": "load", "name": f"load {label}".strip(), "pid": LOAD_PID, "tid": t,
            "ts": _us(m.t0_ns, base), "dur": _us(max(m.marks.values()), m.t0_ns),
            "args": {k: v for k, v in m.sample.items() if isinstance(v, (int, float)) or v is None}}]
    for name, ns in m.marks.items():
        out.append({"ph": "i", "s": "p", "cat": "load", "name": name.replace("_", " "), "pid": LOAD_PID,
                    "tid": t, "ts": _us(ns, base)})
    for ns, live in m.arena_samples:
        ts = max(_us(ns, base), 0.0)
        for arena, nbytes in live.items():
            out.append({"ph": "C", "cat": "memory", "name": f"{arena} arena bytes", "pid": LOAD_PID,
                        "ts": ts, "args": {"bytes": nbytes}})
    return out


def write_trace(path: Path, doc: dict) -> None:
    """Write ``doc`` to ``path`` atomically (core/io/atomic_file.py: a reader sees the old
    file or the whole new one); a path that cannot be written is a UsageError naming it."""
    from onnx_prep.core.errors import UsageError, Where
    from onnx_prep.core.io.atomic_file import write_atomically

    try:
        write_atomically(Path(path), json.dumps(doc, separators=(",", ":")).encode())
    except OSError as exc:
        raise UsageError(f"cannot write the trace: {exc.strerror}", Where(file=str(path))) from exc
