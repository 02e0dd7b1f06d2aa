"""``onnx-prep resolve`` through the real CLI entry point: summary, --json against the
documented schema, the embedded default model, and one test per bad input (exit 2,
one line on stderr naming what and where, no traceback without --debug)."""
from __future__ import annotations

import json
import os
import shutil

import jsonschema
import onnx
import pytest
from typer.testing import CliRunner

from onnx_prep.cli.app import app
from onnx_prep.core.model.resolution_report import schema_path

from test_resolve import hf_snapshot
from test_resolve_models import DATA, custom_op_model, edit_external, single_weight_model, tied_int4_model


def run(*args: str, env: dict | None = None):
    return CliRunner(env=env).invoke(app, list(args))


def schema() -> dict:
    return json.loads(schema_path().read_text())


def assert_one_line_error(result, *needles: str) -> str:
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip("\n").split("\n")
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("error: ")
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in line, (needle, line)
    return line


# ------------------------------------------------------------------------- success

def test_summary_of_the_tiny_llm(tiny_llm_path):
    result = run("resolve", str(tiny_llm_path))
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    for needle in ("111 kept of 255 (14 pruned, 130 fused away",
                   "9 rms_norm, 8 rotary, 4 attention, 4 silu", "int4_matmul", "int4_gather", "int4mm.v1.bs32",
                   "44 trusted (44 fine", "prepared requirements", "17 distinct; 0 source weights feed more than one"):
        assert needle in out, needle
    assert result.stderr == ""


