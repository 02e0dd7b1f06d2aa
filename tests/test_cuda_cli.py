"""The command line's CUDA surface through real ``onnx-prep`` processes: ``devices``
(exit 0, CUDA usable or not; its JSON record), and ``--device cuda`` on ``run`` and
``profile``: one line naming why, exit 2, checked before any model is read (the default
model is not even generated), never a silent CPU run. Where CUDA is usable but the
device path is not built, a process whose probe answers through the fake driver
(tests/fake_cuda_driver.py) shows the other one-line error."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_exit_codes import onnx_prep
from test_cuda_device_probe import HAS_CUDA_PYTHON

from onnx_prep.core.errors import EXIT_OK, EXIT_UNUSABLE

TESTS = Path(__file__).resolve().parent
NOT_INSTALLED = "cuda-python not installed (pip install 'onnx-prep[cuda]')"

# main() in a fresh interpreter whose CUDA probe goes to the fake driver: a usable
# "Fake H200" with 2 MiB granules.
WITH_FAKE_DEVICE = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from fake_cuda_driver import FakeDriver
from onnx_prep.core.cuda import device_probe, device_selection
real = device_probe.probe_devices
device_probe.probe_devices = device_selection.probe_devices = lambda: real(lambda: FakeDriver(name="Fake H200"))
sys.argv = ["onnx-prep", *sys.argv[1:]]
from onnx_prep.cli.app import main
main()
"""


def with_fake_device(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITH_FAKE_DEVICE, *args], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, **env))


@pytest.fixture
def empty_cache(tmp_path) -> dict:
    """An empty user cache: a command that generated the default model would fill it."""
    return {"ONNX_PREP_CACHE": str(tmp_path / "cache")}


def _one_error_line(p: subprocess.CompletedProcess) -> str:
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stdout == ""
    return lines[0]


def test_devices_reports_the_cpu_and_why_cuda_is_or_is_not_usable():
    p = onnx_prep("devices")
    assert p.returncode == EXIT_OK, p.stderr
    lines = p.stdout.strip().splitlines()
    assert lines[0].startswith("cpu: kernels ") and lines[1].startswith("cuda: ")
    if not HAS_CUDA_PYTHON:
        assert lines[1] == f"cuda: not usable: {NOT_INSTALLED}"


def test_devices_json_matches_its_schema(empty_cache):
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema not installed: schema check skipped")
    from importlib import resources

    schema = json.loads(resources.files("onnx_prep.core").joinpath("schemas/devices.schema.json").read_text())
    p = onnx_prep("devices", "--json")
    assert p.returncode == EXIT_OK, p.stderr
    doc = json.loads(p.stdout)
    jsonschema.validate(doc, schema)
    if not HAS_CUDA_PYTHON:
        assert doc["cuda"] == {"usable": False, "reason": NOT_INSTALLED, "binding": None, "driver_version": None,
                               "devices": []}
    fake = with_fake_device("devices", "--json", env=empty_cache)
    assert fake.returncode == EXIT_OK, fake.stderr
    doc = json.loads(fake.stdout)
    jsonschema.validate(doc, schema)
    assert doc["cuda"]["usable"] and doc["cuda"]["devices"][0]["name"] == "Fake H200"
    assert doc["cuda"]["devices"][0]["granularity"] == 2 << 20


@pytest.mark.parametrize("args", [
    ["run", "--device", "cuda"],
    ["run", "--device", "cuda", "--runtime", "ort", "--tokens", "2"],
    ["profile", "--device", "cuda"],
    ["profile", "--device", "cuda", "--batch-sweep", "1,2"],
], ids=" ".join)
def test_device_cuda_without_a_usable_device_is_one_line_and_exit_2(args, empty_cache):
    p = onnx_prep(*args, env=empty_cache)
    assert p.returncode == EXIT_UNUSABLE
    line = _one_error_line(p)
    assert line.startswith("error: --device cuda: ")
    if not HAS_CUDA_PYTHON:
        assert line == f"error: --device cuda: CUDA is not usable: {NOT_INSTALLED}; use --device cpu"
    assert not Path(empty_cache["ONNX_PREP_CACHE"]).exists()  # refused before the default model was made


@pytest.mark.parametrize("args", [["run", "--device", "cuda"], ["profile", "--device", "cuda"],
                                  ["profile", "--device", "cuda", "--batch-sweep", "1,2"]], ids=" ".join)
def test_device_cuda_on_a_usable_device_names_the_missing_path_and_exits_2(args, empty_cache):
    p = with_fake_device(*args, env=empty_cache)
    assert p.returncode == EXIT_UNUSABLE
    assert _one_error_line(p) == (
        "error: --device cuda: the CUDA decode path is not built yet (the device graph runner has no launcher for the fused decoder ops, and"
        " no session runs a step on the device (one loads the weights into device slots)); found Fake H200 (device 0); "
        "use --device cpu; docs/cuda.md says what exists")
    assert not Path(empty_cache["ONNX_PREP_CACHE"]).exists()


def test_an_unknown_device_is_a_usage_error():
    p = onnx_prep("run", "--device", "tpu")
    assert p.returncode == EXIT_UNUSABLE
    assert _one_error_line(p) == "error: --device must be one of ['cpu', 'cuda'], got 'tpu'"


def test_device_cpu_runs_as_before(small_llm_path):
    p = onnx_prep("run", str(small_llm_path), "--device", "cpu", "--tokens", "2", "--json")
    assert p.returncode == EXIT_OK, p.stderr
    assert len(json.loads(p.stdout)["tokens"][0]) == 2
