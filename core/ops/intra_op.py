"""Intra-op parallelism: who may split one op's work across threads, and into how many parts.

The runtime installs a fork-join function (``Scheduler.fork_join``: the first part on the
calling thread, the others on CPU workers idle right now) for the duration of a run — the
hot path on the caller's thread, each cold-path step on its worker — with a part count.
An op that can split its work (the native INT4 matmul, over column ranges on panel
boundaries) asks :func:`current` and splits when the work is big enough; with nothing
installed (direct calls, sequential sessions, the numpy reference) every op runs whole on
the calling thread. Each output column is computed by exactly the same instructions
whichever part computes it, so split and whole results are equal bit for bit.

    with intra_op.using(scheduler.fork_join, parts=2):
        program.execute(values, prepared)
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

ForkJoin = Callable[[Sequence[Callable[[], Any]]], int]

# An INT4 matmul splits when packed weight bytes x rows (rows counted up to 8) reach
# this: handing a part to an idle worker costs a wake-up (tens of microseconds on a
# small VM), and a decode GEMV (one row) is memory-bound, so it gains little below a few
# MiB, while prefill rows add compute. Medium fixture, 2 vCPUs: an 8-token prefill
# 185 -> 110 ms, one decode token 31.5 -> 29.6 ms. See docs/runtime.md.
MIN_SPLIT_WORK = 4 << 20


class _Counters:
    """Process-wide: ops split (``splits``) and parts made (``parts``)."""

    def __init__(self) -> None:
        self.splits = 0
        self.parts = 0
        self._lock = threading.Lock()

    def add(self, parts: int) -> None:
        with self._lock:
            self.splits += 1
            self.parts += parts


COUNTERS = _Counters()


def count_split(parts: int) -> None:
    COUNTERS.add(parts)


def worth_splitting(packed_bytes: int, rows: int) -> bool:
    return packed_bytes * min(max(rows, 1), 8) >= MIN_SPLIT_WORK

_CURRENT: contextvars.ContextVar[tuple[ForkJoin, int] | None] = contextvars.ContextVar(
    "onnx_prep_intra_op", default=None)


def current() -> tuple[ForkJoin, int] | None:
    """``(fork_join, parts)`` installed for this thread's current run, or None."""
    return _CURRENT.get()


@contextlib.contextmanager
def using(fork_join: ForkJoin | None, parts: int) -> Iterator[None]:
    """Install ``fork_join`` with ``parts`` (>= 2 to split at all) for the block."""
    token = _CURRENT.set((fork_join, int(parts)) if fork_join is not None and parts >= 2 else None)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def column_ranges(n: int, parts: int, align: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into at most ``parts`` ranges of whole ``align``-column panels."""
    panels = -(-n // align)
    per = -(-panels // max(1, parts))
    return [(b * align, min(n, (b + per) * align)) for b in range(0, panels, per)]
