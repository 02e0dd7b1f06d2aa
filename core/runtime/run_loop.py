"""RunLoop: how a session executes runs: the hot path and the cold path.

Cold path: ONE continuation per run (not one task per node) walks the plan's invocation
steps. Before a step it pins exactly the prepared objects that step consumes; if one is
missing it asks for its producer chain at CRITICAL priority (priority inheritance
promotes a queued prefetch; ``SessionTasks.wait_for``) and yields: the continuation is
resubmitted with those producers as dependencies. It never waits for an initialization
barrier. The step's objects stay pinned until its actions have executed. While it runs
it keeps a bounded look-ahead window of later steps' producers in flight at DEMANDED
(the run will consume them: they may use every worker, queued after CRITICAL work).
NOTE: with PREFETCH here, two CPU workers left one idle for critical work while the
run's own next weights queued behind one worker (medium fixture, warm page cache:
TTFO median 900 ms at PREFETCH vs 535 ms at DEMANDED, 5 loads each, back to back).

Hot path: when every requirement is resident (the store's readiness epoch unchanged), a
run pins the whole set once, replays the action list with a binding built once, and
releases the pin: zero scheduler submissions, no per-node lookups. ``run_async`` then
executes on the calling thread and returns an already-completed handle.

Mutable caller state (the KV cache) arrives in ``RuntimeContext.feeds``; nothing of a run
is stored here. Concurrent runs share resident objects and own the rest.
"""
from __future__ import annotations

import itertools
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import numpy as np

from onnx_prep.core.errors import BudgetError, OnnxPrepError, UsageError, Where
from onnx_prep.core.model.prepared_key import PreparedKey
from onnx_prep.core.model.resolved_model import ResolvedModel
from onnx_prep.core.ops import append_buffer, cancellation, intra_op, run_counters
from onnx_prep.core.plan.execution_plan import RAW_LAYOUT, PreparedExecutionPlan
from onnx_prep.core.plan.task import Priority, TaskKind
from onnx_prep.core.runtime.action_program import ActionProgram
from onnx_prep.core.runtime.arenas import Arena, MemoryBudget
from onnx_prep.core.runtime.execution_handle import ExecutionHandle
from onnx_prep.core.runtime.load_order import reads_first
from onnx_prep.core.runtime.output_estimate import OutputEstimate
from onnx_prep.core.runtime.prepared_store import PreparedObjectStore
from onnx_prep.core.runtime.scheduler import Scheduler, TaskContext, TaskHandle
from onnx_prep.core.runtime.session_tasks import SessionTasks
from onnx_prep.core.runtime.slot_pool import SlotPool
from onnx_prep.core.runtime.stats import Counters, SessionStats

__all__ = ["RunLoop", "RuntimeContext"]


class RuntimeContext:
    """Per-run caller state: the feeds (KV cache included) in, the outputs out.

    ``step_log`` records ``(step index, start_ns, end_ns, worker)`` per executed step
    (cold path) so tests and profiles can see the order of events; ``mode`` is
    "hot" or "cold". Output bytes stay reserved in the IO arena until ``release()``.
    """

    def __init__(self, feeds: Mapping[str, np.ndarray], *, on_step=None, before_step=None) -> None:
        self.feeds = dict(feeds)
        self.on_step = on_step  # called as on_step(step_index) after each cold-path step
        # called as before_step(step_index) on the worker running a cold-path step, with
        # the step's prepared objects pinned and bound, right before its actions execute
        self.before_step = before_step
        self.outputs: dict[str, np.ndarray] | None = None
        self.step_log: list[tuple[int, int, int, str]] = []
        self.mode: str | None = None
        self.submit_ns = time.perf_counter_ns()
        # KV room the caller announced on its thread (append_buffer.room_for); the run
        # may execute on a worker thread, which does not see the caller's context.
        self.append_room = append_buffer.room_hint()
        self.first_step_ns: int | None = None
        self.done_ns: int | None = None
        self.counters = Counters()  # the run's own counts (its ops', its yields); see stats.py
        self._io_reservation = None

    def release(self) -> None:
        """Give the outputs' IO-arena bytes back (the caller keeps the arrays)."""
        if self._io_reservation is not None:
            self._io_reservation.release()
            self._io_reservation = None