def test_json_validates_against_the_documented_schema(tiny_llm_path):
    result = run("resolve", str(tiny_llm_path), "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    jsonschema.Draft202012Validator.check_schema(schema())
    jsonschema.validate(doc, schema(), cls=jsonschema.Draft202012Validator)
    assert doc["schema_version"] == 1
    assert doc["nodes"]["kept"] == len(doc["node_kernels"]) == 111
    assert [(p["pattern"], p["count"]) for p in doc["fusion"]["patterns"]] == [("rms_norm", 9), ("rotary", 8),
                                                                                ("attention", 4), ("silu", 4)]
    assert doc["payload"]["bytes"] == sum(w["length"] for w in doc["weights"] if w["file"])
    assert {k["kernel"]: k["nodes"] for k in doc["kernels"]}["int4_matmul"] == 17
    assert doc["shared_sources"] == []  # the tied table: one requirement for both nodes
    [tied] = [q for q in doc["requirements"] if q["source_lineage"][0] == "embed_tokens.weight_q4"]
    assert tied["consumers"] == ["embed_tokens", "lm_head"]
    assert doc["digests"] == {"tensor_metadata": 44, "file_checksum": 0, "none": 0, "missing": []}


def test_schema_rejects_undocumented_fields(tiny_llm_path):
    """The schema is closed: a field added without documenting it fails this suite."""
    doc = json.loads(run("resolve", str(tiny_llm_path), "--json").stdout)
    doc["nodes"]["surprise"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, schema(), cls=jsonschema.Draft202012Validator)


def test_json_of_pruned_model_with_missing_digests(tmp_path):
    result = run("resolve", str(tied_int4_model(tmp_path, digest=None)), "--json")
    doc = json.loads(result.stdout)
    jsonschema.validate(doc, schema(), cls=jsonschema.Draft202012Validator)
    assert doc["nodes"] == {"total": 5, "kept": 3, "pruned": 2, "fused_away": 0, "fused_int4_matmuls": 0}
    assert doc["initializers"]["pruned"] == 1 and doc["initializers"]["inline"] == 1
    assert doc["digests"]["none"] == 3 and doc["digests"]["missing"] == ["W", "embed.scales", "head.scales"]


def test_default_model_is_generated_once_with_a_note(tmp_path):
    env = {"ONNX_PREP_CACHE": str(tmp_path / "cache")}
    first = run("resolve", "--json", env=env)
    assert first.exit_code == 0, first.stderr
    assert "generating the default model" in first.stderr
    doc = json.loads(first.stdout)  # the note went to stderr: stdout still parses
    assert doc["model"]["path"].startswith(str(tmp_path / "cache"))
    second = run("resolve", env=env)
    assert second.exit_code == 0 and second.stderr == ""
    assert "int4_gather" in second.stdout


def test_trust_symlinks_resolves_a_hugging_face_snapshot(tmp_path):
    path = hf_snapshot(tmp_path)
    assert_one_line_error(run("resolve", str(path)), "symlink", "--trust-symlinks", f"file {DATA}", "tensor 'W'")
    ok = run("resolve", str(path), "--trust-symlinks", "--json")
    assert ok.exit_code == 0, ok.stderr
    assert json.loads(ok.stdout)["payload"]["entries"] == 1


# ------------------------------------------------------------------------- bad input

def test_not_a_protobuf(tmp_path):
    bad = tmp_path / "notes.onnx"
    bad.write_text("this is not a model\n" * 10)
    assert_one_line_error(run("resolve", str(bad)), "not an ONNX", f"model {bad}")


def test_truncated_model_file(tmp_path):
    path = tied_int4_model(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert_one_line_error(run("resolve", str(path)), f"model {path}")


def test_empty_model_file(tmp_path):
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    assert_one_line_error(run("resolve", str(path)), "not an ONNX model", f"model {path}")


def test_absolute_location(tmp_path):
    path = edit_external(single_weight_model(tmp_path), "W", location=str(tmp_path / DATA))
    assert_one_line_error(run("resolve", str(path)), "absolute", "tensor 'W'", f"file {tmp_path / DATA}")


def test_location_escaping_with_dotdot(tmp_path):
    path = single_weight_model(tmp_path / "m")
    shutil.copy2(tmp_path / "m" / DATA, tmp_path / DATA)  # a real file is there: still refused
    edit_external(path, "W", location=f"../{DATA}")
    assert_one_line_error(run("resolve", str(path)), "escapes the model folder", "tensor 'W'", f"file ../{DATA}")


def test_symlinked_data_file(tmp_path):
    path = single_weight_model(tmp_path / "m")
    shutil.move(tmp_path / "m" / DATA, tmp_path / "outside.bin")
    os.symlink(tmp_path / "outside.bin", tmp_path / "m" / DATA)
    assert_one_line_error(run("resolve", str(path)), "is a symlink", "tensor 'W'", f"file {DATA}")


def test_missing_data_file(tmp_path):
    path = single_weight_model(tmp_path)
    (tmp_path / DATA).unlink()
    assert_one_line_error(run("resolve", str(path)), "not found", "tensor 'W'", f"file {DATA}", "offset 0")


def test_offset_beyond_the_end(tmp_path):
    path = edit_external(single_weight_model(tmp_path), "W", offset="1000000")
    assert_one_line_error(run("resolve", str(path)), "run past the end", "tensor 'W'", f"file {DATA}",
                          "offset 1000000")


def test_length_beyond_the_end(tmp_path):
    path = single_weight_model(tmp_path)
    os.truncate(tmp_path / DATA, 16)  # the 32-byte tensor now runs 16 bytes past the end
    assert_one_line_error(run("resolve", str(path)), "[0, 32) run past the end", "(16 bytes)", "tensor 'W'")


def test_negative_offset(tmp_path):
    path = edit_external(single_weight_model(tmp_path), "W", offset="-8")
    assert_one_line_error(run("resolve", str(path)), "negative external data offset -8", "tensor 'W'")


def test_negative_length(tmp_path):
    path = edit_external(single_weight_model(tmp_path), "W", length="-32")
    assert_one_line_error(run("resolve", str(path)), "negative external data length -32", "tensor 'W'")


def test_checksum_of_the_wrong_form(tmp_path):
    path = edit_external(single_weight_model(tmp_path, digest="checksum"), "W", checksum="md5:abc")
    assert_one_line_error(run("resolve", str(path)), "checksum is not a SHA-1", "'md5:abc'", "tensor 'W'",
                          f"file {DATA}")


def test_tensor_digest_of_the_wrong_form(tmp_path):
    path = single_weight_model(tmp_path)
    model = onnx.load(str(path), load_external_data=False)
    model.graph.initializer[0].metadata_props[0].value = "sha256:xyz"
    onnx.save(model, str(path))
    assert_one_line_error(run("resolve", str(path)), "onnx_prep.sha256", "tensor 'W'")


def test_op_with_no_kernel_prints_the_summary_then_fails(tmp_path):
    path = custom_op_model(tmp_path)
    result = run("resolve", str(path))
    assert_one_line_error(result, "no kernel", "custom.ops::Frobnicate", "frob1, frob2", f"model {path}")
    assert "unsupported ops" in result.stdout and "Frobnicate" in result.stdout
    as_json = run("resolve", str(path), "--json")
    assert as_json.exit_code == 2
    doc = json.loads(as_json.stdout)
    jsonschema.validate(doc, schema(), cls=jsonschema.Draft202012Validator)
    assert doc["unsupported"] == [{"op_type": "Frobnicate", "domain": "custom.ops", "nodes": ["frob1", "frob2"]}]


def test_missing_model_file(tmp_path):
    assert_one_line_error(run("resolve", str(tmp_path / "nope.onnx")), "model file not found")


def test_debug_shows_the_traceback(tmp_path):
    path = edit_external(single_weight_model(tmp_path), "W", offset="-8")
    result = run("--debug", "resolve", str(path))
    assert result.exit_code == 2
    assert "Traceback" in result.stderr and "negative external data offset" in result.stderr


def test_names_print_as_they_are(tmp_path):
    """Rich would turn ``:smile:`` in a path into an emoji; the output keeps the name."""
    path = tied_int4_model(tmp_path / "m:smile:")
    result = run("resolve", str(path))
    assert result.exit_code == 0, result.stderr
    assert f"resolve {path}" in result.stdout
