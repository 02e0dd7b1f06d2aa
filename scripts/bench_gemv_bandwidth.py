"""How close the decode GEMVs come to what this machine's cores can read: the INT4
matmul at batch 1 over more weights than the caches hold, on one thread, on two threads
each taking half of every weight's columns with no sync between weights, and split
through a run's mailbox as a decode step splits it (native/handoff.c: a fork and a
join per weight); beside a plain two-thread read of as many bytes (numpy's sum of
float32, a floor: it adds as it reads).

    .venv/bin/python scripts/bench_gemv_bandwidth.py [--weights 80] [--K 2048] [--N 5632]
        [--level 4] [--repeats 5] [--json FILE]

Prints GB/s of packed weight bytes, min / median / max over the repeats (the four
interleaved in each repeat). The weights are random, level-4 (int8 activations) by
default, block 32, no zero points: the medium fixture's MLP shape. Run it alone: other
work on the machine changes every figure.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from onnx_prep import native
from onnx_prep.core.ops import intra_op
from onnx_prep.core.profile.machine_activity import MachineActivity, describe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", type=int, default=80)
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--N", type=int, default=5632)
    ap.add_argument("--level", type=int, default=4, choices=(0, 4))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    K, N, bs = args.K, args.N, 32
    rng = np.random.default_rng(0)
    B = rng.integers(0, 256, (N, -(-K // bs), bs // 2), dtype=np.uint8)
    scales = (rng.random(N * -(-K // bs)) * 0.02).astype(np.float32)
    # NOTE: one array per weight (the same values): each read comes from its own memory
    packs = [native.prepack_matmul_nbits(B, scales, None, K=K, N=N, block_size=bs, accuracy_level=args.level)
             for _ in range(args.weights)]
    nbytes = sum(p.nbytes for p in packs)
    A = rng.standard_normal((1, K)).astype(np.float32)
    half = N // 2 // native.PANEL_N * native.PANEL_N

    def one_thread() -> None:
        for p in packs:
            native.matmul_nbits(A, p)

    def columns(c0: int, c1: int) -> None:
        out = np.empty((1, N), np.float32)
        for p in packs:
            native.matmul_nbits(A, p, col_begin=c0, col_end=c1, out=out)

    def two_free() -> None:
        ts = [threading.Thread(target=columns, args=(0, half)), threading.Thread(target=columns, args=(half, N))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    # the helper spins between weights, as in a decode step, and sleeps while the other
    # cases run (a helper that never slept would take a core from them)
    box = native.Mailbox()
    helper = threading.Thread(target=box.serve, daemon=True)
    helper.start()
    ranges = intra_op.column_ranges(N, intra_op.chunk_count(packs[0].nbytes, 1, 2), native.PANEL_N)

    def mailbox() -> None:
        for p in packs:
            _, batch = native.matmul_nbits_batch(A, p, ranges)
            box.fork_join(batch)

    plain = np.ones(nbytes // 4, np.float32)

    def read_two() -> None:
        parts = (plain[: plain.size // 2], plain[plain.size // 2:])
        ts = [threading.Thread(target=np.sum, args=(x,)) for x in parts]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    cases = {"one thread": one_thread, "two threads, no sync": two_free,
             "two, split as a step": mailbox, "numpy sum, two threads": read_two}
    rates: dict[str, list[float]] = {k: [] for k in cases}
    activity0 = MachineActivity.now()
    try:
        for _ in range(args.repeats):
            for name, fn in cases.items():
                t = time.perf_counter()
                fn()
                rates[name].append(nbytes / (time.perf_counter() - t) / 1e9)
    finally:
        box.stop()
        helper.join()
    activity = MachineActivity.now().since(activity0)
    print(f"{args.weights} INT4 weights [{K} x {N}], level {args.level}, {nbytes / 1e6:.1f} MB packed, "
          f"isa {native.active_isa()}; GB/s of packed bytes, min / median / max of {args.repeats}")
    for name, v in rates.items():
        print(f"  {name:26s} {min(v):6.2f} {statistics.median(v):6.2f} {max(v):6.2f}")
    print(describe(activity))
    if args.json:
        args.json.write_text(json.dumps({"weights": args.weights, "K": K, "N": N, "level": args.level,
                                         "packed_bytes": nbytes, "gb_per_s": rates,
                                         "machine_activity": activity}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
