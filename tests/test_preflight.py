"""The CI preflight's record (core/cache/preflight.py): the fixtures are clean, and each
class of problem, made on a real broken copy of a fixture (its real data file), is a
finding that names its subject; several problems in one model are all found in one run.
Input that is not a model at all is raised, not reported."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from contextlib import contextmanager

import jsonschema
import onnx
import pytest
from onnx import TensorProto

from onnx_prep.core.cache.preflight import CHECKS, preflight, schema_path
from onnx_prep.core.errors import EXIT_FINDINGS, EXIT_OK, ModelFormatError, UsageError
from onnx_prep.core.model.resolution import resolve_model, weight_descriptor
from test_reader_integrity import (DATA as TINY_DATA, VICTIM, _drop_file_checksum, _drop_tensor_digests,
                                   _with_file_checksum, _zero)
from test_reader_integrity import tiny_copy  # noqa: F401 - a fixture
from test_prepared_cache import _flip, build
from test_resolve_models import custom_op_model
from test_resolve_refusals import MODEL, NORM, REFUSED, _edited

SMALL_DATA = MODEL + ".data"


def validated(doc: dict) -> dict:
    schema = json.loads(schema_path().read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)
    return doc


def statuses(doc: dict) -> dict[str, str]:
    return {c["id"]: c["status"] for c in doc["checks"]}


def findings(doc: dict, check: str) -> list[dict]:
    return [f for f in doc["findings"] if f["check"] == check]


def _strip_digests(m, name: str) -> None:
    """The tensor's sha256 and its file checksum: it has no trusted digest left."""
    _drop_tensor_digests(m, {name})
    _drop_file_checksum(m, name)


def _edit(path, edit) -> None:
    m = onnx.load(str(path), load_external_data=False)
    edit(m)
    onnx.save(m, str(path))


@pytest.fixture
def small_copy(small_llm_path, tmp_path):
    shutil.copytree(small_llm_path.parent, tmp_path / "m")
    return tmp_path / "m" / MODEL


# ------------------------------------------------------------------------ clean

@pytest.mark.parametrize("fixture", ["tiny_llm_path", "small_llm_path", "tiny_zp_llm_path"])
def test_every_fixture_is_clean_even_reading_every_payload(request, fixture):
    doc = validated(preflight(request.getfixturevalue(fixture), verify_payloads=True))
    assert doc["exit_code"] == EXIT_OK and doc["findings"] == []
    assert [c["id"] for c in doc["checks"]] == list(CHECKS)
    assert set(statuses(doc).values()) == {"ok"}  # no cache beside it: nothing to say


def _external(path):
    """The descriptors of a model's external initializers (what the preflight checks)."""
    model = onnx.load(str(path), load_external_data=False)
    return [weight_descriptor(t, str(path)) for t in model.graph.initializer
            if t.data_location == TensorProto.EXTERNAL]


# ------------------------------------------------------------- one class each

def test_a_missing_data_file_is_one_finding_and_hides_no_other_check(small_copy):
    (small_copy.parent / SMALL_DATA).unlink()
    doc = validated(preflight(small_copy))
    assert doc["exit_code"] == EXIT_FINDINGS
    [f] = doc["findings"]
    assert (f["check"], f["subject"], f["severity"]) == ("external_data", SMALL_DATA, "error")
    assert "not found" in f["message"] and f["where"]["file"] == SMALL_DATA
    assert f["where"]["tensors"] == len(_external(small_copy))  # every external initializer, active or not
    assert statuses(doc) == {"model.conformance": "ok", "kernels": "ok", "external_data": "findings",
                             "digests": "ok", "prepared_cache": "ok"}


