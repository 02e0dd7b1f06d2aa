"""CI's fixed fuzzing budget: scripts/fuzz.py's cases over recorded seeds.

Each case mutates a real model (``onnx_prep.fixtures.mutator``), then resolves it and
decodes two tokens in-process; it must end normally or with a typed ``OnnxPrepError``,
never read outside its folder, and never trace more than 512 MiB. ``REGRESSIONS`` are
the seeds that once failed (what each was, in the comment); ``scripts/fuzz.py
--minutes N`` searches further and every failure it finds is added here.
"""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
REGRESSIONS = {
    9: "MatMulNBits without its N attribute: a KeyError",
    188: "MatMulNBits without its K attribute: a KeyError",
    1037: "MatMulNBits N = -2**63: an OverflowError in the native size query",
    1081: "MatMulNBits K = 2**63 - 1: an untyped ValueError from the native wrapper",
    1254: "MatMulNBits block_size = 2**31: an untyped ValueError",
    1379: "MatMulNBits block_size = -2**63: an OverflowError",
    1395: "lm_head MatMulNBits N = 2**31 - 1: a 160 GiB slot reservation, MemoryError",
    1582: "MatMulNBits without K, with a checksum key removed: a KeyError",
    5712: "a Cast to 2**40: onnx's type inference raised a ValueError",
}
BLOCKS = 4  # seeds 0..199 in blocks of 50, about 5 s each here


def _fuzz():
    spec = importlib.util.spec_from_file_location("fuzz", ROOT / "scripts" / "fuzz.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory):
    module = _fuzz()
    return module, module.small_fixture(tmp_path_factory.mktemp("fuzz-source"))


def _run_script(*args: str) -> subprocess.CompletedProcess:
    # A child process under the script's own address-space cap: a mutant that asks for
    # the machine's memory fails its case instead of the test run.
    return subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "scripts" / "fuzz.py"), *args],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("block", range(BLOCKS))
def test_recorded_seeds(block):
    out = _run_script("--seed", str(block * 50), "--cases", "50", "--minutes", "10")
    assert out.returncode == 0 and "distinct failures: 0" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "cases tried: 50 " in out.stdout


def test_regression_seeds():
    seeds = ",".join(str(s) for s in sorted(REGRESSIONS))
    out = _run_script("--seeds", seeds, "--minutes", "10")
    assert out.returncode == 0 and "distinct failures: 0" in out.stdout, out.stdout + out.stderr[-2000:]
    assert f"cases tried: {len(REGRESSIONS)}" in out.stdout


def test_a_typed_error_passes_and_an_untyped_one_fails(fuzz, tmp_path, monkeypatch):
    """The oracle itself: a mutant refused with a typed error passes; the same case
    with the library made to raise an untyped error fails, naming the seed."""
    module, source = fuzz
    assert module.fuzz_case(source, tmp_path / "a", 1)[1] is None
    from onnx_prep.core.decode import run_record

    def broken(*a, **k):
        raise KeyError("N")

    monkeypatch.setattr(run_record, "record_run", broken)
    failure = module.fuzz_case(source, tmp_path / "b", 1)[1]
    assert failure is not None and failure.startswith("seed 1: untyped KeyError")
