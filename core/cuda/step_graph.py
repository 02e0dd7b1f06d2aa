"""StepGraph: one decode step's launches captured once as a CUDA graph on a stream, and
replayed on the steps after it.

A step is a callable that issues its work (copies, kernel launches) on the stream it is
given, with the device addresses of its buffers. The first ``run`` captures it
(``begin_capture`` → the step → ``end_capture`` → ``graph_instantiate``; captured work
does not run) and launches the graph; later runs launch the same graph
(``graph_launch``: one call instead of one per kernel). A graph replays the launches
with the addresses they had at capture, so:

- the caller gives each run a ``key``: what the captured work depends on (the addresses
  of every buffer the step reads or writes, and its shapes). A run whose key differs
  from the captured one is an **invalidation**: the graph is destroyed and the step
  captured again. Weights in stable-VA slots (core/cuda/device_slot_pool.py) keep their
  address across evict → page-in, so paging them does not change the key: the graph
  replays and reads the new physical memory under the same address;
- capture is **declined** where ``capture_decision`` says so (its reason, naming the
  predicate and its inputs, is kept in ``reason``), and a capture that **fails** (the
  driver refusing something in the step) ends the capture, keeps the driver's error as
  the reason and runs the step eagerly; either way the run is a **fallback**. A failed
  key is not captured again (every run of it would fail the same way) until the key
  changes.

Counters (``counters()``): captures, replays (runs served by an existing graph; the
capturing run launches its new graph too, counted as a capture), fallbacks,
invalidations. Not thread-safe: a stream's steps are issued by one thread, which is
also what thread-local capture mode requires.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass
from typing import Any

from onnx_prep.core.cuda.driver import DeviceDriver, DriverCallError
from onnx_prep.core.cuda.graph_capture import CaptureDecision

__all__ = ["StepGraph", "StepGraphCounters"]

CAPTURED, REPLAYED, EAGER = "captured", "replayed", "eager"


@dataclass
class StepGraphCounters:
    captures: int = 0
    replays: int = 0
    fallbacks: int = 0  # steps run eagerly: capture declined or failed
    invalidations: int = 0  # graphs dropped because the key changed

    def to_json(self) -> dict:
        return asdict(self)


class StepGraph:
    """The decode step's graph on ``stream``, captured when ``decision`` allows."""

    def __init__(self, driver: DeviceDriver, stream: Any, decision: CaptureDecision) -> None:
        self.driver = driver
        self.stream = stream
        self.decision = decision
        self.reason = decision.reason  # why the last step ran as it did
        self._counters = StepGraphCounters()
        self._graph: Any = None
        self._exec: Any = None
        self._key: Hashable = None
        self._failed_key: Hashable = None
        self._failed = False

    def run(self, step: Callable[[Any], None], key: Hashable) -> str:
        """Issue one step on the stream: ``"replayed"``, ``"captured"`` or ``"eager"``.
        Returns once the work is queued; synchronise the stream for its results."""
        c = self._counters
        if not self.decision.ok:
            return self._eager(step, self.decision.reason)
        if self._exec is not None:
            if key == self._key:
                self.driver.graph_launch(self._exec, self.stream)
                c.replays += 1
                return REPLAYED
            self._drop()
            c.invalidations += 1
        if self._failed and key == self._failed_key:
            return self._eager(step, self.reason)
        try:
            graph_exec = self._capture(step)
        except DriverCallError as exc:
            self._failed, self._failed_key = True, key
            return self._eager(step, f"capture failed: {exc}")
        self._key, self._failed = key, False
        self.driver.graph_launch(graph_exec, self.stream)  # the captured work has not run yet
        c.captures += 1
        self.reason = f"captured ({self.decision.reason})"
        return CAPTURED

    def counters(self) -> StepGraphCounters:
        return StepGraphCounters(**asdict(self._counters))

    def close(self) -> None:
        """Destroy the graph, if any (idempotent)."""
        self._drop()

    def __enter__(self) -> StepGraph:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _eager(self, step: Callable[[Any], None], reason: str) -> str:
        step(self.stream)
        self._counters.fallbacks += 1
        self.reason = reason
        return EAGER

    def _capture(self, step: Callable[[Any], None]) -> Any:
        d = self.driver
        d.begin_capture(self.stream)
        try:
            step(self.stream)
        except BaseException:
            try:  # leave capture mode; the capture is worthless
                graph = d.end_capture(self.stream)
                d.graph_destroy(graph)
            except DriverCallError:
                pass  # an invalidated capture ends with an error and no graph
            raise
        graph = d.end_capture(self.stream)
        try:
            graph_exec = d.graph_instantiate(graph)
        except BaseException:
            d.graph_destroy(graph)
            raise
        self._graph, self._exec = graph, graph_exec
        return graph_exec

    def _drop(self) -> None:
        if self._exec is not None:
            self.driver.graph_exec_destroy(self._exec)
            self.driver.graph_destroy(self._graph)
        self._graph = self._exec = self._key = None
