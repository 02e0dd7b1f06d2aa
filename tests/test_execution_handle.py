"""ExecutionHandle over the scheduler and the prepared-object store: wait / is_ready /
cancel / status, failure propagation, shared-task consumer counts, destruction rule.

``MiniSession`` wires the substrate the way a session does (shared read -> prepack chains
publishing into the store; a run = a chain of steps that pin the weights they consume),
with Event-gated hooks instead of sleeps. It is a test harness, not the real session.
"""
from __future__ import annotations

import threading

import pytest

from onnx_prep.core.runtime.arenas import Arena, MemoryBudget
from onnx_prep.core.errors import CancelledError, ExternalDataError, TaskFailedError, UsageError, Where
from onnx_prep.core.runtime.execution_handle import ExecutionHandle, SubmissionState
from onnx_prep.core.runtime.prepared_store import PreparedObjectStore, ResidencyState
from onnx_prep.core.runtime.scheduler import Scheduler, TaskState
from onnx_prep.core.plan.task import Priority, ResourceClass

T = 30


class Buf:
    def __init__(self, reservation) -> None:
        self.reservation = reservation
        self.nbytes = reservation.nbytes

    def release(self) -> None:
        self.reservation.release()


class MiniSession:
    def __init__(self, sched: Scheduler, store: PreparedObjectStore, weights: list[str], nbytes: int = 64):
        self.sched, self.store, self.weights, self.nbytes = sched, store, weights, nbytes
        self.read_hooks: dict[str, object] = {}  # key -> fn(ctx) run inside the read task
        self.step_hooks: dict[int, object] = {}  # step index -> fn(ctx)
        self.session_tasks: dict[str, object] = {}
        self.step_log: list[int] = []
        self.settle_lock = threading.Lock()

    def _read(self, key):
        def fn(ctx):
            fut, owner = self.store.begin_load(key)
            if not owner:
                return None
            try:
                hook = self.read_hooks.get(key)
                if hook is not None:
                    hook(ctx)
                ctx.raise_if_cancelled()
            except CancelledError:
                self.store.abandon(key, fut.generation)
                raise
            except BaseException as e:
                self.store.fail(key, fut.generation, e)
                raise
            return (fut.generation, ctx.detach(Arena.PREPARATION))
        return fn

    def _prepack(self, key):
        def fn(ctx):
            loaded = ctx.inputs[0]
            if loaded is None:
                return None
            gen, source = loaded
            self.store.mark_preparing(key, gen)
            source.release()
            self.store.publish(key, gen, Buf(ctx.detach(Arena.PREPARED)))
        return fn

    def session_task(self, key):
        t = self.session_tasks.get(key)
        if t is not None and t.state not in (TaskState.FAILED, TaskState.CANCELLED):
            return t
        r = self.sched.submit(self._read(key), resource=ResourceClass.IO, priority=Priority.PREFETCH,
                              mem={Arena.PREPARATION: self.nbytes}, name=f"read {key}")
        p = self.sched.submit(self._prepack(key), deps=[r], priority=Priority.PREFETCH,
                              mem={Arena.PREPARED: self.nbytes}, name=f"prepack {key}")
        # Both ends: the read may finish after its prepack was already cancelled.
        r.add_done_callback(lambda _: self._chain_ended(key, r, p))
        p.add_done_callback(lambda _: self._chain_ended(key, r, p))
        self.session_tasks[key] = p
        return p

    def _chain_ended(self, key, read, prepack):
        """A load spans two tasks: if the chain stopped after the read, settle the store
        entry and return the source bytes (the pattern the session must follow). Runs
        from the done-callbacks of both tasks; acts once both are terminal (idempotent)."""
        if not (read.state.terminal and prepack.state.terminal):
            return
        if prepack.state is TaskState.DONE or read.state is not TaskState.DONE or read.result() is None:
            return
        gen, source = read.result()
        source.release()
        cause = prepack.cause if prepack.cause is not None else prepack
        error = cause.exception(0) if cause.state is TaskState.FAILED else None
        with self.settle_lock:  # both callbacks may get here; the first settles the load
            if self.store.generation(key) == gen and self.store.state(key) in (
                    ResidencyState.LOADING, ResidencyState.PREPARING):
                if error is None:
                    self.store.abandon(key, gen)
                else:
                    self.store.fail(key, gen, error)

    def prepare_async(self) -> ExecutionHandle:
        return ExecutionHandle(shared=[self.session_task(k) for k in self.weights], name="prepare")

    def run_async(self) -> ExecutionHandle:
        shared = [self.session_task(k) for k in self.weights]
        steps, prev = [], None
        for i, key in enumerate(self.weights):
            def step(ctx, i=i, key=key):
                pins = self.store.pin_many([key])  # pinned from dispatch until the step completes
                assert pins is not None, f"step {i} found {key} not resident"
                with pins:
                    hook = self.step_hooks.get(i)
                    if hook is not None:
                        hook(ctx)
                    ctx.raise_if_cancelled()
                    self.step_log.append(i)
                    return pins[key].generation
            deps = [shared[i]] + ([prev] if prev is not None else [])
            prev = self.sched.submit(step, deps=deps, priority=Priority.CRITICAL, name=f"step {i}",
                                     mem={Arena.EXECUTION: 8}, promote_deps=True)
            steps.append(prev)
        return ExecutionHandle(owned=steps, shared=shared, name="run")


