"""``onnx-prep plan-dump`` through the real CLI entry point: the table, ``--format json``
(the documented schema, the same record the core builds), ``--format dot``, the scope
and text filters, and one line with exit 2 for each unusable input."""
from __future__ import annotations

import json
import shutil

import jsonschema
import pytest
from typer.testing import CliRunner

from onnx_prep.cli.app import app
from onnx_prep.core.plan.plan_report import plan_dump, schema_path

from test_plan_report import TIED, cache_path, parse_dot  # noqa: F401 - cache_path is a fixture
from test_resolve_cli import assert_one_line_error
from test_resolve_models import custom_op_model


def run(*args: str, env: dict | None = None):
    return CliRunner(env=env).invoke(app, ["plan-dump", *args])


def test_table_summary_then_tasks(tiny_llm_path):
    result = run(str(tiny_llm_path), "--filter", "layers.0.m", env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    for needle in ("session 61, invocation 18", "read_source 44, prepack 17, execute 18", "io 44, cpu 35",
                   "source 13,125,760 B", "critical path", "est. 3.23 ms", "cost model",
                   "look-ahead", "8 steps", "8 of 79 tasks", "71 filtered out by --filter 'layers.0.m'",
                   "tasks (* on the critical path;"):
        assert needle in out, needle
    assert out.index("look-ahead") < out.index("tasks (* on the critical path;")  # summary first
    rows = [line.split() for line in out.split("\n")]
    # block 0's MLP, as the design's table reads: per weight, two reads on the I/O
    # queue feeding one prepack on a CPU worker, then the step that waits for it
    # and for the step before it (on the critical path: the steps' chain)
    assert ["12", "S.read_source:layers.0.mlp.gate_up.weight_q4", "session", "read_source", "io", "-",
            "1,048,576"] in rows
    assert ["13", "S.read_source:layers.0.mlp.gate_up.scales", "session", "read_source", "io", "-", "262,144"] in rows
    prepack = [r for r in rows if r[:1] == ["14"]][0]
    assert prepack[1].startswith("S.prepack:P:layers.0.mlp.gate_up.weight_q4+layers.0.mlp.gate_up.scales|int4mm.")
    assert prepack[2:] == ["session", "prepack", "cpu", "#12", "#13", "1,310,720"]
    assert ["64*", "I.3:layers.0.mlp.gate_up_proj", "invocation", "execute", "cpu", "#63", "#14", "-"] in rows
    assert "fan-out" not in out  # the tied table: one prepack, no source feeding two
    assert result.stderr == ""


def test_a_raw_read_shows_the_key_it_publishes(tiny_llm_path):
    out = run(str(tiny_llm_path), "--filter", "layers.0.input_norm", env={"COLUMNS": "200"}).stdout
    assert "S.read_source:layers.0.input_norm.weight" in out
    assert "→ P:layers.0.input_norm.weight|raw|cpu" in out


def test_json_is_the_core_record_and_validates(tiny_llm_path):
    result = run(str(tiny_llm_path), "--format", "json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    jsonschema.validate(doc, json.loads(schema_path().read_text()), cls=jsonschema.Draft202012Validator)
    expected = json.loads(json.dumps(plan_dump(tiny_llm_path)))
    expected["summary"]["build_ms"] = doc["summary"]["build_ms"]  # the one measured figure
    assert doc == expected
    short = json.loads(run(str(tiny_llm_path), "--json").stdout)  # --json, as every command has
    short["summary"]["build_ms"] = doc["summary"]["build_ms"]
    assert short == doc


def test_dot_parses_with_every_task_and_edge(tiny_llm_path):
    result = run(str(tiny_llm_path), "--format", "dot")
    assert result.exit_code == 0, result.stderr
    nodes, edges = parse_dot(result.stdout)
    assert len(nodes) == 79
    assert {(TIED, c) for c in (e[1] for e in edges if e[0] == TIED)} == {e for e in edges if e[0] == TIED}
    assert len([e for e in edges if e[0] == TIED]) == 1  # one prepack of the tied table


@pytest.mark.parametrize("scope,count", [("session", 61), ("invocation", 18)])
def test_scope_filter(tiny_llm_path, scope, count):
    doc = json.loads(run(str(tiny_llm_path), "--format", "json", "--scope", scope).stdout)
    assert {t["scope"] for t in doc["tasks"]} == {scope} and len(doc["tasks"]) == count
    assert doc["summary"]["filter"]["filtered_out"] == 79 - count


def test_text_filter_with_dot(tiny_llm_path):
    result = run(str(tiny_llm_path), "--format", "dot", "--filter", "embed_tokens")
    nodes, edges = parse_dot(result.stdout)
    assert TIED in nodes and all("embed_tokens" in n for n in nodes)
    assert all(a in nodes and b in nodes for a, b in edges)


# ------------------------------------------------------------------------- bad input

def test_missing_model(tmp_path):
    missing = tmp_path / "absent.onnx"
    assert_one_line_error(run(str(missing)), str(missing))


def test_not_a_protobuf(tmp_path):
    bad = tmp_path / "notes.onnx"
    bad.write_text("this is not a model\n" * 10)
    assert_one_line_error(run(str(bad)), "not an ONNX", f"model {bad}")


def test_an_op_without_a_kernel_has_no_plan(tmp_path):
    path = custom_op_model(tmp_path)
    assert_one_line_error(run(str(path)), "no kernel", "custom.ops::Frobnicate (nodes frob1, frob2)", f"model {path}")


@pytest.mark.parametrize("args,needle", [(("--format", "svg"), "--format must be one of table, json, dot"),
                                         (("--scope", "step"), "--scope must be one of session, invocation"),
                                         (("--json", "--format", "dot"), "--json and --format dot disagree")])
def test_bad_options(tiny_llm_path, args, needle):
    assert_one_line_error(run(str(tiny_llm_path), *args), needle)


def test_prepared_names_the_cache_to_plan_with(tiny_llm_path, cache_path):
    doc = json.loads(run(str(tiny_llm_path), "--prepared", str(cache_path), "--json").stdout)
    assert doc["summary"]["recipes"]["read_packed_payload"] == 17
    assert doc["summary"]["by_kind"] == {"read_source": 10, "read_packed": 17, "execute": 18}
    table = run(str(tiny_llm_path), "--prepared", str(cache_path), env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.stderr
    assert "read packed 17, read and prepacked 0, raw reads 10" in table.stdout
    off = json.loads(run(str(tiny_llm_path), "--prepared", str(cache_path), "--cache-policy", "disabled",
                         "--json").stdout)
    assert off["summary"]["recipes"]["read_packed_payload"] == 0  # the plan without the cache


def test_the_cache_beside_the_model_is_used_as_run_uses_it(tiny_llm_path, cache_path, tmp_path):
    """No --prepared: <model stem>.prepared.onnx beside the model, read-only, as `run`."""
    folder = tmp_path / "m"
    folder.mkdir()
    for f in [*tiny_llm_path.parent.glob("tiny-llm.onnx*"), *cache_path.parent.iterdir()]:
        shutil.copy2(f, folder / f.name)
    result = run(str(folder / "tiny-llm.onnx"), "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["summary"]["recipes"]["read_packed_payload"] == 17


def test_require_complete_without_a_cache(tiny_llm_path):
    assert_one_line_error(run(str(tiny_llm_path), "--cache-policy", "require-complete"),
                          "no prepared cache there (file ")


@pytest.mark.parametrize("args,needle", [(("--cache-policy", "sometimes"), "--cache-policy must be one of"),
                                         (("--prepared", "/no/such.prepared.onnx"),
                                          "--prepared /no/such.prepared.onnx: no prepared cache there")])
def test_bad_cache_options(tiny_llm_path, args, needle):
    assert_one_line_error(run(str(tiny_llm_path), *args), needle)
