"""RuntimeStats: one record of what a session did, or one of its runs did.

Every counter of the runtime has its home here or writes into one of these; none is
process-wide. Who counts what:

- the session's reader (``ExternalDataReader.counters``, per reader): source bytes read
  and mapped, the reads, the bytes dropped from the page cache;
- the session (a :class:`Counters`): prepacks and their time, materializations,
  page-ins, evictions, runs hot and cold, ...;
- a run's ops (core/ops/run_counters.py), into the run's own :class:`Counters`
  (``RuntimeContext.counters``), which the session adds to its own when the run ends:
  KV Concats appended in place or copied, INT4 matmuls split, the chunks lent helpers ran;
- the session's :class:`~onnx_prep.core.runtime.timeline.Timeline`: its scheduler tasks
  by kind and by resource queue (how long they waited for a worker and memory);
- a :class:`~onnx_prep.core.runtime.arenas.PeakWatch`: arena peaks.

A session keeps the last four in one :class:`SessionStats`, which makes its records.
Scheduler-wide diagnostics (``Scheduler.futile_wakeups``, ``side_jobs_run``) stay on the
scheduler: a workspace's scheduler serves several sessions, so they are no session's.

``Session.stats()`` is the record since the session opened. ``handle.stats()`` on the
handle of ``run_async`` or ``prepare_async``, once it is done, is the record over that
submission: what the session did from its start to its end (reads, prepacks, ... of the
tasks that ended meanwhile, whoever asked for them), except for what is the run's own:
its hot or cold run, its yields and its ops' counts (a concurrent run's are not in
it), and its arena peaks (what the budget held at most while it was in flight).

``to_json()`` shape (schema ``stats/1``; times in nanoseconds, sizes in bytes)::

    {"schema": "stats/1",
     "io": {"source_bytes", "source_bytes_read", "source_bytes_mapped", "source_reads",
            "source_bytes_dropped", "packed_bytes_read", "packed_bytes_mapped", "packed_bytes_pmd_mapped",
            "packed_reads"},
     "prepare": {"prepacks", "prepack_ns", "materializations", "page_ins", "page_in_bytes",
                 "evictions", "shed", "slot_bytes_warmed"},
     "runs": {"hot", "cold", "yields", "reads_first"},
     "memory": {"arena_peaks": {"preparation", "prepared", "execution", "io"}, "global_peak"},
     "tasks": {KIND: {"tasks", "ran", "queue_wait_ns", "run_ns", "cpu_ns"}},
     "queues": {RESOURCE: {"tasks", "ran", "queue_wait_ns", "run_ns", "cpu_ns"}},
     "kv": {"appended_in_place", "copied"},
     "intra_op": {"matmul_splits", "split_parts", "attention_splits", "runs_lending", "chunks_by_helpers",
                  "helper_sleeps", "helper_wakes"},
     "device": {"uploads", "source_uploads", "host_to_device_bytes", "upload_ns", "device_prepacks",
                "device_prepack_ns", "committed_bytes", "peak_committed_bytes"}}   # a session on a device only

``device`` is there for a session that loads onto a device (``SessionOptions(device=...)``;
a CPU session's record is as it was): its uploads of prepared objects (``uploads``: packed
on a CPU worker, read from a prepared cache, or raw weights) and of sources for the
device-side prepack (``source_uploads``), the bytes they copied host to device and their
device time (``upload_ns``: the elapsed time of the events recorded around each copy on
the device's stream, summed), the objects packed on the device (``device_prepacks``; a
CPU prepack counts in ``prepacks``) and their device time (``device_prepack_ns``, events
likewise), then the device slot pool's committed bytes
(granule-rounded) when the record was made and their peak since the session opened;
those two are the pool's, not differences, in a submission's record too.

``source_bytes`` is read plus mapped (a session's map path faults every mapped byte in).
``packed_*`` count reads of a prepared cache: 0 until there is one. ``packed_bytes_read``
counts every packed byte a task took from the cache; ``packed_bytes_mapped`` those of
them mapped into their slots rather than copied; ``packed_bytes_pmd_mapped`` those of the
mapped ones the page tables map with 2 MiB entries once populated (read from the page
tables after each mapping: exact, Linux 6.7+ (PAGEMAP_SCAN); null where the kernel cannot
tell). Each page-in maps again, so each counts again.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from onnx_prep.core.runtime.timeline import TaskTotals, Timeline

SCHEMA = "stats/1"

__all__ = ["Counters", "RuntimeStats", "SessionStats", "Snapshot", "TaskTotals", "SCHEMA"]


class Counters:
    """Named integer counters that several threads add to (a session's, a run's)."""

    __slots__ = ("_values", "_lock")

    def __init__(self) -> None:
        self._values: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0) + n

    def merge(self, other: Mapping[str, int]) -> None:
        """Add every count of ``other`` (a run's, into its session's)."""
        with self._lock:
            for k, n in other.items():
                self._values[k] = self._values.get(k, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


# The record's counts, by the JSON section that shows them; each is the field's name
# and the name its counter goes by.
_SECTIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "io": (("source_bytes_read", "bytes_read"), ("source_bytes_mapped", "bytes_mapped"),
           ("source_reads", "source_reads"), ("source_bytes_dropped", "bytes_dropped"),
           ("packed_bytes_read", "packed_bytes_read"), ("packed_bytes_mapped", "packed_bytes_mapped"),
           ("packed_bytes_pmd_mapped", "packed_bytes_pmd_mapped"), ("packed_reads", "packed_reads")),
    "prepare": (("prepacks", "prepacks"), ("prepack_ns", "prepack_ns"),
                ("materializations", "materializations"), ("page_ins", "rematerializations"),
                ("page_in_bytes", "rematerialized_bytes"),
                ("evictions", "evictions"), ("shed", "shed"), ("slot_bytes_warmed", "slot_bytes_warmed")),
    "runs": (("hot_runs", "hot_runs"), ("cold_runs", "cold_runs"), ("yields", "yields"),
             ("reads_first", "reads_first")),
    "kv": (("kv_appended_in_place", "kv_appended_in_place"), ("kv_copied", "kv_copied")),
    "intra_op": (("matmul_splits", "matmul_splits"), ("split_parts", "split_parts"),
                 ("attention_splits", "attention_splits"),
                 ("runs_lending", "runs_lending"), ("chunks_by_helpers", "chunks_by_helpers"),
                 ("helper_sleeps", "helper_sleeps"), ("helper_wakes", "helper_wakes")),
    "device": (("uploads", "uploads"), ("source_uploads", "source_uploads"),
               ("host_to_device_bytes", "host_to_device_bytes"), ("upload_ns", "upload_ns"),
               ("device_prepacks", "device_prepacks"), ("device_prepack_ns", "device_prepack_ns")),
}
# JSON keys that differ from the field name (a section's prefix dropped)
_JSON_KEY = {"hot_runs": "hot", "cold_runs": "cold", "kv_appended_in_place": "appended_in_place",
             "kv_copied": "copied"}
# Counted, in no section: mappings whose PMD-mapped bytes the kernel could not tell
# (packed_bytes_pmd_mapped is null in the JSON when there was one)
_UNSHOWN = (("packed_pmd_unknown", "packed_pmd_unknown"),)
COUNTER_FIELDS: tuple[tuple[str, str], ...] = (*(p for ps in _SECTIONS.values() for p in ps), *_UNSHOWN)
_NO_TASKS = TaskTotals()
# The counters that are a run's own in its record (the rest is the session's, over the run)
RUN_OWN = ("hot_runs", "cold_runs", "yields", "reads_first", *(c for _, c in _SECTIONS["kv"] + _SECTIONS["intra_op"]))


@dataclass(frozen=True)
class RuntimeStats:
    """See the module docstring. Build one with :meth:`from_counts`."""

    # io: the reader
    source_bytes_read: int = 0
    source_bytes_mapped: int = 0
    source_reads: int = 0
    source_bytes_dropped: int = 0
    packed_bytes_read: int = 0
    packed_bytes_mapped: int = 0
    packed_bytes_pmd_mapped: int = 0  # of packed_bytes_mapped, mapped by 2 MiB page-table entries
    packed_reads: int = 0
    packed_pmd_unknown: int = 0  # mappings the kernel could not tell that of (no PAGEMAP_SCAN)
    # prepare: the session's prepared objects
    prepacks: int = 0
    prepack_ns: int = 0
    materializations: int = 0  # publishes: prepacks, raw reads, packed reads
    page_ins: int = 0  # publishes of a key that had been resident before (after an eviction)
    page_in_bytes: int = 0  # the prepared bytes those publishes brought back
    evictions: int = 0
    shed: int = 0  # speculative tasks cancelled because a run's producer could not get memory
    slot_bytes_warmed: int = 0  # stable-slot bytes committed ahead of their prepack by idle CPU
    # runs
    hot_runs: int = 0
    cold_runs: int = 0
    yields: int = 0  # cold-path continuations that waited for a prepared object
    reads_first: int = 0  # cold runs that waited for every object before their first step (load_order.reads_first)
    # a run's ops
    kv_appended_in_place: int = 0
    kv_copied: int = 0
    matmul_splits: int = 0
    split_parts: int = 0
    attention_splits: int = 0  # decode-step attentions whose units the run's helpers shared
    runs_lending: int = 0
    chunks_by_helpers: int = 0
    helper_sleeps: int = 0
    helper_wakes: int = 0
    # a device load (uploads of the device plan)
    uploads: int = 0  # prepared objects copied to their device slots
    source_uploads: int = 0  # sources copied to device memory for the device-side prepack
    host_to_device_bytes: int = 0  # both
    upload_ns: int = 0  # device time of the uploads, both (events around each copy)
    device_prepacks: int = 0  # objects packed on the device (CPU prepacks: ``prepacks``)
    device_prepack_ns: int = 0  # their device time (events around each kernel)
    # memory and tasks
    arena_peaks: Mapping[str, int] = field(default_factory=dict)  # arena name -> bytes
    global_peak: int = 0
    tasks: Mapping[str, TaskTotals] = field(default_factory=dict)  # by task kind
    queues: Mapping[str, TaskTotals] = field(default_factory=dict)  # by resource queue
    # a session on a device: its slots' {"committed_bytes", "peak_committed_bytes"}; None: the CPU
    device_memory: Mapping[str, int] | None = None

    @property
    def upload_ms(self) -> float:
        return self.upload_ns / 1e6

    @property
    def source_bytes(self) -> int:
        """Source bytes brought in: read, or mapped (and faulted in)."""
        return self.source_bytes_read + self.source_bytes_mapped

    @property
    def runs(self) -> int:
        return self.hot_runs + self.cold_runs

    @classmethod
    def from_counts(cls, counts: Mapping[str, int], *, arena_peaks: Mapping[str, int] | None = None,
                    global_peak: int = 0, tasks: Mapping[str, TaskTotals] | None = None,
                    queues: Mapping[str, TaskTotals] | None = None,
                    device_memory: Mapping[str, int] | None = None) -> RuntimeStats:
        """The record of ``counts`` (counter name -> value; missing ones are 0)."""
        return cls(**{f: int(counts.get(c, 0)) for f, c in COUNTER_FIELDS},
                   arena_peaks=dict(arena_peaks or {}), global_peak=global_peak,
                   tasks=dict(tasks or {}), queues=dict(queues or {}),
                   device_memory=None if device_memory is None else dict(device_memory))

    def counts(self) -> dict[str, int]:
        """The record's counts by counter name (what :meth:`from_counts` takes)."""
        return {c: getattr(self, f) for f, c in COUNTER_FIELDS}

    def since(self, earlier: RuntimeStats) -> RuntimeStats:
        """Counts and task totals minus ``earlier``'s. Peaks do not subtract: the result
        keeps this record's."""
        return Snapshot.of(self).since(Snapshot.of(earlier)).record(
            arena_peaks=self.arena_peaks, global_peak=self.global_peak, device_memory=self.device_memory)

    @property
    def pmd_mapped(self) -> int | None:
        """``packed_bytes_pmd_mapped``, or None when a mapping's could not be told."""
        return None if self.packed_pmd_unknown else self.packed_bytes_pmd_mapped

    def to_json(self) -> dict:
        def section(name: str) -> dict:
            return {_JSON_KEY.get(f, f): self.pmd_mapped if f == "packed_bytes_pmd_mapped" else getattr(self, f)
                    for f, _ in _SECTIONS[name]}

        doc = {"schema": SCHEMA,
               "io": {"source_bytes": self.source_bytes, **section("io")},
               "prepare": section("prepare"),
               "runs": section("runs"),
               "memory": {"arena_peaks": dict(self.arena_peaks), "global_peak": self.global_peak},
               "tasks": {k: v.to_json() for k, v in sorted(self.tasks.items())},
               "queues": {k: v.to_json() for k, v in sorted(self.queues.items())},
               "kv": section("kv"),
               "intra_op": section("intra_op")}
        if self.device_memory is not None:
            doc["device"] = {**section("device"), **self.device_memory}
        return doc