def _threads(prefix):
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


@pytest.fixture
def env(request):
    name = f"eh-{request.node.name}"[:40]
    budget = MemoryBudget(None, {Arena.PREPARATION: 1024, Arena.PREPARED: 4096, Arena.EXECUTION: 64})
    sched = Scheduler(io_workers=2, cpu_workers=2, budget=budget, name=name)
    store = PreparedObjectStore()
    sess = MiniSession(sched, store, [f"w{i}" for i in range(4)])
    yield sess
    sched.close()
    assert not _threads(name), "worker threads survived close()"
    assert budget.global_live == store.resident_bytes


def _assert_quiescent(sess: MiniSession):
    assert sess.sched.wait_idle(T)
    assert sess.sched.live_tasks() == 0
    assert sess.store.total_pins == 0
    for k in sess.weights:
        assert sess.store.state(k) not in (ResidencyState.LOADING, ResidencyState.PREPARING)


def _hold_until_cancelled(started: threading.Event):
    def hook(ctx):
        started.set()
        assert ctx.token.wait(T)
    return hook


def test_run_completes_and_status_is_done(env):
    h = env.run_async()
    h.wait(T)
    assert h.is_ready()
    st = h.status()
    assert st.state is SubmissionState.DONE and st.failing_task is None and not st.suppressed
    assert st.counts["done"] == 8
    assert env.step_log == [0, 1, 2, 3]
    _assert_quiescent(env)
    # Prepare after the run: every session task is already done; nothing new runs.
    p = env.prepare_async()
    assert p.is_ready()
    p.wait()


def test_failure_cancels_only_dependents_and_wait_reraises(env):
    def bad_read(ctx):
        raise ExternalDataError("short read", Where(tensor="w2", file="model.bin", offset=4096))

    env.read_hooks["w2"] = bad_read
    h = env.run_async()
    with pytest.raises(TaskFailedError) as ei:
        h.wait(T)
    err = ei.value
    assert isinstance(err.__cause__, ExternalDataError)
    assert str(err).startswith("short read") and err.task == "read w2" and err.where.offset == 4096
    st = h.status()
    assert st.state is SubmissionState.FAILED and st.failing_task == "read w2"
    assert set(st.suppressed) == {"prepack w2", "step 2", "step 3"}
    assert env.step_log == [0, 1]  # independent work completed
    assert all(env.store.is_resident(k) for k in ("w0", "w1", "w3"))
    assert env.store.state("w2") is ResidencyState.FAILED
    _assert_quiescent(env)
    # The next run retries the failed weight through a new generation.
    env.read_hooks.clear()
    h2 = env.run_async()
    h2.wait(T)
    assert env.store.generation("w2") == 2 and env.store.generation("w0") == 1


def test_step_failure_is_per_run(env):
    env.step_hooks[1] = lambda ctx: 1 / 0
    h = env.run_async()
    with pytest.raises(TaskFailedError, match="step 1.*ZeroDivisionError") as ei:
        h.wait(T)
    assert isinstance(ei.value.__cause__, ZeroDivisionError)
    assert h.status().suppressed == ("step 2", "step 3") or set(h.status().suppressed) == {"step 2", "step 3"}
    # The session-scoped work was not a casualty of the run's failure.
    assert all(env.store.is_resident(k) for k in env.weights)
    env.step_hooks.clear()
    env.run_async().wait(T)
    _assert_quiescent(env)


