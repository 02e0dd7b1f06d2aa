"""Why a cold parallel load cannot overlap its reads with its slot commits: the model's
cold reads alone, beside CPU-bound threads, and beside threads committing stable slots.

    .venv/bin/python scripts/bench_read_contention.py [--preset medium] [--repeats 5] [--json FILE]

A cold load does two kinds of page work besides the packing: the page cache fills with
the data file (the populating read), and every stable slot commits fresh zeroed pages
(one per 4 KiB: ~145k for the medium fixture). Per repeat, interleaved, with the data
file dropped from the page cache before each case:

  reads_alone       every manifest read as the sessions do it (the shared mapping,
                    populated), nothing else running
  reads_beside_cpu  the same, while two threads run numpy arithmetic (GIL released)
  reads_beside_commits
                    the same, while two threads commit slots for every prepared object
                    of the model (opened before the clock starts, as Session
                    construction does; StableSlot.commit, as the prepacks do)
  commits_alone     those commits, two threads, nothing else running

Prints min/median/max of each, and how much of the smaller of reads and commits the
overlap saved: 0% means they ran as if one after the other, 100% fully overlapped.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np


def _stats(xs):
    return f"{min(xs):7.1f} {statistics.median(xs):7.1f} {max(xs):7.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the samples (ms) and the machine activity here")
    args = ap.parse_args(argv)

    from onnx_prep.core.io.external_data import ExternalDataReader
    from onnx_prep.core.profile.machine_activity import MachineActivity, describe
    from onnx_prep.core.plan.execution_plan import build_prepared_execution_plan
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.fixtures import FixtureConfig, ensure_cached
    from onnx_prep.native import StableSlot

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_load import _drop_cache  # the same page-cache drop as the load benchmark

    resolved = resolve_model(ensure_cached(FixtureConfig.preset(args.preset)))
    # the slots Session construction opens: one per prepared requirement of the plan
    sizes = [r.packed_bytes for r in build_prepared_execution_plan(resolved).requirements if r.packed_bytes > 0]
    print(f"{args.preset}: {resolved.manifest.total_bytes / 2**20:.0f} MiB to read, "
          f"{sum(sizes) / 2**20:.0f} MiB of slots in {len(sizes)} objects", file=sys.stderr)

    def reads() -> float:
        _drop_cache(resolved)
        reader = ExternalDataReader.for_model(resolved)
        t = time.perf_counter()
        for d in resolved.manifest:
            reader.map_shared(d, populate=True)
        ms = (time.perf_counter() - t) * 1e3
        reader.close_shared()
        return ms

    def compute(stop: threading.Event) -> None:
        a = np.ones(1 << 16, dtype=np.float32)
        while not stop.is_set():
            for _ in range(100):
                a = a * np.float32(1.0000001)

    def commit_all(slots, out: list) -> None:
        t = time.perf_counter()
        for s in slots:
            s.commit(s.capacity)
        out.append((time.perf_counter() - t) * 1e3)

    def opened_slots():
        slots = [StableSlot(n) for n in sizes]
        for s in slots:
            s.open()
        return slots

    res: dict[str, list[float]] = {}
    activity0 = MachineActivity.now()
    for _ in range(args.repeats):
        res.setdefault("reads_alone", []).append(reads())

        stop = threading.Event()
        ths = [threading.Thread(target=compute, args=(stop,), daemon=True) for _ in range(2)]
        for t in ths:
            t.start()
        res.setdefault("reads_beside_cpu", []).append(reads())
        stop.set()
        for t in ths:
            t.join()

        for case in ("reads_beside_commits", "commits_alone"):
            slots = opened_slots()
            done: list[float] = []
            t0 = time.perf_counter()
            ths = [threading.Thread(target=commit_all, args=(slots[i::2], done), daemon=True) for i in range(2)]
            for t in ths:
                t.start()
            if case == "reads_beside_commits":
                r = reads()
            for t in ths:
                t.join()
            both = (time.perf_counter() - t0) * 1e3
            if case == "reads_beside_commits":
                res.setdefault(case, []).append(r)
                res.setdefault("reads_and_commits_wall", []).append(both)
            else:
                res.setdefault(case, []).append(both)
            del slots
    activity = MachineActivity.now().since(activity0)

    print(f"{'case (ms)':28s}     min  median     max")
    for k, v in res.items():
        print(f"{k:28s} {_stats(v)}")
    m = {k: statistics.median(v) for k, v in res.items()}
    serial = m["reads_alone"] + m["commits_alone"]
    saved = (serial - m["reads_and_commits_wall"]) / min(m["reads_alone"], m["commits_alone"])
    print(f"reads + commits one after the other {serial:.0f} ms, overlapped {m['reads_and_commits_wall']:.0f} ms "
          f"(medians): the overlap saved {100 * saved:.0f}% of the shorter")
    print(describe(activity))
    if args.json:
        args.json.write_text(json.dumps({"preset": args.preset, "samples_ms": res, "overlap_saved": saved,
                                         "machine_activity": activity}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
