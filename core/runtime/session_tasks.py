"""SessionTasks: the current generation of each session task (source reads, prepacks,
and on a device plan uploads and the staging they copy).

A session's prepared objects are produced by the plan's session tasks; each has at most
one live scheduler task (a *generation*) at a time. This module submits them on demand
(:meth:`SessionTasks.ensure`: a run's producer chain at CRITICAL, its look-ahead at
DEMANDED, a prepare at PREFETCH/BACKGROUND), resubmits one whose object was evicted or
whose last generation failed or was cancelled, follows a tied source's consumers
together, frees each source buffer once every prepack of it has published (a device
plan's staged bytes once their upload has; a source uploaded for the device-side
prepack once every device prepack of it has published), sheds
speculative work that holds memory a run needs, and asks the eviction policy for room
while runs wait (:meth:`SessionTasks.wait_for`).

One lock (the session's) guards the generations and the waits.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from onnx_prep.core.model.prepared_key import PreparedKey
from onnx_prep.core.plan.execution_plan import PreparedExecutionPlan
from onnx_prep.core.plan.task import Priority, TaskDescriptor, TaskId, TaskKind
from onnx_prep.core.runtime.arenas import Arena, MemoryBudget
from onnx_prep.core.runtime.eviction_policy import EvictionPolicy
from onnx_prep.core.runtime.materializer import release_source
from onnx_prep.core.runtime.prepared_store import PreparedObjectStore
from onnx_prep.core.runtime.scheduler import Scheduler, TaskHandle, TaskState
from onnx_prep.core.runtime.timeline import Timeline

__all__ = ["SessionTasks"]

_DEAD = (TaskState.FAILED, TaskState.CANCELLED)


class SessionTasks:
    """``task_fn(desc)`` makes a task's body (the materializer's); ``nbytes(key)`` is what
    evicting a resident key gives back; ``count(name, n=1)`` bumps a session counter."""

    def __init__(self, plan: PreparedExecutionPlan, scheduler: Scheduler, store: PreparedObjectStore,
                 budget: MemoryBudget, eviction: EvictionPolicy, *, task_fn: Callable,
                 nbytes: Callable[[PreparedKey], int], count: Callable[..., None],
                 lock: threading.RLock, timeline: Timeline | None = None) -> None:
        self.plan, self.scheduler, self.store, self.budget = plan, scheduler, store, budget
        self.eviction = eviction
        self._task_fn, self._nbytes, self._count = task_fn, nbytes, count
        self._lock = lock
        self._timeline = timeline  # where the scheduler records this session's task events
        self.handles: dict[TaskId, TaskHandle] = {}  # current generation of each session task
        self.keys = tuple(r.key for r in plan.requirements)
        self._publisher: dict[PreparedKey, TaskDescriptor] = {
            r.key: plan.by_id[r.publisher] for r in plan.requirements}
        # Plan consumers of each non-publishing read (a tied source feeds two prepacks).
        self._read_consumers: dict[TaskId, tuple[TaskId, ...]] = {}
        for t in plan.session_tasks:
            for d in t.dependencies:
                self._read_consumers[d] = self._read_consumers.get(d, ()) + (t.id,)
        self._step_keys = tuple(plan.by_id[s.task_id].prepared_requirements for s in plan.steps)
        # Keys a yielded run is waiting for, with the step it waits at: after every publish
        # the session retries making room for them (see make_room).
        self._critical_wait: dict[PreparedKey, int] = {}
        self._planned: dict[PreparedKey, int] = {}  # under a PREPARED limit: see reserve_room

    def prepare(self, keys=None) -> list[TaskHandle]:
        """Submit every session task eagerly (with ``keys``, those that publish them):
        producers of the first look-ahead window at PREFETCH, the rest at BACKGROUND;
        the live tasks (reads too, so a failing read is named in a status).
        Already-resident objects submit nothing."""
        window = self.plan.lookahead.steps
        shared: list[TaskHandle] = []
        asked = None if keys is None else frozenset(keys)
        wanted = self.keys if asked is None else [k for k in self.keys if k in asked]
        with self._lock:  # NOTE: one lock hold: a tied source counts both consumers
            for r in self.plan.requirements:
                if asked is not None and r.key not in asked:
                    continue
                prio = Priority.PREFETCH if r.first_step < window else Priority.BACKGROUND
                h = self.ensure(r.publisher, prio)
                if h is not None:
                    shared.append(h)
            closure = {t.id for t in self.plan.session_closure(wanted)}
            for tid in closure:
                h = self.handles.get(tid)
                if h is not None and h not in shared:
                    shared.append(h)
        return shared

    def wait_for(self, keys, step: int) -> list[TaskHandle]:
        """A run at ``step`` needs ``keys``: the producers of those not resident, asked
        for at CRITICAL; while it waits for them, room is made for them."""
        waiting = []
        for k in keys:
            if not self.store.is_resident(k):
                with self._lock:  # under a limit: room made as the look-ahead makes it
                    self.reserve_room(k, step, keys)
                    h = self.ensure(self._publisher[k].id, Priority.CRITICAL)
                if h is not None:
                    waiting.append(h)
        if waiting:
            with self._lock:
                for k in keys:
                    if not self.store.is_resident(k):
                        self._critical_wait[k] = step
            self.make_room()
        return waiting

    def close(self) -> None:
        """Cancel every live generation, wait for it, free what reads hold."""
        with self._lock:
            handles = list(self.handles.values())
            self.handles.clear()
        for h in handles:
            h.cancel()
        for h in handles:
            h.wait()
        for h in handles:
            release_source(h)

    def ensure(self, tid: TaskId, priority: Priority) -> TaskHandle | None:
        """The live handle of session task ``tid`` (submitting a new generation if it
        has none, or if its last one failed or its object was evicted); None when its
        object is already resident."""
        with self._lock:
            desc = self.plan.by_id[tid]
            if desc.publishes is not None and self.store.is_resident(desc.publishes):
                return None
            h = self.handles.get(tid)
            if h is not None:
                st = h.state
                if st not in _DEAD and not (st is TaskState.DONE and desc.publishes is not None):
                    if priority < h.priority:
                        self.scheduler.promote(h, priority)
                        if desc.kind is TaskKind.PREPACK:
                            self._ensure_tied(tid, desc, priority)
                    return h
            deps, reads = [], []
            for d in desc.dependencies:
                dh = self.ensure(d, priority)
                if dh is not None:
                    deps.append(dh)
                    if self.plan.by_id[d].publishes is None:  # a read (or a device plan's staging)
                        reads.append((d, dh))
            h = self.scheduler.submit(self._task_fn(desc), resource=desc.resource, priority=priority,
                                      deps=tuple(deps), mem=desc.memory_request(), name=desc.id,
                                      meta=desc, kind=desc.kind, log=self._timeline)
            self.handles[tid] = h
            # A read can finish after its consumers were cancelled (shed): free it then.
            # NOTE: registered once this consumer is in handles, not when the read is
            # submitted: a read already done runs the callback at once, and with the
            # consumer's previous (cancelled) generation still registered it freed the
            # source this one is about to consume (a tight-budget run failed so ~1 in 8
            # times once counting stopped taking the session lock, which had kept every
            # read from finishing while its consumer was being submitted).
            for d, dh in reads:
                dh.add_done_callback(lambda _h, t=d: self._on_read_done(t))
            if desc.kind is TaskKind.PREPACK:
                self._ensure_tied(tid, desc, priority)
            if desc.publishes is None and desc.kind in (TaskKind.PREPACK, TaskKind.UPLOAD):
                # a device plan's CPU prepack into staging, or a source's upload to the
                # device (for the device-side prepack): the reads it copied go when it ends
                h.add_done_callback(lambda _h, d=desc.dependencies: self.sources_used(d))
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
                ch = self.handles.get(c)
                # a new sibling, or a live one to raise; never resubmit one that finished
                # or was cancelled (it comes back when its own consumer asks for it)
                if ch is None or not ch.state.terminal:
                    self.ensure(c, sib)

    def published(self, key: PreparedKey) -> None:
        """After every publish: while runs wait for objects, make room for them."""
        with self._lock:
            self._critical_wait.pop(key, None)
            pending = bool(self._critical_wait)
            # (unless evicted already: the callback runs after the publish, unlocked)
            if self.budget.limit(Arena.PREPARED) is not None and self.store.is_resident(key):
                self._planned.setdefault(key, self.plan.by_key[key].packed_bytes)
        if pending:
            self.make_room()

    def sources_used(self, read_ids) -> None:
        with self._lock:
            for dep_id in read_ids:
                self._maybe_release_read(dep_id)

    # ------------------------------------------------------------ streaming under a limit
    # NOTE: under a PREPARED limit, what to evict is decided from the plan's accounting,
    # never from the budget's live bytes (which depend on when producers happen to be
    # admitted) nor from task states (which depend on when they happen to finish): the
    # planned set holds every object room was made for (by the look-ahead or a run's
    # demand) or that was published, until it is evicted. Decisions are then a function
    # of the runs' positions alone: the same decode evicts and pages in the same objects
    # every time (the batch sweep's counters are identical across repeats), and a
    # producer submitted after its room was made is never blocked by admission.
    def planned_prepared_bytes(self) -> int:
        """Bytes of the objects room has been made for (caller holds the lock)."""
        return sum(self._planned.values())

    def reserve_room(self, key: PreparedKey, at: int, keep) -> bool:
        """Before ``key``'s producer is asked for under a PREPARED limit: make room for it
        (and the tied siblings its prepack brings) by evicting unpinned resident objects
        outside ``keep``, furthest next use from step ``at`` first. False when that
        cannot be done; nothing is counted then."""
        limit = self.budget.limit(Arena.PREPARED)
        if limit is None:
            return True
        with self._lock:
            self._forget_gone()
            if key in self._planned:
                return True
            coming = [key] + [k for k in self._tied_submitted_with(key) if k not in self._planned]
            need = sum(self.plan.by_key[k].packed_bytes for k in coming)
            if not self._evict_until(self.planned_prepared_bytes() + need, limit, at, keep):
                return False
            for k in coming:
                self._planned[k] = self.plan.by_key[k].packed_bytes
            return True

    def _forget_gone(self) -> None:
        """Drop planned objects that are neither resident nor on their way: evicted from
        outside the plan's accounting (``Session.evict``), or whose producer failed or
        was cancelled."""
        for k in [k for k in self._planned if not self.store.is_resident(k)]:
            h = self.handles.get(self._publisher[k].id)
            if h is None or h.state.terminal:
                del self._planned[k]

    def fetch_ahead(self, key: PreparedKey, at: int, keep) -> bool:
        """Under a PREPARED limit: make room for ``key`` (``reserve_room``) and ask for
        its producer at DEMANDED, in one hold of the lock; False when there is no room."""
        with self._lock:
            if not self.reserve_room(key, at, keep):
                return False
            self.ensure(self._publisher[key].id, Priority.DEMANDED)
            return True

    def _tied_submitted_with(self, key: PreparedKey) -> list[PreparedKey]:
        """The tied siblings ``ensure`` submits with ``key``'s prepack (_ensure_tied):
        those never submitted yet."""
        desc = self._publisher[key]
        out = []
        if desc.kind is TaskKind.PREPACK:
            for d in desc.dependencies:
                for c in self._read_consumers.get(d, ()):
                    sib = self.plan.by_id[c].publishes
                    if c != desc.id and self.handles.get(c) is None and sib is not None:
                        out.append(sib)
        return out

    def _evict_until(self, planned: int, limit: int, at: int, keep) -> bool:
        """Evict planned, resident, unpinned objects outside ``keep`` (furthest next use
        first) until ``planned`` fits ``limit``. Caller holds the lock."""
        evicted = 0
        if planned > limit:
            for k in self.eviction.iter_victims(self.store, at, keep):
                if k in self._planned and self.store.evict(k):
                    planned -= self._planned.pop(k)
                    evicted += 1
                    if planned <= limit:
                        break
        if evicted:
            self._count("evictions", evicted)
        return planned <= limit

    def make_room(self) -> int:
        """Drop-and-rebuild eviction under a PREPARED arena limit: while the objects runs
        are waiting for do not fit, evict unpinned resident objects, furthest next use
        first. Evicted objects are rebuilt through their recipe when next needed.
        Returns the number evicted."""
        budget = self.budget
        limit = budget.limit(Arena.PREPARED)
        with self._lock:
            for k in list(self._critical_wait):  # a failed or cancelled producer: nobody waits
                h = self.handles.get(self._publisher[k].id)
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
            # the plan's accounting (see above): the waited-for producers are live, so
            # they are counted; evict until everything counted fits
            self._forget_gone()  # what shedding just cancelled no longer counts
            for k in waits:  # a run's demand counts like the look-ahead's
                self._planned.setdefault(k, self.plan.by_key[k].packed_bytes)
            planned = self.planned_prepared_bytes()
            if planned <= limit:  # every counted producer is admitted as soon as it is queued
                return 0
            before = len(self._planned)
            self._evict_until(planned, limit, at, keep)
            return before - len(self._planned)

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
                h = self.handles.get(t.id)
                if h is None or h.state is not TaskState.READY:
                    continue
                for arena, n in t.memory_request().items():
                    lim = budget.limit(arena)
                    if lim is not None and budget.live(arena) + n > lim:
                        blocked = True
        if not blocked:
            return 0
        shed = 0
        for tid, h in list(self.handles.items()):
            if h.priority is not Priority.CRITICAL and h.state in (TaskState.PENDING, TaskState.READY):
                if h.cancel():
                    shed += 1
        for tid in list(self.handles):
            if self.plan.by_id[tid].publishes is None:  # reads (and a device plan's staging)
                self._maybe_release_read(tid)
        self._count("shed", shed)
        return shed

    def _on_read_done(self, read_tid: TaskId) -> None:
        with self._lock:
            self._maybe_release_read(read_tid)

    def _maybe_release_read(self, read_tid: TaskId) -> None:
        """Free a source buffer once every plan consumer of it has published (a tied
        source is held until both of its prepacks have) or will not run. A consumer that
        published and was evicted since has used it: a later generation reads again
        (holding sources for objects that may never come back filled the PREPARATION
        arena under a tight budget, and a run waiting for a read stalled)."""
        h = self.handles.get(read_tid)
        if h is None or h.state is not TaskState.DONE:
            return
        for c in self._read_consumers.get(read_tid, ()):
            key = self.plan.by_id[c].publishes
            if key is None:  # a device plan's CPU prepack into staging or source upload: done once it ended
                ch = self.handles.get(c)
                if ch is not None and ch.state not in (*_DEAD, TaskState.DONE):
                    return
                continue
            if not self.store.is_resident(key):
                ch = self.handles.get(c)
                if ch is None or ch.state not in (*_DEAD, TaskState.DONE):
                    return  # still needed by a consumer that has not published
        del self.handles[read_tid]
        release_source(h)
