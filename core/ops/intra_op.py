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
from collections.abc import Callable, Iterator
from typing import Any

from onnx_prep.core.ops import run_counters

ForkJoin = Callable[..., int]  # Scheduler.fork_join(fns, *, helpers=None)

# An INT4 matmul splits when packed weight bytes x rows (rows counted up to 8) reach
# this: handing a chunk to an idle worker costs a wake-up (tens of microseconds on a
# small VM). A 2048x2048 decode GEMV (2.6 MB packed) still gains: 179 us whole, 126 us
# in two chunks (2 vCPUs, level 4, medians of 60). See docs/runtime.md.
MIN_SPLIT_WORK = 2 << 20


# What a run's splits count (core/ops/run_counters.py: into the run's own counters, none
# outside a run; RuntimeStats fields): ops split and parts made ("matmul_splits",
# "split_parts"), attentions whose units were shared ("attention_splits"); for a run
# that lent helpers ("runs_lending", once per such run), the chunks they ran through its
# mailbox ("chunks_by_helpers"), how often they went to sleep after spinning idle and
# had to be woken by a publish ("helper_sleeps", "helper_wakes"; native/handoff.py,
# SPIN_NS_DEFAULT).


def count_split(parts: int) -> None:
    """One op split into ``parts`` parts, in the run executing on this thread."""
    run_counters.count("matmul_splits")
    run_counters.count("split_parts", parts)


def count_attention_split() -> None:
    """One decode-step attention whose units went through the run's mailbox."""
    run_counters.count("attention_splits")


def count_handed_off(chunks: int, sleeps: int = 0, wakes: int = 0) -> None:
    """A run that lent helpers: the chunks they ran, their sleeps and wake-ups."""
    run_counters.count("runs_lending")
    run_counters.count("chunks_by_helpers", chunks)
    run_counters.count("helper_sleeps", sleeps)
    run_counters.count("helper_wakes", wakes)


# A decode GEMV is cut into chunks of about CHUNK_WORK packed bytes, at least one and
# at most MAX_CHUNKS_PER_PART per part, that the caller and the helpers pull in order: a
# helper that wakes late takes fewer of them instead of leaving the caller waiting at the
# end, and a chunk stays big enough that its call overhead does not show. Decode GEMVs
# (level 4, 2 vCPUs, medians of 60): 2048x2048 whole 179 us, 2 chunks 126, 8 chunks 173;
# 2048x11264 whole 524 us, 2 chunks 370, 8 chunks 286; 2048x32000 whole 1461 us,
# 2 chunks 1325, 16 chunks 1051.
CHUNK_WORK = 2 << 20
MAX_CHUNKS_PER_PART = 8
SMALL_ROWS = 2  # up to this many rows, a split INT4 matmul is cut as a decode GEMV (chunk_count)
# A decode step's attention whose caches hold at least this many bytes (keys and values)
# shares its units with the run's helpers (attention_split). NOTE: measured on the
# builder Llama at level 4 (2026-12-03, 2-vCPU Intel Xeon; split on and off every two
# steps in one session, median step ratio off / on): a 32-token context (256 KiB a layer
# at batch 1, 512 KiB at batch 2) 1.003 / 1.005 in a quiet hour, 0.990 / 0.971 in a
# noisy one: the hand-off costs what the shared read saves; 128 tokens (1 MiB) 1.041,
# 256 1.052, 512 1.046, 1,536 1.161.
MIN_ATTENTION_SPLIT_BYTES = 1 << 20


def _work(packed_bytes: int, rows: int) -> int:
    return packed_bytes * min(max(rows, 1), 8)


def worth_splitting(packed_bytes: int, rows: int) -> bool:
    return _work(packed_bytes, rows) >= MIN_SPLIT_WORK


