"""Start-up: commands import what they use when they use it. ``onnx-prep --help``,
``--version``, each command's ``--help`` and usage errors import neither numpy nor onnx
(read from ``sys.modules`` of a real process when it exits; deterministic, not timed:
scripts/bench_startup.py measures the time). Commands are registered by name, and a
missing command module is an import error, not a silent gap."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from onnx_prep.core.errors import EXIT_OK, EXIT_UNUSABLE

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("numpy", "onnx", "ml_dtypes", "onnxruntime", "onnx_prep.native")
# Never on `run`'s way to its answer: other commands' tools (ONNX Runtime without
# --runtime/--compare ort, zstandard without a compressed cache, matplotlib's plots), the
# test and export stacks, onnx's reference evaluator (no op here needs it), logging (the
# runtime logs only a swallowed exception: core/errors.log_exception), and rich when the
# answer is JSON and nothing is wrong (cli/output.py makes its consoles on use), and the
# CUDA path (cuda-python and core/cuda: only --device cuda and `devices` import them).
NOT_ON_RUN_PATH = ("onnxruntime", "onnxruntime_genai", "zstandard", "matplotlib", "hypothesis", "jsonschema",
                   "pytest", "torch", "transformers", "onnx_ir", "onnx.reference", "rich", "scipy", "pandas",
                   "logging", "cuda", "onnx_prep.core.cuda")

# The console script's main() in a fresh interpreter; on the way out (SystemExit) it
# writes every module imported as the last line of stderr.
PROBE = """
import sys
sys.argv = ["onnx-prep", *sys.argv[1:]]
from onnx_prep.cli.app import main
try:
    main()
finally:
    sys.stderr.write("\\nimported: " + repr(sorted(sys.modules)) + "\\n")
"""


def probe(*args: str, watch: tuple[str, ...] | None = HEAVY) -> tuple[int, list[str]]:
    """(exit code, which of ``watch`` the command imported; every module with None)."""
    p = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=60)
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("imported: "), p.stderr
    modules = ast.literal_eval(last.removeprefix("imported: "))
    return p.returncode, modules if watch is None else [m for m in watch if m in modules]


@pytest.mark.parametrize("args, code", [
    (["--help"], EXIT_OK),
    (["--version"], EXIT_OK),
    (["run", "--help"], EXIT_OK),
    (["resolve", "--help"], EXIT_OK),
    (["fixture", "--help"], EXIT_OK),
    (["demo", "--help"], EXIT_OK),
    (["plan-dump", "--help"], EXIT_OK),
    (["plan-dump", "--format", "svg"], EXIT_UNUSABLE),
    (["digest", "--help"], EXIT_OK),
    (["check", "--help"], EXIT_OK),
    (["check", "--no-such-option"], EXIT_UNUSABLE),
    (["profile", "--help"], EXIT_OK),
    (["run", "--no-such-option"], EXIT_UNUSABLE),
    (["no-such-command"], EXIT_UNUSABLE),
    (["run", "--runtime", "tvm"], EXIT_UNUSABLE),
    (["run", "--tokens", "0"], EXIT_UNUSABLE),
    (["run", "--prompt-ids", "1,x"], EXIT_UNUSABLE),
    (["run", "--compare", "ort", "--runtime", "ort"], EXIT_UNUSABLE),
    (["devices", "--help"], EXIT_OK),
], ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_answers_without_the_load_path(args, code):
    got, imported = probe(*args)
    assert got == code
    assert imported == [], f"{' '.join(args)} imported {imported}"


def test_the_probe_sees_the_load_path_when_a_command_loads_a_model(small_llm_path):
    """The same probe on a real run: the modules are there (the test above can fail)."""
    code, imported = probe("run", str(small_llm_path), "--runtime", "ort", "--tokens", "1", "--json")
    assert code == EXIT_OK
    assert {"numpy", "onnx"} <= set(imported)


def test_run_from_a_prepared_cache_imports_only_its_load_path(tmp_path, small_llm_path):
    """The issue's whole-process run (``run MODEL --tokens 1 --prepared CACHE --json``)
    imports the load path and none of NOT_ON_RUN_PATH; with --compare ort the same probe
    sees onnxruntime and rich's absence is the JSON's doing (the test can fail)."""
    cache = tmp_path / "small.prepared.onnx"
    build = subprocess.run([sys.executable, "-m", "onnx_prep", "build-cache", str(small_llm_path), "-o", str(cache)],
                           capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    run = ["run", str(small_llm_path), "--tokens", "1", "--prepared", str(cache), "--cache-policy",
           "require-complete"]
    code, modules = probe(*run, "--json", watch=None)
    assert code == EXIT_OK
    assert {"numpy", "onnx", "onnx_prep.native", "onnx_prep.core.runtime.session"} <= set(modules)
    assert [m for m in NOT_ON_RUN_PATH if m in modules] == []
    code, imported = probe(*run, watch=NOT_ON_RUN_PATH)  # the text answer prints through rich
    assert (code, imported) == (EXIT_OK, ["rich"])
    code, imported = probe(*run, "--compare", "ort", "--json", watch=("onnxruntime",))
    assert (code, imported) == (EXIT_OK, ["onnxruntime"])


def test_help_stays_light():
    """``--help`` formats through typer and rich (which import logging): no model code, no
    command's tools."""
    code, modules = probe("--help", watch=None)
    assert code == EXIT_OK and "rich" in modules
    assert [m for m in (*HEAVY, *NOT_ON_RUN_PATH) if m in modules and m not in ("rich", "logging")] == []
    ours = {m for m in modules if m.startswith("onnx_prep.core")}
    assert ours <= {"onnx_prep.core", "onnx_prep.core.errors", "onnx_prep.core.lazy_exports"}, ours


