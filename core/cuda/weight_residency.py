"""WeightResidency: which of a decode step's weights are on the device, step after step,
when they do not all fit the device budget.

A step reads its weights in one fixed order (the launch order of its weight-reading
kernels, the ``uses``), the same order every step. Under a budget smaller than the
weights, the step is cut into **segments**: maximal runs of consecutive uses whose
distinct weights (each rounded up to whole granules, what the device really commits)
fit the budget together. Before a segment runs, ``prepare`` makes its weights resident:
it evicts others, the one needed furthest ahead first (the uses repeat every step, so
the next use of each weight is known exactly: the choice that pages least, as the CPU
runtime's EvictionPolicy makes it), and pages in the missing ones through its
**pager**, which says where a weight comes from:

- :class:`HostCopies`: page-locked host copies of the packed bytes, kept for the
  residency's life (``DeviceSlotPool.commit`` + an async upload on the step's stream);
- a device session's own plan (core/cuda/session_pages.py, ``SessionPages``): the
  session's recipes make the weight resident again (its prepared-cache payload read
  and uploaded, or its sources read and packed on the device, or packed on a CPU worker
  and uploaded), and its store evicts it. Nothing of the model stays in host memory.

Why segments, and why this keeps CUDA-graph capture: a page-in maps physical memory
(``cuMemMap``), which no graph can hold, so page-ins happen between segments, and each
segment is its own graph (core/cuda/step_graph.py). The cut depends only on the uses'
sizes and the budget, so it is the same every step, and a weight paged back in lands at
its reserved address (stable-VA slots): every segment's graph replays, none is
captured again.

Eviction waits for the device: the stream may still hold queued kernels that read the
victim. So ``finished`` records an event after each segment's work, and evicting a
weight first synchronises the event of the last segment that read it (unmapping memory
a queued kernel still reads is a fault the device reports later). With one stream the
wait drains the queue up to that segment; a copy stream that overlaps page-ins with the
previous segment's kernels is a later step.

Counters (``counters()``): uses, hits (a use whose weight was resident when its segment
was prepared), page-ins, evictions, host-to-device bytes and the byte hit rate, beside
the pool's committed bytes and their peak. A weight larger than the budget on its own is
refused when the residency is made, before anything is paged.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from onnx_prep.core.cuda.device_slot_pool import DeviceSlotPool, DeviceView
from onnx_prep.core.errors import DeviceBudgetError, Where
from onnx_prep.core.model.prepared_key import PreparedKey

__all__ = ["HostCopies", "ResidencyCounters", "WeightPager", "WeightResidency", "segments"]


@dataclass
class ResidencyCounters:
    segments_per_step: int = 0
    steps: int = 0
    uses: int = 0  # weight uses prepared (distinct weights per segment, summed)
    hits: int = 0  # of those, resident already
    hit_bytes: int = 0
    page_ins: int = 0
    page_in_bytes: int = 0  # host to device, by this residency
    evictions: int = 0
    eviction_waits: int = 0  # evictions that synchronised an event first
    committed_bytes: int = 0  # the pool's, granule-rounded
    peak_committed_bytes: int = 0

    @property
    def byte_hit_rate(self) -> float:
        total = self.hit_bytes + self.page_in_bytes
        return self.hit_bytes / total if total else 1.0

    def to_json(self) -> dict:
        return {**asdict(self), "byte_hit_rate": self.byte_hit_rate}


def segments(uses: Sequence[PreparedKey], sizes: Mapping[PreparedKey, int], budget: int | None
             ) -> tuple[tuple[int, int], ...]:
    """The step's cut: ``(start, end)`` ranges over ``uses``, each maximal (greedy from the
    step's start) with its distinct weights' ``sizes`` summing to at most ``budget``.
    No budget: one segment. A weight over the budget alone raises DeviceBudgetError."""
    if not uses:
        return ()
    if budget is None:
        return ((0, len(uses)),)
    for key in dict.fromkeys(uses):
        if sizes[key] > budget:
            raise DeviceBudgetError(f"weight needs {sizes[key]:,} device bytes (whole granules), more than the "
                                    f"device budget of {budget:,}", Where(tensor=key), hint="raise --budget")
    out, start, held, total = [], 0, set(), 0
    for i, key in enumerate(uses):
        if key in held:
            continue
        if total + sizes[key] > budget:
            out.append((start, i))
            start, held, total = i, set(), 0
        held.add(key)
        total += sizes[key]
    out.append((start, len(uses)))
    return tuple(out)


class WeightPager(Protocol):
    """Where a residency's weights come from and go back to."""

    def nbytes(self, key: PreparedKey) -> int: ...  # the weight's bytes (its object's size)

    def page_in(self, keys: Sequence[PreparedKey], stream: Any) -> None:
        """Make ``keys`` resident (their slots committed under the pool's budget), each
        copy either done when this returns or queued on ``stream`` (before whatever the
        caller queues next)."""

    def evict(self, key: PreparedKey) -> None: ...  # its memory back; its address stays reserved


class HostCopies:
    """A pager over page-locked host copies (``driver.host_alloc``'s, one per weight, kept
    by the caller for the residency's life): a page-in commits the slot and queues the
    copy on the step's stream."""

    def __init__(self, pool: DeviceSlotPool, host: Mapping[PreparedKey, Any]) -> None:
        self.pool, self.host = pool, host

    def nbytes(self, key: PreparedKey) -> int:
        return memoryview(self.host[key]).nbytes

    def page_in(self, keys: Sequence[PreparedKey], stream: Any) -> None:
        for k in keys:
            self.pool.commit(k, self.nbytes(k))
            self.pool.upload(k, self.host[k], stream)

    def evict(self, key: PreparedKey) -> None:
        self.pool.decommit(key)


