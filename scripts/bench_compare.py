"""Two checkouts, one model, paired: does a change slow the load or the decode?

Runs ``onnx-prep run MODEL --json`` from each checkout's own ``.venv`` in alternating
order (A B, then B A, ...), each a fresh process as a user runs it, and prints per side
min / median / max of:

- ``open_ms`` (session open), ``first_output_ms`` (the prefill step: time to first
  output inside the process) and ``decode_ms`` (median step after the prefill);
- ``spawn_to_exit_ms``: the whole process, spawn to exit, as the user feels it;
- peak RSS of the child (``ru_maxrss``).

and the paired difference B - A per repeat (min / median / max), since both sides of a
pair ran back to back on the same machine state. Tokens must be identical across every
run (the script stops otherwise). Usage::

    python scripts/bench_compare.py --a /path/before --b /path/after \\
        [--preset medium] [--tokens 32] [--repeats 7]

Each checkout needs ``make install`` first; its modules are byte-compiled before the
first run, as ``pip install`` of the wheel does (scripts/bytecode.py). The model is generated once by side B's
fixture generator into a temporary folder (or pass ``--model PATH``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIGURES = ("open_ms", "first_output_ms", "decode_ms", "spawn_to_exit_ms", "peak_rss_mib")


def _run(checkout: Path, model: Path, tokens: int, prompt: str) -> tuple[dict, list]:
    exe = checkout / ".venv" / "bin" / "onnx-prep"
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        child = subprocess.Popen([str(exe), "run", str(model), "--prompt-ids", prompt,
                                  "--tokens", str(tokens), "--json"],
                                 stdout=out, stderr=err, cwd=checkout)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage (peak RSS)
        wall = (time.perf_counter() - t0) * 1e3
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        if child.returncode != 0:
            sys.exit(f"{exe} exited {child.returncode}: {err.read().strip()}")
        doc = json.loads(out.read())
    t = doc["timings"]
    steps = t["step_ms"][1:]
    figures = {"open_ms": t["open_ms"], "first_output_ms": t["first_output_ms"],
               "decode_ms": statistics.median(steps) if steps else float("nan"),
               "spawn_to_exit_ms": wall,
               "peak_rss_mib": usage.ru_maxrss / 1024}
    return figures, doc["tokens"]


def _stats(xs: list[float]) -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "n/a"
    return f"{min(xs):9.1f} {statistics.median(xs):9.1f} {max(xs):9.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", type=Path, required=True, help="the baseline checkout")
    ap.add_argument("--b", type=Path, required=True, help="the changed checkout")
    ap.add_argument("--model", type=Path)
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-ids", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    from onnx_prep.core.profile.machine import describe_machine
    from onnx_prep.core.profile.machine_activity import MachineActivity, describe

    tmp = None
    model = args.model
    if model is None:
        tmp = tempfile.TemporaryDirectory()
        gen = subprocess.run([str(args.b / ".venv" / "bin" / "onnx-prep"), "fixture", args.preset,
                              tmp.name], capture_output=True, text=True, check=True)
        model = next(Path(tmp.name).glob("*.onnx"))
        del gen

    print(describe_machine())
    sys.path.insert(0, str(Path(__file__).parent))
    from bytecode import describe_bytecode, ensure_bytecode

    for side, checkout in (("A", args.a), ("B", args.b)):  # each side as pip install leaves it
        print(f"{side}: {describe_bytecode(ensure_bytecode(str(checkout / '.venv' / 'bin' / 'python'), ()))}")
    activity = MachineActivity.now()
    print(f"model {model} ({args.preset}), {args.tokens} tokens, prompt {args.prompt_ids}, "
          f"{args.repeats} pairs, order alternating A B / B A")
    sides = {"A": args.a, "B": args.b}
    results: dict[str, list[dict]] = {"A": [], "B": []}
    tokens_seen = None
    for r in range(args.repeats):
        for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
            figures, tokens = _run(sides[side], model, args.tokens, args.prompt_ids)
            if tokens_seen is None:
                tokens_seen = tokens
            elif tokens != tokens_seen:
                sys.exit(f"side {side} repeat {r}: tokens differ from the first run")
            results[side].append(figures)

    print(f"\n{'figure':18} {'side':4} {'min':>9} {'median':>9} {'max':>9}")
    for f in FIGURES:
        for side in ("A", "B"):
            print(f"{f:18} {side:4} {_stats([x[f] for x in results[side]])}")
        diffs = [b[f] - a[f] for a, b in zip(results["A"], results["B"])]
        print(f"{f:18} {'B-A':4} {_stats(diffs)}")
    print("\ntokens identical across all runs: yes")
    print(describe(MachineActivity.now().since(activity)))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
