"""Session: prepared execution of one resolved model over the shared runtime substrate.

Seed, "Construction and execution lifecycle", "Cold and hot inference paths" and
"Asynchronous session contract". A session owns (or shares, through a
:class:`Workspace`) a :class:`Scheduler` and a :class:`MemoryBudget`, and owns a
:class:`PreparedObjectStore`, the immutable :class:`PreparedExecutionPlan` and the
compiled :class:`ActionProgram`.

Contract
--------
``Session(resolved, options: SessionOptions | None = None, **kw)``
    ``resolved`` must be a frozen ResolvedModel (``Session.open(path)`` resolves first).
    ``options`` is the one configuration record; keyword arguments of its field names
    override it. ``source_pages``: whether each source tensor leaves the page cache
    once prepacked ("keep", "drop", or "auto": drop when the payload is over a quarter
    of the memory available; ``external_data.drop_source_pages``).
    ``Session.source_pages`` is the choice made.
``prepare_async() -> ExecutionHandle`` submits every session task (reads, prepacks);
    ``prepare()`` is exactly ``prepare_async().wait()``.
``run_async(ctx: RuntimeContext) -> ExecutionHandle``; ``run(feeds) -> dict`` is exactly
    ``run_async(RuntimeContext(feeds)).wait()`` and returns ``ctx.outputs``.

Cold path: ONE continuation per run (not one task per node) walks the plan's invocation
steps. Before a step it checks the residency of exactly the prepared objects that step
consumes; if one is missing it asks for its producer chain at CRITICAL priority (priority
inheritance promotes a queued prefetch) and yields: the continuation is resubmitted with
those producers as dependencies. It never waits for an initialization barrier. While it
runs it keeps a bounded look-ahead window of later steps' producers in flight at DEMANDED
(the run will consume them: they may use every worker, queued after CRITICAL work).
NOTE: with PREFETCH here, two CPU workers left one idle for critical work while the
run's own next weights queued behind one worker (medium fixture, warm page cache:
TTFO median 900 ms at PREFETCH vs 535 ms at DEMANDED, 5 loads each, back to back).

Hot path: when every requirement is resident (the store's readiness epoch unchanged), a
run pins the whole set once, replays the action list with a binding built once, and
releases the pin: zero scheduler submissions, no per-node lookups. ``run_async`` then
executes on the calling thread and returns an already-completed handle.

Residency: every prepared object (packed weight, or raw external weight) lives in a
host stable-VA slot (``onnx_prep.native.StableSlot``) reserved once per key: eviction
decommits the pages, re-materialization commits them again at the SAME address, so the
numpy views and the hot path's binding, made once, stay valid.

Mutable caller state (the KV cache) arrives in ``RuntimeContext.feeds``; nothing of a run
is stored in the session. Concurrent runs share resident objects and own the rest.
"""
from __future__ import annotations

import itertools
import math
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from onnx_prep.core.runtime.action_program import ActionProgram
from onnx_prep.core.runtime.arenas import Arena, MemoryBudget
from onnx_prep.core.errors import BudgetError, OnnxPrepError, UsageError, Where
from onnx_prep.core.runtime.execution_handle import ExecutionHandle
from onnx_prep.core.io.external_data import ExternalDataReader
from onnx_prep.core.ops import append_buffer, intra_op
from onnx_prep.core.ops.intra_op import spin_helpers_default
from onnx_prep.core.plan.execution_plan import (
    RAW_LAYOUT,
    LookaheadWindow,
    PreparedExecutionPlan,
    build_prepared_execution_plan,
)
from onnx_prep.core.model.prepared_key import PreparedKey
from onnx_prep.core.runtime.prepared_store import PreparedObjectStore
from onnx_prep.core.runtime.slot_pool import HostSlotPool, to_idle_priority
from onnx_prep.core.runtime.materializer import SOURCE_IO, Materializer, release_source
from onnx_prep.core.runtime.eviction_policy import EvictionPolicy
from onnx_prep.core.model.resolved_model import ResolvedModel, require_frozen
from onnx_prep.core.runtime.scheduler import Scheduler, TaskContext, TaskHandle, TaskState
from onnx_prep.core.plan.task import Priority, ResourceClass, TaskDescriptor, TaskId, TaskKind

_DEAD = (TaskState.FAILED, TaskState.CANCELLED)

