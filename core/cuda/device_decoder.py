"""DeviceDecoder: a resolved model's steps on a CUDA device, its packed weights streamed
under the device budget: a ``Runner`` for the decode loop (core/decode/generation.py),
as the CPU session and ONNX Runtime are.

What it puts together:

- the objects, from one of two places:
  - **a device session** (``open_device_decoder``, what ``run --device cuda`` and the
    device sweep use; ``session=``): the session's plan puts each object in its device
    slot (a prepared cache's payload read and uploaded, or its sources uploaded and
    packed on the device, or packed on a CPU worker and uploaded), and pages them for
    the decoder under the device budget (session_pages.py): nothing of the model stays
    in host memory;
  - **packed host arrays** (``packed=``: the component alone, as its tests build it),
    copied once into page-locked host memory, which page-ins copy from;
- every object's device address range, reserved once (``DeviceSlotPool.reserve``; a
  device session reserves its slots when it opens) before the node list is built, so
  the launches carry addresses that hold whatever is paged in or out later;
- the node list run by :class:`DeviceGraphRunner` (device_graph.py): a run is one
  :class:`DeviceStep` of copies and launches;
- :class:`WeightResidency` (weight_residency.py): the order in which the step's launches
  read packed objects (found from their arguments: an address inside an object's
  range) is the step's weight order; the step is cut into the residency's segments,
  each segment's weights made resident before it is issued;
- a :class:`StepGraph` per segment when ``capture_decision`` allows it (its key: the
  step's key and the segment), else the segments issued eagerly, the reason kept.

- :class:`DeviceKVCache` (device_kv_cache.py), for the models whose KV it covers
  (GroupQueryAttention's past, the builder's exports): the past and present in device
  buffers of the run's capacity, read and appended where they are, the loop given
  placeholders of the presents' shapes, so a decode step's launches and copies are the
  same every step.

Capture: a StepGraph per phase (the prefill, the decode step) and segment. With the KV
on the device each is captured once and replayed on every later step (captures = 2 x
segments, replays = segments x (steps - 2) over one decode). A model whose KV is fed
from the host (the fused Attention, which concatenates its past: one row more a step,
copied in) changes the launches' arguments each step, so capture is declined with the
predicate's reason and why the KV is not kept, unless ``kv_capacity_fixed`` says the
caller keeps the shapes; a step of a kept model whose KV comes through the host after
all (no capacity known, a past this decoder did not return) runs eagerly, a fallback.
Counters (``counters()``): the residency's (page-ins, evictions, host-to-device bytes,
byte hit rate, committed and peak), the graphs' (captures, replays, fallbacks,
invalidations) summed over segments, steps, and the capture reason (``run --json``'s
record: its schema fixes these keys); ``kv_reason``: whether the KV is kept on the
device, or why not.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from onnx_prep.core.cuda.device_graph import DeviceGraphRunner, DeviceObject
from onnx_prep.core.cuda.device_kv_cache import DeviceKVCache, kv_pairs
from onnx_prep.core.cuda.device_slot_pool import DeviceSlotPool, DeviceView
from onnx_prep.core.cuda.driver import DeviceDriver
from onnx_prep.core.cuda.graph_capture import capture_decision
from onnx_prep.core.cuda.session_pages import SessionPages, session_objects
from onnx_prep.core.cuda.step_graph import StepGraph
from onnx_prep.core.cuda.weight_residency import WeightResidency
from onnx_prep.core.errors import DeviceError

__all__ = ["DeviceDecoder", "open_device_decoder"]


class _Segment:
    """Ops ``[start, end)`` of a step, issued by one call (what a StepGraph captures)."""

    def __init__(self, step: Any, start: int, end: int) -> None:
        self.step, self.start, self.end = step, start, end

    def __call__(self, stream: Any) -> None:
        self.step.issue(stream, self.start, self.end)


class DeviceDecoder:
    """``resolved`` on ``driver``'s device ``ordinal``; ``packed``: every prepared object
    the device nodes read (host arrays of packed bytes, by key), ``weights``: the raw
    weights they read as data; ``budget``: device bytes the packed objects may commit
    (None: all resident); ``capture``: use CUDA graphs where the predicate allows;
    ``kv_capacity_fixed``: the caller feeds the same shapes every step;
    ``kv_on_device``: keep the KV on the device where the model allows it, in buffers
    of ``kv_capacity`` rows (None: the decode loop's ``append_buffer.room_for``). The
    presents it returns for a KV kept on the device are placeholders (read-only NaN of
    the presents' shapes) to be fed back as the next past.

    ``session``: a device session (``device_pages=True``) instead of ``packed`` and
    ``weights``, its device's budget the decoder's (``budget`` not given); the decoder
    owns it from here (closed with it, or by a construction that fails), and ``owned``
    (closed after it: the prepared cache it reads)."""

    def __init__(self, resolved: Any, driver: DeviceDriver, packed: Mapping[Any, np.ndarray] | None = None, *,
                 weights: Mapping[str, np.ndarray] | None = None, budget: int | None = None, capture: bool = True,
                 kv_capacity_fixed: bool = False, kv_on_device: bool = True, kv_capacity: int | None = None,
                 ordinal: int = 0, session: Any = None, owned: Sequence[Any] = ()) -> None:
        from onnx_prep import native

        if (packed is None) == (session is None):
            raise ValueError("give the packed objects (packed=) or a device session (session=), not both")
        if session is not None and budget is not None:
            raise ValueError("a device session's budget is its device's (CudaSessionDevice(budget=...))")
        self.driver = driver
        self.session = session
        self._owned = list(owned)  # closed after the session (e.g. the read-only cache it reads)
        self.pool = DeviceSlotPool(driver, ordinal, budget=budget) if session is None else session.device.slots
        self.stream = driver.stream_create()
        self.host: dict[Any, Any] = {}
        self.runner: DeviceGraphRunner | None = None
        self.residency: WeightResidency | None = None
        self._pager: Any = self.host  # what the residency pages from: the host copies, or the session
        self._step_budget = self.pool.budget  # what the step's packed weights may commit together
        self._graphs: dict[tuple[str, int], StepGraph] = {}  # (phase, segment) -> its graph
        self._cuts: tuple[int, ...] = ()
        self._host_fed = 0  # segments run eagerly because their step's KV came through the host
        self.steps = 0
        self.load: Any = None  # open_device_decoder: the device session's load stats (RuntimeStats)
        self.cache_commit: dict | None = None  # open_device_decoder: what a build-if-missing cache published
        self.kv: DeviceKVCache | None = None
        try:
            if session is None:
                prepared = {}
                for key, array in packed.items():
                    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
                    pinned = driver.host_alloc(raw.nbytes)
                    pinned[:] = raw
                    self.host[key] = pinned
                    self.pool.reserve(key, raw.nbytes)
                    prepared[key] = DeviceObject(DeviceView(self.pool.address(key), raw.nbytes),
                                                 native.packed_header(raw))
                self._ranges = sorted((self.pool.address(k), self.pool.address(k) + memoryview(h).nbytes, k)
                                      for k, h in self.host.items())
            else:
                prepared, weights = self._from_session(session)
            self.runner = DeviceGraphRunner(resolved, driver, prepared=prepared, weights=weights,
                                            stream=self.stream, ordinal=ordinal)
            pairs, ids, why = kv_pairs(resolved) if kv_on_device else ((), "", "kv_on_device=False")
            if pairs:
                self.kv = DeviceKVCache(driver, pairs, ids, kv_capacity)
        except BaseException:
            self.close()
            raise
        self.kv_reason = "kept on the device at a fixed capacity" if self.kv is not None else \
            f"fed from the host: {why}"
        self.decision = capture_decision(offload_enabled=self.pool.budget is not None, stable_va=True,
                                         kv_capacity_fixed=kv_capacity_fixed or self.kv is not None, host_ops=0)
        self.capture = capture
        self.reason = self.decision.reason if capture else "capture off (capture=False)"
        if capture and not self.decision.ok and self.kv is None:
            self.reason += f" (the KV cache is {self.kv_reason})"

    def _from_session(self, session: Any) -> tuple[dict, dict]:
        """The launches' objects over a device session's slots (session_pages.py); the
        raw weights made resident, and every packed object too where all of them fit
        what the budget leaves (else the residency pages them, step by step)."""
        from onnx_prep.core.errors import DeviceBudgetError

        objects = session_objects(session)
        self._ranges = objects.ranges
        self._pager = SessionPages(session, objects.nbytes)
        g = self.pool.granularity
        sizes = [-(-max(n, 1) // g) * g for n in objects.nbytes.values()]  # whole granules, as committed
        if self.pool.budget is not None:
            self._step_budget = self.pool.budget - objects.raw_committed
            largest = max(sizes, default=0)
            if largest > self._step_budget:
                raise DeviceBudgetError(
                    f"device budget of {self.pool.budget:,} B leaves {self._step_budget:,} B for the packed weights "
                    f"once the raw weights commit {objects.raw_committed:,} B, and the largest packed weight needs "
                    f"{largest:,} B (whole granules)", hint=f"give a budget of at least "
                                                           f"{objects.raw_committed + largest:,} B")
        if self._step_budget is None or sum(sizes) <= self._step_budget:
            session.prepare(list(objects.nbytes))  # all resident from the start: no step pages
        return objects.prepared, objects.weights

    # -- the Runner protocol
    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        resident, phase = None, "step"
        if self.kv is not None:
            resident, phase = self.kv.take(feeds)
        host_fed = self.kv is not None and resident is None  # phase says why
        step = self.runner.prepare(feeds, resident=resident, keep=self.kv.presents if resident else frozenset())
        step.stage()
        uses, at = self._uses(step)
        if self.residency is None:
            self.residency = WeightResidency(self.pool, uses, self._pager, self.stream, budget=self._step_budget)
            starts = [at[a] for a, _ in self.residency.segments[1:]]
            self._cuts = (0, *starts, len(step.ops))
        elif uses != self.residency.uses:
            raise DeviceError("the step reads its weights in another order than the first step did "
                              f"({len(uses)} uses against {len(self.residency.uses)})",
                              hint="this is a bug in onnx-prep; please report it")
        else:
            starts = [at[a] for a, _ in self.residency.segments[1:]]
            self._cuts = (0, *starts, len(step.ops))
        cuts = self._cuts

        def run_segment(i: int) -> None:
            segment = _Segment(step, cuts[i], cuts[i + 1])
            if self.capture and not host_fed:
                graph = self._graphs.get((phase, i))
                if graph is None:
                    graph = self._graphs[(phase, i)] = StepGraph(self.driver, self.stream, self.decision)
                graph.run(segment, (step.key, i))
            else:
                segment(self.stream)
                if self.capture:
                    self._host_fed += 1
                    self.reason = f"eager: the step's KV came through the host ({phase})"

        self.residency.step(run_segment)
        self.driver.stream_synchronize(self.stream)
        self.steps += 1
        out = step.outputs()
        if resident is not None:
            out.update(self.kv.advance())
        return out

    def _uses(self, step: Any) -> tuple[tuple[Any, ...], list[int]]:
        """The packed objects the step's launches read, in launch order, and the op
        index of each use's launch."""
        import bisect

        starts = [r[0] for r in self._ranges]
        uses, at = [], []
        for index, op in enumerate(step.ops):
            if op[0] != "launch":
                continue
            read = []
            for _, value in op[2].args:
                if isinstance(value, int) and value:
                    j = bisect.bisect_right(starts, value) - 1
                    if j >= 0 and value < self._ranges[j][1] and self._ranges[j][2] not in read:
                        read.append(self._ranges[j][2])
            for key in read:
                uses.append(key)
                at.append(index)
        return tuple(uses), at

    def own(self, resource: Any) -> None:
        """Close ``resource`` with the decoder, after its session (a prepared cache the
        session's page-ins read)."""
        self._owned.append(resource)

    # -- accounting
    def counters(self) -> dict:
        r = self.residency.counters().to_json() if self.residency is not None else {}
        graphs = {"captures": 0, "replays": 0, "fallbacks": self._host_fed, "invalidations": 0}
        for g in self._graphs.values():
            for name, n in g.counters().to_json().items():
                graphs[name] += n
        return {"steps": self.steps, **r, **graphs, "capture": self.capture and self.decision.ok,
                "capture_reason": self.reason}

    def device_record(self) -> dict:
        """``run --json``'s ``device`` section: which device, the budget, and
        :meth:`counters`."""
        return {"device": self.driver.device_name(self.pool.device), "budget": self.pool.budget,
                **self.counters()}

    def close(self) -> None:
        """Release everything: graphs, the residency, the runner, the pool, the stream,
        the page-locked copies (idempotent)."""
        d = self.driver
        for g in self._graphs.values():
            g.close()
        self._graphs = {}
        if self.kv is not None:
            if self.stream is not None:
                d.stream_synchronize(self.stream)
            self.kv.close()
        if self.residency is not None:
            self.residency.close()
            self.residency = None
        if self.runner is not None:
            self.runner.close()
            self.runner = None
        if self.stream is not None:
            d.stream_synchronize(self.stream)
        if self.session is not None:
            self.session.close()  # its device: the slots, its stream, any staging
            self.session = None
        else:
            self.pool.close()
        for h in self.host.values():
            d.host_free(h)
        self.host = {}
        if self.stream is not None:
            d.stream_destroy(self.stream)
            self.stream = None
        owned, self._owned = self._owned, []
        for o in owned:
            o.close()

    def __enter__(self) -> DeviceDecoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_device_decoder(resolved: Any, driver: DeviceDriver, *, budget: int | None = None, capture: bool = True,
                        kv_capacity_fixed: bool = False, kv_on_device: bool = True, verify_digests: bool = True,
                        trust_symlinks: bool = False, cache: Any = None, ordinal: int = 0,
                        device_prepack: bool | None = None) -> DeviceDecoder:
    """``resolved`` on the device through ONE load path: a device session
    (core/runtime/session.py on a :class:`CudaSessionDevice` of ``budget`` device bytes,
    its objects paged by the decoder: ``device_pages``) whose plan puts every object in
    its device slot, from ``cache`` (a prepared cache, core/cache/prepared_cache.py)
    where it has the object, else read through the model's one reader (digests checked)
    and packed on the device where its kernels are (``device_prepack``: None where they
    compile, False never, True required) or on a CPU worker; then a
    :class:`DeviceDecoder` over the session's slots, which owns the session.

    A device session does not write the prepared cache, so a ``build-if-missing``
    cache with entries missing is completed first: a CPU session packs the missing
    objects (handed to the cache as any CPU load does), the cache publishes them
    (``decoder.cache_commit``: what it wrote), and the device session reads it
    read-only."""
    from onnx_prep.core.cuda.session_device import CudaSessionDevice
    from onnx_prep.core.runtime.session import Session, SessionOptions

    commit = None
    owned = []
    if cache is not None and getattr(cache, "persisting", False):
        commit = _complete_cache(resolved, cache, verify_digests=verify_digests, trust_symlinks=trust_symlinks)
        cache = cache.read_only()
        owned.append(cache)
    try:
        device = CudaSessionDevice(driver, ordinal, budget=budget, device_prepack=device_prepack)
        session = Session(resolved, SessionOptions(device=device, device_pages=True, cache=cache,
                                                   verify_digests=verify_digests, trust_symlinks=trust_symlinks))
    except BaseException:
        for o in owned:
            o.close()
        raise
    decoder = DeviceDecoder(resolved, driver, session=session, capture=capture, kv_capacity_fixed=kv_capacity_fixed,
                            kv_on_device=kv_on_device, ordinal=ordinal, owned=owned)
    decoder.load = session.stats()
    decoder.cache_commit = commit
    return decoder


def _complete_cache(resolved: Any, cache: Any, *, verify_digests: bool, trust_symlinks: bool) -> dict | None:
    """A ``build-if-missing`` cache's missing entries packed by a CPU session and
    published; what ``commit`` wrote, or None when nothing was missing."""
    from onnx_prep.core.plan.execution_plan import RAW_LAYOUT, build_prepared_execution_plan
    from onnx_prep.core.runtime.session import Session

    plan = build_prepared_execution_plan(resolved)
    missing = [r.key for r in plan.requirements if r.request.layout != RAW_LAYOUT and cache.lookup(r.request) is None]
    if not missing:
        return None
    with Session(resolved, cache=cache, verify_digests=verify_digests, trust_symlinks=trust_symlinks) as s:
        s.prepare(missing)
    return cache.commit()
