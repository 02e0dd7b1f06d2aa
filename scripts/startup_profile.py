"""Where one whole ``onnx-prep run`` process spends its time, spawn to exit, phase by phase.

    .venv/bin/python scripts/startup_profile.py [--model PATH | --preset medium]
        [--prepared CACHE | --no-cache] [--tokens 1] [--spawns 5] [--json FILE]

The issue's whole-process run, ``onnx-prep run MODEL --tokens 1 --prepared CACHE --json``
(the cache built into a temporary folder first unless --prepared names one; --no-cache
runs without), spawned --spawns times after one untimed spawn (warm page cache). Each
child runs the console script (``cli/app.entry``) with timestamps (the monotonic clock, which
parent and child share) taken where the phases meet:

  interpreter   spawn to the child's first statement (exec, interpreter, site)
  cli imports   the command line's modules (typer, onnx_prep.cli)
  to resolve    argument parsing and the run's own imports before resolution
  resolve       resolve_model (imports made inside it included)
  open          resolution's end to the session constructed (the cache opened)
  first output  the first Session.run (the prefill)
  to close      the rest of the decode, to Session.close
  close         Session.close
  to main end   rendering the record, main() returning
  exit          main()'s end to the parent seeing the process gone (the exit
                handlers, the kernel freeing the address space; the interpreter's
                teardown too where entry() cannot skip it)

min / median / max per phase. Then one more spawn under ``python -X importtime``: import
time by top-level package (each module's own time, so the packages sum to the total).
The package's modules are byte-compiled first, as ``pip install`` does
(scripts/bytecode.py). Timestamps come from wrappers this script installs in the child
as the modules load; nothing in the package is changed. On a shared machine every
figure is an upper bound: the run ends with how much other work ran meanwhile.
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
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bytecode import describe_bytecode, ensure_bytecode  # noqa: E402 - compiled as pip install does

PHASES = (("interpreter", "spawn", "child_start"), ("cli imports", "child_start", "cli_imported"),
          ("to resolve", "cli_imported", "resolve_start"), ("resolve", "resolve_start", "resolve_end"),
          ("open", "resolve_end", "open_end"), ("first output", "open_end", "first_output"),
          ("to close", "first_output", "close_start"), ("close", "close_start", "close_end"),
          ("to main end", "close_end", "main_end"), ("exit", "main_end", "exited"))

# The child: marks on the monotonic clock, written to the file named by argv[1] when
# main() ends; the modules that hold the phases are wrapped as they load.
CHILD = r"""
import time
_now = lambda: time.clock_gettime_ns(time.CLOCK_MONOTONIC)
MARKS = {"child_start": _now()}
import functools, importlib.abc, json, sys

def _timed(fn, start, end, once=False):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        if start and not (once and start in MARKS):
            MARKS[start] = _now()
        try:
            return fn(*a, **kw)
        finally:
            if not (once and end in MARKS):
                MARKS[end] = _now()
    return wrapper

def _patch(module):
    if module.__name__ == "onnx_prep.core.model.resolution":
        module.resolve_model = _timed(module.resolve_model, "resolve_start", "resolve_end")
    else:
        s = module.Session
        s.__init__ = _timed(s.__init__, None, "open_end")
        s.run = _timed(s.run, None, "first_output", once=True)
        s.close = _timed(s.close, "close_start", "close_end", once=True)

class _Hook(importlib.abc.MetaPathFinder):
    NAMES = ("onnx_prep.core.model.resolution", "onnx_prep.core.runtime.session")

    def find_spec(self, name, path, target=None):
        if name not in self.NAMES:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else finder.find_spec(name, path, target)
            if spec is not None:
                run = spec.loader.exec_module
                def exec_module(module, run=run):
                    run(module)
                    _patch(module)
                spec.loader.exec_module = exec_module
                return spec
        return None

sys.meta_path.insert(0, _Hook())
out, sys.argv = sys.argv[1], ["onnx-prep", *sys.argv[2:]]
from onnx_prep.cli import app
MARKS["cli_imported"] = _now()
main = app.main

def marked_main():  # entry() calls it: the exit that follows is the console script's own
    try:
        main()
    finally:
        MARKS["main_end"] = _now()
        with open(out, "w") as f:
            json.dump(MARKS, f)

