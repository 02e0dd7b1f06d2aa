"""Where a decode step's time goes around its split INT4 GEMVs, measured so that it
survives other work on the machine: thread CPU time of the run's own thread, the
hand-off's counters (native/handoff.c) and the step's GEMVs replayed on one thread.

    .venv/bin/python scripts/gemv_step_profile.py [--preset medium | --model PATH]
        [--tokens 24] [--rounds 4] [--threads 2] [--batch 1] [--compare huge-pages|streaming|panels|fusion]
        [--per-op] [--json FILE]

Per decode step (the prefill and the first decode step left out), min and median of:
  wall_ms        the step's wall time (what other work on the machine inflates most)
  cpu_ms         CPU time of the run's thread over the step
  fj_ms          wall time inside Mailbox.fork_join (the split GEMVs), summed
  fj_cpu_ms      the run thread's CPU time inside fork_join: its own chunks and its wait
  wait_ms        the run thread's wait, with no chunk left to take, for helpers' chunks
  batches        split GEMVs; solo: those whose every chunk the run thread ran itself
                 (no helper arrived in time); helper_chunks: chunks helpers ran
  switches       voluntary context switches of the process's threads over the step
                 (a thread that blocked: on a VM its vCPU may idle and be given away;
                 getrusage, 0 where there is none)
and ``replay_ms``: the CPU time of one step's GEMVs (same activations, same prepared
weights) run whole and back to back on this thread, min over repeats: the GEMVs'
one-thread cost, to set against fj_cpu_ms + the helpers' share.

``--compare huge-pages`` opens the model twice, its prepared weights on 4 KiB pages and
on transparent huge pages (``SessionOptions.huge_pages``), runs them interleaved round by
round, and prints each session's open + prepare time (the huge pages' first-use cost
lands there). ``--compare streaming`` runs two sessions of the model, one with the decode GEMVs'
non-temporal weight prefetch (the default) and one without (native/op_internal.h,
``OP_STREAM_AHEAD``), interleaved round by round. ``--compare helpers`` runs one
session whose hot runs keep their lent helpers (the default) and one that lends and
takes them back at every run (spinning 1 ms, as before; core/runtime/run_loop.py):
compare their ``switches``. ``--compare panels`` does the same
with a one- or two-row level-4 GEMV reading one panel at a time and two side by side (the
default; native/kernels_avx512.c, ``DEFINE_I8_PANEL_PAIR``). ``--compare fusion`` runs the
model resolved with pattern fusion (the default) and without (``resolve_model(fuse=False)``;
on a builder export, whose other ops are contrib ops already, that is the ``silu`` fusion
alone: docs/resolve.md).
The greedy tokens of every session must be identical (checked).
``--per-op`` then decodes once more in the first session with every action timed on
its own (the run's thread, the split GEMVs' helpers lent as usual) and prints, per op
type, the actions a step, their ms a step and µs each: where the time outside the
GEMVs goes. Timing each action adds a little to each; the GEMVs' sum stays close to fj_ms.
``--ort-per-op`` then decodes the same prompt with ONNX Runtime (the same threads, its
session config as ``run --compare ort`` sets it) with its profiler on, and prints its
kernel time per op type a step beside ours (steps 0 and 1 left out, as above): where the
two steps differ. ONNX Runtime fuses at load what we run as separate ops (Sigmoid and
Mul become QuickGelu), so compare the groups, not only the rows.
``--split-all`` splits every INT4 matmul however small (smoke runs on tiny fixtures).
Figures are indicative; wall times need a quiet machine (scripts/bench_decode_speed.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from onnx_prep.core.runtime.run_loop import HELPER_SPIN_NS as KEPT_SPIN_NS

METRICS = ("wall_ms", "cpu_ms", "fj_ms", "fj_cpu_ms", "wait_ms", "batches", "solo", "helper_chunks", "switches")
# --compare: the sessions to interleave, each with its Session huge_pages, whether
# one-pass INT4 GEMVs stream their weights past the caches (native.set_weight_streaming),
# how many panels a one- or two-row int8 GEMV reads side by side (native.set_gemv_panels) and
# whether hot runs keep their lent helpers (core/runtime/run_loop.py; not kept: lent and
# taken back at every run, spinning 1 ms, as before they were kept) and whether the
# model is resolved with pattern fusion (resolve's default) or without. Streaming None:
# the machine's choice (core/ops/weight_streaming.py).
MODES = {"none": {"default": (None, None, 2, True, True)},
         "huge-pages": {"4k": (False, None, 2, True, True), "huge": (True, None, 2, True, True)},
         "streaming": {"stream": (None, True, 2, True, True), "no-stream": (None, False, 2, True, True)},
         "panels": {"one-panel": (None, None, 1, True, True), "panel-pairs": (None, None, 2, True, True)},
         "helpers": {"per-run": (None, None, 2, False, True), "kept": (None, None, 2, True, True)},
         "fusion": {"unfused": (None, None, 2, True, False), "fused": (None, None, 2, True, True)}}


def _settings(mode: tuple) -> None:
    from onnx_prep import native
    from onnx_prep.core.runtime import run_loop

    from onnx_prep.core.ops.weight_streaming import choice

    native.set_weight_streaming(choice().on if mode[1] is None else mode[1])
    native.set_gemv_panels(mode[2])
    run_loop.HELPER_SPIN_NS = KEPT_SPIN_NS if mode[3] else 1_000_000


def _per_run_helpers(session) -> None:
    """Hot runs of ``session`` lend their helpers and take them back at every run (what
    they did before they kept them)."""
    session.runs._keep = lambda kept: False


class StepProbe:
    """Counts what one session's steps spend in Mailbox.fork_join and in
    MatmulSplit.through, the bound GEMV call (wrapped at class level while the probe is
    active; one session runs at a time)."""

    def __init__(self) -> None:
        self.acc = dict.fromkeys(METRICS[2:], 0.0)
        self.capture: list | None = None  # when a list: every INT4 matmul's (A, packed, bias)

    def install(self):
        from onnx_prep import native
        from onnx_prep.native import handoff

        orig_fj, orig_batch, orig_whole = handoff.Mailbox.fork_join, handoff.MatmulSplit.batch, native.matmul_nbits
        orig_through = handoff.MatmulSplit.through
        acc = self.acc

        def timed(box, call):
            w0, s0, h0, b0 = box.wait_ns, box.solo_batches, box.chunks_by_helpers, box.batches
            t, c = time.perf_counter(), time.thread_time()
            out = call()
            acc["fj_cpu_ms"] += (time.thread_time() - c) * 1e3
            acc["fj_ms"] += (time.perf_counter() - t) * 1e3
            acc["wait_ms"] += (box.wait_ns - w0) / 1e6
            acc["solo"] += box.solo_batches - s0
            acc["helper_chunks"] += box.chunks_by_helpers - h0
            acc["batches"] += box.batches - b0
            return out

        def fork_join(box, batch):
            timed(box, lambda: orig_fj(box, batch))

        def through(split, box, A):  # the bound call (core/ops/int4.py): batch and fork_join in one
            if self.capture is not None:
                self.capture.append((A.copy(), split.weight(), None))
            return timed(box, lambda: orig_through(split, box, A))

        def batch(split, A, *, bias=None, **kw):
            if self.capture is not None:
                self.capture.append((A.copy(), split.weight(), bias))
            return orig_batch(split, A, bias=bias, **kw)

        def whole(A, packed, *, bias=None, **kw):
            if self.capture is not None:
                self.capture.append((A.copy(), packed, bias))
            return orig_whole(A, packed, bias=bias, **kw)

        handoff.Mailbox.fork_join, handoff.MatmulSplit.batch, native.matmul_nbits = fork_join, batch, whole
        handoff.MatmulSplit.through = through

        def uninstall():
            handoff.Mailbox.fork_join = orig_fj
            handoff.MatmulSplit.batch, native.matmul_nbits = orig_batch, orig_whole
            handoff.MatmulSplit.through = orig_through
        return uninstall

    def reset(self) -> None:
        for k in self.acc:
            self.acc[k] = 0.0


def voluntary_switches() -> int:
    """Voluntary context switches of this process so far, every thread's, ended ones too
    (getrusage; 0 where there is none)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not Unix
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw


