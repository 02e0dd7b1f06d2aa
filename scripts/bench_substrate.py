"""Micro-costs of the runtime substrate: per-task scheduler overhead by resource and
mode, memory admission, and the hot path's readiness check and run-level pin.

    .venv/bin/python scripts/bench_substrate.py [--tasks 20000] [--repeats 5] [--json]

Prints min/median/max over repeats (raw samples with --json). Not a test: figures depend
on the machine and its load; docs/runtime.md quotes one run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from onnx_prep.core.runtime.arenas import Arena, MemoryBudget
from onnx_prep.core.runtime.prepared_store import PreparedObjectStore
from onnx_prep.core.runtime.scheduler import Scheduler, TaskGroup
from onnx_prep.core.plan.task import ResourceClass


class _Buf:
    nbytes = 16

    def release(self) -> None:
        pass


def per_task_us(n: int, resource: ResourceClass, *, chain=False, mem=None, sequential=False) -> float:
    budget = MemoryBudget(1 << 30, {Arena.EXECUTION: 1 << 20})
    s = Scheduler(io_workers=2, cpu_workers=2, sequential=sequential, budget=budget, name="bench")
    try:
        g = TaskGroup()
        prev = None
        t0 = time.perf_counter()
        for _ in range(n):
            deps = [prev] if (chain and prev is not None) else ()
            prev = s.submit(lambda ctx: None, resource=resource, deps=deps, mem=mem, group=g)
        g.wait()
        return (time.perf_counter() - t0) / n * 1e6
    finally:
        s.close()


def hot_path_ns(keys: int, n: int) -> tuple[float, float]:
    st = PreparedObjectStore()
    names = [f"P:w{i}|l|cpu" for i in range(keys)]
    for k in names:
        fut, _ = st.begin_load(k)
        st.publish(k, fut.generation, _Buf())
    view = st.readiness(names)
    assert view.is_ready()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        view.is_ready()
    ready = (time.perf_counter_ns() - t0) / n
    t0 = time.perf_counter_ns()
    for _ in range(n):
        view.pin_if_ready().release()
    pin = (time.perf_counter_ns() - t0) / n
    return ready, pin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    cases = {
        "cpu_independent_us_per_task": dict(resource=ResourceClass.CPU),
        "cpu_chain_us_per_task": dict(resource=ResourceClass.CPU, chain=True),
        "cpu_with_mem_admission_us_per_task": dict(resource=ResourceClass.CPU, mem={Arena.EXECUTION: 64}),
        "inline_chain_us_per_task": dict(resource=ResourceClass.INLINE, chain=True),
        "sequential_us_per_task": dict(resource=ResourceClass.CPU, sequential=True),
    }
    samples: dict[str, list[float]] = {k: [per_task_us(a.tasks, **kw) for _ in range(a.repeats)]
                                       for k, kw in cases.items()}
    hp = [hot_path_ns(200, 20000) for _ in range(a.repeats)]
    samples["readiness_check_ns_200_keys"] = [r for r, _ in hp]
    samples["run_level_pin_and_release_ns_200_keys"] = [p for _, p in hp]
    if a.json:
        print(json.dumps({k: {"min": min(v), "median": statistics.median(v), "max": max(v), "samples": v}
                          for k, v in samples.items()}, indent=2))
        return
    for k, v in samples.items():
        print(f"{k:42s} min {min(v):9.1f}  median {statistics.median(v):9.1f}  max {max(v):9.1f}")


if __name__ == "__main__":
    main()