class Workspace:
    """A scheduler and a memory budget shared by several sessions in one process.

    Sessions on one workspace share its worker threads and compete for its arenas;
    an allocation that cannot fit fails that run's handle with a BudgetError naming
    the arena and sizes, and the session works again once memory allows.
    """

    def __init__(self, *, budget: MemoryBudget | None = None, io_workers: int = 2,
                 cpu_workers: int | None = None, sequential: bool = False) -> None:
        self.budget = budget or MemoryBudget()
        self.scheduler = Scheduler(io_workers=io_workers, cpu_workers=cpu_workers,
                                   budget=self.budget, sequential=sequential)

    def close(self) -> None:
        self.scheduler.close()

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
    handle_ready: threading.Event = field(default_factory=threading.Event)
    values: list | None = None
    step: int = 0
    io_bytes: int = 0
    exec_bytes: int = 0
    exec_reservation: Any = None


@dataclass
class SessionCounters:
    hot_runs: int = 0
    cold_runs: int = 0
    yields: int = 0  # cold-path continuations that waited for a prepared object
    materializations: int = 0  # publishes (prepacks, raw reads, packed reads)
    rematerializations: int = 0  # publishes of a key that had been resident before (page-ins)
    evictions: int = 0  # objects the session evicted to make room under the PREPARED limit
    shed: int = 0  # speculative tasks cancelled because a run's producer could not get memory
    source_reads: int = 0
    slot_bytes_warmed: int = 0  # stable-slot bytes committed ahead of their prepack by idle CPU


@dataclass(frozen=True)
class SessionOptions:
    """How a session is configured: ``Session(resolved, options)``. Keyword arguments of
    the same names also work (``Session(resolved, sequential=True)``) and override
    ``options``. ``sequential``, ``budget``, ``io_workers`` and ``cpu_workers`` make the
    session's own workspace; with ``workspace`` they are not used."""

    workspace: Workspace | None = None  # a scheduler and budget shared with other sessions
    sequential: bool = False  # every task on the calling thread, in order (tests, baselines)
    budget: MemoryBudget | None = None
    io_workers: int = 2
    cpu_workers: int | None = None
    lookahead: LookaheadWindow | None = None  # the plan's default when None
    reader: ExternalDataReader | None = None  # the model's own reader when None
    trust_symlinks: bool = False
    source_io: str = "map"  # SOURCE_IO: how prepack sources are read
    intra_op: bool = True  # split large matmuls across the CPU workers
    spin_helpers: bool | None = None  # None: ONNX_PREP_SPIN_HELPERS (see _executing)
    warm_slots: bool = True  # commit reserved slots from idle CPU during prepare
    source_pages: str = "auto"  # keep / drop / auto (see the module docstring)

    def __post_init__(self) -> None:
        if self.source_io not in SOURCE_IO:
            raise UsageError(f"unknown source_io {self.source_io!r}",
                             hint=f"choose one of {', '.join(SOURCE_IO)}")


