"""DeviceDecoder: a resolved model's steps on a CUDA device, its packed weights streamed
under the device budget: a ``Runner`` for the decode loop (core/decode/generation.py),
as the CPU session and ONNX Runtime are.

What it puts together:

- the packed objects, made on the host by the CPU's load (``open_device_decoder``: a CPU
  session, so a prepared cache's payloads where it has them, else the CPU prepack: the
  same bytes on every device), copied once into page-locked host memory, where they
  stay for the decoder's life: they are what a page-in copies from;
- every object's device address range, reserved once (``DeviceSlotPool.reserve``)
  before the node list is built, so the launches carry addresses that hold whatever is
  paged in or out later;
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

from collections.abc import Mapping
from typing import Any

import numpy as np

from onnx_prep.core.cuda.device_graph import DeviceGraphRunner, DeviceObject
from onnx_prep.core.cuda.device_kv_cache import DeviceKVCache, kv_pairs
from onnx_prep.core.cuda.device_slot_pool import DeviceSlotPool, DeviceView
from onnx_prep.core.cuda.driver import DeviceDriver
from onnx_prep.core.cuda.graph_capture import capture_decision
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
    the presents' shapes) to be fed back as the next past."""

    def __init__(self, resolved: Any, driver: DeviceDriver, packed: Mapping[Any, np.ndarray], *,
                 weights: Mapping[str, np.ndarray] | None = None, budget: int | None = None, capture: bool = True,
                 kv_capacity_fixed: bool = False, kv_on_device: bool = True, kv_capacity: int | None = None,
                 ordinal: int = 0) -> None:
        from onnx_prep import native

        self.driver = driver
        self.pool = DeviceSlotPool(driver, ordinal, budget=budget)
        self.stream = driver.stream_create()
        self.host: dict[Any, Any] = {}
        self.runner: DeviceGraphRunner | None = None
        self.residency: WeightResidency | None = None
        self._graphs: dict[tuple[str, int], StepGraph] = {}  # (phase, segment) -> its graph
        self._cuts: tuple[int, ...] = ()
        self._host_fed = 0  # segments run eagerly because their step's KV came through the host
        self.steps = 0
        self.load: Any = None  # open_device_decoder: the CPU session's load stats (RuntimeStats)
        self.kv: DeviceKVCache | None = None
        try:
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
        self.decision = capture_decision(offload_enabled=budget is not None, stable_va=True,
                                         kv_capacity_fixed=kv_capacity_fixed or self.kv is not None, host_ops=0)
        self.capture = capture
        self.reason = self.decision.reason if capture else "capture off (capture=False)"
        if capture and not self.decision.ok and self.kv is None:
            self.reason += f" (the KV cache is {self.kv_reason})"

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
            self.residency = WeightResidency(self.pool, uses, self.host, self.stream)
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
        self.pool.close()
        for h in self.host.values():
            d.host_free(h)
        self.host = {}
        if self.stream is not None:
            d.stream_destroy(self.stream)
            self.stream = None

    def __enter__(self) -> DeviceDecoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_device_decoder(resolved: Any, driver: DeviceDriver, *, budget: int | None = None, capture: bool = True,
                        kv_capacity_fixed: bool = False, kv_on_device: bool = True, verify_digests: bool = True,
                        trust_symlinks: bool = False, cache: Any = None, ordinal: int = 0) -> DeviceDecoder:
    """``resolved`` on the device, loaded as the CPU loads it: a CPU session
    (core/runtime/session.py) prepares every object, from ``cache`` (a prepared cache,
    core/cache/prepared_cache.py: its payloads mapped, nothing packed) where it has them,
    else read through the model's one reader (digests checked) and packed by the CPU
    prepack; then a :class:`DeviceDecoder` over them, which copies the packed objects
    into page-locked memory (what its page-ins copy from) and the raw weights it reads
    as data. The session is closed before this returns; a ``build-if-missing`` cache has
    been handed what it packed (the caller commits it)."""
    from onnx_prep.core.plan.execution_plan import RAW_LAYOUT
    from onnx_prep.core.runtime.session import Session

    with Session(resolved, cache=cache, verify_digests=verify_digests, trust_symlinks=trust_symlinks) as session:
        session.prepare()
        packed: dict[Any, np.ndarray] = {}
        weights: dict[str, np.ndarray] = {}
        for r in session.plan.requirements:
            view = session.prepared_view(r.key)
            if r.request.layout == RAW_LAYOUT:
                weights[r.request.logical_value] = np.array(view)  # a copy: the slot goes with the session
            else:
                packed[r.key] = view  # copied into page-locked memory by the decoder, before the session closes
        decoder = DeviceDecoder(resolved, driver, packed, weights=weights, budget=budget, capture=capture,
                                kv_capacity_fixed=kv_capacity_fixed, kv_on_device=kv_on_device, ordinal=ordinal)
        decoder.load = session.stats()
    return decoder
