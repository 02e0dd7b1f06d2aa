"""Decode step time as the KV cache grows: append buffers sized once, append buffers
growing on their own, and plain copies.

    .venv/bin/python scripts/bench_decode.py [--preset medium] [--tokens 512] [--prompt-len 8] [--json FILE]

Greedy decode of --tokens tokens on one thread through the same action program and
the same prepared weights, compiled twice, in three modes:
  append  append buffers (the default: a KV Concat writes only the new rows,
          core/ops/append_buffer.py), sized once: greedy_decode announces prompt + tokens
  grow    the same program with no length announced (a caller running its own step
          loop): each buffer grows by about 1.5x when its room runs out, each on its own
          step (append_buffer.room_after)
  copy    compiled without append buffers: every step copies the whole past
The modes run A B C C B A; the generated tokens must be identical, and the logits
bit-identical, in every run. Per mode, the step times in windows of past length
(min / median / max over the steps in the window and both runs), and the counters of
in-place appends and copies.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--model", type=Path, help="an ONNX decoder model (default: the --preset fixture)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from onnx_prep.core.runtime.action_program import ActionProgram
    from onnx_prep.core.decode.decoder_io import DecoderIO
    from onnx_prep.core.io.external_data import ExternalDataReader
    from onnx_prep.core.decode.generation import greedy_decode
    from onnx_prep.core.profile.machine_activity import MachineActivity, describe
    from onnx_prep.core.ops import append_buffer, run_counters
    from onnx_prep.core.runtime.stats import Counters, RuntimeStats
    from onnx_prep.core.kernels.prepack import prepack_all, source_loader
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.fixtures import FixtureConfig, ensure_cached
    from onnx_prep.native import active_isa

    path = args.model or ensure_cached(FixtureConfig.preset(args.preset))
    resolved = resolve_model(path)
    io = DecoderIO.from_model(path)
    load = source_loader(resolved, ExternalDataReader.for_model(resolved))
    prepared = prepack_all(resolved, load)
    programs = {}
    for mode, flag in (("append", True), ("copy", False)):
        p = ActionProgram.compile(resolved, append_in_place=flag)
        programs[mode] = (p, p.bind_prepared(prepared))
    weights = {n: load(n) for n in programs["append"][0].weight_names}  # the same for both

    class Runner:
        """One mode's program, counting what its Concats did as a session run does
        (core/ops/run_counters.py), with the record greedy_decode reads (stats())."""

        def __init__(self, mode):
            self.program, self.binding = programs["copy" if mode == "copy" else "append"]
            self.room = 0 if mode == "grow" else None  # grow: no length announced
            self.counters = Counters()

        def run(self, feeds):
            with run_counters.counting(self.counters):
                if self.room is None:
                    return self.program.run(feeds, self.binding, weights=weights)
                with append_buffer.room_for(self.room):  # overrides greedy_decode's hint
                    return self.program.run(feeds, self.binding, weights=weights)

        def stats(self):
            return RuntimeStats.from_counts(self.counters.snapshot())

    prompt = (np.arange(args.prompt_len, dtype=np.int64)[None, :] * 7 + 3) % 1000
    print(f"model {path}  isa {active_isa()}  prompt {args.prompt_len}  tokens {args.tokens}  one thread",
          file=sys.stderr)
    steps = {"append": [], "grow": [], "copy": []}
    counts = {}
    results = {}
    activity0 = MachineActivity.now()
    for mode in ("append", "grow", "copy", "copy", "grow", "append"):
        t0 = time.perf_counter()
        res = greedy_decode(Runner(mode), io, prompt, args.tokens, keep_logits=True)
        wall = time.perf_counter() - t0
        counts[mode] = {"appended_in_place": res.stats.kv_appended_in_place, "copied": res.stats.kv_copied}
        steps[mode].append(res.step_ms)
        if mode in results:
            assert res.tokens.tolist() == results[mode].tokens.tolist()
        results[mode] = res
        print(f"  {mode}: {wall:.1f} s, {args.tokens / wall:.1f} tokens/s", file=sys.stderr)
    activity = MachineActivity.now().since(activity0)
    a = results["append"]
    for other in ("grow", "copy"):
        o = results[other]
        assert a.tokens.tolist() == o.tokens.tolist(), f"tokens differ between append and {other}"
        assert all(np.array_equal(x, y) for x, y in zip(a.logits, o.logits)), \
            f"logits differ between append and {other}"

    edges = [1, 64, 128, 256, 512, 1024, 2048]
    windows = [(lo, hi) for lo, hi in zip(edges, edges[1:]) if lo < args.tokens]
    print(f"\ndecode step ms by past length (min / median / max, both runs); tokens and logits identical")
    print(f"  {'past':>12}  {'append':>24}  {'grow':>24}  {'copy':>24}  copy/append")
    summary = []
    fmt = lambda st: f"{st['min']:7.1f} {st['median']:7.1f} {st['max']:7.1f}"
    for lo, hi in windows:
        row = {"past_from": args.prompt_len + lo - 1, "past_to": args.prompt_len + min(hi, args.tokens) - 2}
        for mode in steps:
            xs = [x for run in steps[mode] for x in run[lo:hi]]
            row[mode] = {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}
        summary.append(row)
        print(f"  {row['past_from']:5d}-{row['past_to']:<6d}  {fmt(row['append'])}  {fmt(row['grow'])}"
              f"  {fmt(row['copy'])}  {row['copy']['median'] / row['append']['median']:10.2f}x")
    total = {m: sum(sum(r[1:]) for r in steps[m]) / len(steps[m]) / 1e3 for m in steps}
    print(f"\ndecode only (steps 2..{args.tokens}, mean of runs): "
          + ", ".join(f"{m} {total[m]:.2f} s ({(args.tokens - 1) / total[m]:.1f} tokens/s)" for m in steps))
    print("slowest decode step (both runs): "
          + ", ".join(f"{m} {max(max(r[1:], default=0.0) for r in steps[m]):.1f} ms" for m in steps))
    print(f"counters per run: " + ", ".join(f"{m} {counts[m]}" for m in steps))
    print(describe(activity))
    if args.json:
        args.json.write_text(json.dumps({"model": str(path), "tokens": args.tokens, "windows": summary,
                                         "decode_s": total, "counters": counts,
                                         "step_ms": steps, "machine_activity": activity}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
