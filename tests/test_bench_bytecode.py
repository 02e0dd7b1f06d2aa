"""scripts/bytecode.py: the benchmarks that spawn processes compile the package's
bytecode first, as ``pip install`` does, even where PYTHONDONTWRITEBYTECODE is set, and
say how much of each package has current bytecode. Run on a package of its own in a
temporary folder, by the real interpreter."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bytecode_module():
    spec = importlib.util.spec_from_file_location("bench_bytecode", ROOT / "scripts" / "bytecode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compiles_the_package_and_counts_current_bytecode(tmp_path, monkeypatch):
    bc = _bytecode_module()
    pkg = tmp_path / "pkgx"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("A = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")  # the children only read; compileall writes

    first = bc.ensure_bytecode(sys.executable, others=("pkgx", "no_such_package_here"), ours=("pkgx",))
    c = first["compiled"]
    assert (c["package"], c["modules"], c["current_before"], c["current"]) == ("pkgx", 3, 0, 3)
    assert os.path.isfile(importlib.util.cache_from_source(str(pkg / "sub" / "__init__.py")))
    assert first["others"]["pkgx"]["current"] == 3 and "no_such_package_here" not in first["others"]
    assert bc.describe_bytecode(first) == ("bytecode: pkgx 3 of 3 modules compiled (3 written now, as pip "
                                           "install does); modules with bytecode: pkgx 100%")

    (pkg / "a.py").write_text("A = 22\n")  # its bytecode no longer matches (size)
    again = bc.ensure_bytecode(sys.executable, others=(), ours=("pkgx",))["compiled"]
    assert (again["current_before"], again["current"]) == (2, 3)


def test_reports_the_installed_packages_bytecode():
    """onnx_prep compiled in full; the others (numpy, onnx, ...) as pip left them."""
    bc = _bytecode_module()
    report = bc.ensure_bytecode(sys.executable, others=("numpy",))
    c = report["compiled"]
    assert c["package"] == "onnx_prep" and c["modules"] > 50 and c["current"] == c["modules"]
    assert report["others"]["numpy"]["modules"] > 0
    assert bc.describe_bytecode(report).startswith(f"bytecode: onnx_prep {c['modules']} of {c['modules']} ")
