"""The CPU plan is what it was before the device plan existed: ``plan-dump`` of the tiny
fixture and of the medium-shaped graph, as a table, as JSON and as Graphviz, byte for
byte (the model's path and the measured build time aside), with and without
``--device cpu``. The digests were taken from ``plan-dump`` on main at fee1bf0, before
the device plan was added; a change to the CPU plan or its rendering fails here and
must be a decision, with the digests updated in the same commit. Updated since: the
JSON digests with the ``silu`` fusion (a SiLU gate's Sigmoid and Mul become one
QuickGelu node, so the node positions the JSON lists shift; table and Graphviz
unchanged)."""
from __future__ import annotations

import hashlib
import re

import pytest
from typer.testing import CliRunner

from onnx_prep.cli.app import app

# (fixture, format) -> sha256 of the normalized output (``normalized`` below)
BEFORE = {
    ("tiny", "table"): "ba967a86a4b225779038751c42da71fdc1455f9d5f98ae41b440a4c991abe94f",
    ("tiny", "json"): "b5756910b2ce63d309520336537ae7a7b2d9d66081c47be78c4f50d51f94b490",
    ("tiny", "dot"): "8d2c3fb287ad7fab3e97320cb9872cf389ce01c251d3977f720396cb8071d60b",
    ("medium", "table"): "35a4bc3dc0804d68ae015e3e3602b216d216d9c71744edcb1335c045b9d37e60",
    ("medium", "json"): "fe721d879619df9d75438489d85b1120be83c29198789936dca27893a33982c5",
    ("medium", "dot"): "5dc23d7948f30301dcfddb05087cdf4f705000991922da05d6d5d02523695377",
}


@pytest.fixture(scope="module")
def medium_graph_path(tmp_path_factory):
    """The medium preset's graph (16 blocks) at small widths (as test_fusion's)."""
    from onnx_prep.fixtures import FixtureConfig, generate

    cfg = FixtureConfig.preset("medium").replace(hidden=128, intermediate=256, heads=4, vocab=512)
    return generate(cfg, tmp_path_factory.mktemp("medium-graph"))


def normalized(text: str, model: str) -> str:
    """The output without what differs between runs: the model's path, and the plan's
    build time (measured)."""
    text = text.replace(model, "MODEL")
    text = re.sub(r'"build_ms": [0-9.e-]+', '"build_ms": 0', text)
    return re.sub(r"plan build( +│) +[0-9.]+ ms +│", r"plan build\1 x ms │", text)


@pytest.fixture
def console_140(monkeypatch):
    """A 140-column stdout console for the command (``cli/output`` makes one per process,
    as wide as the first test that printed wanted)."""
    from rich.console import Console

    from onnx_prep.cli import output

    monkeypatch.setattr(output, "stdout", Console(width=140, soft_wrap=True, emoji=False), raising=False)


def dump(model, fmt: str, *extra: str) -> str:
    result = CliRunner(env={"COLUMNS": "140"}).invoke(app, ["plan-dump", str(model), "--format", fmt, *extra])
    assert result.exit_code == 0, result.stderr
    return normalized(result.stdout, str(model))


@pytest.mark.parametrize("fmt", ["table", "json", "dot"])
@pytest.mark.parametrize("which", ["tiny", "medium"])
@pytest.mark.parametrize("device", [(), ("--device", "cpu")], ids=["default", "device-cpu"])
def test_the_cpu_plan_dump_is_unchanged(which, fmt, device, tiny_llm_path, request, console_140):
    model = tiny_llm_path if which == "tiny" else request.getfixturevalue("medium_graph_path")
    out = dump(model, fmt, *device)
    assert hashlib.sha256(out.encode()).hexdigest() == BEFORE[(which, fmt)], out[:2000]
