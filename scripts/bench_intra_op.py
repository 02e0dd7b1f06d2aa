"""Hot-path runs with and without intra-op splitting, interleaved in one process.

    .venv/bin/python scripts/bench_intra_op.py [--preset medium] [--repeats 10] [--json FILE]

Three prepared Sessions over the same model: ``whole`` (``intra_op=False``), ``wake``
(large INT4 matmuls split over the CPU workers, chunks handed over through
Scheduler.fork_join to workers that sleep between them: ``spin_helpers=False``) and
``spin`` (the default: idle CPU workers lent to each hot run wait in C for the chunks,
native/handoff.py). Per repeat each runs an 8-token prefill and one decode token,
alternating. The decode tokens form a real decode per session: each step's past is that
session's previous presents (so the KV cache appends in place, as in `onnx-prep run`),
from the prefill's past up to DECODE_SPAN tokens, then again from the prefill. Prints
min/median/max per case and the speed-ups of the medians; outputs are checked equal bit
for bit between the sessions at every step (splitting must not change a value).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

# NOTE: until this round decode1 ran the same step (past = the prefill's 8 tokens) every
# repeat. A past that was already extended once cannot be appended in place again, so
# every such run copied its 32 KV caches: not what a decode does.
DECODE_SPAN = 32


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from onnx_prep.core.decode.decoder_io import DecoderIO
    from onnx_prep.core.decode.generation import next_past, step_feeds
    from onnx_prep.core.profile.machine_activity import MachineActivity, describe
    from onnx_prep.native.handoff import SPIN_NS_DEFAULT
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.core.runtime.session import Session
    from onnx_prep.fixtures import FixtureConfig, ensure_cached

    r = resolve_model(ensure_cached(FixtureConfig.preset(args.preset)))
    io = DecoderIO.discover(r.inputs, r.outputs)
    prefill = step_feeds(io, np.arange(1, 9, dtype=np.int64)[None, :], io.empty_past(1), 0)
    sessions = {"whole": Session(r, intra_op=False), "wake": Session(r, spin_helpers=False), "spin": Session(r)}
    try:
        for s in sessions.values():
            s.prepare()
        a = sessions["whole"].run(prefill)
        past0 = next_past(io, a, 8)
        for mode in ("wake", "spin"):  # the sessions must agree exactly
            b = sessions[mode].run(prefill)
            assert all(np.array_equal(a[k], b[k]) for k in a), f"prefill8: {mode} and whole outputs differ"
        chain = {mode: (past0, 8) for mode in sessions}  # each session's own decode
        times: dict[str, list[float]] = {}
        activity0 = MachineActivity.now()
        c0 = {mode: s.stats() for mode, s in sessions.items()}
        for i in range(args.repeats):
            logits = {}
            for mode, s in sessions.items():
                t = time.perf_counter()
                s.run(prefill)
                times.setdefault(f"prefill8.{mode}", []).append((time.perf_counter() - t) * 1e3)
                past, n = chain[mode]
                feeds = step_feeds(io, np.array([[5 + n % 7]], dtype=np.int64), past, n)
                t = time.perf_counter()
                out = s.run(feeds)
                times.setdefault(f"decode1.{mode}", []).append((time.perf_counter() - t) * 1e3)
                logits[mode] = out[io.logits]
                chain[mode] = (past0, 8) if n + 1 >= 8 + DECODE_SPAN else (next_past(io, out, n + 1), n + 1)
            for mode in ("wake", "spin"):
                assert np.array_equal(logits[mode], logits["whole"]), f"decode step {i}: {mode} and whole differ"
        activity = MachineActivity.now().since(activity0)
        # what the sessions' lent helpers did (only spin lends), from their records
        done = [s.stats().since(c0[mode]) for mode, s in sessions.items()]
        helpers = {k: sum(getattr(d, f) for d in done) for k, f in
                   (("handed_off", "chunks_by_helpers"), ("sleeps", "helper_sleeps"), ("wakes", "helper_wakes"))}
    finally:
        for s in sessions.values():
            s.close()
    print(f"{args.preset}: hot path, {args.repeats} interleaved repeats (ms, min / median / max)")
    for k, v in times.items():
        print(f"  {k:16s} {min(v):8.2f} {statistics.median(v):8.2f} {max(v):8.2f}")
    for name in ("prefill8", "decode1"):
        w, wk, sp = (statistics.median(times[f"{name}.{m}"]) for m in ("whole", "wake", "spin"))
        print(f"  {name}: wake {w / wk:.2f}x, spin {w / sp:.2f}x faster than whole; spin {wk / sp:.2f}x "
              f"faster than wake (medians)")
    runs = 2 * args.repeats
    print(f"  spin runs' helpers: {helpers['handed_off'] / runs:.1f} chunks, {helpers['sleeps'] / runs:.2f} sleeps, "
          f"{helpers['wakes'] / runs:.2f} wakes per run (sleep after {SPIN_NS_DEFAULT / 1e6:g} ms idle)")
    print(describe(activity))
    if args.json:
        args.json.write_text(json.dumps({"times_ms": times, "helpers": helpers, "machine_activity": activity}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
