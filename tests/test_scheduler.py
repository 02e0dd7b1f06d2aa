"""Scheduler: priorities, inheritance, reserved critical capacity, memory admission,
failure propagation, cancellation, shared-task refcounts, sequential mode, shutdown.

Synthetic graphs on real threads. Tasks are held with threading.Event, never sleeps.
"""
from __future__ import annotations

import hashlib
import threading

import pytest

from onnx_prep.core.runtime.arenas import Arena, MemoryBudget
from onnx_prep.core.errors import BudgetError, CancelledError, UsageError
from onnx_prep.core.runtime.scheduler import Scheduler, TaskGroup, TaskState
from onnx_prep.core.plan.task import Priority, ResourceClass

T = 30  # generous timeout for waits that must succeed

CPU, IO, INLINE, DEVICE = ResourceClass.CPU, ResourceClass.IO, ResourceClass.INLINE, ResourceClass.DEVICE
MAPPED = ResourceClass.MAPPED
CRIT, PRE, BG = Priority.CRITICAL, Priority.PREFETCH, Priority.BACKGROUND


def _threads(prefix: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


@pytest.fixture
def make_sched():
    made = []

    def make(*args, **kw):
        kw.setdefault("name", f"t{len(made)}-{id(made)}")
        s = Scheduler(*args, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()
        assert not _threads(s.name), "worker threads survived close()"


def _gate(started: threading.Event | None = None):
    """A task body that blocks until the returned Event is set."""
    release = threading.Event()

    def fn(ctx):
        if started is not None:
            started.set()
        assert release.wait(T)

    return fn, release


def _recorder(order: list, label: str):
    lock = threading.Lock()

    def fn(ctx):
        with lock:
            order.append(label)
        return label

    return fn


def test_dependencies_inputs_and_results(make_sched):
    s = make_sched(io_workers=1, cpu_workers=2)
    a = s.submit(lambda ctx: 2, resource=IO, name="a")
    b = s.submit(lambda ctx: 3, name="b")
    c = s.submit(lambda ctx: ctx.inputs[0] * ctx.inputs[1], deps=[a, b], name="c")
    d = s.submit(lambda ctx: ctx.inputs[0] + 1, deps=[c], resource=INLINE, name="d")
    assert d.result(T) == 7
    assert s.submissions == 4
    assert [t.state for t in (a, b, c, d)] == [TaskState.DONE] * 4
    # The inline task ran on the thread that completed its last dependency.
    assert d.worker == c.worker
    ev = {e.name: e for e in s.events()}
    assert ev["c"].start_ns >= max(ev["a"].end_ns, ev["b"].end_ns)
    assert ev["a"].worker.endswith("-io-0") and ev["a"].resource is IO


def test_events_record_cpu_time_apart_from_waiting(make_sched):
    """cpu_ns is the running thread's CPU time: a task blocked on an event gets almost
    none of its wall time, a task computing gets most of it (the load profile's
    wall-vs-CPU counter rests on this)."""
    import numpy as np

    s = make_sched(io_workers=1, cpu_workers=2)
    started, go = threading.Event(), threading.Event()

    def blocked(ctx):
        started.set()
        assert go.wait(T)

    def compute(ctx):
        x = np.ones((256, 256), dtype=np.float64)
        for _ in range(40):
            x = x @ x / 256.0
        return float(x[0, 0])

    b = s.submit(blocked, name="blocked")
    assert started.wait(T)
    c = s.submit(compute, name="compute")
    assert c.result(T) == 1.0
    go.set()
    assert b.wait(T) and s.wait_idle(T)
    ev = {e.name: e for e in s.events()}
    wall_b = ev["blocked"].end_ns - ev["blocked"].start_ns
    wall_c = ev["compute"].end_ns - ev["compute"].start_ns
    assert wall_b >= wall_c  # it was blocked while the other task computed
    assert ev["blocked"].cpu_ns < wall_b / 4
    assert 0 < ev["compute"].cpu_ns <= wall_c + 1_000_000  # thread clocks tick coarser than perf_counter
    assert ev["compute"].to_json()["cpu_ns"] == ev["compute"].cpu_ns


def test_priority_order_then_fifo(make_sched):
    s = make_sched(io_workers=1, cpu_workers=1)
    gate, release = _gate()
    g = s.submit(gate, name="gate")
    order: list[str] = []
    for label, prio in [("bg1", BG), ("pre1", PRE), ("crit1", CRIT), ("bg2", BG), ("pre2", PRE), ("crit2", CRIT)]:
        s.submit(_recorder(order, label), priority=prio, name=label)
    release.set()
    assert g.wait(T) and s.wait_idle(T)
    assert order == ["crit1", "crit2", "pre1", "pre2", "bg1", "bg2"]


def test_promoted_prefetch_chain_runs_before_other_prefetch_work(make_sched):
    s = make_sched(io_workers=1, cpu_workers=1)
    io_gate, io_release = _gate()
    cpu_gate, cpu_release = _gate()
    s.submit(io_gate, resource=IO, name="io-gate")
    s.submit(cpu_gate, name="cpu-gate")
    order: list[str] = []
    reads = [s.submit(_recorder(order, f"read{i}"), resource=IO, priority=PRE, name=f"read{i}") for i in range(4)]
    packs = [s.submit(_recorder(order, f"pack{i}"), deps=[reads[i]], priority=PRE, name=f"pack{i}")
             for i in range(4)]
    # A run reaches layer 3: its step waits on pack3, whose producer chain inherits CRITICAL.
    step = s.submit(_recorder(order, "step3"), deps=[packs[3]], priority=CRIT, name="step3")
    assert s.promote(step) == 2  # pack3 and read3 changed (step3 already critical)
    assert reads[3].priority is CRIT and packs[3].priority is CRIT and reads[0].priority is PRE
    io_release.set()
    cpu_release.set()
    assert s.wait_idle(T)
    assert order.index("read3") < min(order.index(f"read{i}") for i in range(3))
    assert order.index("step3") < min(order.index(f"pack{i}") for i in range(3))
    assert order.index("pack3") < order.index("step3")


def test_promote_deps_on_submit(make_sched):
    s = make_sched(io_workers=1, cpu_workers=1)
    gate, release = _gate()
    s.submit(gate, resource=IO, name="gate")
    order: list[str] = []
    r0 = s.submit(_recorder(order, "r0"), resource=IO, priority=BG, name="r0")
    r1 = s.submit(_recorder(order, "r1"), resource=IO, priority=BG, name="r1")
    s.submit(_recorder(order, "use1"), deps=[r1], priority=CRIT, promote_deps=True, name="use1")
    assert r1.priority is CRIT and r0.priority is BG
    release.set()
    assert s.wait_idle(T)
    assert order.index("r1") < order.index("r0")


@pytest.mark.parametrize("resource,prio", [(CPU, BG), (IO, BG), (IO, Priority.DEMANDED), (MAPPED, BG)])
def test_reserved_critical_slot(make_sched, resource, prio):
    """Speculative work never takes the reserved worker; on the I/O queue DEMANDED work
    is capped the same way (one storage device does not read faster from more threads)."""
    s = make_sched(io_workers=3, cpu_workers=3, map_workers=3)
    n = s.workers(resource)
    started = threading.Semaphore(0)
    release = threading.Event()
    count = {"started": 0}
    lock = threading.Lock()

    def background(ctx):
        with lock:
            count["started"] += 1
        started.release()
        assert release.wait(T)

    bg = [s.submit(background, resource=resource, priority=prio, name=f"bg{i}") for i in range(n + 2)]
    for _ in range(n - 1):
        assert started.acquire(timeout=T)
    ran = threading.Event()
    crit = s.submit(lambda ctx: ran.set(), resource=resource, priority=CRIT, name="crit")
    assert crit.wait(T) and ran.is_set(), "critical work starved by background tasks"
    with lock:
        assert count["started"] == n - 1  # background never took the reserved worker
    release.set()
    assert all(t.wait(T) for t in bg)
    assert all(t.state is TaskState.DONE for t in bg)


def test_mapped_workers_start_with_the_first_mapped_task(make_sched):
    """A scheduler that maps nothing has no threads for the MAPPED queue; its first
    mapped task starts them, and runs on one of them."""
    s = make_sched(io_workers=2, cpu_workers=2, map_workers=2)
    assert len(_threads(s.name)) == 4 and s.workers(MAPPED) == 2
    worker = s.submit(lambda ctx: ctx.worker, resource=MAPPED, priority=PRE, name="m").result(T)
    assert worker.startswith(f"{s.name}-mapped-")
    assert sorted(_threads(s.name)) == sorted(s.worker_names) and len(s.worker_names) == 6
    with pytest.raises(UsageError, match="map=0"):
        Scheduler(map_workers=0, name="no-map")


def test_a_mapped_read_does_not_wait_behind_source_reads_holding_the_io_queue(make_sched):
    """Both I/O workers held, one by a long CRITICAL source read, one by a speculative
    one, with more reads queued: mapped reads (speculative too) start and finish
    meanwhile, on the mapped queue's workers, while the queued source read still waits."""
    s = make_sched(io_workers=2, cpu_workers=1, map_workers=2)
    crit_started, pre_started = threading.Event(), threading.Event()
    crit_fn, crit_release = _gate(crit_started)
    pre_fn, pre_release = _gate(pre_started)
    try:
        long_read = s.submit(crit_fn, resource=IO, priority=CRIT, name="long source read")
        spec_read = s.submit(pre_fn, resource=IO, priority=PRE, name="speculative source read")
        assert crit_started.wait(T) and pre_started.wait(T)
        queued = s.submit(lambda ctx: None, resource=IO, priority=PRE, name="queued source read")
        mapped = [s.submit(lambda ctx: ctx.worker, resource=MAPPED, priority=prio, name=f"map{i}")
                  for i, prio in enumerate((PRE, Priority.DEMANDED, PRE))]
        assert all(m.wait(T) for m in mapped)
        assert all(m.state is TaskState.DONE and "-mapped-" in m.result() for m in mapped)
        assert long_read.state is TaskState.RUNNING and spec_read.state is TaskState.RUNNING
        assert queued.state is TaskState.READY  # behind the cap on the I/O queue
    finally:
        crit_release.set()
        pre_release.set()
    assert s.wait_idle(T) and queued.state is TaskState.DONE


def test_demanded_mapped_reads_use_every_mapped_worker(make_sched):
    """DEMANDED work passes the mapped queue's cap (as on CPU, unlike IO): two page-ins a
    run will consume run together on the two mapped workers."""
    s = make_sched(io_workers=1, cpu_workers=1, map_workers=2)
    both = threading.Barrier(2, timeout=T)  # breaks (a failure) unless both run at once
    tasks = [s.submit(lambda ctx: both.wait(), resource=MAPPED, priority=Priority.DEMANDED, name=f"d{i}")
             for i in range(2)]
    assert all(t.wait(T) for t in tasks)
    assert [t.state for t in tasks] == [TaskState.DONE] * 2


def test_a_completion_does_not_wake_workers_that_cannot_start_anything(make_sched):
    """Capped I/O (one speculative read at a time on two workers): the worker that
    finishes a read starts the next itself, so the other, idle behind the cap, is not
    woken by every completion only to find nothing it may start."""
    s = make_sched(io_workers=2, cpu_workers=1)
    gate = threading.Event()
    first = s.submit(lambda ctx: gate.wait(T), resource=IO, priority=PRE, name="gate")
    data = bytes(1 << 20)

    def read(ctx):  # ~1 ms of work with the GIL released, like a read
        hashlib.sha256(data).digest()

    rest = [s.submit(read, resource=IO, priority=PRE, name=f"r{i}") for i in range(30)]
    # while the gate holds the capped place, each submission may wake the idle worker once
    # (it finds the cap reached); what counts is what the 31 completions do
    before = s.futile_wakeups
    gate.set()
    assert first.wait(T) and all(t.wait(T) for t in rest)
    assert all(t.state is TaskState.DONE for t in rest)
    assert s.futile_wakeups - before <= 2  # was one per completion (31) before


def test_demanded_work_may_use_the_reserved_worker_but_queues_after_critical(make_sched):
    """A caller blocked in ExecutionHandle.wait() raises what it waits for to DEMANDED:
    it may take the worker speculative work leaves free, yet CRITICAL work queued at
    the same time still goes first."""
    from collections import defaultdict

    from onnx_prep.core.runtime.execution_handle import ExecutionHandle

    s = make_sched(io_workers=1, cpu_workers=2)
    started = threading.Semaphore(0)
    release: defaultdict[str, threading.Event] = defaultdict(threading.Event)
    order: list[str] = []
    lock = threading.Lock()

    def held(ctx):
        name = ctx.handle.name
        with lock:
            order.append(name)
            ev = release[name]
        started.release()
        assert ev.wait(T)

    def let_go(name):
        with lock:
            release[name].set()

    bg = [s.submit(held, priority=BG, name=f"bg{i}") for i in range(3)]
    assert started.acquire(timeout=T)  # bg0 runs; the second worker is held back
    waiter = threading.Thread(target=lambda: ExecutionHandle(shared=[bg[2]], name="w").wait(T))
    waiter.start()
    assert started.acquire(timeout=T)  # the waited-for task took the reserved worker
    assert order == ["bg0", "bg2"]
    assert bg[2].priority is Priority.DEMANDED and bg[1].priority is BG
    # Both workers busy: queue an DEMANDED task, then a CRITICAL one; free one worker.
    aw = s.submit(held, priority=Priority.DEMANDED, name="aw")
    cr = s.submit(held, priority=CRIT, name="cr")
    let_go("bg0")
    assert started.acquire(timeout=T)
    assert order[-1] == "cr"  # critical first, though queued after the awaited task
    let_go("bg2")
    waiter.join(T)
    assert not waiter.is_alive() and bg[2].state is TaskState.DONE
    assert started.acquire(timeout=T)
    assert order[-1] == "aw"  # then awaited work, before the speculative bg1
    for name in ("cr", "aw", "bg1"):
        let_go(name)
    assert all(t.wait(T) for t in (*bg, aw, cr))
    assert order == ["bg0", "bg2", "cr", "aw", "bg1"]


def test_memory_admission_waits_without_holding_a_worker(make_sched):
    budget = MemoryBudget(None, {Arena.PREPARATION: 100})
    s = make_sched(io_workers=1, cpu_workers=2, budget=budget)
    a_started = threading.Event()
    gate_a, release_a = _gate(a_started)
    a = s.submit(gate_a, mem={Arena.PREPARATION: 80}, name="a")
    assert a_started.wait(T)
    b = s.submit(lambda ctx: budget.live(Arena.PREPARATION), mem={Arena.PREPARATION: 50}, name="b")
    c = s.submit(lambda ctx: "c ran", name="c")  # needs no memory: must not queue behind b
    assert c.result(T) == "c ran"
    assert b.state is TaskState.READY
    release_a.set()
    assert b.result(T) == 50  # a's 80 bytes were returned before b was admitted
    assert a.state is TaskState.DONE and a.end_ns <= b.start_ns
    assert budget.peak(Arena.PREPARATION) <= 100 and budget.live(Arena.PREPARATION) == 0


def test_too_big_allocation_fails_at_once_naming_arena_and_sizes(make_sched):
    budget = MemoryBudget(None, {Arena.PREPARED: 1000})
    s = make_sched(io_workers=1, cpu_workers=2, budget=budget)
    big = s.submit(lambda ctx: None, mem={Arena.PREPARED: 4096}, name="prepack big")
    dep = s.submit(lambda ctx: None, deps=[big], name="user")
    assert big.wait(T) and big.state is TaskState.FAILED
    err = big.exception()
    assert isinstance(err, BudgetError)
    assert "prepared" in str(err) and "4,096" in str(err) and "1,000" in str(err) and "prepack big" in str(err)
    assert dep.wait(T) and dep.state is TaskState.CANCELLED and dep.cause is big


def test_tight_budget_completes_and_peaks_stay_under_limits(make_sched):
    # read(i) -> prepack(i) -> step(i) -> step(i+1): each read's output is held (detached)
    # until its prepack is done; prepacks publish into PREPARED which steps then release.
    sizes = [30, 70, 50, 90, 40, 60, 80, 20]
    largest = max(sizes)
    limits = {Arena.PREPARATION: largest + 1, Arena.PREPARED: 2 * largest + 1, Arena.EXECUTION: 17}
    budget = MemoryBudget(sum(v for v in limits.values()), limits)
    s = make_sched(io_workers=2, cpu_workers=2, budget=budget)
    group = TaskGroup()
    prepared: dict[int, object] = {}
    prev = None
    for i, n in enumerate(sizes):
        def read(ctx, i=i):
            return ctx.detach(Arena.PREPARATION)  # the source buffer outlives the read

        def prepack(ctx, i=i):
            ctx.inputs[0].release()  # source consumed
            prepared[i] = ctx.detach(Arena.PREPARED)

        def step(ctx, i=i):
            prepared.pop(i).release()  # last use of the packed weight
            return i

        r = s.submit(read, resource=IO, priority=PRE, mem={Arena.PREPARATION: n}, name=f"read{i}", group=group)
        p = s.submit(prepack, priority=PRE, deps=[r], mem={Arena.PREPARED: n}, name=f"prepack{i}", group=group)
        deps = [p] if prev is None else [p, prev]
        prev = s.submit(step, deps=deps, mem={Arena.EXECUTION: 16}, name=f"step{i}", group=group)
    assert group.wait(T), "tight budget deadlocked"
    assert not group.failures()
    assert all(t.state is TaskState.DONE for t in group.tasks)
    for arena, lim in limits.items():
        assert 0 < budget.peak(arena) <= lim
    assert budget.global_peak <= budget.global_limit and budget.global_live == 0


def test_concurrent_memory_tasks_never_exceed_limit(make_sched):
    budget = MemoryBudget(None, {Arena.EXECUTION: 100})
    s = make_sched(io_workers=1, cpu_workers=4, budget=budget)
    lock = threading.Lock()
    live = {"now": 0, "max": 0}

    def body(ctx):
        n = ctx.reservation.nbytes
        with lock:
            live["now"] += n
            live["max"] = max(live["max"], live["now"])
        with lock:
            live["now"] -= n

    group = TaskGroup(s.submit(body, mem={Arena.EXECUTION: 10 + 7 * (i % 10)}, name=f"t{i}") for i in range(60))
    assert group.wait(T)
    assert live["max"] <= 100 and budget.peak(Arena.EXECUTION) <= 100


def test_failure_cancels_only_dependents(make_sched):
    s = make_sched(io_workers=1, cpu_workers=2)
    group = TaskGroup()

    def boom(ctx):
        raise OSError("disk on fire")

    a = s.submit(boom, resource=IO, name="read A", group=group)
    b = s.submit(lambda ctx: 1, deps=[a], name="prepack A", group=group)
    c = s.submit(lambda ctx: 1, deps=[b], resource=INLINE, name="step A", group=group)
    d = s.submit(lambda ctx: 2, name="read D", group=group)
    e = s.submit(lambda ctx: ctx.inputs[0] + 1, deps=[d], name="step D", group=group)
    assert group.wait(T)
    assert a.state is TaskState.FAILED and isinstance(a.exception(), OSError)
    assert b.state is TaskState.CANCELLED and c.state is TaskState.CANCELLED
    assert b.cause is a and c.cause is a
    assert e.result() == 3 and d.state is TaskState.DONE
    assert group.failures() == [a]
    with pytest.raises(OSError):
        a.result()
    with pytest.raises(CancelledError, match="read A"):
        c.result()
    # A task submitted after its dependency failed is cancelled at once, never run.
    late = s.submit(lambda ctx: pytest.fail("must not run"), deps=[b], name="late")
    assert late.state is TaskState.CANCELLED and late.cause is a
    states = [ev.state for ev in s.events()]
    assert states.count(TaskState.FAILED) == 1 and states.count(TaskState.CANCELLED) == 3


def test_cancel_queued_and_running_tasks(make_sched):
    s = make_sched(io_workers=1, cpu_workers=2)
    started = threading.Event()
    observed = threading.Event()

    def cooperative(ctx):
        started.set()
        assert ctx.token.wait(T)  # cancellable wait
        observed.set()
        ctx.raise_if_cancelled()

    running = s.submit(cooperative, name="running")
    gate, release = _gate()
    blocker = s.submit(gate, resource=IO, name="blocker")
    queued = s.submit(lambda ctx: pytest.fail("cancelled task ran"), resource=IO, name="queued")
    pending = s.submit(lambda ctx: pytest.fail("dependent ran"), deps=[queued], name="pending")
    assert started.wait(T)
    assert queued.cancel() and queued.state is TaskState.CANCELLED
    assert pending.state is TaskState.CANCELLED and pending.cause is queued
    assert running.cancel()
    assert running.wait(T) and observed.is_set() and running.state is TaskState.CANCELLED
    assert not queued.cancel()  # already terminal
    release.set()
    assert blocker.result(T) is None
    assert s.wait_idle(T) and s.live_tasks() == 0


def test_running_task_ignoring_cancel_keeps_its_outcome(make_sched):
    s = make_sched(io_workers=1, cpu_workers=1)
    started = threading.Event()
    gate, release = _gate(started)
    t = s.submit(lambda ctx: (gate(ctx), "finished")[1], name="stubborn")
    assert started.wait(T)
    assert t.cancel()
    release.set()
    assert t.result(T) == "finished" and t.token.cancelled


def test_shared_task_cancelled_only_when_last_consumer_releases(make_sched):
    s = make_sched(io_workers=1, cpu_workers=2)
    gate, release = _gate()
    g = s.submit(gate, resource=IO, name="gate")
    read = s.submit(lambda ctx: None, resource=IO, deps=[g], name="read W")
    pack = s.submit(lambda ctx: None, deps=[read], name="prepack W")
    for t in (read, pack):
        t.retain()  # consumer 1: eager preparation
    pack.retain()  # consumer 2: run 1
    run1 = s.submit(lambda ctx: None, deps=[pack], name="run1 step")
    run1.cancel()  # run 1 cancels its own task first, then releases its interest
    assert not pack.release()
    assert pack.state is TaskState.PENDING and pack.consumers == 1
    # Run 2 depends on pack without holding interest itself: a live dependent keeps it alive.
    run2 = s.submit(lambda ctx: "ok", deps=[pack], name="run2 step")
    assert not pack.release() and pack.state is TaskState.PENDING
    # The eager-preparation handle also gives up: pack is still needed by run 2.
    assert not read.release()
    assert read.state is TaskState.PENDING
    release.set()
    assert run2.result(T) == "ok"

    # Now the orphan case: nobody else needs it, so release cancels it and its shared producer.
    g2_gate, g2_release = _gate()
    g2 = s.submit(g2_gate, resource=IO, name="gate2")
    read2 = s.submit(lambda ctx: pytest.fail("orphan read ran"), resource=IO, deps=[g2], name="read V")
    pack2 = s.submit(lambda ctx: pytest.fail("orphan prepack ran"), deps=[read2], name="prepack V")
    read2.retain()
    pack2.retain()
    read2.release(cancel_if_unused=False)  # the producer is now only shared through pack2
    assert read2.state is TaskState.PENDING
    assert pack2.release()
    assert pack2.state is TaskState.CANCELLED and read2.state is TaskState.CANCELLED
    g2_release.set()
    assert s.wait_idle(T)


def test_sequential_mode_runs_one_task_at_a_time(make_sched):
    s = make_sched(io_workers=4, cpu_workers=4, device_queues=1, sequential=True)
    lock = threading.Lock()
    state = {"now": 0, "max": 0}
    threads: set[str] = set()

    def body(ctx):
        with lock:
            state["now"] += 1
            state["max"] = max(state["max"], state["now"])
            threads.add(threading.current_thread().name)
        with lock:
            state["now"] -= 1
        return sum(ctx.inputs) + 1

    group = TaskGroup()
    layer = [s.submit(body, resource=r, name=f"root{i}", group=group)
             for i, r in enumerate([IO, CPU, DEVICE, INLINE, IO, CPU])]
    for depth in range(4):
        layer = [s.submit(body, resource=[IO, CPU, INLINE, DEVICE][(depth + j) % 4], deps=layer[j:j + 2],
                          name=f"d{depth}-{j}", group=group) for j in range(len(layer) - 1)]
    assert group.wait(T)
    assert all(t.state is TaskState.DONE for t in group.tasks)
    assert state["max"] == 1 and len(threads) == 1
    assert threads == set(s.worker_names) and len(s.worker_names) == 1
    ev = sorted(s.events(), key=lambda e: e.start_ns)
    assert all(a.end_ns <= b.start_ns for a, b in zip(ev, ev[1:], strict=False))


def test_device_work_needs_a_device_queue(make_sched):
    s = make_sched(io_workers=1, cpu_workers=1)
    with pytest.raises(UsageError, match="device"):
        s.submit(lambda ctx: None, resource=DEVICE, name="upload")


def test_callback_errors_do_not_break_the_scheduler(make_sched, caplog):
    s = make_sched(io_workers=1, cpu_workers=1)
    t = s.submit(lambda ctx: 1, name="a")
    t.add_done_callback(lambda h: 1 / 0)
    assert t.result(T) == 1
    seen = []
    t.add_done_callback(seen.append)  # already terminal: called at once
    assert seen == [t]
    assert s.submit(lambda ctx: 2, name="b").result(T) == 2


def test_close_cancels_pending_joins_workers_and_refuses_new_work():
    name = "close-test"
    s = Scheduler(io_workers=2, cpu_workers=2, name=name)
    assert len(_threads(name)) == 4
    started = threading.Event()

    def cooperative(ctx):
        started.set()
        ctx.token.wait(T)
        ctx.raise_if_cancelled()

    running = s.submit(cooperative, name="running")
    assert started.wait(T)
    io_started = threading.Event()

    def io_cooperative(ctx):
        io_started.set()
        ctx.token.wait(T)
        ctx.raise_if_cancelled()

    g = s.submit(io_cooperative, resource=IO, name="read")
    pending = s.submit(lambda ctx: pytest.fail("ran after close"), deps=[g], name="pending")
    assert io_started.wait(T)
    s.close()
    assert running.state is TaskState.CANCELLED and g.state is TaskState.CANCELLED
    assert pending.state is TaskState.CANCELLED
    assert _threads(name) == []
    with pytest.raises(UsageError, match="closed"):
        s.submit(lambda ctx: None)
    s.close()  # idempotent


def test_a_timeline_gets_its_owners_events_with_their_kinds(make_sched):
    """Two owners on one scheduler: each timeline has exactly its own tasks, their kinds,
    and totals whose queue wait is the events' ready-to-start time."""
    from onnx_prep.core.plan.task import TaskKind
    from onnx_prep.core.runtime.timeline import Timeline

    s = make_sched(io_workers=1, cpu_workers=1)
    mine, theirs = Timeline(), Timeline()
    gate = threading.Event()
    first = s.submit(lambda ctx: gate.wait(T), resource=IO, name="r1", kind=TaskKind.READ_SOURCE, log=mine)
    queued = s.submit(lambda ctx: 1, resource=IO, name="r2", kind=TaskKind.READ_SOURCE, log=mine)
    packed = s.submit(lambda ctx: 2, deps=[first], name="p", kind=TaskKind.PREPACK, log=mine)
    other = s.submit(lambda ctx: 3, name="x", log=theirs)  # no kind given
    gate.set()
    for h in (first, queued, packed, other):
        h.result(T)
    assert s.wait_idle(T)
    ev = {e.name: e for e in mine.events()}
    assert set(ev) == {"r1", "r2", "p"} and [e.name for e in theirs.events()] == ["x"]
    assert ev["r1"].kind is TaskKind.READ_SOURCE and ev["p"].kind is TaskKind.PREPACK
    assert theirs.events()[0].kind is None and theirs.by_kind()["other"].tasks == 1
    assert ev["r2"].start_ns >= ev["r1"].end_ns  # one I/O worker: r2 queued behind r1
    by_kind = mine.by_kind()
    assert by_kind["read_source"].tasks == by_kind["read_source"].ran == 2
    assert by_kind["read_source"].queue_wait_ns == sum(ev[n].start_ns - ev[n].ready_ns for n in ("r1", "r2"))
    assert by_kind["read_source"].queue_wait_ns >= ev["r1"].end_ns - ev["r2"].ready_ns
    assert mine.by_resource()["io"].run_ns == sum(ev[n].end_ns - ev[n].start_ns for n in ("r1", "r2"))
    assert mine.by_resource()["cpu"].tasks == 1
    assert ev["p"].to_json()["kind"] == "prepack"
    # the scheduler's own log has every task
    assert {e.name for e in s.events()} >= {"r1", "r2", "p", "x"}
