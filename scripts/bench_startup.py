"""Start-up of the ``onnx-prep`` command: whole-process wall time and import time per module.

    .venv/bin/python scripts/bench_startup.py [--spawns 15] [--top 12] [--json FILE]

For ``onnx-prep --help``, ``onnx-prep --version`` and ``onnx-prep run --tokens 1`` (the
embedded default model; generated first, outside the timing, if absent):
  wall     the whole process, spawn to exit, min / median / max over --spawns spawns
           of the console script, after one untimed spawn (warm page cache);
  imports  one more spawn under ``python -X importtime``: the total import time (the
           top-level imports' cumulative times) and the --top modules by cumulative time,
           nested ones indented under what imported them.
It prints the CPU it ran on (model, the kernels' ISA, cores) and how much other work
ran on the machine meanwhile: on a shared machine the wall times are upper bounds.
Before the first spawn, onnx_prep's modules are byte-compiled, as ``pip install`` of
the wheel does (scripts/bytecode.py; the line it prints says so).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

COMMANDS = (["--help"], ["--version"], ["run", "--tokens", "1"])


def _entry_point() -> list[str]:
    """The console script beside this interpreter (what users run), else ``-m onnx_prep``."""
    script = Path(sys.executable).with_name("onnx-prep")
    return [str(script)] if script.is_file() else ["-m", "onnx_prep"]


def _cpu() -> dict:
    from onnx_prep.core.profile.machine import cpu_model
    from onnx_prep.native import active_isa

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model": cpu_model(), "isa": active_isa(), "cores": os.cpu_count() or 1, "usable_cores": usable}


def _wall(argv: list[str], spawns: int) -> dict:
    cmd = [sys.executable, *_entry_point(), *argv]
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)  # untimed
    runs = []
    for _ in range(spawns):
        t0 = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        runs.append(time.perf_counter() - t0)
    return {"runs": runs, "min": min(runs), "median": statistics.median(runs), "max": max(runs)}


def _imports(argv: list[str], top: int) -> tuple[float, list[dict], list[str]]:
    """(total ms, the ``top`` entries by cumulative time, every module imported) of one
    ``-X importtime`` spawn (the JSON keeps them all)."""
    p = subprocess.run([sys.executable, "-X", "importtime", *_entry_point(), *argv],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=True)
    rows = []
    for line in p.stderr.splitlines():
        if not line.startswith("import time:") or "[us]" in line:
            continue
        self_us, cum_us, name = line.removeprefix("import time:").split("|")
        depth = (len(name) - len(name.lstrip(" "))) // 2
        rows.append({"module": name.strip(), "depth": depth, "self_ms": int(self_us) / 1e3,
                     "cumulative_ms": int(cum_us) / 1e3, "order": len(rows)})
    total = sum(r["cumulative_ms"] for r in rows if r["depth"] == 0)
    chosen = sorted(sorted(rows, key=lambda r: -r["cumulative_ms"])[:top], key=lambda r: r["order"])
    return total, [{k: v for k, v in r.items() if k != "order"} for r in chosen], sorted(r["module"] for r in rows)


def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spawns", type=int, default=15, help="timed spawns per command")
    ap.add_argument("--top", type=int, default=12, help="modules listed per command, by cumulative import time")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)

    from onnx_prep.core.profile.machine import describe_machine
    from onnx_prep.core.profile.machine_activity import MachineActivity, describe
    from onnx_prep.fixtures import default_model_path

    default_model_path()  # generated outside the timing
    cpu = _cpu()
    versions = {n: _version(n) for n in ("onnx-prep", "numpy", "onnx", "ml_dtypes", "typer", "rich")}
    print(f"onnx-prep {versions['onnx-prep']} start-up; {describe_machine()}, {cpu['usable_cores']} usable; "
          f"Python {platform.python_version()}, " + ", ".join(f"{n} {v}" for n, v in versions.items()
                                                            if n != "onnx-prep"))
    sys.path.insert(0, str(Path(__file__).parent))
    from bytecode import describe_bytecode, ensure_bytecode

    bytecode = ensure_bytecode()
    print(describe_bytecode(bytecode))
    before = MachineActivity.now()
    results = []
    for cmd in COMMANDS:
        wall = _wall(cmd, args.spawns)
        total, imports, modules = _imports(cmd, args.top)
        results.append({"argv": cmd, "wall_s": wall, "import_total_ms": total, "imports": imports,
                        "modules": modules})
        print(f"\nonnx-prep {' '.join(cmd)}: wall {wall['min']:.3f} / {wall['median']:.3f} / "
              f"{wall['max']:.3f} s (min / median / max of {args.spawns}); imports {total:.0f} ms, the top "
              f"{len(imports)}:")
        print(f"  {'cumulative ms':>13} {'self ms':>8}  module")
        for i in imports:
            print(f"  {i['cumulative_ms']:13.1f} {i['self_ms']:8.1f}  {'  ' * i['depth']}{i['module']}")
    activity = MachineActivity.now().since(before)
    print("\n" + describe(activity))
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu, "python": platform.python_version(), "versions": versions,
                                         "spawns": args.spawns, "commands": results, "bytecode": bytecode,
                                         "machine_activity": activity}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
