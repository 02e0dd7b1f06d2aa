"""Session: prepared execution of one resolved model over the shared runtime substrate.

A session owns (or shares, through a :class:`Workspace`) a :class:`Scheduler` and a
:class:`MemoryBudget`, and owns a :class:`PreparedObjectStore`, the immutable
:class:`PreparedExecutionPlan` and the compiled :class:`ActionProgram`. It is the facade
over the parts that hold the rest, each by the state it owns:

- ``slots`` (``slot_pool.HostSlotPool``): one stable address range per prepared key;
- ``materializer`` (``materializer.Materializer``): recipe -> task bodies;
- ``tasks`` (``session_tasks.SessionTasks``): the live generation of each session task;
- ``eviction`` (``eviction_policy.EvictionPolicy``): what to evict, by next use;
- ``runs`` (``run_loop.RunLoop``): the hot path and the cold path.

Contract
--------
``Session(resolved, options: SessionOptions | None = None, **kw)``
    ``resolved`` must be a frozen ResolvedModel (``Session.open(path)`` resolves first).
    ``options`` is the one configuration record; keyword arguments of its field names
    override it. ``source_pages``: whether each source tensor leaves the page cache
    once prepacked ("keep", "drop", or "auto": drop when the payload is over a quarter
    of the memory available; ``source_pages.drop_source_pages``).
    ``Session.source_pages`` is the choice made.
``prepare_async() -> ExecutionHandle`` submits every session task (reads, prepacks);
    ``prepare()`` is exactly ``prepare_async().wait()``.
``run_async(ctx: RuntimeContext) -> ExecutionHandle``; ``run(feeds) -> dict`` is exactly
    ``run_async(RuntimeContext(feeds)).wait()`` and returns ``ctx.outputs``. How runs
    execute (cold continuation, hot replay): ``run_loop.py``.

Residency: every prepared object (packed weight, or raw external weight) lives in a
host stable-VA slot (``onnx_prep.native.StableSlot``) reserved once per key: eviction
decommits the pages, re-materialization commits them again at the SAME address, so the
numpy views and the hot path's binding, made once, stay valid.

On a device (``SessionOptions(device=...)``: a ``session_device.SessionDevice``, e.g.
core/cuda/session_device.py's ``CudaSessionDevice``): the plan is the device plan for
the device's ``target()``, every prepared object lives in the device's slot pool
(device stable-VA slots), the plan's uploads run on one device queue (the session's own
workspace gets it), and ``prepare()`` loads every object into its device slot. The
session owns the device from then on: ``close()`` closes it (slots, stream, staging),
as does a construction that fails. Where the device packs (``packs_on_device``), the
plan takes the kernel's choice of where to pack (``target()``'s ``prepack="kernel"``)
and the device-side prepack runs on the device queue (materializer.py). What is
refused, each in one line: a plan that packs on a device without the kernel
(``packs_on_device`` False); a budget below every slot at once, unless the caller pages
(``device_pages=True``: it asks for the objects a step needs with ``prepare(keys)`` and
gives them back with ``evict(key)``, as core/cuda/session_pages.py does for a decode
streamed under the budget; the device's pool refuses any commit past the budget); a
prepared cache that persists (a device session does not write one: build it first); a
host PREPARED limit (the objects live in device memory, under the device's budget).
``run`` is refused: a device's steps are run by core/cuda/device_decoder.py, over
this session's slots.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

import numpy as np

from onnx_prep.core.errors import UsageError
from onnx_prep.core.io.external_data import ExternalDataReader
from onnx_prep.core.model.prepared_key import PreparedKey
from onnx_prep.core.model.resolved_model import ResolvedModel, require_frozen
from onnx_prep.core.ops.intra_op import spin_helpers_default
from onnx_prep.core.plan.execution_plan import (
    RAW_LAYOUT,
    READ_PACKED_PAYLOAD,
    LookaheadWindow,
    PackedPayloadIndex,
    PreparedExecutionPlan,
    build_prepared_execution_plan,
)
from onnx_prep.core.plan.task import ResourceClass
from onnx_prep.core.runtime.action_program import ActionProgram
from onnx_prep.core.runtime.arenas import Arena, MemoryBudget
from onnx_prep.core.runtime.eviction_policy import EvictionPolicy
from onnx_prep.core.runtime.execution_handle import ExecutionHandle
from onnx_prep.core.runtime.materializer import SOURCE_IO, Materializer
from onnx_prep.core.runtime.prepared_store import PreparedObjectStore
from onnx_prep.core.runtime.run_loop import RunLoop, RuntimeContext
from onnx_prep.core.runtime.scheduler import Scheduler, TaskEvent
from onnx_prep.core.runtime.session_device import SessionDevice
from onnx_prep.core.runtime.session_tasks import SessionTasks
from onnx_prep.core.runtime.slot_pool import HostSlotPool, to_idle_priority
from onnx_prep.core.runtime.stats import RuntimeStats, SessionStats

__all__ = ["Session", "SessionOptions", "Workspace", "RuntimeContext"]


class Workspace:
    """A scheduler and a memory budget shared by several sessions in one process.

    Sessions on one workspace share its worker threads and compete for its arenas;
    an allocation that cannot fit fails that run's handle with a BudgetError naming
    the arena and sizes, and the session works again once memory allows.
    """

    def __init__(self, *, budget: MemoryBudget | None = None, io_workers: int = 2,
                 cpu_workers: int | None = None, sequential: bool = False, device_queues: int = 0) -> None:
        self.budget = budget or MemoryBudget()
        self.scheduler = Scheduler(io_workers=io_workers, cpu_workers=cpu_workers, device_queues=device_queues,
                                   budget=self.budget, sequential=sequential)

    def close(self) -> None:
        self.scheduler.close()

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
    # At most this many threads compute one op: the calling thread and the helpers it
    # borrows (``--threads``, as ONNX Runtime's intra-op threads count the caller). None:
    # as many as the CPU workers and cores allow.
    intra_op_threads: int | None = None
    spin_helpers: bool | None = None  # None: ONNX_PREP_SPIN_HELPERS (see _executing)
    warm_slots: bool = True  # commit reserved slots from idle CPU during prepare
    source_pages: str = "auto"  # keep / drop / auto (see the module docstring)
    verify_digests: bool = True  # check trusted digests as the reader reads (external_data)
    cache: PackedPayloadIndex | None = None  # a prepared cache (core/cache/prepared_cache.py)
    # Stable slots on transparent huge pages: None is ONNX_PREP_HUGE_PAGES, except under a
    # PREPARED limit, where it is on (see Session.__init__)
    huge_pages: bool | None = None
    fuse: bool = True  # Session.open: fuse standard-op patterns at resolve (core/model/fusion.py)
    # Every run returns every value its nodes computed, not only the graph outputs
    # (ActionProgram.compile's keep_values: nothing is freed during a run); for comparing
    # a step value by value with another runtime (core/decode/node_comparison.py). A
    # value that is a view of a weight is valid only while the session is open.
    keep_values: bool = False
    # The device to load onto (session_device.SessionDevice; the module docstring); None: the CPU
    device: SessionDevice | None = None
    # On a device: the caller pages the objects (prepare(keys), evict), so a budget below
    # every slot at once is not refused here (the module docstring)
    device_pages: bool = False

    def __post_init__(self) -> None:
        if self.device_pages and self.device is None:
            raise UsageError("device_pages pages a device's objects: give the session a device")
        if self.source_io not in SOURCE_IO:
            raise UsageError(f"unknown source_io {self.source_io!r}",
                             hint=f"choose one of {', '.join(SOURCE_IO)}")
        if not self.verify_digests and getattr(self.cache, "persisting", False):
            raise UsageError("a prepared cache persists only verified bytes: digest verification "
                             "cannot be off while it is written",
                             hint="drop --no-verify-digests, or use --cache-policy read-only")


class Session:
    def __init__(self, resolved: ResolvedModel, options: SessionOptions | None = None, **kw) -> None:
        opts = self.options = replace(options or SessionOptions(), **kw)
        self.source_io = opts.source_io
        self.resolved = require_frozen(resolved)
        from onnx_prep.core.runtime.source_pages import available_memory_bytes, drop_source_pages

        # NOTE: dropping a prepacked source from the page cache frees memory for what
        # comes next and spares the kernel reclaiming it later; keeping it makes the next
        # load of the same model warm. Measured, docs/runtime.md ("Source pages").
        self._drop_sources = drop_source_pages(
            opts.source_pages, resolved.manifest.total_bytes,
            available_memory_bytes() if opts.source_pages == "auto" else None)
        from onnx_prep.native import active_isa

        self.isa = active_isa()  # a bad ONNX_PREP_ISA or a stale build fails here, before any work
        from onnx_prep.core.ops import weight_streaming

        weight_streaming.choice()  # the decode GEMVs' streaming for this machine: probed once a process (~5 ms)
        device = self.device = opts.device
        try:
            self.plan: PreparedExecutionPlan = build_prepared_execution_plan(
                resolved, lookahead=opts.lookahead, cache=opts.cache,
                device=None if device is None else device.target())
            if device is not None:
                self._check_device_load(device, opts)
        except BaseException:
            if device is not None:  # the session owns it (module docstring)
                device.close()
            raise
        self.program = ActionProgram.compile(resolved, keep_values=opts.keep_values)
        self.reader = opts.reader or ExternalDataReader.for_model(
            resolved, trust_symlinks=opts.trust_symlinks, verify_digests=opts.verify_digests,
            compute_digests=bool(getattr(opts.cache, "persisting", False)))
        self._own_workspace = opts.workspace is None
        # NOTE: a device has ONE queue worker: its uploads go through one stream in order
        # (core/cuda/session_device.py), and a second worker would only wait on its lock.
        self.workspace = opts.workspace or Workspace(budget=opts.budget, io_workers=opts.io_workers,
                                                     cpu_workers=opts.cpu_workers, sequential=opts.sequential,
                                                     device_queues=0 if device is None else 1)
        self.scheduler: Scheduler = self.workspace.scheduler
        self.budget: MemoryBudget = self.workspace.budget
        self.store = PreparedObjectStore()
        # What the session counts, its tasks' timeline, the arena peaks since it opened:
        # stats() is the record of them (core/runtime/stats.py).
        self._stats = SessionStats(self.reader.counters, self.budget, None if device is None else device.memory)
        self._lock = threading.RLock()
        self._closed = False
        self._held_writes = False  # the first run held the cache writer (_hold_cache_writes)
        plan = self.plan

        # Every requirement's stable slot is reserved here, before any worker runs, so
        # materializing only populates pages (HostSlotPool.reserve says why).
        # NOTE: under a PREPARED limit objects are evicted and paged back every run, and
        # the same slots are committed again and again: on huge pages a 40 MB commit and
        # decommit took 2 ms here, on 4 KiB pages 28-48 ms (one fault per page, each a
        # trap to the host on this VM), the most of a page-in's cost. The first-use cost
        # that keeps them off by default (docs/runtime.md) is paid once, not per step.
        huge = opts.huge_pages
        if huge is None and self.budget.limit(Arena.PREPARED) is not None:
            huge = True
        # on a device: its slot pool (device stable-VA slots, reserved here alike), where
        # the raw weights (a few KiB each, read by every step, never paged) share
        # granules instead of taking one each (device_slot_pool.py: shared ranges); in
        # plan order, as the plan's device_memory places them
        self.slots = HostSlotPool(huge_pages=huge) if device is None else device.slots
        for r in plan.requirements:
            if r.packed_bytes > 0:
                self.slots.reserve(r.key, r.packed_bytes,
                                   shared=device is not None and r.request.layout == RAW_LAYOUT)
        self.eviction = EvictionPolicy(plan)
        self.tasks = SessionTasks(plan, self.scheduler, self.store, self.budget, self.eviction,
                                  task_fn=lambda desc: self.materializer.task_fn(desc),
                                  nbytes=self.slots.nbytes, count=self._count, lock=self._lock,
                                  timeline=self._stats.timeline)
        self.materializer = Materializer(
            resolved, plan, self.reader, self.store, self.slots, source_io=self.source_io,
            drop_sources=self._drop_sources, count=self._count, published=self.tasks.published,
            sources_used=self.tasks.sources_used, device=device)

        # Intra-op parts (core/ops/intra_op.py): the hot path runs on the caller's thread,
        # so its parts are the caller plus the CPU workers; a cold step runs on a worker.
        cores = os.cpu_count() or 1
        cpu = 0 if (self.scheduler.sequential or not opts.intra_op) else self.scheduler.workers(ResourceClass.CPU)
        cap = cores if opts.intra_op_threads is None else max(1, opts.intra_op_threads)
        # Hot runs borrow idle CPU workers as helpers that wait in C, spinning, for the
        # chunks of each split matmul (RunLoop._executing); False: chunks go through
        # Scheduler.fork_join, to workers that sleep between them (no core spent waiting).
        # None: ONNX_PREP_SPIN_HELPERS (default on).
        spin = spin_helpers_default() if opts.spin_helpers is None else bool(opts.spin_helpers)
        self.runs = RunLoop(resolved, plan, self.program, self.store, self.slots, self.scheduler,
                            self.budget, self.tasks, parts_hot=min(cores, cpu + 1, cap) if cpu else 1,
                            parts_cold=min(cores, cpu, cap) if cpu else 1, spin_helpers=spin,
                            stats=self._stats)

        # Slot warming (_warm_slots_loop): while a parallel prepare runs and no run does, a
        # thread in the OS's idle class commits the reserved slots' pages ahead of their
        # prepacks, on CPU time the workers leave idle (waiting for reads, at the tail).
        # Only without memory limits: it commits pages before their admission.
        self._warm_slots = (opts.warm_slots and device is None and not self.scheduler.sequential
                            and self.budget.global_limit is None and self.budget.limit(Arena.PREPARED) is None)
        self._warmer: threading.Thread | None = None

    def _check_device_load(self, device: SessionDevice, opts: SessionOptions) -> None:
        """What a device session refuses before any work (the module docstring)."""
        from onnx_prep.core.errors import DeviceBudgetError
        from onnx_prep.core.kernels.spec import DEVICE_PREPACK
        from onnx_prep.core.plan.device_target import device_memory
        from onnx_prep.core.runtime.session_device import device_prepack_refused

        plan = self.plan
        packs = [r.request.logical_value for r in plan.requirements if r.selected.kind == DEVICE_PREPACK]
        if packs and not device.packs_on_device:
            raise device_prepack_refused(device.name, packs, getattr(device, "device_prepack_reason", None))
        memory = device_memory(plan)
        if memory["fits"] is False and not opts.device_pages:
            raise DeviceBudgetError(
                f"device budget {plan.device.budget:,} B is below the {memory['committed_bytes']:,} B that all "
                f"{memory['slots']} device slots commit ({plan.device.granularity:,} B granules): a device session "
                "loads every prepared object at once unless its caller pages them (device_pages=True)",
                hint=f"give a device budget of at least {memory['committed_bytes']:,} B")
        if getattr(opts.cache, "persisting", False):
            raise UsageError("a session on a device does not write the prepared cache",
                             hint="build it first (onnx-prep build-cache), then open it read-only")
        budget = opts.workspace.budget if opts.workspace is not None else opts.budget
        if budget is not None and budget.limit(Arena.PREPARED) is not None:
            # the device's objects live in its slot pool, under the device budget: a host
            # PREPARED limit would bound nothing there
            raise UsageError(f"a PREPARED limit ({budget.limit(Arena.PREPARED):,} B) means nothing to a session "
                             f"on {device.name}: its prepared objects live in device memory",
                             hint="limit device memory with the device's budget (CudaSessionDevice(budget=...))")
        ws = opts.workspace
        if ws is not None and not ws.scheduler.sequential and ws.scheduler.workers(ResourceClass.DEVICE) == 0:
            raise UsageError("the shared workspace has no device queue for this session's uploads",
                             hint="make it with Workspace(device_queues=1)")

    @property
    def source_pages(self) -> str:
        """The source-pages choice made at construction: "keep" or "drop"."""
        return "drop" if self._drop_sources else "keep"

    # ----------------------------------------------------------------- construction
    @classmethod
    def open(cls, model_path: str | Path, options: SessionOptions | None = None, **kw) -> Session:
        from onnx_prep.core.model.resolution import resolve_model

        opts = replace(options or SessionOptions(), **kw)
        resolved = resolve_model(Path(model_path), trust_symlinks=opts.trust_symlinks, fuse=opts.fuse)
        return cls(resolved, opts)

    def close(self) -> None:
        """Cancel outstanding session work, release every resident object, and stop
        the scheduler if this session owns it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.runs.close()  # helpers kept lent between hot runs go back first
        self.tasks.close()
        if self.plan.cache is not None:  # objects handed over to be persisted stay pinned until written
            self.plan.cache.flush()
        warmer = self._warmer
        if warmer is not None:
            warmer.join()  # it sees _closed at its next step
        if self._own_workspace:
            self.workspace.close()
        self.store.clear()
        self.slots.close()  # reserved slots never used: their address ranges go back now
        if self.device is not None:
            self.device.close()  # its stream, events and any staging left
        self._stats.close()
        self.reader.close_shared()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------- public API
    def prepare_async(self, keys=None) -> ExecutionHandle:
        """Submit every session task eagerly (``SessionTasks.prepare``; with ``keys``,
        only what publishes those prepared keys); the handle holds them as shared
        tasks. Already-resident objects submit nothing."""
        self._check_open()
        since = self._stats.start()
        handle = ExecutionHandle(shared=self.tasks.prepare(keys), name="prepare",
                                 stats=lambda: self._stats.finish(since, None))
        self._start_warmer(handle)
        return handle

    def _runs_started(self) -> bool:
        """Whether any run has started here (read without the lock by the warmer's
        steps: a hint there, checked again under the lock at its next slot)."""
        return self.runs.started

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

        cache = self.plan.cache

        def mapped(r) -> bool:  # a payload mapped into its slot wants no pages of its own
            return (cache is not None and r.selected.kind == READ_PACKED_PAYLOAD
                    and cache.mapping(r.selected.payload) is not None)

        self.slots.warm(((r.key, r.packed_bytes) for r in self.plan.requirements if not mapped(r)),
                        stop, on_warmed=lambda n: self._count("slot_bytes_warmed", n))  # in order of first use

    def prepare(self, keys=None) -> None:
        self.prepare_async(keys).wait()

    def run_async(self, ctx: RuntimeContext) -> ExecutionHandle:
        self._check_open()
        self._check_runs_here()
        release = self._hold_cache_writes()
        try:
            handle = self.runs.run_async(ctx)
        except BaseException:
            if release is not None:
                release()
            raise
        if release is not None:
            handle.add_finalizer(release)  # at once for a run that finished in run_async
        return handle

    def _hold_cache_writes(self):
        """For the session's first run: hold the prepared cache's background writer until
        the run ends (``PreparedCache.hold_writes``), so a first build persists after its
        first output, not beside it. Not under a PREPARED or global limit: objects
        waiting to be written stay pinned, and the run may need their room."""
        with self._lock:
            if self._held_writes:
                return None
            self._held_writes = True
        hold = getattr(self.plan.cache, "hold_writes", None)
        if hold is None or self.budget.global_limit is not None or self.budget.limit(Arena.PREPARED) is not None:
            return None
        return hold()

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Exactly ``run_async(RuntimeContext(feeds)).wait()``; returns the outputs."""
        ctx = RuntimeContext(feeds)
        try:
            handle = self.run_async(ctx)
            try:
                handle.wait()
            except BaseException:  # a Ctrl-C before wait() took it over: nobody waits for the run now
                handle.cancel()  # (a finished run: nothing to do)
                raise
        finally:
            ctx.release()  # the caller owns the arrays; the IO arena gets its bytes back
        return ctx.outputs  # type: ignore[return-value]

    def is_prepared(self) -> bool:
        return self.runs.readiness.is_ready()

    # ------------------------------------------------------------ residency helpers
    def prepared_view(self, key: PreparedKey) -> np.ndarray:
        """The stable view of a resident object (tests: address identity)."""
        return self.slots.view(key)

    def evict(self, key: PreparedKey) -> bool:
        """Evict one unpinned object (its slot keeps its address), counted in the
        ``prepare`` section's evictions as the eviction policy's are. False if pinned."""
        evicted = self.store.evict(key)
        if evicted:
            self._count("evictions")
        return evicted

    def replay_hot(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The hot path's baseline (benchmarks): ``RunLoop.replay_hot``."""
        self._check_runs_here()
        return self.runs.replay_hot(feeds)

    def _check_runs_here(self) -> None:
        if self.device is not None:
            from onnx_prep.core.errors import DeviceError

            raise DeviceError(f"this session loads onto {self.device.name}, and the device step is not built "
                              "(no device graph runner runs a device plan's steps yet): it can prepare, not run",
                              hint="run on the CPU: a session without a device")

    # ------------------------------------------------------------------ statistics
    def stats(self) -> RuntimeStats:
        """The record since the session opened (core/runtime/stats.py): its reader's
        bytes, its prepared objects, its runs and their ops, its tasks, the arena peaks."""
        return self._stats.record()

    def timeline(self) -> list[TaskEvent]:
        """The events of this session's scheduler tasks, in completion order (task id,
        name, kind, resource, priority, worker, submit / ready / start / end times): a
        trace of its reads, prepacks and cold-run steps, apart from other sessions'."""
        return self._stats.timeline.events()

    def _count(self, name: str, n: int = 1) -> None:
        self._stats.counters.add(name, n)

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("session is closed")