app.main = marked_main
app.entry()
"""


def _now() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def spawn(argv: list[str]) -> dict:
    """One child: its marks (ns) and the parent's spawn / exit, and the record it printed."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as marks, tempfile.TemporaryFile("w+") as out:
        t0 = _now()
        p = subprocess.run([sys.executable, "-c", CHILD, marks.name, *argv], stdout=out, stderr=subprocess.PIPE,
                           text=True)
        t1 = _now()
        if p.returncode != 0:
            sys.exit(f"onnx-prep {' '.join(argv)} exited {p.returncode}: {p.stderr.strip()[-400:]}")
        doc = json.load(marks)
        out.seek(0)
        record = json.loads(out.read())
    return {**doc, "spawn": t0, "exited": t1, "record": record}


def phases(m: dict) -> dict:
    """Each phase's ms; a phase whose marks are missing (no Session: --runtime ort) is None."""
    return {name: (m[b] - m[a]) / 1e6 if a in m and b in m else None for name, a, b in PHASES} | {
        "total": (m["exited"] - m["spawn"]) / 1e6}


def imports_by_package(argv: list[str]) -> tuple[float, dict[str, float]]:
    """(total ms, ms per top-level package) of one ``-X importtime`` spawn, by each
    module's own time."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as marks:
        p = subprocess.run([sys.executable, "-X", "importtime", "-c", CHILD, marks.name, *argv],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=True)
    per: dict[str, float] = defaultdict(float)
    for line in p.stderr.splitlines():
        if line.startswith("import time:") and "[us]" not in line:
            self_us, _, name = line.removeprefix("import time:").split("|")
            per[name.strip().split(".")[0]] += int(self_us) / 1e3
    return sum(per.values()), dict(sorted(per.items(), key=lambda kv: -kv[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="an INT4 ONNX decoder (default: the --preset fixture)")
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--prepared", type=Path, help="the prepared cache's manifest (default: built into a temporary "
                                                  "folder first)")
    ap.add_argument("--no-cache", action="store_true", help="run without a prepared cache")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--spawns", type=int, default=5)
    ap.add_argument("--top", type=int, default=8, help="packages listed by import time")
    ap.add_argument("--json", type=Path, help="also write every sample here")
    args = ap.parse_args(argv)

    from onnx_prep.core.profile.machine import describe_machine
    from onnx_prep.core.profile.machine_activity import MachineActivity, describe
    from onnx_prep.fixtures import FixtureConfig, ensure_cached

    model = args.model or ensure_cached(FixtureConfig.preset(args.preset))
    print(describe_machine())
    bytecode = ensure_bytecode()
    print(describe_bytecode(bytecode))
    with tempfile.TemporaryDirectory(prefix="startup-profile-") as tmp:
        run = ["run", str(model), "--tokens", str(args.tokens), "--json"]
        if not args.no_cache:
            cache = args.prepared
            if cache is None:
                from onnx_prep.core.cache.cache_build import build_prepared_cache

                cache = Path(build_prepared_cache(model, cache_dir=Path(tmp))["cache"])
            run += ["--prepared", str(cache), "--cache-policy", "require-complete"]
        print(f"onnx-prep {' '.join(run)}: {args.spawns} spawns after one untimed")
        activity = MachineActivity.now()
        spawn(run)  # untimed: the page cache warm
        samples = [phases(spawn(run)) for _ in range(args.spawns)]
        total, per_package = imports_by_package(run)
        act = MachineActivity.now().since(activity)

    print(f"\n{'phase':14} {'min':>8} {'median':>8} {'max':>8}  ms")
    for name in [p[0] for p in PHASES] + ["total"]:
        xs = [s[name] for s in samples if s[name] is not None]
        if xs:
            print(f"{name:14} {min(xs):8.1f} {statistics.median(xs):8.1f} {max(xs):8.1f}")
    print(f"\nimports (one -X importtime spawn, each module's own time): {total:.0f} ms")
    for name, ms in list(per_package.items())[:args.top]:
        print(f"  {ms:8.1f}  {name}")
    rest = sum(list(per_package.values())[args.top:])
    if rest:
        print(f"  {rest:8.1f}  {len(per_package) - args.top} other packages")
    print(describe(act))
    if args.json:
        args.json.write_text(json.dumps({"model": str(model), "argv": run, "samples": samples,
                                         "imports_ms": {"total": total, "by_package": per_package},
                                         "bytecode": bytecode, "machine_activity": act}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