@pytest.mark.parametrize("point", ["before_start", "during_read", "during_step", "after_done"])
def test_cancellation_at_several_points_leaves_nothing_behind(env, point):
    started = threading.Event()
    if point == "before_start":
        env.read_hooks["w0"] = _hold_until_cancelled(started)
    elif point == "during_read":
        env.read_hooks["w1"] = _hold_until_cancelled(started)
    elif point == "during_step":
        env.step_hooks[2] = _hold_until_cancelled(started)
    h = env.run_async()
    if point == "after_done":
        h.wait(T)
    else:
        assert started.wait(T)
    h.cancel()
    h.cancel()  # idempotent
    if point == "after_done":
        h.wait(T)
        assert h.status().state is SubmissionState.DONE
    else:
        with pytest.raises(CancelledError):
            h.wait(T)
        st = h.status()
        assert st.state is SubmissionState.CANCELLED and st.cancelled and st.failing_task is None
        assert sum(st.counts[s] for s in ("pending", "ready", "running")) == 0
    _assert_quiescent(env)
    if point == "during_step":
        assert env.step_log == [0, 1]


def test_shared_session_task_survives_cancel_of_one_consumer(env):
    started = threading.Event()
    gate = threading.Event()

    def hold(ctx):
        started.set()
        assert gate.wait(T)

    env.read_hooks["w0"] = hold
    run1 = env.run_async()
    run2 = env.run_async()
    assert started.wait(T)
    shared = env.session_tasks["w0"]
    assert shared.consumers == 2
    run1.cancel()
    assert shared.consumers == 1 and not shared.state.terminal
    with pytest.raises(CancelledError):
        run1.wait(T)  # returns although w0 is still loading for run 2
    gate.set()
    run2.wait(T)
    assert env.step_log == [0, 1, 2, 3] and run2.status().state is SubmissionState.DONE
    _assert_quiescent(env)


def test_prepare_cancel_keeps_what_a_run_needs_and_last_consumer_cancels(env):
    started = threading.Event()
    env.read_hooks["w3"] = _hold_until_cancelled(started)
    prep = env.prepare_async()
    run = env.run_async()
    assert started.wait(T)
    prep.cancel()
    with pytest.raises(CancelledError):
        prep.wait(T)
    w3 = env.session_tasks["w3"]
    assert not w3.state.terminal and w3.consumers == 1  # the run still consumes it
    run.cancel()  # last consumer: the shared chain is cancelled, its load abandoned
    with pytest.raises(CancelledError):
        run.wait(T)
    assert w3.state is TaskState.CANCELLED
    _assert_quiescent(env)
    assert env.store.state("w3") is ResidencyState.ABSENT


def test_destroying_a_live_handle_waits(env):
    """The last reference is dropped on another thread while step 3 is held. The step is
    released only once that thread blocks inside the handle's destructor (seen through
    its profile hook, at the wait's lock acquire), so a destructor that returns without
    waiting always finds the run unfinished: no race decides the outcome."""
    import sys

    started, gate = threading.Event(), threading.Event()

    def hold(ctx):
        started.set()
        assert gate.wait(T)

    env.step_hooks[3] = hold
    box = [env.run_async()]
    tasks = box[0].tasks
    seen = []

    def blocking_in_del(frame, event, arg):
        # a C-level lock acquire from Condition.wait, called (through wait_for) by __del__
        if event == "c_call" and getattr(arg, "__name__", "") == "acquire" and frame.f_code.co_name == "wait":
            f = frame
            while f is not None and f.f_code.co_name != "__del__":
                f = f.f_back
            if f is not None:
                gate.set()

    def dropper():
        sys.setprofile(blocking_in_del)  # this thread only
        try:
            box.clear()  # the last reference: __del__ runs here and must wait
        finally:
            sys.setprofile(None)
        seen.append(all(t.state.terminal for t in tasks))

    assert started.wait(T)
    th = threading.Thread(target=dropper)
    th.start()
    th.join(T)
    gate.set()  # a destructor that did not wait left the step held
    assert seen == [True]