def test_a_truncated_data_file_is_one_finding_per_tensor_past_its_end(small_copy):
    manifest = resolve_model(small_copy).manifest
    size = max(d.offset for d in manifest)  # cut inside the data: the last tensor and any past the cut
    os.truncate(small_copy.parent / SMALL_DATA, size)
    past = {d.name for d in manifest if d.offset + d.length > size}
    doc = validated(preflight(small_copy, verify_payloads=True))
    found = findings(doc, "external_data")
    assert past and {f["subject"] for f in found} == past and len(found) == len(past)
    for f in found:
        assert "run past the end of the file" in f["message"] and f"({size} bytes)" in f["message"]
        assert f["where"]["tensor"] == f["subject"] and f["where"]["file"] == SMALL_DATA
    assert doc["exit_code"] == EXIT_FINDINGS
    # the tensors in bounds verify and those past the end are not read; the file's checksum
    # (the fixture records it beside the per-tensor digests) is of the file before the cut
    [whole] = findings(doc, "digests")
    assert whole["subject"] == SMALL_DATA and "data file bytes do not match" in whole["message"]


@pytest.mark.parametrize("location, fragment", [
    ("../outside.data", "escapes the model folder"),
    ("/etc/passwd", "is absolute"),
    ("link.data", "is a symlink"),
    ("fifo.data", "not a regular file"),
])
def test_a_data_file_outside_the_rules_is_a_finding_naming_it(small_copy, location, fragment):
    os.symlink(SMALL_DATA, small_copy.parent / "link.data")
    os.mkfifo(small_copy.parent / "fifo.data")

    def edit(m):
        for e in next(t for t in m.graph.initializer if t.name == NORM).external_data:
            if e.key == "location":
                e.value = location
    _edit(small_copy, edit)
    doc = validated(preflight(small_copy))
    [f] = doc["findings"]
    assert (f["check"], f["subject"], f["where"]["tensors"]) == ("external_data", location, 1)
    assert fragment in f["message"]


def test_an_op_with_no_kernel_names_the_op_and_its_nodes(tmp_path):
    doc = validated(preflight(custom_op_model(tmp_path / "custom")))
    [f] = doc["findings"]
    assert (f["check"], f["subject"]) == ("kernels", "custom.ops::Frobnicate")
    assert "frob1, frob2" in f["message"] and f["where"]["nodes"] == ["frob1", "frob2"]
    assert doc["exit_code"] == EXIT_FINDINGS


def test_a_stripped_digest_is_a_finding_naming_the_tensor_and_the_fix(small_copy):
    _edit(small_copy, lambda m: _strip_digests(m, NORM))
    doc = validated(preflight(small_copy))
    [f] = doc["findings"]
    assert (f["check"], f["subject"], f["severity"]) == ("digests", NORM, "error")
    assert "no trusted digest" in f["message"] and "onnx-prep digest --write" in f["message"]
    assert doc["exit_code"] == EXIT_FINDINGS


def test_a_malformed_digest_is_a_digests_finding(small_copy):
    def edit(m):
        t = next(t for t in m.graph.initializer if t.name == NORM)
        t.metadata_props[0].value = "sha256:nothex"
    _edit(small_copy, edit)
    doc = validated(preflight(small_copy))
    [f] = doc["findings"]
    assert (f["check"], f["subject"]) == ("digests", NORM) and "sha256:<64 hex>" in f["message"]
    # resolution stops there: the rest of the conformance checks cannot run
    assert statuses(doc)["model.conformance"] == "skipped"


def test_a_wrong_digest_is_found_only_by_reading_the_payload(tiny_copy):  # noqa: F811
    d = _zero(tiny_copy, VICTIM)
    assert validated(preflight(tiny_copy))["exit_code"] == EXIT_OK  # stat only: no byte read
    doc = validated(preflight(tiny_copy, verify_payloads=True))
    # the tensor's digest, and its file's checksum (the fixture records both): one finding each
    whole, f = doc["findings"]
    assert (whole["subject"], whole["where"]["offset"]) == (TINY_DATA, 0)
    actual = "sha256:" + hashlib.sha256(b"\0" * d.length).hexdigest()
    assert (f["check"], f["subject"]) == ("digests", VICTIM) and "do not match" in f["message"]
    assert f["where"] | {"model": None} == {"model": None, "tensor": VICTIM, "file": TINY_DATA,
                                            "offset": d.offset, "expected": d.digest, "actual": actual}
    assert doc["exit_code"] == EXIT_FINDINGS


