"""Where one decode step of a fixture model spends its time, per op type (ActionProgram,
native prepared objects, hot-path binding). Prints a table; --json for machine output.

The steps continue one another as a real decode does (each step's presents are the next
step's past, so KV Concats append in place): the past starts at --past random tokens and
grows by one per step. ONNX Runtime, with --ort, runs the first step's feeds each time.

    .venv/bin/python scripts/profile_ops.py [--preset tiny-llm | --model PATH] [--batch 1] [--past 16] [--repeats 20]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from onnx_prep.core.runtime.action_program import ActionProgram
from onnx_prep.core.io.external_data import ExternalDataReader
from onnx_prep.core.kernels.prepack import prepack_all, source_loader
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.fixtures import generate


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny-llm")
    ap.add_argument("--model", type=Path, help="a decoder model instead of --preset (any export `run` "
                    "decodes: its inputs are found as `run` finds them)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--past", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--backend", default="native", choices=["native", "reference"])
    ap.add_argument("--ort", action="store_true", help="also time ONNX Runtime (1 thread) on the same feeds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory()
    path = args.model if args.model is not None else generate(args.preset, Path(tmp.name))
    resolved = resolve_model(path)
    load = source_loader(resolved, ExternalDataReader.for_model(resolved))
    program = ActionProgram.compile(resolved)
    binding = program.bind_prepared(prepack_all(resolved, load, backend=args.backend))
    weights = {n: load(n) for n in program.weight_names}

    from onnx_prep.core.decode.decoder_io import DecoderIO
    from onnx_prep.core.decode.generation import next_past, step_feeds

    # The roles come from the same discovery `run` uses, so an export with symbolic KV
    # dims (the genai builder's) works: the past is a prefill of --past random tokens.
    io = DecoderIO.for_resolved(resolved)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 100, size=(args.batch, args.past))
    out = program.run(step_feeds(io, prompt, io.empty_past(args.batch), 0), binding, weights=weights)
    past_len = args.past
    feeds = step_feeds(io, prompt[:, -1:], next_past(io, out, past_len), past_len)

    def advance(feeds, out):
        """The next decode step's feeds: the presents as past (so KV Concats append in
        place, as in a real decode), one position further."""
        nonlocal past_len
        past_len += 1
        return step_feeds(io, feeds[io.input_ids.name], next_past(io, out, past_len), past_len)

    ort_feeds = dict(feeds)
    for _ in range(3):  # warm up
        feeds = advance(feeds, program.run(feeds, binding, weights=weights))
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        feeds = advance(feeds, program.run(feeds, binding, weights=weights))
    step_ms = (time.perf_counter() - t0) / args.repeats * 1e3

    ort_ms = None
    if args.ort:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        for _ in range(3):
            sess.run(None, ort_feeds)
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            sess.run(None, ort_feeds)
        ort_ms = (time.perf_counter() - t0) / args.repeats * 1e3
    tmp.cleanup()

    per_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    total_profiled = 0.0
    for _ in range(args.repeats):
        values = program.new_values(feeds, weights)
        for a, ns in zip(program.actions, program.execute_profiled(values, binding)):
            kind = f"{a.op_type} [{resolved.nodes[a.node_index].kernel}]"
            per_op[kind][0] += ns / 1e6 / args.repeats
            per_op[kind][1] += 1
            total_profiled += ns / 1e6 / args.repeats
        feeds = advance(feeds, program.fetch(values))
    rows = sorted(((k, v[0], v[1] // args.repeats) for k, v in per_op.items()), key=lambda r: -r[1])
    from onnx_prep import native

    record = {"model": str(args.model) if args.model is not None else args.preset, "batch": args.batch, "past": args.past, "backend": args.backend,
              "isa": native.active_isa(), "actions": len(program), "step_ms": round(step_ms, 3),
              "ort_step_ms": None if ort_ms is None else round(ort_ms, 3),
              "profiled_ms": round(total_profiled, 3),
              "per_op": [{"op": k, "ms": round(ms, 3), "count": n, "share": round(ms / total_profiled, 4)}
                         for k, ms, n in rows]}
    if args.json:
        json.dump(record, sys.stdout, indent=1)
        print()
        return 0
    print(f"{record['model']} batch {args.batch} past {args.past} backend {args.backend} isa {record['isa']}: "
          f"{len(program)} actions, decode step {step_ms:.2f} ms (per-action profile {total_profiled:.2f} ms)"
          + ("" if ort_ms is None else f"; ONNX Runtime (1 thread) {ort_ms:.2f} ms"))
    print(f"{'op [kernel]':40s} {'count':>5s} {'ms':>8s} {'share':>6s}")
    for k, ms, n in rows:
        print(f"{k:40s} {n:5d} {ms:8.3f} {ms / total_profiled:6.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
