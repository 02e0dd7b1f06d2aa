"""The one reader's integrity checks (docs/runtime.md, "The reader"): trusted digests
are verified while the bytes are read, and a data file truncated or rewritten during a
load is an error naming it, never a SIGBUS.

Real fixtures, real data files, the real native module. A truncation could kill the
process if the guard failed, so those tests run in a subprocess and assert its exit."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from conftest import keep_tensor_digest
from onnx_prep.cli.app import app
from onnx_prep.core.errors import EXIT_OK, EXIT_UNUSABLE, DigestError, ExternalDataError
from onnx_prep.core.io import external_data
from onnx_prep.core.io.content_digest import digest_of
from onnx_prep.core.io.external_data import ExternalDataReader
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.model.weights import TENSOR_DIGEST_KEY, TENSOR_FAST_DIGEST_KEY, DigestSource

DATA = "tiny-llm.onnx.data"
VICTIM = "lm_head.scales"


@pytest.fixture
def tiny_copy(tiny_llm_path, tmp_path):
    """A private copy of the tiny model (its data file gets damaged)."""
    for p in tiny_llm_path.parent.iterdir():
        shutil.copy(p, tmp_path / p.name)
    return tmp_path / tiny_llm_path.name


def _drop_tensor_digests(m, names):
    """Remove the per-tensor digests (``onnx_prep.sha256`` and ``onnx_prep.xxh3`` in the
    tensor's metadata_props)."""
    for t in m.graph.initializer:
        if t.name in names:
            del t.metadata_props[:]


def _drop_file_checksum(m, name):
    """Remove the tensor's ONNX ``checksum`` external-data entry."""
    t = next(t for t in m.graph.initializer if t.name == name)
    keep = [(e.key, e.value) for e in t.external_data if e.key != "checksum"]
    del t.external_data[:]
    for key, value in keep:
        t.external_data.add(key=key, value=value)


def _zero(model, name):
    d = resolve_model(model).weights[name]
    with open(model.parent / d.file, "r+b") as f:
        f.seek(d.offset)
        f.write(b"\0" * d.length)
    return d


# ------------------------------------------------------------------- digests

@pytest.mark.parametrize("source_io", ["map", "read"])
def test_zeroed_tensor_with_its_digest_fails_the_load(tiny_copy, source_io):
    from onnx_prep.core.runtime.session import Session

    d = _zero(tiny_copy, VICTIM)
    assert d.digest_source is DigestSource.TENSOR_METADATA
    assert d.load_digest == d.fast_digest and d.fast_digest.startswith("xxh3:")  # the one a load checks
    zero_digest = digest_of(b"\0" * d.length)
    with Session.open(tiny_copy, source_io=source_io) as s:
        with pytest.raises(Exception) as ei:
            s.prepare()
    cause = ei.value.__cause__ or ei.value
    assert isinstance(cause, DigestError)
    text = str(cause)
    assert f"tensor '{VICTIM}'" in text and f"file {DATA}" in text and f"offset {d.offset}" in text
    assert f"expected {d.fast_digest}" in text and f"got {zero_digest}" in text


def test_run_exits_2_on_a_digest_mismatch_and_0_without_verification(tiny_copy):
    d = _zero(tiny_copy, VICTIM)
    runner = CliRunner()
    bad = runner.invoke(app, ["run", str(tiny_copy), "--tokens", "2"])
    assert bad.exit_code == EXIT_UNUSABLE, bad.output
    line = bad.output.strip()
    assert "\n" not in line and "do not match their declared digest" in line
    assert f"tensor '{VICTIM}'" in line and f"offset {d.offset}" in line and d.load_digest in line
    off = runner.invoke(app, ["run", str(tiny_copy), "--tokens", "2", "--no-verify-digests"])
    assert off.exit_code == EXIT_OK, off.output


@pytest.mark.parametrize("kept", [TENSOR_DIGEST_KEY, TENSOR_FAST_DIGEST_KEY])
def test_a_model_recording_one_per_tensor_digest_is_checked_with_that_one(tiny_copy, kept):
    """A model digested before the xxh3 existed (sha256 only), or one recording only the
    xxh3: a load checks the digest it has, in that digest's algorithm."""
    keep_tensor_digest(tiny_copy, kept)
    d = _zero(tiny_copy, VICTIM)
    algorithm = "sha256" if kept == TENSOR_DIGEST_KEY else "xxh3"
    assert d.digest_source is DigestSource.TENSOR_METADATA and d.load_digest == d.digest
    assert d.digest.startswith(algorithm + ":") and d.fast_digest == (d.digest if algorithm == "xxh3" else None)
    with pytest.raises(DigestError) as ei:
        ExternalDataReader.for_model(resolve_model(tiny_copy)).read(d)
    assert f"expected {d.digest}" in str(ei.value) and f"got {digest_of(bytes(d.length), algorithm)}" in str(ei.value)


def test_a_load_checks_the_xxh3_and_every_digest_check_checks_both(tiny_copy):
    """The sha256 is not what a load hashes (the xxh3 is): a model whose sha256 alone is
    wrong loads, and the reader that checks every digest (``check --verify-payloads``)
    names it."""
    m = onnx.load(str(tiny_copy), load_external_data=False)
    t = next(t for t in m.graph.initializer if t.name == VICTIM)
    wrong = "sha256:" + "0" * 64
    for p in t.metadata_props:
        if p.key == TENSOR_DIGEST_KEY:
            p.value = wrong
    onnx.save(m, str(tiny_copy))
    r = resolve_model(tiny_copy)
    d = r.weights[VICTIM]
    assert d.digest == wrong and d.load_digest == d.fast_digest
    ExternalDataReader.for_model(r).read(d)  # the xxh3 matches
    with pytest.raises(DigestError, match=f"expected {wrong}"):
        ExternalDataReader(r.model_dir, r.manifest, model=str(r.model_path), verify_every_digest=True).read(d)


def test_a_malformed_xxh3_digest_is_refused_at_resolve(tiny_copy):
    m = onnx.load(str(tiny_copy), load_external_data=False)
    t = next(t for t in m.graph.initializer if t.name == VICTIM)
    t.metadata_props.add(key=TENSOR_FAST_DIGEST_KEY, value="xxh3:1234")
    onnx.save(m, str(tiny_copy))
    with pytest.raises(DigestError, match=r"metadata_props onnx_prep.xxh3 is not 'xxh3:<16 hex>': 'xxh3:1234'"):
        resolve_model(tiny_copy)


def test_corruption_without_a_digest_cannot_be_caught(tiny_copy):
    """The limit, documented (docs/run.md): a tensor that declares no digest loads
    whatever bytes its file holds."""
    m = onnx.load(str(tiny_copy), load_external_data=False)
    _drop_tensor_digests(m, {VICTIM})
    _drop_file_checksum(m, VICTIM)
    onnx.save(m, str(tiny_copy))
    d = _zero(tiny_copy, VICTIM)
    assert d.digest_source is DigestSource.NONE
    reader = ExternalDataReader.for_model(resolve_model(tiny_copy))
    assert not reader.read(d).any() and not reader.map_shared(d, populate=True).any()


def test_reads_verify_by_default_and_can_be_told_not_to(tiny_copy):
    d = _zero(tiny_copy, VICTIM)
    r = resolve_model(tiny_copy)
    on, off = ExternalDataReader.for_model(r), ExternalDataReader.for_model(r, verify_digests=False)
    for read in (lambda rd: rd.read(d), lambda rd: rd.map_shared(d, populate=True)):
        with pytest.raises(DigestError):
            read(on)
        assert not read(off).any()
    assert not on.read(d, verify=False).any()  # a call may override its reader


def test_digest_is_hashed_chunk_by_chunk_across_a_multi_chunk_tensor(tiny_copy, monkeypatch):
    """A tensor longer than one hashing step is verified whole: a byte changed in its
    last chunk, through both read paths."""
    monkeypatch.setattr(external_data, "_HASH_CHUNK", 4096)
    r = resolve_model(tiny_copy)
    d = r.weights[VICTIM]
    assert d.length > 4 * 4096
    ExternalDataReader.for_model(r).read(d)  # intact: passes
    with open(tiny_copy.parent / d.file, "r+b") as f:
        f.seek(d.offset + d.length - 1)
        last = f.read(1)
        f.seek(d.offset + d.length - 1)
        f.write(bytes([last[0] ^ 1]))
    for read in (lambda rd: rd.read(d), lambda rd: rd.map_shared(d, populate=True)):
        with pytest.raises(DigestError, match="do not match"):
            read(ExternalDataReader.for_model(r))


def _with_file_checksum(model):
    """The model's tensors declare only the ONNX ``checksum`` (SHA-1 of the whole file)."""
    m = onnx.load(str(model), load_external_data=False)
    _drop_tensor_digests(m, {t.name for t in m.graph.initializer})
    sha1 = hashlib.sha1((model.parent / DATA).read_bytes()).hexdigest()
    for t in m.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            _drop_file_checksum(m, t.name)
            t.external_data.add(key="checksum", value=sha1)
    onnx.save(m, str(model))
    return resolve_model(model)


def test_file_checksum_is_verified_once_per_file_per_process(tiny_copy):
    r = _with_file_checksum(tiny_copy)
    d = r.weights[VICTIM]
    assert d.digest_source is DigestSource.FILE_CHECKSUM
    external_data._files_verified.clear()
    ExternalDataReader.for_model(r).read(d)
    assert len(external_data._files_verified) == 1
    key = next(iter(external_data._files_verified))
    ExternalDataReader.for_model(r).map_shared(d, populate=True)  # another reader: no new check
    assert external_data._files_verified == {key}
    os.utime(tiny_copy.parent / DATA, ns=(1, 1))  # the file "changed": checked again, passes
    ExternalDataReader.for_model(r).read(d)
    assert len(external_data._files_verified) == 2
    _zero(tiny_copy, VICTIM)  # now it does not match
    with pytest.raises(DigestError) as ei:
        ExternalDataReader.for_model(r).read(r.weights["layers.0.input_norm.weight"])
    text = str(ei.value)
    assert "data file bytes do not match" in text and f"file {DATA}" in text and "offset 0" in text
    assert "expected sha1:" in text and "got sha1:" in text


# ---------------------------------------------------- the file changes under a load

def _subprocess(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)


def test_truncation_under_a_mapped_view_is_an_error_not_sigbus(tiny_copy):
    """Mapped and populated, then the file is truncated: the pages are gone from the
    mapping. Hashing the view (C, GIL released) and summing it touch them; the guard
    turns each SIGBUS into zeros and ``check_unchanged`` names the file."""
    p = _subprocess(f"""
        import hashlib, os
        from onnx_prep.core.errors import ExternalDataError
        from onnx_prep.core.io.external_data import ExternalDataReader
        from onnx_prep.core.model.resolution import resolve_model
        r = resolve_model({str(tiny_copy)!r})
        reader = ExternalDataReader.for_model(r)
        d = r.weights[{VICTIM!r}]
        v = reader.map_shared(d, populate=True)
        reader.check_unchanged(d)
        os.truncate(r.model_dir / d.file, 0)
        hashlib.sha256(v).hexdigest(); int(v.sum())
        try:
            reader.check_unchanged(d)
        except ExternalDataError as e:
            print("ERR", e)
    """)
    assert p.returncode == 0, (p.returncode, p.stderr)
    assert p.stdout.startswith("ERR external data file was truncated or rewritten while it was being read")
    assert f"tensor '{VICTIM}'" in p.stdout and f"file {DATA}" in p.stdout and "offset " in p.stdout


@pytest.mark.parametrize("change", ["truncate", "rewrite"])
def test_data_file_changed_during_a_session_load_fails_it_clearly(tiny_copy, change):
    """A sequential session (every task on the calling thread, in order): at the 6th
    source read the hook truncates the data file to half, or rewrites it in place as
    ``cp`` does (truncate to 0, then the same bytes). The process survives: a truncation
    is an error naming the file (the read past the new end); a rewrite with identical
    bytes may load. (In this order each prepack runs right after its sources' reads, so
    no mapped page is consumed after the truncation here; the guard itself is proven by
    the test above.)"""
    p = _subprocess(f"""
        import os
        from onnx_prep.core.errors import OnnxPrepError
        from onnx_prep.core.runtime.session import Session
        path = {str(tiny_copy.parent / DATA)!r}
        data = open(path, "rb").read()
        seen = []
        def before(desc):
            seen.append(desc.name)
            if len(seen) == 6:
                if {change!r} == "truncate":
                    os.truncate(path, len(data) // 2)
                else:
                    with open(path, "r+b") as f:
                        f.truncate(0); f.write(data)
        with Session.open({str(tiny_copy)!r}, sequential=True) as s:
            s.reader.hooks.before_read = before
            try:
                s.prepare()
                print("LOADED")
            except OnnxPrepError as e:
                cause = e.__cause__ or e
                print("ERR", type(cause).__name__, cause)
    """)
    assert p.returncode == 0, (p.returncode, p.stderr)
    if change == "rewrite" and p.stdout.startswith("LOADED"):
        # identical bytes back before any mapped page was touched again: a valid load
        return
    assert p.stdout.startswith("ERR "), p.stdout
    assert f"file {DATA}" in p.stdout and "tensor '" in p.stdout and "offset " in p.stdout
    assert any(m in p.stdout for m in ("truncated or rewritten", "run past the end", "ended after")), p.stdout