@dataclass
class _Run:
    ctx: RuntimeContext
    name: str
    handle: ExecutionHandle | None = None
    # What a continuation that yielded before the handle existed submitted: (the producers
    # it waits for, its next continuation); the handle takes them over (RunLoop._attach).
    # ``lock`` guards these three fields; ``abandoned``: the handle never came (_abandon).
    early: list = field(default_factory=list)
    abandoned: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    values: list | None = None
    step: int = 0
    io_bytes: int = 0
    exec_bytes: int = 0
    exec_reservation: Any = None



# A hot run's lent helpers (see RunLoop._executing): how long one spins without a batch
# before it sleeps, and how long it serves without one before it goes back to the pool.
# A decode step's gaps between batches (its other ops, the loop between steps) are well
# under the spin; a caller that pauses longer gets its workers back after the linger.
HELPER_SPIN_NS = 5_000_000
HELPER_LINGER_NS = 50_000_000


class RunLoop:
    """Runs of one session. ``parts_hot`` / ``parts_cold``: intra-op split of a hot run
    (the caller plus the CPU workers) and of a cold step (on a worker);
    ``spin_helpers``: hot runs lend idle CPU workers that wait in C for split chunks
    (see :meth:`_executing`); ``stats``: the session's (core/runtime/stats.py), which
    each run's record is taken from; a run's own counts go to ``RuntimeContext.counters``."""

    def __init__(self, resolved: ResolvedModel, plan: PreparedExecutionPlan, program: ActionProgram,
                 store: PreparedObjectStore, slots: SlotPool, scheduler: Scheduler, budget: MemoryBudget,
                 tasks: SessionTasks, *, parts_hot: int, parts_cold: int, spin_helpers: bool,
                 stats: SessionStats) -> None:
        self.resolved, self.plan, self.program = resolved, plan, program
        self.store, self.slots, self.scheduler, self.budget = store, slots, scheduler, budget
        self.tasks = tasks
        self._parts_hot, self._parts_cold = parts_hot, parts_cold
        self._spin_helpers = spin_helpers
        self._lend_at_start = False  # see _executing
        self._kept: tuple[Any, list] | None = None  # a hot run's mailbox and its helpers, lingering
        self._kept_lock = threading.Lock()
        self._closed = False
        self._stats = stats
        self.started = False  # a run has started (the slot warmer stops)
        self._run_ids = itertools.count(1)
        self._step_keys: tuple[tuple[PreparedKey, ...], ...] = tuple(
            plan.by_id[s.task_id].prepared_requirements for s in plan.steps)
        slot_of = program.slot_of
        self._step_raw: tuple[tuple[tuple[int, PreparedKey], ...], ...] = tuple(
            tuple((slot_of[plan.by_key[k].request.logical_value], k) for k in keys
                  if plan.by_key[k].request.layout == RAW_LAYOUT
                  and plan.by_key[k].request.logical_value in slot_of)
            for keys in self._step_keys)
        self.readiness = store.readiness(r.key for r in plan.requirements)
        self._reads_first = reads_first(plan, budget)
        self._raw_placeholder = {n: None for n in program.weight_names}
        self._hot_binding = None
        self._hot_weights: dict[str, np.ndarray] | None = None
        self._out_estimator = OutputEstimate(resolved)

    def run_async(self, ctx: RuntimeContext) -> ExecutionHandle:
        """A hot run when every requirement is resident (on this thread, already
        complete), else a cold run (a continuation on the scheduler)."""
        run_id = next(self._run_ids)
        self.started = True
        since = self._stats.start()
        pins = self.readiness.pin_if_ready()
        if pins is not None:
            return self._run_hot(ctx, pins, run_id, since)
        run = _Run(ctx=ctx, name=f"run-{run_id}")
        ctx.mode = "cold"
        ctx.counters.add("cold_runs")
        self.release_helpers()  # a cold run's prepacks and steps need every worker
        try:
            self._reserve_run_memory(run)
        except BudgetError as e:
            return ExecutionHandle.completed(name=run.name, error=e,
                                             stats=self._stats.finish(since, ctx.counters.snapshot()))
        # The handle is built around the first continuation, after its submit; one that
        # yields before the handle exists leaves what it submitted in run.early for the
        # handle to take over: no worker waits for this thread. A Ctrl-C from the submit
        # on (inside it too, once the task is queued) abandons the run. NOTE: a yield used
        # to wait for the handle, and a Ctrl-C inside the submit (as a decode starts; under
        # load, as this thread took the GIL back from the woken worker) left it waiting
        # forever, and the session's close waiting for that worker.
        first = None
        try:
            reads = self._all_reads() if self._reads_first else ()
            if reads:
                ctx.counters.add("reads_first")
            first = self._submit_continuation(run, deps=reads)
            return self._attach(run, first, since, reads)
        except BaseException:
            self._abandon(run, first)
            raise

    def _all_reads(self) -> tuple[TaskHandle, ...]:
        """The producers of every object not yet resident, asked for at DEMANDED (every
        worker of their queue may run them): what a run that reads first waits for."""
        handles = []
        for r in self.plan.requirements:
            h = self.tasks.ensure(r.publisher, Priority.DEMANDED)
            if h is not None:
                handles.append(h)
        return tuple(handles)

    def _attach(self, run: _Run, first: TaskHandle, since, shared: tuple[TaskHandle, ...] = ()
                ) -> ExecutionHandle:
        """The run's handle: its first continuation (``shared``: the producers it waits
        for), and what continuations that yielded before it existed submitted (their
        producers shared, their next steps owned)."""
        ctx = run.ctx
        with run.lock:  # a continuation yielding now waits for this block, not for a handle
            early = run.early
            handle = ExecutionHandle(owned=(first, *(nxt for _, nxt in early)),
                                     shared=shared + tuple(h for waiting, _ in early for h in waiting),
                                     name=run.name, keepalive=ctx,
                                     stats=lambda: self._stats.finish(since, ctx.counters.snapshot()))
            handle.add_finalizer(lambda r=run: _release(r.exec_reservation))
            run.handle, run.early = handle, []
        return handle

    def _abandon(self, run: _Run, first: TaskHandle | None) -> None:
        """``run_async`` did not return the handle (Ctrl-C, or a failed submit): nobody
        will wait for the run, so it stops: its handle cancelled, or, without one, its
        continuations (a yield from now on cancels what it submitted)."""
        with run.lock:
            run.abandoned = True
            handle, early = run.handle, list(run.early)
        if handle is not None:
            handle.cancel()  # its finalizer releases the run's memory
            return
        for t in (first, *(nxt for _, nxt in early)):
            if t is not None:
                t.cancel()
        _release(run.exec_reservation)

    @contextmanager
    def _executing(self, ctx: RuntimeContext, parts: int, *, lend_helpers: bool = False) -> Iterator[None]:
        """What a run's actions execute under, on whichever thread runs them: the
        intra-op split (``parts`` ways) and the KV room the caller announced.

        ``lend_helpers`` (the hot path): the CPU workers idle at the start are lent to
        the run, waiting in C on the run's mailbox for the chunks of each split matmul
        (native/handoff.py): at the start if the session's previous hot run split a
        matmul, else at the run's first split (``intra_op.LazyMailbox``: a run that
        splits nothing lends nothing). NOTE: lending at the first split costs that
        split its helper (the worker wakes while the caller runs the chunks); a medium
        decode token took 27.05 ms against 26.17 lending at the start in one A/B
        (medians of 40, interleaved), within the noise in another. So a run lends at
        its start when the one before split (decode steps look like the step before),
        and a session whose runs split nothing (the tiny fixture's decode) never lends.
        Lent helpers spin between batches, so each costs a core while the run publishes
        them, and sleep after ``HELPER_SPIN_NS`` without one.

        The helpers outlive the run: the mailbox is kept for the next hot run that
        splits, whose caller publishes to the same helpers, and they go back to the pool after
        ``HELPER_LINGER_NS`` without a batch (or at a cold run, or the session's close).
        NOTE: why: lent at each run's start and reclaimed at its end, each decode step
        woke a sleeping worker and put it back to sleep, and on a VM each sleep idles a
        vCPU, which the host may give to another guest until something wakes it. The
        builder export's decode at batch 1 (2 vCPUs, 2026-12-03): voluntary context
        switches 6.0 a step (the run's thread 1.8, each worker ~2) against 0.0 kept, and
        the vCPUs idle 2-16% of a decode against 0-1%. Step time: no difference on a
        quiet host (medians 43.04 against 42.63 ms, 8 alternating rounds); a prototype
        kept 44.0 against 48.7 ms while the host stole 3-12% of the CPU (one run).
        Without an idle worker, or on the cold path (where the other workers pack
        weights), splits go through ``fork_join``."""
        lazy, opened, since = None, [], {}  # since: a kept box's counts at this run's start
        # NOTE: a lent helper serves its box until the box stops or it lingers out, and the
        # session's close joins every worker: a box is listed for the stop before anything
        # is lent to it, inside the try (a Ctrl-C between a lend and the listing left a
        # worker serving).
        try:
            if lend_helpers and self._spin_helpers and parts >= 2:
                def open_mailbox():
                    kept = self._take_kept()
                    if kept is not None:
                        since[id(kept[0])] = (kept[0].chunks_by_helpers, kept[0].sleeps, kept[0].wakes)
                        opened.append(kept)
                        return kept[0]
                    from onnx_prep import native

                    box, lent = native.Mailbox(spin_ns=HELPER_SPIN_NS, linger_ns=HELPER_LINGER_NS), []
                    opened.append((box, lent))
                    lent.extend(self.scheduler.lend(box.serve, parts - 1))
                    return box if lent else None

                lazy = intra_op.LazyMailbox(open_mailbox)
                if self._lend_at_start:
                    lazy.open_now()
            with intra_op.using(self.scheduler.fork_join, parts, mailbox=lazy), \
                    append_buffer.room_for(ctx.append_room), run_counters.counting(ctx.counters):
                yield
        finally:
            for box, lent in opened:
                if lent:
                    chunks, sleeps, wakes = since.get(id(box), (0, 0, 0))
                    with run_counters.counting(ctx.counters):
                        intra_op.count_handed_off(box.chunks_by_helpers - chunks, box.sleeps - sleeps,
                                                  box.wakes - wakes)
            for box, lent in opened:
                if not (lent and self._keep((box, lent))):
                    self._give_back(box, lent)
            if lazy is not None:  # the next hot run lends at its start if this one split
                self._lend_at_start = lazy.asked

    def _take_kept(self) -> tuple[Any, list] | None:
        """The kept mailbox, for this run alone, while a helper still serves it; one
        whose helpers lingered out is reclaimed (their tasks have returned)."""
        with self._kept_lock:
            kept, self._kept = self._kept, None
        if kept is None:
            return None
        if kept[0].serving:
            return kept
        self._give_back(*kept)
        return None

    def _keep(self, kept: tuple[Any, list]) -> bool:
        """Keep a run's mailbox for the next hot run (False: one is kept already, by a
        run beside this one, or the session is closing)."""
        with self._kept_lock:
            if self._kept is not None or self._closed:
                return False
            self._kept = kept
            return True

    def release_helpers(self) -> None:
        """Stop the kept mailbox and take its helpers back (a cold run, the close)."""
        with self._kept_lock:
            kept, self._kept = self._kept, None
        if kept is not None:
            self._give_back(*kept)

    def _give_back(self, box, lent: list) -> None:
        box.stop()  # first: an offer a worker takes later then returns at once
        if lent:
            self.scheduler.reclaim(lent)

    def close(self) -> None:
        """No hot run keeps helpers from here on; the kept ones go back now."""
        with self._kept_lock:
            self._closed = True
        self.release_helpers()

    def _run_hot(self, ctx: RuntimeContext, pins, run_id: int, since) -> ExecutionHandle:
        ctx.mode = "hot"
        ctx.counters.add("hot_runs")
        try:
            if self._hot_binding is None:
                view = self.slots.view
                packed = {k: view(k) for k in self.program.requirements}
                self._hot_binding = self.program.bind_prepared(packed)
                self._hot_weights = {
                    self.plan.by_key[k].request.logical_value: view(k)
                    for k in self.plan.by_key if self.plan.by_key[k].request.layout == RAW_LAYOUT}
            run = _Run(ctx=ctx, name=f"run-{run_id}")
            self._reserve_run_memory(run)
            try:
                values = self.program.new_values(ctx.feeds, self._hot_weights)
                ctx.first_step_ns = time.perf_counter_ns()
                with self._executing(ctx, self._parts_hot, lend_helpers=True):
                    self.program.execute(values, self._hot_binding)
                ctx.outputs = self.program.fetch(values)
                ctx.done_ns = time.perf_counter_ns()
                self._settle_outputs(ctx)
            finally:
                _release(run.exec_reservation)
        except OnnxPrepError as e:
            return ExecutionHandle.completed(name=f"run-{run_id}", error=e,
                                             stats=self._stats.finish(since, ctx.counters.snapshot()))
        finally:
            pins.release()
        return ExecutionHandle.completed(name=f"run-{run_id}", stats=self._stats.finish(since, ctx.counters.snapshot()))

    def replay_hot(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The hot path's baseline (benchmarks): the same action program, prepared
        binding, weights and intra-op helpers as a hot run, replayed directly with none of
        a run's bookkeeping (readiness, pins, arena reservations, handle, stats). Only
        after a hot run has bound the prepared objects (a UsageError before)."""
        if self._hot_binding is None:
            raise UsageError("no hot run yet: replay_hot needs the binding a hot run makes",
                             hint="prepare() and run() once first")
        with self._executing(RuntimeContext(feeds), self._parts_hot, lend_helpers=True):
            return self.program.run(feeds, self._hot_binding, weights=self._hot_weights)

    # ------------------------------------------------------------------- cold path
    def _submit_continuation(self, run: _Run, deps) -> TaskHandle:
        return self.scheduler.submit(lambda tctx, r=run: self._continue(r, tctx),
                                     priority=Priority.CRITICAL, deps=tuple(deps),
                                     name=f"{run.name}:step{run.step}", promote_deps=True,
                                     kind=TaskKind.EXECUTE, log=self._stats.timeline)

    def _continue(self, run: _Run, tctx: TaskContext) -> None:
        ctx = run.ctx
        program = self.program
        steps = self.plan.steps
        store = self.store
        if run.values is None:
            run.values = program.new_values(ctx.feeds, self._raw_placeholder)
        values = run.values
        self._prefetch(run.step)
        while run.step < len(steps):
            tctx.raise_if_cancelled()
            si = run.step
            keys = self._step_keys[si]
            pins = store.pin_many(keys) if keys else None
            if keys and pins is None:
                waiting = self.tasks.wait_for(keys, si)
                if waiting:
                    ctx.counters.add("yields")
                    nxt = self._submit_continuation(run, deps=waiting)  # yield until they publish
                    with run.lock:
                        handle = run.handle
                        if handle is None and not run.abandoned:
                            run.early.append((tuple(waiting), nxt))  # the handle takes them (_attach)
                            return
                    if handle is None:  # abandoned before its handle existed (run_async)
                        nxt.cancel()
                        return
                    for h in waiting:
                        handle.add(h, shared=True)
                    handle.add(nxt)
                    return
                continue  # published between the checks: pin again
            try:
                view = self.slots.view
                for slot, k in self._step_raw[si]:
                    values[slot] = view(k)
                prepared = {k: view(k) for k in keys}
                if ctx.before_step is not None:
                    ctx.before_step(si)
                begin, end = steps[si].action_range
                t0 = time.perf_counter_ns()
                if ctx.first_step_ns is None:
                    ctx.first_step_ns = t0
                with self._executing(ctx, self._parts_cold), cancellation.checking(tctx.token):
                    program.execute(values, prepared, begin, end)
                ctx.step_log.append((si, t0, time.perf_counter_ns(), tctx.worker))
            finally:
                if pins is not None:
                    pins.release()
            if ctx.on_step is not None:
                ctx.on_step(si)
            run.step += 1
            self._prefetch(run.step)
        ctx.outputs = program.fetch(values)
        ctx.done_ns = time.perf_counter_ns()
        run.values = None
        self._settle_outputs(ctx)

    def _prefetch(self, from_step: int) -> None:
        """Keep the producers of the next ``lookahead.steps`` steps in flight, bounded
        by ``lookahead.bytes`` of not-yet-resident objects."""
        win = self.plan.lookahead
        budget = win.bytes
        limit = self.budget.limit(Arena.PREPARED)
        if limit is not None:
            # NOTE: a window as large as the limit keeps only the window resident: every
            # object behind it is evicted to make room, and the whole model streams
            # through every run (the tiny LLM at half its packed size paged in 99% of its
            # bytes per decode step). A quarter of the limit leaves the rest to objects the
            # furthest-next-use choice keeps from run to run: 74% then (a half or an
            # eighth: the same), and the medium fixture pages in exactly its packed size
            # minus the limit, the least any policy can (it paged in 12% more).
            budget = min(budget, limit // LIMITED_WINDOW_SHARE)
        store = self.store
        last = min(from_step + win.steps, len(self.plan.steps))
        # under a PREPARED limit, room is made for each before it is asked for: the
        # window's objects are kept, the furthest next use outside it goes first
        # window's objects are kept, the furthest next use outside it goes first; and the
        # window's bytes count resident objects too, so how far it reaches depends on the
        # run's position alone, not on which producers happen to have finished
        limited = self.budget.limit(Arena.PREPARED) is not None
        keep = {k for si in range(from_step, last) for k in self._step_keys[si]} if limited else ()
        for si in range(from_step, last):
            for k in self._step_keys[si]:
                req = self.plan.by_key[k]
                resident = store.is_resident(k)
                if resident and not limited:
                    continue
                if req.read_bytes + req.packed_bytes > budget:
                    return
                budget -= req.read_bytes + req.packed_bytes
                if resident:
                    continue
                if limited:
                    if not self.tasks.fetch_ahead(k, from_step, keep):
                        return
                    continue
                self.tasks.ensure(req.publisher, Priority.DEMANDED)  # the run will consume it

    def _reserve_run_memory(self, run: _Run) -> None:
        """Execution-arena working set and IO-arena outputs, admitted before the run.

        NOTE: an estimate: output bytes from the declared output shapes with symbolic
        dims bound by the feeds, and a working set of twice the larger of inputs and
        outputs. A run that cannot fit fails with BudgetError naming the arena."""
        feeds_bytes = sum(int(np.asarray(v).nbytes) for v in run.ctx.feeds.values())
        out_bytes = self._out_estimator.estimate(run.ctx.feeds)
        run.exec_bytes = 2 * max(feeds_bytes, out_bytes)
        run.io_bytes = out_bytes
        req = {a: b for a, b in ((Arena.EXECUTION, run.exec_bytes), (Arena.IO, run.io_bytes)) if b}
        if not req:
            return
        self.budget.check_fits(req, label=f"run of {self.resolved.model_path.name}")
        res = self.budget.try_reserve_many(req, critical=True, label="run")
        if res is None:
            raise BudgetError(
                "not enough memory for the run now: "
                + ", ".join(f"{a.value} arena needs {b} bytes, {self.budget.live(a)} in use of "
                            f"{self.budget.limit(a)}" for a, b in req.items()),
                Where(model=str(self.resolved.model_path)),
                hint="retry when other runs finish, or raise the budget")
        io = res.detach(Arena.IO) if Arena.IO in res.amounts else None
        run.exec_reservation = res
        run.ctx._io_reservation = io

    def _settle_outputs(self, ctx: RuntimeContext) -> None:
        """True the IO-arena reservation up to the real output bytes: shrink it, or
        reserve the difference (a BudgetError if it cannot fit: the outputs are dropped).
        A KV output that is a view of an append buffer holds the whole buffer."""
        actual = append_buffer.held_bytes((ctx.outputs or {}).values())
        res = ctx._io_reservation
        held = res.amounts.get(Arena.IO, 0) if res is not None else 0
        if actual <= held:
            if res is not None:
                res.shrink(Arena.IO, actual)
            return
        self.budget.check_fits({Arena.IO: actual}, label="run outputs")
        extra = self.budget.try_reserve(Arena.IO, actual - held, critical=True, label="run outputs")
        if extra is None:
            ctx.outputs = None
            raise BudgetError(
                f"not enough memory for the run's outputs now: io arena needs {actual} bytes, "
                f"{self.budget.live(Arena.IO)} in use of {self.budget.limit(Arena.IO)}",
                Where(model=str(self.resolved.model_path)),
                hint="release earlier outputs (RuntimeContext.release) or raise the budget")
        ctx._io_reservation = _Joined(res, extra)


class _Joined:
    """Two reservations released together."""

    __slots__ = ("parts",)

    def __init__(self, *parts) -> None:
        self.parts = parts

    @property
    def amounts(self) -> dict:
        out: dict = {}
        for p in self.parts:
            if p is not None:
                for a, n in p.amounts.items():
                    out[a] = out.get(a, 0) + n
        return out

    def release(self) -> None:
        for p in self.parts:
            _release(p)


# Under a PREPARED limit, the look-ahead reaches at most 1/LIMITED_WINDOW_SHARE of it (_prefetch).
LIMITED_WINDOW_SHARE = 4


def _release(reservation) -> None:
    if reservation is not None:
        reservation.release()
