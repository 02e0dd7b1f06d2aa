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
def open_fake():
    d = FakeDriver(name="Fake H200", memory=1 << 30)
    d.init()
    return d
device_selection.open_driver = open_fake
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


def test_the_load_profile_on_a_usable_device_says_it_does_not_run_there_and_exits_2(empty_cache):
    p = with_fake_device("profile", "--device", "cuda", env=empty_cache)
    assert p.returncode == EXIT_UNUSABLE
    assert _one_error_line(p) == (
        "error: --device cuda: the load profile (profile without --batch-sweep) does not run on a device yet; "
        "found Fake H200 (device 0); use --device cpu; docs/cuda.md says what runs on a device")
    assert not Path(empty_cache["ONNX_PREP_CACHE"]).exists()


def _schema(name: str) -> dict:
    from importlib import resources

    return json.loads(resources.files("onnx_prep.core").joinpath(f"schemas/{name}.schema.json").read_text())


def test_run_on_a_fake_device_decodes_the_cpus_tokens_streamed_under_a_device_budget(tmp_path):
    """The default tiny model through ``run --device cuda`` on the fake device (kernels run
    by the CPU twins): all resident, and under a 6 MiB budget (its 17 packed objects take a
    2 MiB granule each) streamed through several segments a step; the tokens are the CPU
    run's, the device section counts what was paged."""
    env = {"ONNX_PREP_CACHE": str(tmp_path / "cache")}
    cpu = onnx_prep("run", "--tokens", "6", "--json", env=env)
    assert cpu.returncode == EXIT_OK, cpu.stderr
    want = json.loads(cpu.stdout)
    assert want["device"] is None
    for extra, segments in (((), 1), (("--device-budget", "6MiB"), None)):
        p = with_fake_device("run", "--device", "cuda", "--tokens", "6", "--json", *extra, env=env)
        assert p.returncode == EXIT_OK, p.stderr
        doc = json.loads(p.stdout)
        assert doc["tokens"] == want["tokens"]
        dv = doc["device"]
        assert dv["device"] == "Fake H200" and dv["steps"] == 6
        if segments == 1:
            assert (dv["segments_per_step"], dv["evictions"], dv["page_ins"]) == (1, 0, 17)
        else:
            assert dv["segments_per_step"] > 1 and dv["evictions"] > 0 and dv["peak_committed_bytes"] <= 6 << 20
            assert dv["page_ins"] > 17
        assert "kv_capacity_fixed=False" in dv["capture_reason"] and dv["fallbacks"] == 6 * dv["segments_per_step"]
        jsonschema = pytest.importorskip("jsonschema", reason="jsonschema not installed: schema check skipped")
        jsonschema.validate(doc, _schema("run"))


def test_run_on_a_fake_device_takes_a_prompt_longer_than_a_decode_step(tmp_path):
    """``run --device cuda --prompt-ids`` with 40 ids (more than the 8 rows of a decode
    step: the prefill's attention on the device too) gives the CPU run's tokens."""
    env = {"ONNX_PREP_CACHE": str(tmp_path / "cache")}
    ids = ",".join(str((7 * i + 3) % 500) for i in range(40))
    cpu = onnx_prep("run", "--tokens", "4", "--json", "--prompt-ids", ids, env=env)
    assert cpu.returncode == EXIT_OK, cpu.stderr
    want = json.loads(cpu.stdout)["tokens"]
    p = with_fake_device("run", "--device", "cuda", "--tokens", "4", "--json", "--prompt-ids", ids, env=env)
    assert p.returncode == EXIT_OK, p.stderr
    doc = json.loads(p.stdout)
    assert doc["tokens"] == want and len(want[0]) == 4 and doc["device"]["steps"] == 4


def test_run_on_a_fake_device_loads_from_the_prepared_cache_as_the_cpu_does(tmp_path):
    """``run --device cuda`` loads its objects as the CPU does (a CPU session): from a
    complete prepared cache every packed object is a payload read (none packed), under
    require-complete, and the tokens are the CPU run's; build-if-missing on a device run
    writes the cache the next run reads."""
    env = {"ONNX_PREP_CACHE": str(tmp_path / "cache")}
    cpu = onnx_prep("run", "--tokens", "4", "--json", env=env)
    assert cpu.returncode == EXIT_OK, cpu.stderr
    want = json.loads(cpu.stdout)["tokens"]
    p = with_fake_device("run", "--device", "cuda", "--tokens", "4", "--json", "--cache-policy", "build-if-missing",
                         env=env)
    assert p.returncode == EXIT_OK, p.stderr
    doc = json.loads(p.stdout)
    assert doc["tokens"] == want and doc["cache"]["committed"]["written"] == 17
    p = with_fake_device("run", "--device", "cuda", "--tokens", "4", "--json", "--cache-policy", "require-complete",
                         env=env)
    assert p.returncode == EXIT_OK, p.stderr
    doc = json.loads(p.stdout)
    assert doc["tokens"] == want and doc["device"]["steps"] == 4
    assert doc["cache"]["entries"]["hit"] == 17 and doc["cache"]["packed_reads"] == 17


