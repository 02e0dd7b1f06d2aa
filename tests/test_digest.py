"""Weight digests (core/model/weight_digests.py, docs/digest.md): a model without
digests gets the ones its generator would have recorded, computed in one pass per data
file through the one reader; recorded digests are checked on that pass; the model is
rewritten atomically, metadata only, and still loads in ONNX Runtime with identical
outputs; the reader then refuses a changed byte.

Real fixtures, real data files; the tiny fixture's generator records both digests
itself (fixtures/data_file.py, hashing the arrays as it writes them), so a copy with
them stripped is a model "without digests" whose right answer is known independently."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import pytest

from conftest import keep_tensor_digest, ort_or_skip
from onnx_prep.core.errors import DigestError, ExternalDataError, UsageError
from onnx_prep.core.io.external_data import ExternalDataReader
from onnx_prep.core.model import weight_digests
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.model.weight_digests import compute_digests, digest_model, write_digests
from onnx_prep.core.io.content_digest import digest_of
from onnx_prep.core.model.weights import TENSOR_DIGEST_KEY, TENSOR_FAST_DIGEST_KEY, DigestSource

DATA = "tiny-llm.onnx.data"


def strip_digests(model_path, *, sha256=True, checksum=True, keep=()):
    """Remove the per-tensor digests (sha256 and xxh3) and/or the ONNX checksum of every
    initializer not in ``keep``, in place (the entries' order and other keys stay)."""
    m = onnx.load(str(model_path), load_external_data=False)
    for t in m.graph.initializer:
        if t.name in keep:
            continue
        if sha256:
            del t.metadata_props[:]
        if checksum:
            entries = [(e.key, e.value) for e in t.external_data if e.key != "checksum"]
            del t.external_data[:]
            for key, value in entries:
                t.external_data.add(key=key, value=value)
    onnx.save(m, str(model_path))


def sha256_file(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def bare(tiny_llm_path, tmp_path):
    """A copy of the tiny model without any digest (its data file copied, not linked)."""
    for p in tiny_llm_path.parent.iterdir():
        shutil.copy(p, tmp_path / p.name)
    path = tmp_path / tiny_llm_path.name
    strip_digests(path)
    return path


def test_a_model_without_digests_gets_the_ones_its_generator_recorded(bare, tiny_llm_path):
    data = bare.parent / DATA
    before = (sha256_file(data), os.stat(data).st_mtime_ns)
    assert all(d.digest_source is DigestSource.NONE for d in resolve_model(bare).manifest)

    doc = digest_model(bare, write=True)

    assert doc["totals"]["added"] == doc["totals"]["tensors"] == 45 and doc["totals"]["missing"] == 0
    assert doc["files"][0]["status"] == "added" and doc["write"]["written"] is True
    assert doc["write"]["tensor_digests_added"] == 45 and doc["write"]["checksums_added"] == 45
    # the data file is never written
    assert (sha256_file(data), os.stat(data).st_mtime_ns) == before
    # every weight trusted, by its own sha256
    resolved = resolve_model(bare)
    assert all(d.digest_source is DigestSource.TENSOR_METADATA for d in resolved.manifest)
    # and exactly the digests the generator computed while writing the data
    original = onnx.load(str(tiny_llm_path), load_external_data=False)
    digested = onnx.load(str(bare), load_external_data=False)
    for a, b in zip(original.graph.initializer, digested.graph.initializer):
        assert list(b.metadata_props) == list(a.metadata_props), a.name
        assert list(b.external_data) == list(a.external_data), a.name
    assert doc["hashing"]["bytes"] == data.stat().st_size


def test_each_external_entry_is_kept_and_only_gains_a_checksum(bare):
    m = onnx.load(str(bare), load_external_data=False)
    # a key order no exporter would use, to show entries are kept, not rebuilt
    for t in m.graph.initializer:
        entries = [(e.key, e.value) for e in t.external_data][::-1]
        del t.external_data[:]
        for key, value in entries:
            t.external_data.add(key=key, value=value)
    onnx.save(m, str(bare))
    before = {t.name: [(e.key, e.value) for e in t.external_data] for t in m.graph.initializer}

    digest_model(bare, write=True)

    after = onnx.load(str(bare), load_external_data=False)
    sha1 = hashlib.sha1((bare.parent / DATA).read_bytes()).hexdigest()
    for t in after.graph.initializer:
        assert [(e.key, e.value) for e in t.external_data] == before[t.name] + [("checksum", sha1)]
    # the rest of the model is untouched: with the added fields removed again, the same protobuf
    strip_digests(bare)
    assert onnx.load(str(bare), load_external_data=False) == m


def test_a_second_run_verifies_everything_and_writes_nothing(bare):
    digest_model(bare, write=True)
    st = os.stat(bare)

    doc = digest_model(bare, write=True)

    # 44: with every digest recorded, the embedding's scales are known to be the LM
    # head's bytes, and the tied table is read through the LM head's object (unread)
    assert doc["totals"]["verified"] == 44 and doc["totals"]["missing"] == doc["totals"]["added"] == 0
    assert [f["status"] for f in doc["files"]] == ["verified"]
    assert doc["write"] == {"path": str(bare), "written": False, "tensor_digests_added": 0,
                            "checksums_added": 0, "bytes": 0}
    assert (os.stat(bare).st_ino, os.stat(bare).st_mtime_ns) == (st.st_ino, st.st_mtime_ns)


def test_only_the_missing_digests_are_added(bare, tiny_llm_path):
    shutil.copy(tiny_llm_path, bare)  # every digest recorded, then half of the sha256 removed
    names = [t.name for t in onnx.load(str(bare), load_external_data=False).graph.initializer]
    keep = set(names[::2])
    strip_digests(bare, checksum=False, keep=keep)

    doc = digest_model(bare, write=True)

    status = {t["name"]: t["status"] for t in doc["tensors"]}
    assert {n for n, s in status.items() if s == "verified"} == keep
    assert {n for n, s in status.items() if s == "added"} == set(names) - keep
    assert doc["files"][0]["status"] == "verified" and doc["write"]["checksums_added"] == 0
    assert onnx.load(str(bare), load_external_data=False) == onnx.load(str(tiny_llm_path), load_external_data=False)


def test_a_model_digested_before_the_xxh3_gains_only_its_xxh3(bare, tiny_llm_path):
    """A model whose weights record their sha256 alone (what ``digest --write`` wrote
    before the xxh3): each recorded sha256 is verified, each xxh3 added after it."""
    shutil.copy(tiny_llm_path, bare)
    keep_tensor_digest(bare, TENSOR_DIGEST_KEY)
    assert all(d.fast_digest is None and d.load_digest.startswith("sha256:") for d in resolve_model(bare).manifest)

    doc = digest_model(bare, write=True)

    assert {t["status"] for t in doc["tensors"]} == {"added"} and doc["write"]["checksums_added"] == 0
    # the generator's digests, in its order (sha256, then xxh3), on every weight a load reads
    original, digested = ({t.name: list(t.metadata_props) for t in onnx.load(str(p), load_external_data=False)
                           .graph.initializer} for p in (tiny_llm_path, bare))
    assert len(doc["tensors"]) == 44 and all(digested[t["name"]] == original[t["name"]] for t in doc["tensors"])
    assert all(d.load_digest == d.fast_digest and d.fast_digest.startswith("xxh3:")
               for d in resolve_model(bare).manifest)


def test_the_digested_model_gives_identical_outputs_in_onnx_runtime(bare, tmp_path):
    ort_or_skip()
    from onnx_prep.core.decode.decoder_io import DecoderIO
    from onnx_prep.core.decode.generation import greedy_decode
    from onnx_prep.core.decode.ort_runner import OrtRunner

    prompt = np.array([[1, 2, 3, 4]])
    io = DecoderIO.from_model(bare)
    before = greedy_decode(OrtRunner(bare, threads=1), io, prompt, 3, keep_logits=True)
    digest_model(bare, write=True)
    after = greedy_decode(OrtRunner(bare, threads=1), io, prompt, 3, keep_logits=True)
    assert np.array_equal(after.tokens, before.tokens)
    for a, b in zip(after.logits, before.logits):
        assert np.array_equal(a, b)


def test_a_changed_byte_after_digest_write_fails_the_read(bare):
    digest_model(bare, write=True)
    d = resolve_model(bare).weights["lm_head.scales"]
    with open(bare.parent / DATA, "r+b") as f:
        f.seek(d.offset + 7)
        byte = f.read(1)
        f.seek(d.offset + 7)
        f.write(bytes([byte[0] ^ 0x01]))

    resolved = resolve_model(bare)
    with pytest.raises(DigestError) as ei:
        ExternalDataReader.for_model(resolved).read(resolved.weights["lm_head.scales"])
    assert "tensor 'lm_head.scales'" in str(ei.value) and f"offset {d.offset}" in str(ei.value)
    # digest itself refuses it too, naming both digests, and writes nothing
    st = os.stat(bare)
    with pytest.raises(DigestError) as ei:
        digest_model(bare, write=True)
    text = str(ei.value)
    assert f"recorded {d.digest}" in text and "computed sha256:" in text
    assert "tensor 'lm_head.scales'" in text and f"file {DATA}" in text and f"offset {d.offset}" in text
    assert os.stat(bare).st_mtime_ns == st.st_mtime_ns


def test_a_changed_padding_byte_fails_the_file_checksum(bare, tiny_llm_path):
    """Bytes between tensors belong to no tensor: only the whole file's SHA-1 sees them."""
    shutil.copy(tiny_llm_path, bare)
    strip_digests(bare, checksum=False)  # only the checksum left
    spans = sorted((d.offset, d.offset + d.length) for d in resolve_model(bare).manifest)
    gap = next(hi for (_, hi), (lo, _) in zip(spans, spans[1:]) if lo > hi)
    with open(bare.parent / DATA, "r+b") as f:
        f.seek(gap)
        f.write(b"\x01")

    with pytest.raises(DigestError) as ei:
        digest_model(bare)
    text = str(ei.value)
    assert "data file bytes do not match their recorded checksum" in text
    assert f"file {DATA}" in text and "offset 0" in text and "recorded sha1:" in text and "computed sha1:" in text


@pytest.mark.parametrize("chunk", [1, 4095, 4096, 100_003, 1 << 20])
def test_one_pass_hashes_every_tensor_whatever_the_chunk_boundaries(bare, chunk):
    resolved = resolve_model(bare)
    reader = ExternalDataReader.for_model(resolved)
    descs = list(resolved.manifest)
    if chunk == 1:  # byte by byte is slow in Python: the first tensors' range only
        descs = descs[:3]
    sizes = []
    with ThreadPoolExecutor(1) as pool:  # the file's sha1 on a second thread, as compute_digests runs it
        one_pass = weight_digests._FilePass(descs, sizes.append, pool if chunk > 1 else None)
        st = reader.scan_file(DATA, one_pass.visit, chunk=chunk) if chunk > 1 else None
    if chunk == 1:
        data = (bare.parent / DATA).read_bytes()[:max(d.offset + d.length for d in descs)]
        for i in range(len(data)):
            one_pass.visit(i, memoryview(data[i:i + 1]))
    raw = (bare.parent / DATA).read_bytes()
    for d in descs:
        tensor = raw[d.offset:d.offset + d.length]
        assert one_pass.hashers[d.name][TENSOR_DIGEST_KEY].digest() == "sha256:" + hashlib.sha256(tensor).hexdigest()
        assert one_pass.hashers[d.name][TENSOR_FAST_DIGEST_KEY].digest() == digest_of(tensor)
    if st is not None:
        assert max(sizes) <= chunk and sum(sizes) == len(raw) == st.st_size
        assert one_pass.sha1.hexdigest() == hashlib.sha1(raw).hexdigest()
        assert reader.counters.bytes_read == len(raw)


def test_overlapping_tensors_each_get_their_own_digest(bare):
    """Two initializers may alias bytes of one file; each digest covers its own range."""
    resolved = resolve_model(bare)
    d = next(iter(resolved.manifest))
    alias = dataclasses.replace(d, name="alias", offset=d.offset + 64, length=d.length - 64)
    one_pass = weight_digests._FilePass([d, alias], None)
    ExternalDataReader.for_model(resolved).scan_file(d.file, one_pass.visit, chunk=1000)
    raw = (bare.parent / DATA).read_bytes()
    for t in (alias, d):
        tensor = raw[t.offset:t.offset + t.length]
        assert one_pass.hashers[t.name][TENSOR_DIGEST_KEY].digest() == "sha256:" + hashlib.sha256(tensor).hexdigest()
        assert one_pass.hashers[t.name][TENSOR_FAST_DIGEST_KEY].digest() == digest_of(tensor)


def test_scan_file_refuses_a_file_the_manifest_does_not_name_and_one_that_changes(bare):
    resolved = resolve_model(bare)
    reader = ExternalDataReader.for_model(resolved)
    (bare.parent / "other.data").write_bytes(b"x" * 10)
    with pytest.raises(ExternalDataError, match="no tensor of the payload manifest"):
        reader.scan_file("other.data", lambda pos, view: None)

    def grow(pos, view):  # the file changes during the scan (another writer)
        if pos == 0:
            with open(bare.parent / DATA, "ab") as f:
                f.write(b"\0")

    with pytest.raises(ExternalDataError, match="changed while it was read"):
        reader.scan_file(DATA, grow)


def test_a_data_file_changed_between_hashing_and_writing_is_not_written(bare):
    digests = compute_digests(bare)
    os.utime(bare.parent / DATA, ns=(1, 1))  # same bytes, but not provably the same file any more
    before = bare.read_bytes()
    with pytest.raises(UsageError, match="data file changed while its digests were computed"):
        write_digests(digests)
    assert bare.read_bytes() == before


def test_a_model_file_changed_between_hashing_and_writing_is_not_replaced(bare):
    digests = compute_digests(bare)
    strip_digests(bare)  # rewritten meanwhile (same content, new file)
    before = bare.read_bytes()
    with pytest.raises(UsageError, match="model file changed while its digests were computed"):
        write_digests(digests)
    assert bare.read_bytes() == before


def test_a_protobuf_over_2_gib_is_refused_before_anything_is_written(bare, monkeypatch):
    """Building a real 2 GiB protobuf takes minutes and 4+ GiB of memory: the limit is
    lowered instead; the check and its message are the real ones."""
    monkeypatch.setattr(weight_digests, "PROTOBUF_LIMIT", bare.stat().st_size)
    before = bare.read_bytes()
    with pytest.raises(UsageError, match="over protobuf's 2 GiB limit"):
        digest_model(bare, write=True)
    assert bare.read_bytes() == before and sorted(p.name for p in bare.parent.iterdir()) == sorted([DATA, bare.name])


def test_a_symlinked_model_is_not_replaced_in_place(bare, tmp_path):
    link = bare.parent / "link.onnx"
    link.symlink_to(bare.name)
    with pytest.raises(UsageError, match="model file is a symlink"):
        digest_model(link, write=True)
    assert link.is_symlink()


def test_inline_and_unused_initializers_get_no_sha256_and_are_counted(tmp_path):
    """An inline initializer's bytes live in the protobuf; an unused external one is
    never read (resolution prunes it): both counted, neither given a sha256; the unused
    one's entry still gains its file's checksum."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.arange(1024, dtype=np.float32).reshape(32, 32)
    u = np.full(16, 7, np.float32)
    (tmp_path / "w.bin").write_bytes(w.tobytes() + u.tobytes())

    def external(name, arr, offset):
        t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=arr.shape, data_location=TensorProto.EXTERNAL)
        for key, value in (("location", "w.bin"), ("offset", str(offset)), ("length", str(arr.nbytes))):
            t.external_data.add(key=key, value=value)
        return t

    bias = numpy_helper.from_array(np.ones(32, np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y0"]), helper.make_node("Add", ["y0", "b"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])],
        [external("w", w, 0), bias, external("u", u, w.nbytes)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, str(tmp_path / "m.onnx"))

    doc = digest_model(tmp_path / "m.onnx", write=True)

    assert doc["totals"]["inline"] == 1 and doc["totals"]["unused"] == 1
    assert [t["name"] for t in doc["tensors"]] == ["w"]
    assert doc["tensors"][0]["sha256"] == "sha256:" + hashlib.sha256(w.tobytes()).hexdigest()
    assert doc["files"][0]["entries"] == 2 and doc["write"]["checksums_added"] == 2
    saved = {t.name: t for t in onnx.load(str(tmp_path / "m.onnx"), load_external_data=False).graph.initializer}
    assert [(p.key, p.value) for p in saved["w"].metadata_props] == [
        (TENSOR_DIGEST_KEY, doc["tensors"][0]["sha256"]), (TENSOR_FAST_DIGEST_KEY, digest_of(w.tobytes()))]
    assert not saved["b"].metadata_props and not saved["u"].metadata_props
    sha1 = hashlib.sha1((tmp_path / "w.bin").read_bytes()).hexdigest()
    assert ("checksum", sha1) in [(e.key, e.value) for e in saved["u"].external_data]


def test_onnx_and_onnx_runtime_load_a_model_whose_checksum_is_wrong(bare):
    """What docs/digest.md says of the ONNX ``checksum``: neither ONNX Runtime nor onnx
    checks it (only onnx-prep's reader does), so a wrong one loads there unnoticed."""
    ort = ort_or_skip()
    digest_model(bare, write=True)
    m = onnx.load(str(bare), load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "checksum":
                e.value = "0" * 40
        del t.metadata_props[:]
    onnx.save(m, str(bare))

    ort.InferenceSession(str(bare), providers=["CPUExecutionProvider"])
    onnx.checker.check_model(str(bare), full_check=True)
    assert onnx.load(str(bare)).graph.initializer[0].raw_data  # the data loads too
    with pytest.raises(DigestError, match="recorded checksum"):
        digest_model(bare)
