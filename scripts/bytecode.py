"""Bytecode before a benchmark spawns processes, so a spawn measures what a user runs.

A user's ``pip install`` of the wheel byte-compiles the package at install (each
module's ``__pycache__/*.pyc``). An editable install in a shell that sets
``PYTHONDONTWRITEBYTECODE=1`` has none: every spawn compiles this package's ~110 modules
from source again (about 0.2 s of the run path's imports on the 2-vCPU VM), a cost no
user pays. The benchmarks that time whole processes (bench_cache.py, bench_compare.py,
bench_startup.py, startup_profile.py) call :func:`ensure_bytecode` first. In the
interpreter the processes will run, it

- compiles each of onnx_prep's modules whose bytecode is missing or stale into its
  normal ``__pycache__`` (``py_compile``, which writes whatever ``PYTHONDONTWRITEBYTECODE``
  says; the spawned processes only read it, and a module edited later is compiled in
  memory again, as without bytecode. ``compileall`` is not used: it takes a file whose
  modification second is unchanged for current, the import system checks the size too);
- reports, for onnx_prep and for the other packages the timed processes import (ONNX
  Runtime's side included), the share of modules whose bytecode is there and current
  (its header names the source's size and modification time). pip compiled the others
  at install; a share under 100% is printed, so unequal terms are visible.
"""
from __future__ import annotations

import json
import subprocess
import sys

OURS = ("onnx_prep", "onnx_prep.cli", "onnx_prep.core", "onnx_prep.native", "onnx_prep.fixtures")
OTHERS = ("numpy", "onnx", "ml_dtypes", "typer", "click", "rich", "onnxruntime")

# Runs in the benchmarked interpreter: its bytecode tag, its packages.
_CHILD = r"""
import importlib.util, json, os, py_compile, sys

OURS, OTHERS = json.loads(sys.argv[1]), json.loads(sys.argv[2])

def folders(names):
    out = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except ImportError:
            spec = None
        for folder in (spec.submodule_search_locations or []) if spec else []:
            if folder not in out:
                out.append(folder)
    return out

def sources(folder):
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        yield from (os.path.join(root, f) for f in files if f.endswith(".py"))

def current(src):
    try:
        with open(importlib.util.cache_from_source(src), "rb") as f:
            head = f.read(16)
        st = os.stat(src)
    except OSError:
        return False
    return (head[:4] == importlib.util.MAGIC_NUMBER and head[4:8] == bytes(4)
            and int.from_bytes(head[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF
            and int.from_bytes(head[12:16], "little") == st.st_size & 0xFFFFFFFF)

def count(folder_list):
    srcs = [s for f in folder_list for s in sources(f)]
    return len(srcs), sum(map(current, srcs))

ours = folders(OURS)
total, before = count(ours)
for src in [s for f in ours for s in sources(f) if not current(s)]:
    try:
        py_compile.compile(src, doraise=True, invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
    except (py_compile.PyCompileError, OSError):
        pass  # a read-only install, a syntax error: counted as not current
_, after = count(ours)
others = {}
for name in OTHERS:
    fl = folders([name])
    if fl:
        n, ok = count(fl)
        others[name] = {"modules": n, "current": ok, "folders": fl}
print(json.dumps({"compiled": {"package": OURS[0], "modules": total, "current_before": before, "current": after,
                               "folders": ours}, "others": others}))
"""


def ensure_bytecode(python: str = sys.executable, others: tuple[str, ...] = OTHERS,
                    ours: tuple[str, ...] = OURS) -> dict:
    """Compile the modules of the packages ``ours`` (onnx_prep's folders) for ``python``
    and report: ``{"compiled": {"package", "modules", "current_before", "current",
    "folders"}, "others": {package: {"modules", "current", "folders"}}}``, ``current``
    counting modules whose bytecode is there and matches their source. Packages
    ``python`` cannot find are left out of ``others``."""
    p = subprocess.run([python, "-c", _CHILD, json.dumps(ours), json.dumps(list(others))],
                       capture_output=True, text=True, check=True)
    return json.loads(p.stdout)


def describe_bytecode(report: dict) -> str:
    """One line: the compiled package's bytecode (and how much of it was written now),
    then each other package's share of modules with current bytecode."""
    c = report["compiled"]
    line = (f"bytecode: {c['package']} {c['current']} of {c['modules']} modules compiled "
            f"({c['current'] - c['current_before']} written now, as pip install does)")
    others = [f"{name} {r['current'] / r['modules']:.0%}" for name, r in report["others"].items() if r["modules"]]
    if others:
        line += "; modules with bytecode: " + ", ".join(others)
    return line