def _minus(now: Mapping[str, TaskTotals], then: Mapping[str, TaskTotals]) -> dict[str, TaskTotals]:
    diff = {k: v.since(then[k]) if k in then else v for k, v in now.items()}
    return {k: v for k, v in diff.items() if v != _NO_TASKS}  # kinds with no task meanwhile go


@dataclass(frozen=True)
class Snapshot:
    """What a record is made of, taken cheaply: counts by counter name, task totals by
    kind and by queue. A run takes one at its start and one at its end, and makes its
    record from their difference only when asked (``handle.stats()``)."""

    counts: Mapping[str, int]
    tasks: Mapping[str, TaskTotals]
    queues: Mapping[str, TaskTotals]

    @classmethod
    def of(cls, rec: RuntimeStats) -> Snapshot:
        return cls(rec.counts(), rec.tasks, rec.queues)

    def since(self, earlier: Snapshot, *, own: Mapping[str, int] | None = None) -> Snapshot:
        """Minus ``earlier``, except the counters in ``own``, which take its values (a
        run's own part)."""
        counts = {c: self.counts.get(c, 0) - earlier.counts.get(c, 0) for _, c in COUNTER_FIELDS}
        counts.update(own or {})
        return Snapshot(counts, _minus(self.tasks, earlier.tasks), _minus(self.queues, earlier.queues))

    def record(self, *, arena_peaks: Mapping[str, int] | None = None, global_peak: int = 0,
               device_memory: Mapping[str, int] | None = None) -> RuntimeStats:
        return RuntimeStats.from_counts(self.counts, arena_peaks=arena_peaks, global_peak=global_peak,
                                        tasks=self.tasks, queues=self.queues, device_memory=device_memory)


