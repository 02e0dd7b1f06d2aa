"""CI's fixed fuzzing budget: scripts/fuzz.py's cases over recorded seeds.

Each case mutates a real model (``onnx_prep.fixtures.mutator``), then resolves it and
decodes two tokens in-process; it must end normally or with a typed ``OnnxPrepError``,
never read outside its folder, and never trace more than 512 MiB. ``REGRESSIONS`` are
the seeds that once failed (what each was, in the comment); ``scripts/fuzz.py
--minutes N`` searches further and every failure it finds is added here.
"""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
REGRESSIONS = {
    9: "MatMulNBits without its N attribute: a KeyError",
    188: "MatMulNBits without its K attribute: a KeyError",
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


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # a mutant's NaNs in numpy ops are not findings
@pytest.mark.parametrize("block", range(BLOCKS))
def test_recorded_seeds(fuzz, tmp_path, block):
    module, source = fuzz
    seeds = list(range(block * 50, (block + 1) * 50))
    if block == 0:
        seeds += [s for s in REGRESSIONS if s >= BLOCKS * 50]
    failures = [f for s in seeds if (f := module.fuzz_case(source, tmp_path, s)[1])]
    assert not failures, "\n".join(failures)


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