def chunk_count(packed_bytes: int, rows: int, parts: int) -> int:
    """How many column chunks to cut a split INT4 matmul into, for ``parts`` threads.

    NOTE: a decode GEMV (one row) is cut into ~CHUNK_WORK chunks, so a helper that joins
    late, or is descheduled on a busy machine, leaves the caller a small chunk to wait
    for, not half the GEMV. Through a run's mailbox A is prepared (quantized, at level
    4) once per matmul, not per chunk (native/handoff.c), so on one thread 16 chunks cost
    what one does (level 4, weights streamed, min of 5: 2048x32000 1493 us whole, 1427 in
    16 chunks; 5632x2048 272 and 274); through ``fork_join`` each chunk prepares A again
    (5632x2048: 300 us in 16 chunks), still worth it there for a late-waking worker.
    Two rows (decode at batch 2) are cut as one is; with more, one chunk per part: each
    chunk's kernel call repeats its per-call work for every row, and an 8-row prefill in
    16 chunks was slower than in 2. Measured for two rows: a builder-exported Llama at
    level 4, batch 2, 2 threads, two sessions alternating round by round (2026-12-03,
    2-vCPU Intel Xeon), per-part chunks against one-row chunks, step medians 27.22 ->
    26.10 and 25.62 -> 25.53 ms (mins 24.61 -> 24.25, 24.48 -> 23.96), the medium
    fixture at level 4 29.62 -> 29.20 (min 28.38 -> 27.81); at batch 4 and 8 no
    difference beyond noise (38.37 / 39.13, 53.32 / 52.19), so those keep one per part.
    The count is a multiple of ``parts``: 3 chunks over 2 threads leave one thread a
    chunk alone at the end, a third of the GEMV, where 4 leave it a quarter of what each
    ran (the medium fixture's 7.9 MB QKV and 7.2 MB down projections made 3 chunks, its
    14.4 MB gate-up projection 7). Measured: medium level 4, batch 1, 2 threads, 3 and 7
    against 4 and 8, alternating every two steps in one session (2026-12-02, 2-vCPU
    Intel Xeon): median step 57.03 -> 52.87 ms and 50.61 -> 46.35."""
    if rows > SMALL_ROWS:
        return parts
    n = max(parts, min(parts * MAX_CHUNKS_PER_PART, packed_bytes // CHUNK_WORK))
    return -(-n // parts) * parts


def attention_split(units: int, cache_bytes: int) -> tuple[Any, int]:
    """``(mailbox, chunks)`` for a decode step's attention over ``units`` (batch row x kv
    head) reading ``cache_bytes`` of keys and values: the run's mailbox and twice as many
    chunks as it has parts (a late helper leaves a small one), or ``(None, 1)`` on one
    thread (a cold run, one unit, a small cache: the hand-off would cost more than it
    saves).

    NOTE: the step's attention reads every cached key and value once, from memory (the
    GEMV before it streamed the caches out): memory-bound like the GEMVs, so the cores
    that share them share it too."""
    split = _CURRENT.get()
    if split is None or units < 2 or cache_bytes < MIN_ATTENTION_SPLIT_BYTES:
        return None, 1
    box = mailbox()
    return (None, 1) if box is None else (box, min(units, 2 * split[1]))


SPIN_ENV = "ONNX_PREP_SPIN_HELPERS"


def spin_helpers_default() -> bool:
    """Whether hot runs lend idle CPU workers that wait in C, spinning, for split-matmul
    chunks (``Session(spin_helpers=None)``): ``ONNX_PREP_SPIN_HELPERS`` unset or ``1``:
    yes; ``0``: no (chunks go through ``fork_join`` to workers that sleep between them;
    no core spent waiting, slower decode)."""
    from onnx_prep.core.environment import flag

    return flag(SPIN_ENV, default=True, on="let idle workers wait for matmul chunks in C (faster decode)",
                off="keep idle workers from spinning during runs")


_CURRENT: contextvars.ContextVar[tuple[ForkJoin, int] | None] = contextvars.ContextVar(
    "onnx_prep_intra_op", default=None)
_MAILBOX: contextvars.ContextVar[LazyMailbox | None] = contextvars.ContextVar("onnx_prep_intra_op_mailbox",
                                                                              default=None)


def current() -> tuple[ForkJoin, int] | None:
    """``(fork_join, parts)`` installed for this thread's current run, or None."""
    return _CURRENT.get()


class LazyMailbox:
    """A run's mailbox, opened by the first split that asks for it: ``open_fn()`` lends
    the helpers and returns the ``native.Mailbox`` they serve, or None (no idle worker);
    either way once per run.

    NOTE: lazily, because a run that splits nothing must not lend anything. The tiny
    fixture's decode steps split no matmul, yet each lent a helper at its start: a
    worker woken, spinning for up to 1 ms on the other core of a 2.4 ms step, then
    stopped and reclaimed (in one run of bench_intra_op those steps took 2.94 ms against
    2.62 without any split; with lazy lending 2.43 against 2.40, though repeated A/Bs put
    the time difference within this VM's noise of ~5%; the core left alone is the sure
    part). The first split of a run pays the lending instead: its chunks start on the
    caller while the helper wakes; Session lends at the start of a run when the run
    before it split."""

    __slots__ = ("_open", "_box", "_opened", "asked")

    def __init__(self, open_fn: Callable[[], Any]) -> None:
        self._open, self._box, self._opened = open_fn, None, False
        self.asked = False  # a split asked for it (see get)

    def open_now(self) -> None:
        """Lend now, ahead of any split (the caller expects one)."""
        if not self._opened:
            self._opened = True
            self._box = self._open()

    def get(self) -> Any:
        """For a split: the mailbox, opened now if it was not."""
        self.asked = True
        self.open_now()
        return self._box


def mailbox() -> Any:
    """The ``native.Mailbox`` that helpers lent to this run serve, or None. An INT4
    matmul that splits hands its chunks over through it, in C, instead of through
    ``fork_join`` (native/handoff.py says why). Asking opens the run's
    :class:`LazyMailbox`."""
    if _CURRENT.get() is None:
        return None
    box = _MAILBOX.get()
    return box.get() if box is not None else None


@contextlib.contextmanager
def using(fork_join: ForkJoin | None, parts: int, mailbox: LazyMailbox | None = None) -> Iterator[None]:
    """Install ``fork_join`` with ``parts`` (>= 2 to split at all) for the block, and
    the run's ``mailbox`` if it may lend helpers."""
    token = _CURRENT.set((fork_join, int(parts)) if fork_join is not None and parts >= 2 else None)
    box = _MAILBOX.set(mailbox)
    try:
        yield
    finally:
        _MAILBOX.reset(box)
        _CURRENT.reset(token)


def column_ranges(n: int, parts: int, align: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into at most ``parts`` ranges of whole ``align``-column panels."""
    panels = -(-n // align)
    per = -(-panels // max(1, parts))
    return [(b * align, min(n, (b + per) * align)) for b in range(0, panels, per)]
