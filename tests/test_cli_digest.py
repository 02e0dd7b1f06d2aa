"""``onnx-prep digest`` through a real process (docs/digest.md): the report and its JSON
schema, the write, and each refusal as one line with its exit code: bytes that do not
match a recorded digest, ``-o`` outside the model's folder or onto a data file, and a
write that fails part-way (a full disk, simulated with RLIMIT_FSIZE) or cannot start
(a read-only folder), which leave the old model file as it was and no temporary file."""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess

import jsonschema
import onnx
import pytest

from onnx_prep.core.errors import EXIT_OK, EXIT_UNUSABLE
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.model.weight_digests import schema_path
from onnx_prep.core.model.weights import DigestSource
from test_cli_exit_codes import ONNX_PREP, onnx_prep
from test_digest import DATA, bare  # noqa: F401  (bare is a fixture)


def schema() -> dict:
    return json.loads(schema_path().read_text())


def valid(doc: dict) -> dict:
    """``doc``, once it validates against the documented schema."""
    jsonschema.validate(doc, schema(), cls=jsonschema.Draft202012Validator)
    return doc


def one_line_error(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == EXIT_UNUSABLE, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert p.stdout == ""
    return lines[0]


def test_the_report_and_the_write_validate_against_the_schema(bare):
    jsonschema.Draft202012Validator.check_schema(schema())
    p = onnx_prep("digest", str(bare), "--json")
    assert p.returncode == EXIT_OK and p.stderr == "", p.stderr  # no progress bar off a terminal
    report = valid(json.loads(p.stdout))
    assert report["write"] is None and report["totals"]["missing"] == 45
    assert {t["status"] for t in report["tensors"]} == {"missing"}

    p = onnx_prep("digest", str(bare), "--write", "--json")
    assert p.returncode == EXIT_OK, p.stderr
    written = valid(json.loads(p.stdout))
    assert written["write"]["written"] is True and written["totals"]["added"] == 45
    assert [t["sha256"] for t in written["tensors"]] == [t["sha256"] for t in report["tensors"]]

    # the digests tell the embedding's scales are the LM head's bytes: the tied table is
    # read through the LM head's object (core/kernels/tied_embedding.py), those scales
    # are no longer active, and the other 44 weights are verified
    again = valid(json.loads(onnx_prep("digest", str(bare), "--json").stdout))
    assert again["totals"]["verified"] == 44 and again["files"][0]["status"] == "verified"


def test_the_schema_rejects_an_undocumented_field(bare):
    doc = json.loads(onnx_prep("digest", str(bare), "--json").stdout)
    doc["totals"]["surprise"] = 1
    with pytest.raises(jsonschema.ValidationError):
        valid(doc)


def test_the_text_report_says_what_is_missing_and_then_what_was_added(bare):
    p = onnx_prep("digest", str(bare))
    assert p.returncode == EXIT_OK and p.stderr == "", p.stderr
    assert "tensors: 0 verified, 45 missing, 0 added" in p.stdout
    assert "nothing written: --write records the missing digests" in p.stdout
    p = onnx_prep("digest", str(bare.parent), "--write")  # a folder stands for its model
    assert p.returncode == EXIT_OK, p.stderr
    assert f"wrote {bare}: 45 tensor digests and 45 checksums added" in p.stdout
    p = onnx_prep("digest", str(bare), "--write")
    assert f"nothing written: every digest is recorded in {bare} already" in p.stdout
    # resolve now trusts every weight (44 active: the tied embedding's scales are unread)
    doc = json.loads(onnx_prep("resolve", str(bare), "--json").stdout)
    assert doc["digests"]["tensor_metadata"] == 44 and doc["digests"]["missing"] == []


def test_a_changed_byte_is_exit_2_naming_tensor_file_offset_and_both_digests(bare):
    assert onnx_prep("digest", str(bare), "--write").returncode == EXIT_OK
    d = resolve_model(bare).weights["layers.0.mlp.down.weight_q4"]
    with open(bare.parent / DATA, "r+b") as f:
        f.seek(d.offset + d.length - 1)
        last = f.read(1)
        f.seek(d.offset + d.length - 1)
        f.write(bytes([last[0] ^ 0x80]))
    before = bare.read_bytes()

    line = one_line_error(onnx_prep("digest", str(bare), "--write"))

    assert line.startswith("error: tensor bytes do not match their recorded digest: "
                           f"recorded {d.digest}, computed sha256:")
    assert f"tensor '{d.name}', file {DATA}, offset {d.offset}" in line
    assert bare.read_bytes() == before
    # and a run of the model refuses it the same way (the reader's own check)
    run = onnx_prep("run", str(bare), "--tokens", "1")
    # (a load checks the weight's xxh3, the faster of the two it records)
    assert run.returncode == EXIT_UNUSABLE and f"tensor '{d.name}'" in run.stderr and d.load_digest in run.stderr


def test_output_outside_the_models_folder_is_refused(bare, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "digested.onnx"
    line = one_line_error(onnx_prep("digest", str(bare), "-o", str(elsewhere)))
    assert "-o must be in the model's folder" in line and str(elsewhere) in line
    assert not elsewhere.exists()


def test_output_onto_a_data_file_is_refused(bare):
    data = bare.parent / DATA
    before = data.stat()
    line = one_line_error(onnx_prep("digest", str(bare), "--write", "-o", str(data)))
    assert f"-o names the model's data file {DATA}" in line
    assert (data.stat().st_size, data.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def test_output_beside_the_model_leaves_the_model_as_it_was(bare):
    before = bare.read_bytes()
    out = bare.parent / "digested.onnx"
    p = onnx_prep("digest", str(bare), "-o", str(out))  # -o implies --write
    assert p.returncode == EXIT_OK, p.stderr
    assert bare.read_bytes() == before
    assert all(d.digest_source is DigestSource.TENSOR_METADATA for d in resolve_model(out).manifest)
    assert oct(out.stat().st_mode & 0o777) == oct(bare.stat().st_mode & 0o777)


def _full_disk(limit: int):
    def preexec():
        # SIGXFSZ would kill the process at the limit; ignored, the write fails with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def test_a_write_that_fails_part_way_leaves_the_old_model_and_no_temporary_file(bare):
    before = bare.read_bytes()
    limit = len(before) // 2  # the new file is larger: the write stops half-way through it
    p = subprocess.run([*ONNX_PREP, "digest", str(bare), "--write"], capture_output=True, text=True,
                       timeout=120, preexec_fn=_full_disk(limit))
    line = one_line_error(p)
    assert "cannot write the model file: File too large" in line and "the model file is unchanged" in line
    assert bare.read_bytes() == before
    assert sorted(x.name for x in bare.parent.iterdir()) == sorted([bare.name, DATA])
    # the model still loads as it did: no digest, nothing half-written
    assert all(d.digest_source is DigestSource.NONE for d in resolve_model(bare).manifest)


def test_a_read_only_folder_is_refused_with_the_model_unchanged(bare):
    if os.geteuid() == 0:
        pytest.skip("running as root: a read-only folder does not stop root's writes "
                    "(the RLIMIT_FSIZE test covers a failed write)")
    before = bare.read_bytes()
    os.chmod(bare.parent, 0o555)
    try:
        line = one_line_error(onnx_prep("digest", str(bare), "--write"))
    finally:
        os.chmod(bare.parent, 0o755)
    assert "cannot write the model file: Permission denied" in line
    assert bare.read_bytes() == before
    assert sorted(x.name for x in bare.parent.iterdir()) == sorted([bare.name, DATA])


def test_a_model_with_its_digests_already_verifies_as_it_is(tiny_llm_path):
    """The fixtures record both digests: digest (without --write) only checks them."""
    p = onnx_prep("digest", str(tiny_llm_path), "--json")
    assert p.returncode == EXIT_OK, p.stderr
    doc = json.loads(p.stdout)
    assert doc["totals"]["verified"] == doc["totals"]["tensors"] > 0 and doc["totals"]["missing"] == 0
    assert onnx.load(str(tiny_llm_path), load_external_data=False).graph.initializer  # untouched, still parses


def test_a_progress_bar_on_a_terminal_only(bare):
    """On a terminal, a bar of bytes hashed on stderr (stdout stays the report); off a
    terminal and with --json, nothing on stderr (the tests above)."""
    import pty
    import select

    leader, follower = pty.openpty()
    p = subprocess.Popen([*ONNX_PREP, "digest", str(bare)], stdout=subprocess.PIPE, stderr=follower)
    os.close(follower)
    seen = b""
    while select.select([leader], [], [], 60)[0]:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the process closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    stdout = p.communicate(timeout=60)[0].decode()
    assert p.returncode == EXIT_OK
    assert b"hashing" in seen and b"13.7 MB" in seen
    assert "hashing" not in stdout and "tensors: 0 verified, 45 missing" in stdout