def test_commands_are_registered_by_name():
    from onnx_prep.cli.app import app

    names = [c.name for c in app.registered_commands]
    assert len(names) == len(set(names))
    assert set(names) == {"fixture", "resolve", "run", "demo", "build-cache", "plan-dump", "digest", "check",
                          "profile", "devices"}


def test_a_missing_command_module_is_an_import_error():
    code = ("import sys\n"
            "sys.modules['onnx_prep.cli.demo'] = None  # as if cli/demo.py were not there\n"
            "import onnx_prep.cli.app\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "ModuleNotFoundError" in p.stderr and "onnx_prep.cli.demo" in p.stderr


@pytest.mark.slow
def test_bench_startup_smoke(tmp_path):
    """scripts/bench_startup.py runs and reports every figure (not timed here)."""
    out = tmp_path / "startup.json"
    p = subprocess.run([sys.executable, "scripts/bench_startup.py", "--spawns", "2", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "ONNX_PREP_CACHE": str(tmp_path / "cache")})
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert doc["cpu"]["cores"] >= 1 and doc["cpu"]["isa"] in ("scalar", "avx2", "avx512")
    assert f"ISA {doc['cpu']['isa']}" in p.stdout.splitlines()[0]
    assert [c["argv"] for c in doc["commands"]] == [["--help"], ["--version"], ["run", "--tokens", "1"]]
    for c in doc["commands"]:
        w = c["wall_s"]
        assert len(w["runs"]) == 2 and w["min"] <= w["median"] <= w["max"]
        assert c["imports"] and all(i["cumulative_ms"] >= 0 for i in c["imports"]) and c["modules"]
    run = doc["commands"][2]
    assert {"numpy", "onnx", "onnx_prep.core.runtime.session"} <= set(run["modules"])  # the load path, measured
    assert "numpy" not in doc["commands"][0]["modules"] and "onnx" not in doc["commands"][1]["modules"]
    assert "other work on the machine" in p.stdout
    assert doc["bytecode"]["compiled"]["current"] == doc["bytecode"]["compiled"]["modules"]
    assert "bytecode: onnx_prep" in p.stdout.splitlines()[1]
