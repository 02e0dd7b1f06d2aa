"""``onnx-prep check`` through the real CLI entry point: the summary, one line per
finding, exit codes 0 / 1 / 2, ``--json`` against the schema, and the ``--junit`` file
parsed back with xml.etree. The findings themselves are tested in test_preflight.py."""
from __future__ import annotations

import json
import os
import shutil
import xml.etree.ElementTree as ET

import pytest

from onnx_prep.core.cache.preflight import CHECKS
from onnx_prep.core.errors import EXIT_FINDINGS, EXIT_OK
from onnx_prep.core.model.resolution import resolve_model
from test_prepared_cache import _flip, build
from test_preflight import SMALL_DATA, _edit, _strip_digests, small_copy, validated  # noqa: F401 - a fixture
from test_resolve_cli import assert_one_line_error, run
from test_resolve_refusals import NORM, REFUSED


def junit(path) -> ET.Element:
    root = ET.parse(path).getroot()
    assert root.tag == "testsuite" and root.get("name") == "onnx-prep check"
    assert [c.get("name") for c in root.iter("testcase")] == list(CHECKS)
    return root


def case(root: ET.Element, check: str) -> ET.Element:
    return next(c for c in root.iter("testcase") if c.get("name") == check)


def test_a_clean_model_exits_0_with_a_tick_per_check_and_a_junit_file_without_failures(small_llm_path, tmp_path):
    result = run("check", str(small_llm_path), "--verify-payloads", "--junit", str(tmp_path / "check.xml"))
    assert result.exit_code == EXIT_OK, result.output
    lines = result.stdout.splitlines()
    for check in CHECKS:
        assert f"  ✓ {check}" in lines
    assert lines[-1].startswith("clean: 0 errors") and result.stderr == ""
    root = junit(tmp_path / "check.xml")
    assert (root.get("tests"), root.get("failures"), root.get("skipped")) == ("5", "0", "0")
    assert root.find(".//failure") is None and root.find(".//skipped") is None
    assert [p.name for p in tmp_path.iterdir()] == ["check.xml"]  # no temporary file left


def test_findings_exit_1_one_line_each_and_one_junit_failure_each(small_copy, tmp_path):
    (small_copy.parent / SMALL_DATA).unlink()
    _edit(small_copy, lambda m: _strip_digests(m, NORM))
    out = tmp_path / "check.xml"
    out.write_text("the previous run's file")
    result = run("check", str(small_copy), "--junit", str(out))
    assert result.exit_code == EXIT_FINDINGS, result.output
    lines = result.stdout.splitlines()
    assert "  ✗ external_data: 1 finding" in lines and "  ✗ digests: 1 finding" in lines
    assert f"error: external_data: {SMALL_DATA}: external data file not found; copy the data file next " \
           "to the model, or fix its location" in lines
    offset = resolve_model(small_copy, stat_external=False).weights[NORM].offset
    assert any(line.startswith(f"error: digests: {NORM} (file {SMALL_DATA}, offset {offset}): no trusted "
                               "digest") for line in lines)
    root = junit(out)
    assert root.get("failures") == "2"
    [missing] = case(root, "external_data").findall("failure")
    assert missing.get("message").startswith(f"{SMALL_DATA}: external data file not found")
    assert case(root, "digests").find("failure").get("message").startswith(f"{NORM}: no trusted digest")
    assert case(root, "kernels").find("failure") is None


def test_a_damaged_cache_entry_is_a_junit_failure_and_skipped_checks_say_why(small_copy, tmp_path):
    manifest = build(small_copy)
    _flip(small_copy, manifest)
    result = run("check", str(small_copy), "--verify-payloads", "--junit", str(tmp_path / "check.xml"))
    assert result.exit_code == EXIT_FINDINGS, result.output
    assert any(line.startswith(f"error: prepared_cache: {manifest.entries[0].key} (")
               for line in result.stdout.splitlines())
    [failure] = case(junit(tmp_path / "check.xml"), "prepared_cache").findall("failure")
    assert failure.get("message").startswith(manifest.entries[0].key)
    _edit(small_copy, REFUSED["opset-99"][0])  # resolution refuses: kernels and the cache cannot be checked
    result = run("check", str(small_copy), "--junit", str(tmp_path / "check.xml"))
    assert "  - kernels: skipped: needs the model resolved (see model.conformance)" in result.stdout.splitlines()
    root = junit(tmp_path / "check.xml")
    assert root.get("skipped") == "2"
    assert case(root, "prepared_cache").find("skipped").get("message").startswith("needs the model resolved")


def test_json_validates_and_carries_the_exit_code(small_llm_path, small_copy):
    doc = validated(json.loads(run("check", str(small_llm_path), "--json").stdout))
    assert doc["exit_code"] == EXIT_OK
    _edit(small_copy, REFUSED["opset-99"][0])
    result = run("check", str(small_copy), "--json")
    doc = validated(json.loads(result.stdout))
    assert result.exit_code == doc["exit_code"] == EXIT_FINDINGS
    assert [f["check"] for f in doc["findings"]] == ["model.conformance"]


