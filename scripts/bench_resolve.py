"""Benchmark model resolution: min/median/max of ``resolve_model`` over repeats.

    .venv/bin/python scripts/bench_resolve.py [--repeats 30] [--json] [--cache-dir DIR]

Models come from the fixture cache (generated once if absent; medium is ~0.56 GB):
``tiny-llm`` (4 blocks, hidden 512), ``medium`` (16 blocks, hidden 2048) and, to
compare like with like, ``tiny-llm-16L``: the tiny shapes with medium's 16 blocks, so
the same graph size as medium with 1/12 of its payload. Resolution's own time is
measured (imports and one warm-up call excluded: the warm-up pays one-time lazy
imports). Counters lead: the opens and maps of the model's external data files during
all timed calls (seen by a Python audit hook) must be 0.
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
from pathlib import Path

from onnx_prep.core.profile.machine import cpu_model


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


class DataFileWatch:
    """Counts, while ``active``, opens of the given files and file-backed maps, through a
    Python audit hook (one per process: it cannot be removed, and is inert when not
    active). No reader exists during resolution to count with: every reader's counters
    are its own (core/io/external_data.py)."""

    def __init__(self) -> None:
        self.paths: set[str] = set()
        self.active = False
        self.opens = 0
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if not self.active:
            return
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            name = os.fsdecode(args[0])
            # the reader opens component by component (openat): the last is a bare name
            if os.path.realpath(name) in self.paths or name in {os.path.basename(p) for p in self.paths}:
                self.opens += 1
        elif event == "mmap.__new__" and args[0] != -1:  # a file-backed map
            self.opens += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--cache-dir", help="fixture cache root (default: $ONNX_PREP_CACHE or ~/.cache/onnx-prep)")
    ap.add_argument("--models", default="tiny-llm,tiny-llm-16L,medium")
    ap.add_argument("--json", action="store_true", help="print the records as JSON")
    args = ap.parse_args(argv)
    if args.cache_dir:
        os.environ["ONNX_PREP_CACHE"] = args.cache_dir

    from onnx_prep import __version__
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.fixtures import FixtureConfig, cached_model_path, ensure_cached

    configs = {
        "tiny-llm": FixtureConfig.preset("tiny-llm"),
        "tiny-llm-16L": FixtureConfig.preset("tiny-llm").replace(layers=16),
        "medium": FixtureConfig.preset("medium"),
    }
    records = []
    watch = DataFileWatch()
    for name in args.models.split(","):
        cfg = configs[name]
        if not cached_model_path(cfg).is_file():
            print(f"generating {name} into {cached_model_path(cfg).parent} ...", file=sys.stderr)
        path = ensure_cached(cfg)
        resolved = resolve_model(path)  # warm-up: lazy imports, page cache for the .onnx
        watch.paths = {os.path.realpath(resolved.model_dir / f) for f in {d.file for d in resolved.manifest}}
        watch.opens = 0
        samples = []
        watch.active = True
        try:
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                resolve_model(path)
                samples.append((time.perf_counter() - t0) * 1000.0)
        finally:
            watch.active = False
        nodes = resolved.stats.nodes_total
        med = statistics.median(samples)
        records.append({
            "model": name, "path": str(path), "nodes": nodes,
            "initializers": resolved.stats.initializers_total,
            "payload_bytes": resolved.manifest.total_bytes,
            "model_file_bytes": path.stat().st_size,
            "data_file_opens": watch.opens,
            "repeats": args.repeats,
            "resolve_ms_min": round(min(samples), 3), "resolve_ms_median": round(med, 3),
            "resolve_ms_max": round(max(samples), 3),
            "us_per_node_median": round(med * 1000.0 / nodes, 2),
            "samples_ms": [round(s, 3) for s in samples],
        })
    by = {r["model"]: r for r in records}
    ratios = {}
    for a, b in (("medium", "tiny-llm"), ("medium", "tiny-llm-16L")):
        if a in by and b in by:
            ratios[f"{a}/{b}"] = {
                "median_time": round(by[a]["resolve_ms_median"] / by[b]["resolve_ms_median"], 2),
                "nodes": round(by[a]["nodes"] / by[b]["nodes"], 2),
                "payload_bytes": round(by[a]["payload_bytes"] / by[b]["payload_bytes"], 1),
            }
    provenance = {"version": __version__, "commit": _commit(), "python": platform.python_version(),
                  "cpu": cpu_model(), "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if args.json:
        print(json.dumps({"provenance": provenance, "records": records, "ratios": ratios}, indent=2))
        return 0
    print(f"resolve_model, {args.repeats} repeats after one warm-up; onnx-prep {provenance['version']} "
          f"({provenance['commit']}), Python {provenance['python']}, {provenance['cpu']} x{provenance['cpus']}")
    print(f"{'model':<14}{'nodes':>7}{'payload':>12}{'min ms':>9}{'median':>9}{'max':>9}{'us/node':>9}"
          f"{'data opens':>12}")
    for r in records:
        print(f"{r['model']:<14}{r['nodes']:>7}{r['payload_bytes'] / 2**20:>9.1f} MiB"
              f"{r['resolve_ms_min']:>9.2f}{r['resolve_ms_median']:>9.2f}{r['resolve_ms_max']:>9.2f}"
              f"{r['us_per_node_median']:>9.2f}{r['data_file_opens']:>12}")
    for k, v in ratios.items():
        print(f"{k}: median time x{v['median_time']}, nodes x{v['nodes']}, payload x{v['payload_bytes']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