def test_dropping_a_live_handle_on_a_worker_cancels_instead_of_deadlocking(env):
    started = threading.Event()
    env.read_hooks["w0"] = _hold_until_cancelled(started)
    inner = {}

    def outer(ctx):
        h = env.run_async()
        inner["tasks"] = h.tasks
        assert started.wait(T)
        del h  # on a scheduler worker: cancels

    env.sched.submit(outer, resource=ResourceClass.CPU, name="outer").result(T)
    assert env.sched.wait_idle(T)
    steps = [t for t in inner["tasks"] if t.name.startswith("step")]
    assert len(steps) == 4 and all(t.state is TaskState.CANCELLED for t in steps)
    assert env.session_tasks["w0"].state is TaskState.CANCELLED  # its last consumer left
    _assert_quiescent(env)


def test_context_manager_waits_and_raises(env):
    env.step_hooks[0] = lambda ctx: (_ for _ in ()).throw(RuntimeError("kernel exploded"))
    with pytest.raises(TaskFailedError, match="kernel exploded"):
        with env.run_async():
            pass
    _assert_quiescent(env)


def test_completed_handle_and_finalizers(env):
    h = ExecutionHandle.completed(name="hot run")
    assert h.is_ready() and h.status().state is SubmissionState.DONE
    h.wait()
    ran = []
    h.add_finalizer(lambda: ran.append("now"))
    assert ran == ["now"]
    bad = ExecutionHandle.completed(name="hot run", error=ValueError("nan in logits"), failing_task="step 7")
    with pytest.raises(TaskFailedError, match="step 7.*nan in logits"):
        bad.wait()
    assert bad.status().failing_task == "step 7"

    started, gate = threading.Event(), threading.Event()

    def hold(ctx):
        started.set()
        assert gate.wait(T)

    env.step_hooks[3] = hold
    live = env.run_async()
    live.add_finalizer(lambda: ran.append("finished"))
    assert started.wait(T)
    assert not live.is_ready() and live.status().state is SubmissionState.RUNNING
    with pytest.raises(TimeoutError):
        live.wait(timeout=0.01)
    gate.set()
    live.wait(T)
    assert ran == ["now", "finished"]


def test_handle_finalized_inside_the_scheduler_lock_cancels_without_blocking(env):
    # Models the GC finalizing a live handle while this thread holds the scheduler lock:
    # waiting there would deadlock, so __del__ hands the cancel to a helper thread.
    started = threading.Event()
    env.read_hooks["w0"] = _hold_until_cancelled(started)
    box = [env.run_async()]
    steps = [t for t in box[0].tasks if t.name.startswith("step")]
    assert started.wait(T)
    with env.sched._lock:
        assert env.sched.is_worker_thread()
        box.clear()  # __del__ runs here and must return at once
    assert not env.sched.is_worker_thread()
    assert env.sched.wait_idle(T)
    assert all(t.state is TaskState.CANCELLED for t in steps)
    _assert_quiescent(env)


def test_stats_are_taken_before_a_waiter_sees_the_end(env):
    """The submitter's stats function runs once, when the last task ends and before the
    handle reads as finished, so ``stats()`` has the record as soon as ``wait()``
    returns; a record made later (a function returned) is made once, on first ask; a
    stats function that raises leaves the handle finished, with no record."""
    gate = threading.Event()
    task = env.sched.submit(lambda ctx: gate.wait(T), name="t")
    seen, made = [], []
    holder: list[ExecutionHandle] = []

    def take():
        seen.append(holder[0].is_ready())  # not finished yet for anyone
        return lambda: made.append(1) or "record"

    h = ExecutionHandle(owned=(task,), name="run", stats=take)
    holder.append(h)
    with pytest.raises(UsageError, match="still running"):
        h.stats()
    gate.set()
    h.wait(T)
    assert seen == [False] and made == []
    assert h.stats() == "record" and h.stats() == "record" and made == [1]

    def broken():
        raise RuntimeError("no record")

    bad = ExecutionHandle(owned=(env.sched.submit(lambda ctx: None, name="u"),), name="run2", stats=broken)
    bad.wait(T)
    assert bad.is_ready() and bad.status().state is SubmissionState.DONE and bad.stats() is None
