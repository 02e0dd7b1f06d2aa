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

# The console script's main() in a fresh interpreter; on the way out (SystemExit) it
# writes which of HEAVY were imported as the last line of stderr.
PROBE = f"""
import sys
sys.argv = ["onnx-prep", *sys.argv[1:]]
from onnx_prep.cli.app import main
try:
    main()
finally:
    sys.stderr.write("\\nimported: " + repr([m for m in {HEAVY!r} if m in sys.modules]) + "\\n")
"""


def probe(*args: str) -> tuple[int, list[str]]:
    p = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=60)
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("imported: "), p.stderr
    return p.returncode, ast.literal_eval(last.removeprefix("imported: "))


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


def test_commands_are_registered_by_name():
    from onnx_prep.cli.app import app

    names = [c.name for c in app.registered_commands]
    assert len(names) == len(set(names))
    assert set(names) == {"fixture", "resolve", "run", "demo", "build-cache", "plan-dump", "digest", "check",
                          "profile"}


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