class WeightResidency:
    """The weights ``uses`` reads, paged into ``pool`` by ``pager`` (a :class:`WeightPager`,
    or a mapping of page-locked host copies: :class:`HostCopies` over it) on ``stream``.
    ``budget``: what the step's weights may commit together (None: the pool's budget);
    less than the pool's where the pool also holds what this residency never pages
    (a device session's raw weights)."""

    def __init__(self, pool: DeviceSlotPool, uses: Sequence[PreparedKey], pager: WeightPager | Mapping[PreparedKey, Any],
                 stream: Any, *, budget: int | None = None) -> None:
        self.pool, self.driver, self.stream = pool, pool.driver, stream
        self.uses = tuple(uses)
        self.pager = HostCopies(pool, pager) if isinstance(pager, Mapping) else pager
        g = pool.granularity
        self.nbytes = {k: self.pager.nbytes(k) for k in dict.fromkeys(self.uses)}
        self.sizes = {k: -(-max(n, 1) // g) * g for k, n in self.nbytes.items()}
        self.budget = pool.budget if budget is None else budget
        self.segments = segments(self.uses, self.sizes, self.budget)
        for k, size in self.sizes.items():  # every weight's address, fixed from now on
            if k not in pool:  # (the caller may have reserved it already, to build launches first)
                pool.reserve(k, size)
        self._keys = tuple(tuple(dict.fromkeys(self.uses[a:b])) for a, b in self.segments)
        self._positions: dict[PreparedKey, tuple[int, ...]] = {}
        for i, k in enumerate(self.uses):
            self._positions[k] = self._positions.get(k, ()) + (i,)
        self._resident: set[PreparedKey] = set()
        self._last_reader: dict[PreparedKey, Any] = {}  # weight -> event after the last segment reading it
        self._events = [self.driver.event_create() for _ in self.segments]
        self._c = ResidencyCounters(segments_per_step=len(self.segments))

    def next_use(self, key: PreparedKey, at: int) -> int:
        """Uses from position ``at`` until ``key`` is read again (wrapping to the next step)."""
        n = len(self.uses)
        return min((p - at) % n for p in self._positions[key])

    def prepare(self, index: int) -> None:
        """Make segment ``index``'s weights resident (evicting, then paging in, as the
        module docstring says); the uploads are queued on the stream, before whatever
        the caller queues for the segment."""
        keys = self._keys[index]
        c = self._c
        missing = [k for k in keys if k not in self._resident]
        for k in keys:
            c.uses += 1
            if k in self._resident:
                c.hits += 1
                c.hit_bytes += self.nbytes[k]
        need = sum(self.sizes[k] for k in missing)
        headroom = self.pool.headroom()
        if headroom is not None and need > headroom:
            start = self.segments[index][0]
            victims = sorted((k for k in self._resident if k not in keys),
                             key=lambda k: (-self.next_use(k, start), self.uses.index(k)))
            for victim in victims:
                if need <= headroom:
                    break
                self._evict(victim)
                headroom = self.pool.headroom()
        if missing:
            self.pager.page_in(missing, self.stream)
        for k in missing:
            self._resident.add(k)
            c.page_ins += 1
            c.page_in_bytes += self.nbytes[k]

    def finished(self, index: int) -> None:
        """Segment ``index``'s work is queued: record its event, which evicting any of
        its weights will wait for."""
        event = self._events[index]
        self.driver.event_record(event, self.stream)
        for k in self._keys[index]:
            self._last_reader[k] = event

    def step(self, run_segment: Callable[[int], None]) -> None:
        """One step: for each segment, ``prepare``, ``run_segment(index)`` (which queues
        the segment's work on the stream, or launches its graph), ``finished``."""
        for i in range(len(self.segments)):
            self.prepare(i)
            run_segment(i)
            self.finished(i)
        self._c.steps += 1

    def view(self, key: PreparedKey) -> DeviceView:
        """The weight's device view: its stable address, resident or not (what a
        launch, and a graph's key, take before the weight is paged in)."""
        return DeviceView(self.pool.address(key), self.nbytes[key])

    def keys(self, index: int) -> tuple[PreparedKey, ...]:
        return self._keys[index]

    def counters(self) -> ResidencyCounters:
        pc = self.pool.counters()
        return ResidencyCounters(**{**asdict(self._c), "committed_bytes": pc.committed_bytes,
                                    "peak_committed_bytes": pc.peak_committed_bytes})

    def close(self) -> None:
        """Wait for the stream, evict every weight, destroy the events (the pool's
        ranges stay: the pool's owner closes it)."""
        self.driver.stream_synchronize(self.stream)
        for k in list(self._resident):
            self.pager.evict(k)
        self._resident.clear()
        for e in self._events:
            self.driver.event_destroy(e)
        self._events = []

    def _evict(self, key: PreparedKey) -> None:
        event = self._last_reader.pop(key, None)
        if event is not None:
            self.driver.event_synchronize(event)
            self._c.eviction_waits += 1
        self.pager.evict(key)
        self._resident.discard(key)
        self._c.evictions += 1
