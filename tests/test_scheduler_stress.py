"""Randomised task graphs on real threads: the scheduler's invariants hold under
concurrency, failures, cancellations, promotions and a tight memory budget.

Invariants checked for every graph:
- every task reaches exactly one terminal state and logs exactly one event;
- no task starts before all its dependencies ended DONE;
- a task is DONE iff it ran without error and every dependency is DONE;
- a FAILED task's transitive dependents are CANCELLED with a failed/cancelled cause;
- memory peaks stay within the arena limits and everything is returned.
"""
from __future__ import annotations

import random
import threading

import pytest

from onnx_prep.core.runtime.arenas import Arena, MemoryBudget
from onnx_prep.core.runtime.scheduler import Scheduler, TaskGroup, TaskState
from onnx_prep.core.plan.task import Priority, ResourceClass

T = 60
RESOURCES = [ResourceClass.IO, ResourceClass.CPU, ResourceClass.CPU, ResourceClass.INLINE]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("sequential", [False, True])
def test_random_graphs_keep_invariants(seed, sequential):
    rng = random.Random(seed)
    limits = {Arena.PREPARATION: 300, Arena.PREPARED: 400, Arena.EXECUTION: 200}
    budget = MemoryBudget(800, limits)
    name = f"stress-{seed}-{int(sequential)}"
    sched = Scheduler(io_workers=2, cpu_workers=3, budget=budget, sequential=sequential, name=name)
    ran: dict[int, tuple[int, ...]] = {}  # task id -> states of its deps seen at start
    lock = threading.Lock()
    group = TaskGroup()
    tasks = []
    failing: set[int] = set()

    def body(ctx, fail=False):
        with lock:
            ran[ctx.handle.id] = tuple(d.state is TaskState.DONE for d in ctx.handle.deps)
        if fail:
            raise RuntimeError(f"injected failure in {ctx.handle.name}")
        return ctx.handle.id

    for i in range(250):
        ndeps = min(len(tasks), rng.choice([0, 0, 1, 1, 2, 3]))
        deps = rng.sample(tasks[-30:], min(ndeps, len(tasks[-30:]))) if ndeps else []
        fail = rng.random() < 0.04
        mem = {}
        if rng.random() < 0.5:
            mem[rng.choice(list(limits))] = rng.randint(1, 190)
        t = sched.submit(lambda ctx, fail=fail: body(ctx, fail), resource=rng.choice(RESOURCES),
                         priority=rng.choice(list(Priority)), deps=deps, mem=mem, name=f"t{i}", group=group)
        if fail:
            failing.add(t.id)
        tasks.append(t)
        r = rng.random()
        if r < 0.03:
            rng.choice(tasks).cancel()
        elif r < 0.08:
            sched.promote(rng.choice(tasks))
    assert group.wait(T), "random graph did not finish"
    sched.close()
    assert not [t for t in threading.enumerate() if t.name.startswith(name)]

    events = sched.events()
    assert sorted(e.task_id for e in events) == sorted(t.id for t in tasks)  # one event each
    for t in tasks:
        assert t.state.terminal
        if t.id in ran:
            assert all(ran[t.id]), f"{t.name} started before its dependencies were done"
        deps_ok = all(d.state is TaskState.DONE for d in t.deps)
        if t.state is TaskState.DONE:
            assert deps_ok and t.id in ran and t.id not in failing
        if t.state is TaskState.FAILED:
            assert t.id in failing
        if t.state is TaskState.CANCELLED and t.cause is not None:
            assert t.cause.state in (TaskState.FAILED, TaskState.CANCELLED)
        if not deps_ok:
            assert t.state is TaskState.CANCELLED and t.id not in ran
    for arena, lim in limits.items():
        assert budget.peak(arena) <= lim
    assert budget.global_peak <= 800 and budget.global_live == 0
    if not sequential:
        workers = {e.worker for e in events if e.worker and e.resource is not ResourceClass.INLINE}
        assert len(workers) > 1