def open_decoder(model: Path | None, preset: str, batch: int):
    """``(path, resolved, io, prompt)``: the decoder model's file (``model``, a file or
    the folder an exporter wrote, else the fixture ``preset``, generated and cached),
    resolved, its roles, and an 8-token prompt in each of ``batch`` rows.
    (scripts/ab_decode_step.py uses it too.)"""
    from onnx_prep.core.decode.decoder_io import DecoderIO
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.fixtures import FixtureConfig, ensure_cached

    path = model if model is not None else ensure_cached(FixtureConfig.preset(preset))
    resolved = resolve_model(path)
    prompt = np.tile(np.arange(1, 9, dtype=np.int64)[None, :], (batch, 1))
    return resolved.model_path, resolved, DecoderIO.for_resolved(resolved), prompt


def replay_ms(gemvs: list, repeats: int) -> float:
    """Min CPU time of ``gemvs`` run whole, back to back, on this thread."""
    from onnx_prep import native

    best = float("inf")
    for _ in range(repeats):
        c = time.thread_time()
        for A, packed, bias in gemvs:
            native.matmul_nbits(A, packed, bias=bias)
        best = min(best, (time.thread_time() - c) * 1e3)
    return best


def per_op_profile(session, io, prompt, tokens: int) -> tuple[int, list[tuple[str, int, float]]]:
    """One more greedy decode on ``session`` with each action of each decode step (the
    prefill and the first step left out) timed on its own: (steps timed, [(op type,
    actions a step, ms a step)], slowest first)."""
    from collections import defaultdict

    from onnx_prep.core.decode.generation import greedy_decode
    from onnx_prep.core.runtime.action_program import ActionProgram

    total: dict[str, int] = defaultdict(int)
    count: dict[str, int] = defaultdict(int)
    timing, step = [False], [0]
    execute = ActionProgram.execute

    def timed(self, values, prepared, begin=0, end=None):
        end = len(self.actions) if end is None else end
        if not timing[0]:
            return execute(self, values, prepared, begin, end)
        for i in range(begin, end):
            t = time.perf_counter_ns()
            execute(self, values, prepared, i, i + 1)
            op = self.actions[i].op_type
            total[op] += time.perf_counter_ns() - t
            count[op] += 1

    orun = session.run

    def run(feeds):
        timing[0] = step[0] >= 2
        step[0] += 1
        return orun(feeds)

    ActionProgram.execute, session.run = timed, run
    try:
        greedy_decode(session, io, prompt, tokens)
    finally:
        ActionProgram.execute = execute
        del session.run
    n = max(step[0] - 2, 1)
    rows = sorted(((op, count[op] // n, total[op] / n / 1e6) for op in total), key=lambda r: -r[2])
    return n, rows


def ort_per_op(path: Path, io, prompt, tokens: int, threads: int) -> tuple[int, float, list[tuple[str, int, float]]]:
    """The same greedy decode through ONNX Runtime with its profiler on: (steps timed,
    its median run ms, [(op type, kernels a step, ms a step)], slowest first), the
    prefill and the first decode step left out."""
    import os
    import tempfile
    from collections import defaultdict

    from onnx_prep.core.decode.generation import greedy_decode
    from onnx_prep.core.decode.ort_runner import OrtRunner, like_for_like_config

    runner = OrtRunner(path, threads, session_config=like_for_like_config(),
                       profile_prefix=os.path.join(tempfile.mkdtemp(), "ort"))
    try:
        greedy_decode(runner, io, prompt, tokens)
    finally:
        trace = Path(runner.session.end_profiling())
    events = json.loads(trace.read_text())
    trace.unlink()
    runs = [e for e in events if e.get("name") == "model_run"]
    start = runs[2]["ts"] if len(runs) > 2 else 0
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e["ts"] >= start:
            op = e["args"]["op_name"]
            total[op] += e["dur"]
            count[op] += 1
    n = max(len(runs) - 2, 1)
    rows = sorted(((op, count[op] // n, total[op] / n / 1e3) for op in total), key=lambda r: -r[2])
    return n, statistics.median(r["dur"] for r in runs[2:]) / 1e3 if len(runs) > 2 else 0.0, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--model", type=Path, help="a decoder model file instead of --preset")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1, help="rows decoded together (the same prompt in each)")
    ap.add_argument("--compare", choices=sorted(MODES), default="none")
    ap.add_argument("--split-all", action="store_true")
    ap.add_argument("--per-op", action="store_true", help="then time every action of one more decode, per op type")
    ap.add_argument("--ort-per-op", action="store_true",
                    help="then the same decode in ONNX Runtime with its profiler: its kernel time per op type")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.tokens < 4:
        ap.error("--tokens must be at least 4 (the prefill and the first decode step are left out)")

    from onnx_prep import native
    from onnx_prep.core.decode.generation import greedy_decode
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.core.ops import intra_op
    from onnx_prep.core.profile.machine_activity import MachineActivity, describe
    from onnx_prep.core.runtime.session import Session

    path, resolved, io, prompt = open_decoder(args.model, args.preset, args.batch)
    if args.split_all:
        intra_op.MIN_SPLIT_WORK = 1
    probe = StepProbe()
    uninstall = probe.install()
    sessions, open_s = {}, {}
    steps: dict[str, dict[str, list[float]]] = {}
    replay: dict[str, float] = {}
    replayed: dict[str, int] = {}  # INT4 matmuls of the replayed step
    tokens: dict[str, list] = {}
    try:
        for mode, (huge, *_, fuse) in MODES[args.compare].items():
            t = time.perf_counter()
            s = Session(resolved if fuse else resolve_model(path, fuse=False), cpu_workers=args.threads,
                        intra_op_threads=args.threads, huge_pages=huge)
            if not MODES[args.compare][mode][3]:
                _per_run_helpers(s)
            s.prepare()
            open_s[mode] = time.perf_counter() - t
            sessions[mode] = s
            steps[mode] = {k: [] for k in METRICS}
        activity0 = MachineActivity.now()
        for r in range(args.rounds):
            for mode, s in sessions.items():
                rows: list[dict] = []
                orun = s.run

                def run(feeds, orun=orun, rows=rows):
                    probe.reset()
                    probe.capture = [] if r == 0 and len(rows) == 2 else None
                    v = voluntary_switches()
                    t, c = time.perf_counter(), time.thread_time()
                    out = orun(feeds)
                    row = dict(probe.acc, wall_ms=(time.perf_counter() - t) * 1e3,
                               cpu_ms=(time.thread_time() - c) * 1e3)
                    row["switches"] = voluntary_switches() - v
                    if probe.capture is not None:
                        row["gemvs"], probe.capture = probe.capture, None
                    rows.append(row)
                    return out

                s.run = run
                _settings(MODES[args.compare][mode])
                try:
                    res = greedy_decode(s, io, prompt, args.tokens)
                finally:
                    del s.run
                    _settings(MODES["none"]["default"])
                tokens.setdefault(mode, res.tokens.tolist())
                if tokens[mode] != next(iter(tokens.values())):
                    raise SystemExit(f"{mode}: greedy tokens differ from the other session's")
                for row in rows[2:]:
                    for k in METRICS:
                        steps[mode][k].append(row[k])
                if r == 0:
                    replayed[mode] = len(rows[2]["gemvs"])
                    _settings(MODES[args.compare][mode])
                    try:
                        replay[mode] = replay_ms(rows[2]["gemvs"], max(3, args.rounds * 2))
                    finally:
                        _settings(MODES["none"]["default"])
        activity = MachineActivity.now().since(activity0)
        per_op = per_op_profile(next(iter(sessions.values())), io, prompt, args.tokens) if args.per_op else None
        ort_op = ort_per_op(path, io, prompt, args.tokens, args.threads) if args.ort_per_op else None
    finally:
        uninstall()
        for s in sessions.values():
            s.close()

    from onnx_prep.core.ops.weight_streaming import choice

    name = args.model or args.preset
    print(f"{name}: {args.threads} threads, batch {args.batch}, {args.rounds} rounds of {args.tokens} tokens per session, "
          f"per decode step (min / median); {choice().describe()}")
    for mode in sessions:
        print(f"  [{mode}] open + prepare {open_s[mode]:.2f} s; the step's {replayed[mode]} GEMVs replayed "
              f"on one thread {replay[mode]:.2f} ms")
        for k in METRICS:
            v = steps[mode][k]
            print(f"    {k:14s} {min(v):9.2f} {statistics.median(v):9.2f}")
    if per_op is not None:
        steps_timed, rows = per_op
        print(f"  per op type, {steps_timed} decode steps, every action timed on its own: "
              f"{sum(ms for _, _, ms in rows):.2f} ms a step")
        for op, count, ms in rows:
            print(f"    {op:34s} {count:4d} a step {ms:8.3f} ms {ms / count * 1e3:8.1f} us each")
    if ort_op is not None:
        steps_timed, run_ms, rows = ort_op
        print(f"  ONNX Runtime, per op type, {steps_timed} decode steps (its profiler's kernel times): "
              f"{sum(ms for _, _, ms in rows):.2f} ms a step in kernels, its run {run_ms:.2f} ms (median)")
        for op, count, ms in rows:
            print(f"    {op:34s} {count:4d} a step {ms:8.3f} ms {ms / max(count, 1) * 1e3:8.1f} us each")
    print(describe(activity))
    if args.json:
        args.json.write_text(json.dumps({"model": str(name), "threads": args.threads, "batch": args.batch,
                                         "open_s": open_s,
                                         "replay_ms": replay, "replayed_gemvs": replayed, "steps": steps, "tokens": tokens,
                                         "per_op": None if per_op is None else {
                                             "steps": per_op[0], "ops": [{"op": op, "count": n, "ms": ms}
                                                                         for op, n, ms in per_op[1]]},
                                         "ort_per_op": None if ort_op is None else {
                                             "steps": ort_op[0], "run_ms": ort_op[1],
                                             "ops": [{"op": op, "count": n, "ms": ms} for op, n, ms in ort_op[2]]},
                                         "machine_activity": activity}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