def test_a_wrong_file_checksum_is_one_finding_for_the_file(tiny_copy):  # noqa: F811
    _with_file_checksum(tiny_copy)
    _zero(tiny_copy, VICTIM)
    doc = validated(preflight(tiny_copy, verify_payloads=True))
    [f] = doc["findings"]
    assert (f["check"], f["subject"]) == ("digests", TINY_DATA)
    assert f["where"]["expected"].startswith("sha1:") and f["where"]["actual"].startswith("sha1:")
    assert f["where"]["offset"] == 0 and "tensor" not in f["where"]



def test_a_file_checksum_is_checked_beside_correct_per_tensor_digests(small_copy):
    """A model recording both (what ``digest --write`` writes): bytes appended to its data
    file change no tensor, so every per-tensor digest still matches; the file's
    ``checksum`` does not, and is a finding of the file."""
    with open(small_copy.parent / SMALL_DATA, "ab") as f:
        f.write(b"appended after the checksum was recorded")
    d = next(d for d in _external(small_copy) if d.name == NORM)
    assert d.digest_source.value == "tensor-metadata"  # both recorded: the checksum is not its digest
    assert validated(preflight(small_copy))["exit_code"] == EXIT_OK  # stat only: nothing read
    doc = validated(preflight(small_copy, verify_payloads=True))
    [f] = doc["findings"]
    assert (f["check"], f["subject"], f["severity"]) == ("digests", SMALL_DATA, "error")
    assert "data file bytes do not match" in f["message"]
    assert f["where"]["expected"].startswith("sha1:") and f["where"]["actual"].startswith("sha1:")
    assert f["where"]["offset"] == 0 and "tensor" not in f["where"] and f["where"]["file"] == SMALL_DATA
    assert doc["exit_code"] == EXIT_FINDINGS


CONFORMANCE = ["opset-99", "ir-99", "norm-int32", "two-producers", "mm-B-int8", "gbq-block-7"]


@pytest.mark.parametrize("case", CONFORMANCE)
def test_what_onnxruntime_refuses_is_a_conformance_finding(small_llm_path, tmp_path, case):
    edit, fragments = REFUSED[case]
    doc = validated(preflight(_edited(small_llm_path, tmp_path / case, edit)))
    [f] = doc["findings"]
    assert f["check"] == "model.conformance" and "first refusal" in f["message"]
    for fragment in fragments:
        assert fragment in f["message"] or fragment == f["subject"], (fragment, f)
    assert statuses(doc)["kernels"] == "skipped" and doc["exit_code"] == EXIT_FINDINGS


@pytest.mark.parametrize("case", ["offset-space", "unknown-ext-key", "location-slash"])
def test_a_malformed_external_entry_is_an_external_data_finding(small_llm_path, tmp_path, case):
    edit, fragments = REFUSED[case]
    doc = validated(preflight(_edited(small_llm_path, tmp_path / case, edit)))
    [f] = doc["findings"]
    assert (f["check"], f["subject"]) == ("external_data", NORM)
    for fragment in fragments:
        assert fragment in f["message"] or fragment == f["subject"], (fragment, f)


def test_several_problems_are_all_found_in_one_run(small_copy):
    """A conformance refusal, a missing digest and a missing data file."""
    def edit(m):
        REFUSED["opset-99"][0](m)
        _strip_digests(m, NORM)
    _edit(small_copy, edit)
    os.rename(small_copy.parent / SMALL_DATA, small_copy.parent / "elsewhere.data")
    doc = validated(preflight(small_copy))
    assert {(f["check"], f["subject"]) for f in doc["findings"]} == {
        ("model.conformance", MODEL), ("external_data", SMALL_DATA), ("digests", NORM)}


