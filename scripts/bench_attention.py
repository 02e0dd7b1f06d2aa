#!/usr/bin/env python3
"""Hot per-call time of the attention kernel (``onnx_prep.native.group_query_attention``).

One decode step (B=1, S=1) of a GroupQueryAttention with 32 query heads, 8 kv heads,
head size 64 and rotary, over pasts of 40, 256, 1024 and 4096 tokens, on every ISA the
CPU has (or the ones given). The present buffers are the pasts themselves (the
runtime's shared, in-place buffers), so a call writes only the new key / value rows,
as a decode step does; everything is cache-resident after the first call ("hot"). Each
row prints min / median / max over --reps timed calls (after --warmup untimed ones),
one Python call each (~a few us of argument checks included), and the line on other
work on the machine meanwhile (core/profile/machine_activity.py) that says whether
the figures are to be trusted. --json writes the samples (us) per ISA and past.

Usage: python scripts/bench_attention.py [--reps 200] [--warmup 20] [--isa avx512 ...]
       [--pasts 40 256 1024 4096] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from onnx_prep import native

N, KN, H = 32, 8, 64
PASTS = (40, 256, 1024, 4096)


def step_inputs(rng: np.random.Generator, past: int) -> tuple[list, dict]:
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    total = past + 1
    pk, pv = f(1, KN, total, H), f(1, KN, total, H)  # room for the new row
    angles = rng.uniform(0, 2 * np.pi, (total, H // 2)).astype(np.float32)
    args = [f(1, 1, N * H), f(1, 1, KN * H), f(1, 1, KN * H), pk, pv,
            np.array([past], np.int32), np.array([total], np.int32), np.cos(angles), np.sin(angles)]
    return args, dict(num_heads=N, kv_num_heads=KN, present=(pk, pv))


def time_calls(args: list, kw: dict, isa: str, reps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        native.group_query_attention(*args, isa=isa, **kw)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        native.group_query_attention(*args, isa=isa, **kw)
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def main() -> None:
    from onnx_prep.core.profile.machine_activity import MachineActivity, describe

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--isa", nargs="*", default=None, help="ISAs to run (default: every one available)")
    ap.add_argument("--pasts", nargs="*", type=int, default=list(PASTS))
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    isas = a.isa or list(native.available_isas())
    rng = np.random.default_rng(0)
    print(f"GroupQueryAttention B=1 S=1, {N}/{KN} heads, H={H}, rotary; us per call, {a.reps} calls")
    print(f"{'isa':8} {'past':>6} {'min':>9} {'median':>9} {'max':>9}")
    samples: dict[str, list[float]] = {}
    activity0 = MachineActivity.now()
    for past in a.pasts:
        args, kw = step_inputs(rng, past)
        for isa in isas:
            us = time_calls(args, kw, isa, a.reps, a.warmup)
            ran = native.last_kernel()
            samples[f"{ran}.{past}"] = us
            print(f"{ran:8} {past:6d} {min(us):9.1f} {statistics.median(us):9.1f} {max(us):9.1f}")
    activity = MachineActivity.now().since(activity0)
    print(describe(activity))
    if a.json:
        a.json.write_text(json.dumps({"times_us": samples, "machine_activity": activity}, indent=2))


if __name__ == "__main__":
    main()