class SessionStats:
    """What one session counts, and the records made of it: its :class:`Counters`
    (``counters``; a run's own are merged in when the run ends), its reader's counters,
    its tasks' :class:`Timeline` (``timeline``) and a peak watch on its budget;
    ``device_memory()`` (a session on a device) gives its slots' committed bytes and
    their peak."""

    def __init__(self, reader_counters: Any, budget: Any,
                 device_memory: Callable[[], tuple[int, int]] | None = None) -> None:
        self.counters = Counters()
        self.timeline = Timeline()
        self._reader = reader_counters  # ExternalDataReader.counters
        self._budget = budget
        self._peaks = budget.watch_peaks()
        self._device_memory = device_memory

    def device(self) -> dict[str, int] | None:
        if self._device_memory is None:
            return None
        committed, peak = self._device_memory()
        return {"committed_bytes": committed, "peak_committed_bytes": peak}

    def record(self) -> RuntimeStats:
        """Since the session opened."""
        return _with_peaks(self.snapshot(), self._peaks, self.device())

    def snapshot(self) -> Snapshot:
        counts = self.counters.snapshot()
        counts.update(self._reader.totals())
        return Snapshot(counts, self.timeline.by_kind(), self.timeline.by_resource())

    def start(self) -> tuple[Snapshot, Any]:
        """What a submission's record starts from: a snapshot now and a peak watch."""
        return self.snapshot(), self._budget.watch_peaks()

    def finish(self, started: tuple[Snapshot, Any], own: Mapping[str, int] | None) -> Callable[[], RuntimeStats]:
        """Figures taken as a submission ends (``ExecutionHandle(stats=...)``): the
        session's over its time, but a run's own part (``own``: its run, yields and ops'
        counts; None for a prepare: none), which the session adds to its own now.
        Returns the maker of the record (made when asked)."""
        start, watch = started
        watch.close()
        own = own or {}
        self.counters.merge(own)
        diff = self.snapshot().since(start, own={c: own.get(c, 0) for c in RUN_OWN})
        device = self.device()
        return lambda: _with_peaks(diff, watch, device)

    def close(self) -> None:
        self._peaks.close()  # the record's peaks stay as they were


def _with_peaks(snap: Snapshot, watch: Any, device: Mapping[str, int] | None = None) -> RuntimeStats:
    return snap.record(arena_peaks={a.value: n for a, n in watch.peaks().items()}, global_peak=watch.global_peak,
                       device_memory=device)