def test_the_batch_sweep_on_a_fake_device_reports_device_columns_beside_the_cpus(tmp_path):
    env = {"ONNX_PREP_CACHE": str(tmp_path / "cache")}
    p = with_fake_device("profile", "--batch-sweep", "1,2", "--budget", "50%", "--tokens", "4", "--repeat", "1",
                         "--device", "cuda", "--format", "json", env=env)
    assert p.returncode == EXIT_OK, p.stderr
    doc = json.loads(p.stdout)
    assert doc["device"]["name"] == "Fake H200" and doc["device"]["segments_per_step"] > 1
    assert doc["device"]["budget_bytes"] == doc["device"]["committed_bytes"] // 2
    one, two = (r["device"] for r in doc["rows"])
    assert one["tokens_identical_to_cpu"] and two["tokens_identical_to_cpu"]
    # the same weights stream every step whatever N: bytes per emitted token halve
    assert two["bytes_to_device_per_token"] == pytest.approx(one["bytes_to_device_per_token"] / 2)
    # loaded from a complete prepared cache (require-complete: the sweep fails if it is not), the same rows
    assert onnx_prep("build-cache", env=env).returncode == EXIT_OK
    p = with_fake_device("profile", "--batch-sweep", "1,2", "--budget", "50%", "--tokens", "4", "--repeat", "1",
                         "--device", "cuda", "--cache-policy", "require-complete", "--format", "json", env=env)
    assert p.returncode == EXIT_OK, p.stderr
    again = json.loads(p.stdout)
    assert [r["device"]["tokens_identical_to_cpu"] for r in again["rows"]] == [True, True]
    assert [r["device"]["bytes_to_device_per_token"] for r in again["rows"]] == \
        [one["bytes_to_device_per_token"], two["bytes_to_device_per_token"]]
    assert one["evictions"] > 0 and one["peak_committed_bytes"] <= doc["device"]["budget_bytes"]
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema not installed: schema check skipped")
    jsonschema.validate(doc, _schema("batch-sweep"))


def test_the_batch_sweep_of_a_gqa_fixture_on_a_fake_device_captures_and_replays_its_steps(tmp_path):
    """What scripts/gpu_check.sh's sweep shows on the GPU with medium-gqa: a GroupQueryAttention
    fixture's KV kept on the device, so its steps are captured and replayed (the standard-op
    fixtures' fused attention keeps its KV on the host: captures 0)."""
    from onnx_prep.fixtures import generate

    model = generate("tiny-gqa", tmp_path / "model")
    p = with_fake_device("profile", str(model), "--batch-sweep", "1,2", "--budget", "50%", "--tokens", "4",
                         "--repeat", "1", "--device", "cuda", "--format", "json",
                         env={"ONNX_PREP_CACHE": str(tmp_path / "cache")})
    assert p.returncode == EXIT_OK, p.stderr
    doc = json.loads(p.stdout)
    assert doc["device"]["segments_per_step"] > 1 and "kv_capacity_fixed=True" in doc["device"]["capture_reason"]
    for row in doc["rows"]:
        dv = row["device"]
        assert dv["tokens_identical_to_cpu"] and dv["captures"] > 0 and dv["replays"] > 0, dv
        assert (dv["fallbacks"], dv["invalidations"]) == (0, 0), dv


def test_device_budget_without_a_device_is_a_usage_error():
    p = onnx_prep("run", "--device-budget", "64MiB", "--tokens", "1")
    assert p.returncode == EXIT_UNUSABLE
    assert _one_error_line(p) == "error: --device-budget limits device memory: it needs --device cuda"


def test_an_unknown_device_is_a_usage_error():
    p = onnx_prep("run", "--device", "tpu")
    assert p.returncode == EXIT_UNUSABLE
    assert _one_error_line(p) == "error: --device must be one of ['cpu', 'cuda'], got 'tpu'"


def test_device_cpu_runs_as_before(small_llm_path):
    p = onnx_prep("run", str(small_llm_path), "--device", "cpu", "--tokens", "2", "--json")
    assert p.returncode == EXIT_OK, p.stderr
    assert len(json.loads(p.stdout)["tokens"][0]) == 2
