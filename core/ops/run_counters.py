"""Run counters: where a run's ops count what they did (KV appends and copies, intra-op
splits), without a process-wide counter.

The runtime installs the run's sink for the duration of the run, on whichever thread
executes its actions (``Session`` does, in the same place it installs the intra-op split
and the KV room)::

    with run_counters.counting(sink):
        program.execute(values, prepared)

An op calls :func:`count`; the sink is any object with ``add(name, n)`` (the runtime's
``core/runtime/stats.py`` ``Counters``). With no sink installed (an op called directly,
the numpy reference, ONNX Runtime) nothing is counted: two sessions, or two runs, never
see each other's counts.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, Protocol


class Sink(Protocol):
    def add(self, name: str, n: int = 1) -> None: ...


_SINK: contextvars.ContextVar[Any] = contextvars.ContextVar("onnx_prep_run_counters", default=None)


@contextlib.contextmanager
def counting(sink: Sink | None) -> Iterator[None]:
    """Within the block, :func:`count` on this thread adds to ``sink`` (None: nowhere)."""
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)


def count(name: str, n: int = 1) -> None:
    """Add ``n`` to counter ``name`` of the run executing on this thread, if any."""
    sink = _SINK.get()
    if sink is not None:
        sink.add(name, n)
