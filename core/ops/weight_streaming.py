"""Whether the decode GEMVs stream their weights past the caches, chosen per machine.

A decode step's INT4 GEMVs read every weight once. With streaming on they prefetch
each block non-temporally a little ahead of its use (native/op_internal.h,
``OP_STREAM_AHEAD``), so the hundreds of MB a step reads do not evict what the ops
between the GEMVs use. That was a gain where it was measured first (a Sapphire Rapids
VM: the medium fixture's level-4 step 62.1 -> 56.9 ms) and a loss of half the GEMV
speed on another (a 2-core KVM Xeon with AMX, 2026-12-03: a 2048 x 5632 level-4 GEMV
from memory 0.56 ms plain, 1.19 ms streamed, one thread; the medium fixture's level-4
step at batch 2, 56.3 -> 31.9 ms with it off). There the non-temporal prefetch itself
is the bottleneck: the same lines read with it come at ~6 GB/s a core, without it ~13.

So the first session of a process (or a benchmark, through ``choice()``) measures it
(``native.probe_weight_streaming``: a 512 KiB buffer flushed from the caches, read
plainly and with the GEMVs' prefetch, the fastest of three each; ~5 ms) and turns
streaming off where the prefetched read takes over ``SLOWER_BY`` times the plain one's
time. ``ONNX_PREP_WEIGHT_STREAMING``
= 1 or 0 forces it either way without a probe. Same bits either way.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from onnx_prep.core.environment import flag

STREAMING_ENV = "ONNX_PREP_WEIGHT_STREAMING"
# Off when the prefetched read takes more than this many times the plain one. The
# machine that lost measured 2.5-4.2x in every probe; one that gained should read about
# as fast either way from memory (its gain is in the caches the stream leaves alone).
# NOTE: the Sapphire Rapids VM where streaming gained was not available to probe when
# this was written: its ratio is not measured, and the threshold's margin is the guess.
SLOWER_BY = 1.5
# NOTE: on the 2-core Xeon, six probes each: 256 KiB 2.6-3.2x in 2.6 ms, 512 KiB
# 2.7-3.2x in 5.0 ms, 1 MiB 2.7-3.3x in 10 ms (the CLFLUSHes are most of it)
PROBE_BYTES = 512 << 10
PROBE_PASSES = 3


@dataclass(frozen=True)
class StreamingChoice:
    """What the decode GEMVs do with their weights in this process, and why."""

    on: bool
    source: str  # "probe", "environment", or "default" (no probe possible here: native default, on)
    plain_ms: float | None = None  # the probe's fastest plain read of PROBE_BYTES
    streamed_ms: float | None = None  # ... and with the non-temporal prefetch

    def describe(self) -> str:
        state = "on" if self.on else "off"
        if self.source == "probe":
            return (f"weight streaming {state} (probe: prefetched read {self.streamed_ms / self.plain_ms:.2f}x "
                    f"the plain one's time; off above {SLOWER_BY}x)")
        if self.source == "environment":
            return f"weight streaming {state} ({STREAMING_ENV})"
        return f"weight streaming {state} (not probed)"

    def as_dict(self) -> dict:
        return {"on": self.on, "source": self.source, "probe_plain_ms": self.plain_ms,
                "probe_streamed_ms": self.streamed_ms, "off_above_ratio": SLOWER_BY}


_LOCK = threading.Lock()
_CHOICE: StreamingChoice | None = None


def choice() -> StreamingChoice:
    """This process's choice: the environment's, else the probe's. Made once; the
    first call also sets the native kernels to it (later calls leave alone what a
    benchmark or test set since: ``native.set_weight_streaming``)."""
    global _CHOICE
    with _LOCK:
        if _CHOICE is None:
            _CHOICE = _choose()
            if _CHOICE.source != "default":
                from onnx_prep import native

                native.set_weight_streaming(_CHOICE.on)
        return _CHOICE


def _choose() -> StreamingChoice:
    if os.environ.get(STREAMING_ENV, "").strip():
        on = flag(STREAMING_ENV, default=True, on="stream the decode GEMVs' weights past the caches",
                  off="read them plainly")
        return StreamingChoice(on, "environment")
    from onnx_prep.core.errors import NativeError

    try:
        from onnx_prep import native

        probed = native.probe_weight_streaming(PROBE_BYTES, PROBE_PASSES)
    except NativeError:
        probed = None
    if probed is None:  # no native module, or not an x86 CPU: the kernels' default
        return StreamingChoice(True, "default")
    plain, streamed = probed
    return StreamingChoice(streams(plain, streamed), "probe", plain * 1e3, streamed * 1e3)


def streams(plain_s: float, streamed_s: float) -> bool:
    """The rule: stream unless the prefetched read took over SLOWER_BY times the plain one."""
    return streamed_s <= SLOWER_BY * plain_s