def test_a_warning_is_printed_but_does_not_fail(small_copy, tmp_path):
    def edit(m):
        t = m.graph.initializer.add(name="unused", data_type=1, dims=[4])
        t.data_location = 1
        t.external_data.add(key="location", value="gone.data")
    _edit(small_copy, edit)
    result = run("check", str(small_copy), "--junit", str(tmp_path / "check.xml"))
    assert result.exit_code == EXIT_OK, result.output
    lines = result.stdout.splitlines()
    assert "  ! external_data: 1 warning" in lines and "  ! digests: 1 warning" in lines
    assert any(line.startswith("warning: external_data: gone.data: ") for line in lines)
    root = junit(tmp_path / "check.xml")
    assert root.find(".//failure") is None and "gone.data" in case(root, "external_data").find("system-out").text


def test_names_from_the_model_are_escaped_on_their_one_line(small_copy):
    _edit(small_copy, lambda m: [e.__setattr__("value", "evil\x1b[2J\n.data")
                                 for t in m.graph.initializer if t.name == NORM
                                 for e in t.external_data if e.key == "location"])
    result = run("check", str(small_copy))
    assert result.exit_code == EXIT_FINDINGS, result.output
    assert "\x1b" not in result.stdout
    [line] = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert "evil\\x1b[2J\\n.data" in line


@pytest.mark.parametrize("make, needles", [
    (lambda d: d / "absent.onnx", ["model file not found"]),
    (lambda d: (d / "junk.onnx").write_bytes(b"\xff" * 64) and d / "junk.onnx", ["not an ONNX protobuf"]),
])
def test_input_that_is_not_a_model_exits_2_in_one_line_and_junit_says_so(tmp_path, make, needles):
    out = tmp_path / "check.xml"
    out.write_text("a stale file from a previous run")
    line = assert_one_line_error(run("check", str(make(tmp_path)), "--junit", str(out)), *needles)
    root = ET.parse(out).getroot()
    assert (root.get("name"), root.get("errors")) == ("onnx-prep check", "1")
    assert root.find("testcase/error").get("message") == line.removeprefix("error: ")


def test_a_junit_file_that_cannot_be_written_exits_2_in_one_line(small_llm_path, tmp_path):
    target = tmp_path / "no-such-folder" / "check.xml"
    assert_one_line_error(run("check", str(small_llm_path), "--junit", str(target)),
                          "cannot write the JUnit file", str(target))


def test_a_folder_holding_the_model_is_checked_like_the_file(small_llm_path, tmp_path):
    shutil.copytree(small_llm_path.parent, tmp_path / "m")
    doc = json.loads(run("check", str(tmp_path / "m"), "--json").stdout)
    assert doc["model"] == os.path.abspath(tmp_path / "m" / small_llm_path.name)


def test_the_console_script_exits_1_on_findings_and_3_on_an_internal_error(small_copy):
    from onnx_prep.cli.errors import REPORT_REQUEST
    from onnx_prep.core.errors import EXIT_INTERNAL
    from test_cli_exit_codes import onnx_prep, with_fault

    assert onnx_prep("check", str(small_copy)).returncode == EXIT_OK
    (small_copy.parent / SMALL_DATA).unlink()
    p = onnx_prep("check", str(small_copy))
    assert p.returncode == EXIT_FINDINGS and p.stderr == "", p.stderr
    p = with_fault("onnx_prep.core.model.resolution:resolve_model", "check", str(small_copy))
    assert p.returncode == EXIT_INTERNAL and "injected fault" in p.stderr
    assert p.stderr.strip().splitlines()[-1] == REPORT_REQUEST


def test_a_wrong_file_checksum_beside_right_per_tensor_digests_exits_1(small_copy):
    """--verify-payloads checks the data file's ONNX ``checksum`` even where every tensor
    also records its own digests (and they match)."""
    def edit(m):
        for t in m.graph.initializer:
            for e in t.external_data:
                if e.key == "checksum":
                    e.value = "0" * 40
    _edit(small_copy, edit)
    assert run("check", str(small_copy)).exit_code == EXIT_OK  # stat only: no byte read
    result = run("check", str(small_copy), "--verify-payloads")
    assert result.exit_code == EXIT_FINDINGS, result.output
    [line] = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert line.startswith(f"error: digests: {SMALL_DATA} (offset 0): data file bytes do not match") and \
        f"expected sha1:{'0' * 40}" in line, line


def test_findings_alike_are_one_line_past_three():
    # An export without digests has one finding per weight: the text says it once, names
    # the next subjects and how many; --json keeps every one.
    from onnx_prep.cli.check import ALIKE_MAX, finding_lines

    def f(name, message=None, severity="error"):
        return {"check": "digests", "subject": name, "severity": severity,
                "message": message or "no trusted digest: add digests",
                "where": {"tensor": name, "file": "m.data", "offset": 0}}

    four = [f(f"w{i}") for i in range(ALIKE_MAX + 1)]
    lines = finding_lines(four + [f("x", "other reason")])
    assert len(lines) == 2
    assert lines[0] == ("error: digests: w0 (file m.data, offset 0): no trusted digest: add digests; "
                        "and 3 more like it: w1, w2, ... (each in --json)")
    assert lines[1].startswith("error: digests: x (")
    assert len(finding_lines(four[:ALIKE_MAX])) == ALIKE_MAX  # three alike stay three lines
    assert len(finding_lines(four[:2] + [f("w9", severity="warning")] * 2)) == 4  # severity tells apart
    # a message naming the finding's own entry's source is alike too
    keyed = [{"check": "prepared_cache", "subject": f"P:w{i}.q4+w{i}.scales|int4mm.v1|cpu", "severity": "warning",
              "message": f"unverified: source w{i}.q4 has no digest", "where": {"file": "c.onnx"}} for i in range(5)]
    assert len(finding_lines(keyed)) == 1