class Session:
    def __init__(self, resolved: ResolvedModel, options: SessionOptions | None = None, **kw) -> None:
        opts = self.options = replace(options or SessionOptions(), **kw) if kw else (options or SessionOptions())
        workspace, budget, lookahead = opts.workspace, opts.budget, opts.lookahead
        source_pages = opts.source_pages
        self.source_io = opts.source_io
        self.resolved = require_frozen(resolved)
        from onnx_prep.core.io.external_data import available_memory_bytes, drop_source_pages

        # NOTE: dropping a prepacked source from the page cache frees memory for what
        # comes next and spares the kernel reclaiming it later; keeping it makes the next
        # load of the same model warm. Measured, docs/runtime.md ("Source pages").
        self._drop_sources = drop_source_pages(
            source_pages, resolved.manifest.total_bytes,
            available_memory_bytes() if source_pages == "auto" else None)
        from onnx_prep.native import active_isa

        self.isa = active_isa()  # a bad ONNX_PREP_ISA or a stale build fails here, before any work
        self.plan: PreparedExecutionPlan = build_prepared_execution_plan(resolved, lookahead=lookahead)
        self.program = ActionProgram.compile(resolved)
        self.reader = opts.reader or ExternalDataReader.for_model(resolved, trust_symlinks=opts.trust_symlinks)
        self._own_workspace = workspace is None
        self.workspace = workspace or Workspace(budget=budget, io_workers=opts.io_workers,
                                                cpu_workers=opts.cpu_workers, sequential=opts.sequential)
        self.scheduler: Scheduler = self.workspace.scheduler
        # Intra-op parts (core/ops/intra_op.py): the hot path runs on the caller's thread,
        # so its parts are the caller plus the CPU workers; a cold step runs on a worker.
        cores = os.cpu_count() or 1
        cpu = 0 if (self.scheduler.sequential or not opts.intra_op) else self.scheduler.workers(ResourceClass.CPU)
        self._parts_hot = min(cores, cpu + 1) if cpu else 1
        self._parts_cold = min(cores, cpu) if cpu else 1
        # Hot runs borrow idle CPU workers as helpers that wait in C, spinning, for the
        # chunks of each split matmul (Session._executing); False: chunks go through
        # Scheduler.fork_join, to workers that sleep between them (no core spent waiting).
        # None: ONNX_PREP_SPIN_HELPERS (default on).
        self._spin_helpers = spin_helpers_default() if opts.spin_helpers is None else bool(opts.spin_helpers)
        self._lend_at_start = False  # see _executing
        self.budget: MemoryBudget = self.workspace.budget
        self.store = PreparedObjectStore()
        self.counters = SessionCounters()
        self._lock = threading.RLock()
        self._closed = False
        self._handles: dict[TaskId, TaskHandle] = {}  # current generation of each session task
        self.slots = HostSlotPool()
        self._run_ids = itertools.count(1)

        plan = self.plan
        self._publisher: dict[PreparedKey, TaskDescriptor] = {
            r.key: plan.by_id[r.publisher] for r in plan.requirements}
        # Plan consumers of each non-publishing read (a tied source feeds two prepacks).
        self._read_consumers: dict[TaskId, tuple[TaskId, ...]] = {}
        for t in plan.session_tasks:
            for d in t.dependencies:
                self._read_consumers[d] = self._read_consumers.get(d, ()) + (t.id,)
        self._step_keys: tuple[tuple[PreparedKey, ...], ...] = tuple(
            plan.by_id[s.task_id].prepared_requirements for s in plan.steps)
        slot_of = self.program.slot_of
        self._step_raw: tuple[tuple[tuple[int, PreparedKey], ...], ...] = tuple(
            tuple((slot_of[plan.by_key[k].request.logical_value], k) for k in keys
                  if plan.by_key[k].request.layout == RAW_LAYOUT
                  and plan.by_key[k].request.logical_value in slot_of)
            for keys in self._step_keys)
        self._all_keys = tuple(r.key for r in plan.requirements)
        self.eviction = EvictionPolicy(plan)
        # Keys a yielded run is waiting for, with the step it waits at: after every publish
        # the session retries making room for them (see _make_room).
        self._critical_wait: dict[PreparedKey, int] = {}
        self._readiness = self.store.readiness(self._all_keys)
        self._raw_placeholder = {n: None for n in self.program.weight_names}
        self._hot_binding = None
        self._hot_weights: dict[str, np.ndarray] | None = None
        self._out_estimator = _OutputBytes(resolved)
        self.materializer = Materializer(
            resolved, plan, self.reader, self.store, self.slots, source_io=self.source_io,
            drop_sources=self._drop_sources, count=self._count, published=self._published,
            sources_used=self._sources_used)
        # Every requirement's stable slot is reserved here, before any worker runs, so
        # materializing only populates pages (HostSlotPool.reserve says why).
        for r in plan.requirements:
            if r.packed_bytes > 0:
                self.slots.reserve(r.key, r.packed_bytes)
        # Slot warming (_warm_slots_loop): while a parallel prepare runs and no run does, a
        # thread in the OS's idle class commits the spare slots' pages ahead of their
        # prepacks, on CPU time the workers leave idle (waiting for reads, at the tail).
        # Only without memory limits: it commits pages before their admission.
        self._warm_slots = (opts.warm_slots and not self.scheduler.sequential
                            and self.budget.global_limit is None and self.budget.limit(Arena.PREPARED) is None)
        self._warmer: threading.Thread | None = None

    @property
    def source_pages(self) -> str:
        """The source-pages choice made at construction: "keep" or "drop"."""
        return "drop" if self._drop_sources else "keep"

    # ----------------------------------------------------------------- construction
    @classmethod
    def open(cls, model_path: str | Path, options: SessionOptions | None = None, **kw) -> Session:
        from onnx_prep.core.model.resolution import resolve_model

        opts = replace(options or SessionOptions(), **kw)
        resolved = resolve_model(Path(model_path), trust_symlinks=opts.trust_symlinks)
        return cls(resolved, opts)

    def close(self) -> None:
        """Cancel outstanding session work, release every resident object, and stop
        the scheduler if this session owns it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            handles = list(self._handles.values())
            self._handles.clear()
        for h in handles:
            h.cancel()
        for h in handles:
            h.wait()
        for h in handles:
            release_source(h)
        warmer = self._warmer
        if warmer is not None:
            warmer.join()  # it sees _closed at its next step
        if self._own_workspace:
            self.workspace.close()
        self.store.clear()
        self.slots.close()  # reserved slots never used: their address ranges go back now
        self.reader.close_shared()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------- public API
    def prepare_async(self) -> ExecutionHandle:
        """Submit every session task eagerly: producers of the first look-ahead window
        at PREFETCH, the rest at BACKGROUND. Already-resident objects submit nothing."""
        self._check_open()
        window = self.plan.lookahead.steps
        shared: list[TaskHandle] = []
        with self._lock:  # NOTE: one lock hold: a tied source counts both consumers
            for r in self.plan.requirements:
                prio = Priority.PREFETCH if r.first_step < window else Priority.BACKGROUND
                h = self._ensure(r.publisher, prio)
                if h is not None:
                    shared.append(h)
            closure = {t.id for t in self.plan.session_closure(self._all_keys)}
            for tid in closure:  # the reads too, so a failing read is named in status
                h = self._handles.get(tid)
                if h is not None and h not in shared:
                    shared.append(h)
        handle = ExecutionHandle(shared=shared, name="prepare")
        self._start_warmer(handle)
        return handle

    def _runs_started(self) -> bool:
        """Whether any run has started here (read without the lock by the warmer's
        steps: a hint there, checked again under the lock at its next slot)."""
        return self.counters.cold_runs + self.counters.hot_runs > 0

    def _start_warmer(self, prepare: ExecutionHandle) -> None:
        with self._lock:
            if (not self._warm_slots or not self.slots.has_reserved() or self._closed or self._runs_started()
                    or (self._warmer is not None and self._warmer.is_alive())):
                return  # (a run started: its steps need the memory bandwidth)
            self._warmer = threading.Thread(target=self._warm_slots_loop, args=(prepare,),
                                            name="onnx-prep-slot-warmer", daemon=True)
            self._warmer.start()

    def _warm_slots_loop(self, prepare: ExecutionHandle) -> None:
        """Commit spare slots' pages in the order runs need them, one step at a time,
        from the OS's idle class. NOTE: measured on the 2-vCPU VM, cold page cache,
        medium fixture, 12 interleaved loads each: parallel init 475 ms median
        (351-747) without, 395 ms (351-550) with; warm page cache, no change (328 vs
        338 ms: the workers leave little CPU idle). It stops when a run starts: warming
        beside a run made time to first output 509 -> 556 ms cold and 415 -> 481 warm
        (pages zeroed early leave the cache before their prepack writes them, and the
        zeroing takes bandwidth the run's GEMVs need; docs/runtime.md). It also stops
        when the prepare ends or is cancelled, and when the session closes."""
        if not to_idle_priority():
            return  # at normal priority it would take CPU from the workers instead

        def stop() -> bool:
            # prepare.is_ready(): done, failed or cancelled (asked outside the session lock)
            return prepare.is_ready() or self._closed or self._runs_started()

        self.slots.warm(((r.key, r.packed_bytes) for r in self.plan.requirements),  # in order of first use
                        stop, on_warmed=lambda n: self._count("slot_bytes_warmed", n))

    def prepare(self) -> None:
        self.prepare_async().wait()

    def run_async(self, ctx: RuntimeContext) -> ExecutionHandle:
        self._check_open()
        run_id = next(self._run_ids)
        pins = self._readiness.pin_if_ready()
        if pins is not None:
            return self._run_hot(ctx, pins, run_id)
        run = _Run(ctx=ctx, name=f"run-{run_id}")
        ctx.mode = "cold"
        self._count("cold_runs")
        try:
            self._reserve_run_memory(run)
        except BudgetError as e:
            return ExecutionHandle.completed(name=run.name, error=e)
        first = self._submit_continuation(run, deps=())
        # NOTE: the handle is built around the first continuation; the continuation
        # touches run.handle only after handle_ready is set (a race of a few microseconds).
        run.handle = ExecutionHandle(owned=(first,), name=run.name, keepalive=ctx)
        run.handle_ready.set()
        run.handle.add_finalizer(lambda r=run: _release(r.exec_reservation))
        return run.handle

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Exactly ``run_async(RuntimeContext(feeds)).wait()``; returns the outputs."""
        ctx = RuntimeContext(feeds)
        try:
            self.run_async(ctx).wait()
        finally:
            ctx.release()  # the caller owns the arrays; the IO arena gets its bytes back
        return ctx.outputs  # type: ignore[return-value]

    # ------------------------------------------------------------ residency helpers
    def prepared_view(self, key: PreparedKey) -> np.ndarray:
        """The stable view of a resident object (tests: address identity)."""
        return self.slots.view(key)

    def evict(self, key: PreparedKey) -> bool:
        """Evict one unpinned object (its slot keeps its address). False if pinned."""
        return self.store.evict(key)

    def _count(self, name: str, n: int = 1) -> None:
        """Counters are bumped from worker threads: under the session lock, never lost."""
        with self._lock:
            setattr(self.counters, name, getattr(self.counters, name) + n)

    def is_prepared(self) -> bool:
        return self._readiness.is_ready()

    # ------------------------------------------------------------------- hot path
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
        them, and sleep after 1 ms without one. Without an idle worker, or on the cold
        path (where the other workers pack weights), splits go through ``fork_join``."""
        lazy, opened = None, []
        if lend_helpers and self._spin_helpers and parts >= 2:
            def open_mailbox():
                from onnx_prep import native

                box = native.Mailbox()
                lent = self.scheduler.lend(box.serve, parts - 1)
                if not lent:
                    return None
                opened.append((box, lent))
                return box

            lazy = intra_op.LazyMailbox(open_mailbox)
            if self._lend_at_start:
                lazy.open_now()
        try:
            with intra_op.using(self.scheduler.fork_join, parts, mailbox=lazy), \
                    append_buffer.room_for(ctx.append_room):
                yield
        finally:
            for box, lent in opened:
                box.stop()
                self.scheduler.reclaim(lent)
                intra_op.COUNTERS.add_handed_off(box.chunks_by_helpers, box.sleeps, box.wakes)
            if lazy is not None:  # the next hot run lends at its start if this one split
                self._lend_at_start = lazy.asked

    def _run_hot(self, ctx: RuntimeContext, pins, run_id: int) -> ExecutionHandle:
        ctx.mode = "hot"
        self._count("hot_runs")
        try:
            if self._hot_binding is None:
                view = self.slots.view
                packed = {k: view(k) for k in self.program.requirements}
                self._hot_binding = self.program.bind_prepared(packed)
                self._hot_weights = {
                    self.plan.by_key[k].request.logical_value: view(k)
                    for k in self._all_keys if self.plan.by_key[k].request.layout == RAW_LAYOUT}
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
            return ExecutionHandle.completed(name=f"run-{run_id}", error=e)
        finally:
            pins.release()
        return ExecutionHandle.completed(name=f"run-{run_id}")

    # ------------------------------------------------------------------- cold path
    def _submit_continuation(self, run: _Run, deps) -> TaskHandle:
        return self.scheduler.submit(lambda tctx, r=run: self._continue(r, tctx),
                                     priority=Priority.CRITICAL, deps=tuple(deps),
                                     name=f"{run.name}:step{run.step}", promote_deps=True)

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
                waiting = []
                for k in keys:
                    if not store.is_resident(k):
                        h = self._ensure(self._publisher[k].id, Priority.CRITICAL)
                        if h is not None:
                            waiting.append(h)
                if waiting:
                    self._count("yields")
                    with self._lock:
                        for k in keys:
                            if not store.is_resident(k):
                                self._critical_wait[k] = si
                    self._make_room()
                    nxt = self._submit_continuation(run, deps=waiting)  # yield until they publish
                    run.handle_ready.wait()
                    for h in waiting:
                        run.handle.add(h, shared=True)
                    run.handle.add(nxt)
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
                with self._executing(ctx, self._parts_cold):
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
        store = self.store
        for si in range(from_step, min(from_step + win.steps, len(self.plan.steps))):
            for k in self._step_keys[si]:
                if store.is_resident(k):
                    continue
                req = self.plan.by_key[k]
                if req.read_bytes + req.packed_bytes > budget:
                    return
                budget -= req.read_bytes + req.packed_bytes
                self._ensure(req.publisher, Priority.DEMANDED)  # the run will consume it

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

    # ------------------------------------------------------------ session tasks
    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("session is closed")

    def _ensure(self, tid: TaskId, priority: Priority) -> TaskHandle | None:
        """The live handle of session task ``tid`` (submitting a new generation if it
        has none, or if its last one failed or its object was evicted); None when its
        object is already resident."""
        with self._lock:
            desc = self.plan.by_id[tid]
            if desc.publishes is not None and self.store.is_resident(desc.publishes):
                return None
            h = self._handles.get(tid)
            if h is not None:
                st = h.state
                if st not in _DEAD and not (st is TaskState.DONE and desc.publishes is not None):
                    if priority < h.priority:
                        self.scheduler.promote(h, priority)
                        if desc.kind is TaskKind.PREPACK:
                            self._ensure_tied(tid, desc, priority)
                    return h
            deps = []
            for d in desc.dependencies:
                dh = self._ensure(d, priority)
                if dh is not None:
                    deps.append(dh)
            h = self.scheduler.submit(self.materializer.task_fn(desc), resource=desc.resource, priority=priority,
                                      deps=tuple(deps), mem=desc.memory_request(), name=desc.id,
                                      meta=desc)
            self._handles[tid] = h
            if desc.kind is TaskKind.READ_SOURCE and desc.publishes is None:
                # A read can finish after its consumers were cancelled (shed): free it then.
                h.add_done_callback(lambda _h, t=tid: self._on_read_done(t))
            elif desc.kind is TaskKind.PREPACK:
                self._ensure_tied(tid, desc, priority)
            return h

    def _ensure_tied(self, tid: TaskId, desc: TaskDescriptor, priority: Priority) -> None:
        """A source shared with other prepacks (a tied embedding / LM head) is read once;
        its other consumers follow at the same priority but no more than DEMANDED, so the
        source buffer is freed early and the last consumer (the LM head, at the end of
        the graph) does not become the load's serial tail. Applies when the prepack is
        submitted and again when it is promoted. Caller holds the lock.

        NOTE: why on promotion too: with run_async() first and prepare_async() right
        behind it (time to first output), prepare_async() submits the embedding and the
        LM head at PREFETCH before the run's first step asks for the embedding at
        CRITICAL. Raising only the embedding then left the LM head and its scales (at
        the end of the data file) behind every DEMANDED read: in cold loads of the medium
        fixture they were read at 114-636 ms and packed in the last 25-35 ms before the
        first output. Raised with the embedding, they are read at ~35-47 ms; cold time to
        first output 469 -> 429 and 505 -> 422 ms (medians of 12 alternating loads),
        warm 352 -> 344 (docs/runtime.md)."""
        sib = Priority(max(priority, Priority.DEMANDED))
        for d in desc.dependencies:
            for c in self._read_consumers.get(d, ()):
                if c == tid:
                    continue
                ch = self._handles.get(c)
                # a new sibling, or a live one to raise; never resubmit one that finished
                # or was cancelled (it comes back when its own consumer asks for it)
                if ch is None or not ch.state.terminal:
                    self._ensure(c, sib)

    def _published(self, key: PreparedKey) -> None:
        """After every publish: while runs wait for objects, make room for them."""
        with self._lock:
            self._critical_wait.pop(key, None)
            pending = bool(self._critical_wait)
        if pending:
            self._make_room()

    def _sources_used(self, read_ids) -> None:
        with self._lock:
            for dep_id in read_ids:
                self._maybe_release_read(dep_id)

    def _make_room(self) -> int:
        """Drop-and-rebuild eviction under a PREPARED arena limit: while the objects runs
        are waiting for do not fit, evict unpinned resident objects, furthest next use
        first. Evicted objects are rebuilt through their recipe when next needed.
        Returns the number evicted."""
        budget = self.budget
        limit = budget.limit(Arena.PREPARED)
        with self._lock:
            for k in list(self._critical_wait):  # a failed or cancelled producer: nobody waits
                h = self._handles.get(self._publisher[k].id)
                if h is None or h.state in _DEAD:
                    del self._critical_wait[k]
            waits = dict(self._critical_wait)
            if limit is None:
                if waits:
                    self._shed_speculative_if_blocked(waits)
                return 0
            if not waits:
                return 0
            needed = sum(self.plan.by_key[k].packed_bytes for k in waits
                         if self.store.state(k).value not in ("resident",))
            keep = set(waits)
            at = min(waits.values())
            for si in set(waits.values()):
                keep.update(self._step_keys[si])
            self._shed_speculative_if_blocked(waits)
            free = limit - budget.live(Arena.PREPARED)
            if free >= needed:
                return 0
            evicted = self.eviction.make_room(self.store, needed, free, at, keep, self.slots.nbytes)
            self._count("evictions", evicted)
            return evicted

    def _shed_speculative_if_blocked(self, waits: Mapping[PreparedKey, int]) -> int:
        """Speculative work must not hold memory an active run needs: when a producer a
        run waits for is queued but cannot be admitted (its memory does not fit now),
        cancel every not-yet-running non-CRITICAL session task (the look-ahead too: it is
        resubmitted when the run gets there) and free the source
        buffers only they still needed. They are resubmitted when next wanted.
        Caller holds the lock. Returns the number cancelled."""
        budget = self.budget
        blocked = False
        for k in waits:
            for t in self.plan.session_closure((k,)):
                h = self._handles.get(t.id)
                if h is None or h.state is not TaskState.READY:
                    continue
                for arena, n in t.memory_request().items():
                    lim = budget.limit(arena)
                    if lim is not None and budget.live(arena) + n > lim:
                        blocked = True
        if not blocked:
            return 0
        shed = 0
        for tid, h in list(self._handles.items()):
            if h.priority is not Priority.CRITICAL and h.state in (TaskState.PENDING, TaskState.READY):
                if h.cancel():
                    shed += 1
        for tid in list(self._handles):
            if self.plan.by_id[tid].kind is TaskKind.READ_SOURCE and self.plan.by_id[tid].publishes is None:
                self._maybe_release_read(tid)
        self._count("shed", shed)
        return shed

    def _on_read_done(self, read_tid: TaskId) -> None:
        with self._lock:
            self._maybe_release_read(read_tid)

    def _maybe_release_read(self, read_tid: TaskId) -> None:
        """Free a source buffer once every plan consumer of it is resident (a tied
        source is held until both of its prepacks have published)."""
        h = self._handles.get(read_tid)
        if h is None or h.state is not TaskState.DONE:
            return
        for c in self._read_consumers.get(read_tid, ()):
            key = self.plan.by_id[c].publishes
            if key is not None and not self.store.is_resident(key):
                ch = self._handles.get(c)
                if ch is None or ch.state not in _DEAD:
                    return  # still needed by a consumer that has not published
        del self._handles[read_tid]
        release_source(h)



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


def _release(reservation) -> None:
    if reservation is not None:
        reservation.release()


class _OutputBytes:
    """Output bytes of a run from declared output shapes, symbolic dims bound by the
    feeds' shapes (same symbol name = same size); unknown dims count as 1."""

    def __init__(self, resolved: ResolvedModel) -> None:
        self.inputs = {v.name: v.shape for v in resolved.inputs}
        self.outputs = [(v.shape, v.elem_type) for v in resolved.outputs]

    def estimate(self, feeds: Mapping[str, np.ndarray]) -> int:
        sym: dict[str, int] = {}
        for name, arr in feeds.items():
            shape = self.inputs.get(name)
            if shape is None:
                continue
            for d, n in zip(shape, np.shape(arr)):
                if isinstance(d, str):
                    sym[d] = max(sym.get(d, 0), int(n))
        total = 0
        for shape, elem in self.outputs:
            if shape is None:
                continue
            dims = [d if isinstance(d, int) else sym.get(d, 1) if isinstance(d, str) else 1
                    for d in shape]
            total += int(math.prod(dims)) * _ELEM_BYTES.get(elem, 4)
        return total


_ELEM_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 16: 2}