def test_a_problem_in_a_tensor_no_node_reads_is_a_warning(small_copy):
    """ONNX Runtime drops an unused initializer before loading its data; so does this runtime."""
    def edit(m):
        t = m.graph.initializer.add(name="unused", data_type=TensorProto.FLOAT, dims=[4])
        t.data_location = TensorProto.EXTERNAL
        t.external_data.add(key="location", value="gone.data")
    _edit(small_copy, edit)
    doc = validated(preflight(small_copy))
    assert {(f["check"], f["subject"], f["severity"]) for f in doc["findings"]} == {
        ("external_data", "gone.data", "warning"), ("digests", "unused", "warning")}
    assert doc["exit_code"] == EXIT_OK and doc["summary"]["warnings"] == 2


def test_verification_reports_progress_in_payload_bytes(small_llm_path):
    events = []

    @contextmanager
    def progress(label, total):
        events.append((label, total))
        yield lambda nbytes: events.append(nbytes)

    preflight(small_llm_path, progress=progress)
    assert events == []  # nothing is read without verify_payloads
    preflight(small_llm_path, verify_payloads=True, progress=progress)
    # every external initializer's digest is verified: the active ones (the manifest) and
    # the tied embedding's scales, which a load does not read (the LM head's are its bytes)
    # and the data file's checksum, recorded beside them: one pass over the whole file
    external = _external(small_llm_path)
    manifest = resolve_model(small_llm_path).manifest
    assert [d.name for d in external if d.name not in manifest] == ["embed_tokens.scales"]
    file_size = (small_llm_path.parent / SMALL_DATA).stat().st_size
    assert events[0] == ("verify payloads", sum(d.length for d in external) + file_size)
    assert sorted(events[1:]) == sorted([file_size, *(d.length for d in external)])


# ------------------------------------------------------------ prepared cache

def test_a_built_cache_is_clean_and_a_flipped_payload_byte_is_found_by_reading_it(small_copy):
    [f] = preflight(small_copy, require_complete=True)["findings"]
    assert (f["check"], f["severity"]) == ("prepared_cache", "error") and "build-cache" in f["message"]
    manifest = build(small_copy)
    doc = validated(preflight(small_copy, require_complete=True, verify_payloads=True))
    assert doc["exit_code"] == EXIT_OK and set(statuses(doc).values()) == {"ok"}
    _flip(small_copy, manifest)
    assert preflight(small_copy)["exit_code"] == EXIT_OK  # found only by reading the payloads
    doc = validated(preflight(small_copy, verify_payloads=True))
    [f] = doc["findings"]
    assert (f["check"], f["subject"]) == ("prepared_cache", manifest.entries[0].key)
    assert "does not match its digest" in f["message"] and doc["exit_code"] == EXIT_FINDINGS


def test_a_malformed_or_absent_named_cache_is_a_finding_not_exit_2(small_copy, tmp_path):
    (small_copy.parent / f"{small_copy.stem}.prepared.onnx").write_bytes(b"junk")
    doc = validated(preflight(small_copy))
    [f] = doc["findings"]
    assert (f["check"], f["severity"]) == ("prepared_cache", "error") and "unparseable" in f["message"]
    absent = tmp_path / "elsewhere.prepared.onnx"
    doc = validated(preflight(small_copy, prepared=absent))
    [f] = doc["findings"]
    assert (f["check"], f["subject"]) == ("prepared_cache", str(absent))
    assert f"onnx-prep build-cache -o {absent}" in f["message"] and doc["exit_code"] == EXIT_FINDINGS
    assert doc["options"]["prepared"] == str(absent)


# --------------------------------------------------------------- not a model

def test_input_that_is_not_a_model_is_raised_not_reported(tmp_path):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\xff" * 64)
    with pytest.raises(ModelFormatError, match="not an ONNX protobuf"):
        preflight(junk)
    with pytest.raises(UsageError, match="not found"):
        preflight(tmp_path / "absent.onnx")
