"""``onnx-prep plan-dump --device cuda`` through the real CLI entry point, on a machine
without a GPU: the table says that no device was queried and what was assumed, lists
each task's resource and recipe; ``--json`` validates against the schema; ``--budget``
and ``--granularity`` size the slots; bad values are one line, exit 2."""
from __future__ import annotations

import json

import jsonschema
import pytest
from typer.testing import CliRunner

from onnx_prep.cli.app import app
from onnx_prep.core.plan.plan_report import schema_path

from test_plan_report import parse_dot
from test_resolve_cli import assert_one_line_error


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """A 200-column stdout console (``cli/output`` makes one per process, as wide as the
    first test that printed wanted)."""
    from rich.console import Console

    from onnx_prep.cli import output

    monkeypatch.setattr(output, "stdout", Console(width=200, soft_wrap=True, emoji=False), raising=False)


def run(*args: str):
    return CliRunner().invoke(app, ["plan-dump", *args])


def test_the_table_says_nothing_was_queried_and_what_was_assumed(tiny_llm_path):
    result = run(str(tiny_llm_path), "--device", "cuda", "--filter", "layers.0.mlp.down")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    for needle in ("cuda: planned from metadata, no device queried",
                   "slot granularity 2,097,152 B (2.0 MiB), assumed",
                   # 17 packed objects in 18 granules of their own, the ten raw weights in one
                   # shared granule (before shared granules: a granule each, 56.0 MiB)
                   "27, 39,845,888 B (38.0 MiB) committed (granules; raw weights share)", "for 13,126,848 B (12.5 MiB) packed",
                   "largest step: 0 embed_tokens, 6,291,456 B (6.0 MiB)",
                   "host to device", "13,125,760 B (12.5 MiB) a load", "budget", "none",
                   "io 44, device 79", "upload → pack on device 17", "raw → upload 10",
                   "2,097,152 B read, 2,621,440 B prepacked, 2,097,152 B uploaded",
                   "uploads 25 GB/s; device prepacks not estimated (0 ms)"):
        assert needle in out, needle
    assert out.index("no device queried") < out.index("tasks (* on the critical path;")
    rows = [line.split() for line in out.split("\n")]
    assert ["26", "S.read_source:layers.0.mlp.down.weight_q4", "session", "read_source", "io", "-", "524,288",
            "upload", "→", "pack", "on", "device"] in rows
    assert ["27", "S.upload_source:layers.0.mlp.down.weight_q4", "session", "upload", "device", "#26", "524,288",
            "upload", "→", "pack", "on", "device"] in rows
    step = [r for r in rows if r[:2] == ["109*", "I.4:layers.0.mlp.down_proj"]][0]
    assert step[2:] == ["invocation", "execute", "device", "#108", "#30", "#32", "-", "-"]
    assert result.stderr == ""


def test_a_given_granularity_and_a_budget(tiny_llm_path):
    result = run(str(tiny_llm_path), "--device", "cuda", "--granularity", "1MiB", "--budget", "16MiB",
                 "--scope", "invocation")
    assert result.exit_code == 0, result.stderr
    assert "slot granularity 1,048,576 B (1.0 MiB), given (--granularity)" in result.stdout
    assert "16,777,216 B (16.0 MiB): the slots do not fit at once" in result.stdout
    doc = json.loads(run(str(tiny_llm_path), "--device", "cuda", "--granularity", "1MiB", "--budget", "64MiB",
                         "--json").stdout)
    d = doc["summary"]["device"]
    assert (d["granularity"], d["granularity_source"], d["budget"], d["fits"]) == (1 << 20, "given", 64 << 20, True)
    assert "budget" in run(str(tiny_llm_path), "--device", "cuda", "--budget", "64MiB").stdout


def test_json_validates_and_dot_draws_the_device_queue(tiny_llm_path):
    result = run(str(tiny_llm_path), "--device", "cuda", "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    jsonschema.validate(doc, json.loads(schema_path().read_text()), cls=jsonschema.Draft202012Validator)
    assert doc["summary"]["device"]["queried"] is False
    dot = run(str(tiny_llm_path), "--device", "cuda", "--format", "dot", "--filter", "layers.0.attn.out")
    assert dot.exit_code == 0, dot.stderr
    nodes, edges = parse_dot(dot.stdout)
    assert nodes["S.upload_source:layers.0.attn.out.scales"][1:] == ("#a1d99b", "device")
    assert ("S.read_source:layers.0.attn.out.scales", "S.upload_source:layers.0.attn.out.scales") in edges


@pytest.mark.parametrize("args,needle", [
    (("--budget", "1GiB"), "--budget and --granularity size a device's slots: give them with --device cuda"),
    (("--device", "cpu", "--granularity", "2MiB"), "give them with --device cuda"),
    (("--device", "tpu"), "--device must be one of ['cpu', 'cuda'], got 'tpu'"),
    (("--device", "cuda", "--granularity", "3MiB"), "--device cuda: granularity must be a power of two"),
    (("--device", "cuda", "--budget", "lots"), "--budget must be a size like"),
    (("--device", "cuda", "--budget", "4MiB"),
     "--budget 4,194,304 B: step 0 (embed_tokens) pins 6,291,456 B of device slots (2,097,152 B granules, "
     "assumed); no order of page-ins runs it")])
def test_bad_device_options(tiny_llm_path, args, needle):
    assert_one_line_error(run(str(tiny_llm_path), *args), needle)
