"""The prepared cache's manifest: golden bytes pin the writer, and every validation rule
of docs/cache-format.md is a crafted manifest that fails with its named reason."""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import onnx
import pytest

from onnx_prep.core.cache import manifest as mf
from onnx_prep.core.cache.cache_writer import CacheWriter
from onnx_prep.core.cache.payload_digest import payload_digest_of
from onnx_prep.core.cache.manifest import (
    CacheEntry,
    CacheFormatError,
    SourceRecord,
    decode_manifest,
    encode_manifest,
    read_manifest,
)

D1 = "sha256:" + "1" * 64
D2 = "sha256:" + "2" * 64


def identity(name: str, layout: str = "int4mm.v1.bs32") -> CacheEntry:
    return CacheEntry(key=f"P:{name}|{layout}|cpu", file="", offset=0, length=0, payload_digest="",
                      lineage_digest=D1, source_lineage=(name,), layout=layout, device="cpu",
                      kernel_abi="onnx_prep.native/pack-v1/little-endian/64-bit", format_version=1)


@pytest.fixture
def cache(tmp_path):
    """A real two-entry cache written by the writer: (folder, manifest bytes)."""
    w = CacheWriter(tmp_path, "m", "m.prepared.onnx")
    w.append(identity("a"), np.arange(5000, dtype=np.uint8))
    w.append(identity("b"), np.full(100, 7, dtype=np.uint8))
    live, added = w.commit(source_model_digest=D2, sources={"a": SourceRecord(D1, 22, (8, 2, 16))},
                           keep=lambda e: True, wanted=lambda new, old: True)
    return tmp_path, (tmp_path / "m.prepared.onnx").read_bytes()


def test_golden_bytes_pin_the_writer(cache):
    folder, data = cache
    # Equal caches are equal files: entries sorted by key, no timestamps. A change to the
    # format changes these digests: bump CACHE_FORMAT_VERSION and docs/cache-format.md.
    assert hashlib.sha256(data).hexdigest() == GOLDEN_MANIFEST
    payload = (folder / "m.prepared.g1.data").read_bytes()
    assert len(payload) == 8192 + 100  # the second entry starts on a 4 KiB boundary
    assert hashlib.sha256(payload).hexdigest() == GOLDEN_PAYLOAD
    m = read_manifest(folder / "m.prepared.onnx")
    assert [(e.key, e.offset, e.length) for e in m.entries] == [
        ("P:a|int4mm.v1.bs32|cpu", 0, 5000), ("P:b|int4mm.v1.bs32|cpu", 8192, 100)]
    assert m.entries[0].payload_digest == payload_digest_of(np.arange(5000, dtype=np.uint8))
    assert [e.payload_digest for e in m.entries] == ["xxh3:1b74bda2c82a8c7a", "xxh3:8d386492dd512dcd"]
    assert m.format_version == mf.CACHE_FORMAT_VERSION == 3
    assert sorted(os.listdir(folder)) == ["m.prepared.g1.data", "m.prepared.lock", "m.prepared.onnx"]


# Version 3 (xxh3 payload digests); the same manifest at version 2 with xxh64 digests
# was 6e72a43623c6b3f4d34683fc9e551fe975f3e7d1d77ae4100b727feae8f8d10f.
GOLDEN_MANIFEST = "cc2a3ec331aa89a4b55394ebd9a6272e9e982dfe73042dce4d7a095228cc2706"
GOLDEN_PAYLOAD = "15c087254e06f1136d1ec04144eec9de5db55e3991d8272b4589e71dc25350a3"


def _model(data: bytes) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.ParseFromString(data)
    return m


def _prop(props, key):
    return next(p for p in props if p.key == key)


def _t(m, i=0):
    return m.graph.initializer[i]


# each case: (reason, a change to the parsed manifest)
CASES = {
    "format_version": lambda m: setattr(_prop(m.metadata_props, mf.META_FORMAT), "value", "4"),
    "missing_field": lambda m: m.metadata_props.remove(_prop(m.metadata_props, mf.META_GENERATION)),
    "bad_number:space": lambda m: setattr(_prop(m.metadata_props, mf.META_GENERATION), "value", " 1"),
    "bad_number:arabic": lambda m: setattr(_prop(_t(m).external_data, "offset"), "value", "\u0660"),
    "bad_number:sign": lambda m: setattr(_prop(_t(m).external_data, "length"), "value", "-5"),
    "bad_number:huge": lambda m: setattr(_prop(_t(m).external_data, "length"), "value", "9" * 20),
    "bad_digest": lambda m: setattr(_prop(_t(m).metadata_props, mf.T_PAYLOAD_DIGEST), "value", "sha256:xyz"),
    "duplicate_key": lambda m: _t(m).external_data.add(key="offset", value="0"),
    "value_too_long": lambda m: setattr(_prop(_t(m).metadata_props, mf.T_LAYOUT), "value", "x" * (mf.MAX_TEXT + 1)),
    "bad_sources": lambda m: setattr(_prop(m.metadata_props, mf.META_SOURCES), "value", "[1, 2]"),
    "has_nodes": lambda m: m.graph.node.add(op_type="Identity"),
    "duplicate_entry": lambda m: m.graph.initializer.append(_t(m)),
    "bad_name": lambda m: setattr(_t(m), "name", "packed/P:a|int4mm.v1.bs32|cpu"),
    "bad_tensor": lambda m: setattr(_t(m), "data_type", onnx.TensorProto.INT8),
    "not_external": lambda m: setattr(_t(m), "raw_data", b"\x00" * 8),
    "unknown_key": lambda m: _t(m).external_data.add(key="basepath", value="/etc"),
    "bad_location:parent": lambda m: setattr(_prop(_t(m).external_data, "location"), "value", "../x.data"),
    "bad_location:folder": lambda m: setattr(_prop(_t(m).external_data, "location"), "value", "sub/x.data"),
    "bad_location:absolute": lambda m: setattr(_prop(_t(m).external_data, "location"), "value", "/etc/passwd"),
    "misaligned": lambda m: setattr(_prop(_t(m, 1).external_data, "offset"), "value", "4000"),
    "length_mismatch": lambda m: _t(m).dims.__setitem__(0, 4999),
    "bad_lineage": lambda m: setattr(_prop(_t(m).metadata_props, mf.T_LINEAGE), "value", '{"a": 1}'),
    "key_mismatch": lambda m: setattr(_prop(_t(m).metadata_props, mf.T_LAYOUT), "value", "other"),
    "unknown_encoding": lambda m: (_t(m).metadata_props.add(key=mf.T_ENCODING, value="lz4"),
                                   _t(m).metadata_props.add(key=mf.T_DECODED_LENGTH, value="5000")),
    "overlap": lambda m: (setattr(_prop(_t(m, 1).external_data, "offset"), "value", "0")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_rule_fails_with_its_named_reason(cache, case):
    folder, data = cache
    m = _model(data)
    CASES[case](m)
    with pytest.raises(CacheFormatError) as info:
        decode_manifest(m.SerializeToString(), folder)
    assert info.value.reason == case.split(":")[0]
    assert "\n" not in str(info.value)


def test_bytes_that_are_not_a_protobuf_are_unparseable(cache):
    folder, _ = cache
    with pytest.raises(CacheFormatError) as info:
        decode_manifest(b"\x0a\xff\xff\xff\xff\x0f", folder)
    assert info.value.reason == "unparseable"


def test_a_manifest_over_the_size_cap_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "m.prepared.onnx"
    with open(path, "wb") as f:  # sparse: costs no disk
        f.truncate(mf.MAX_MANIFEST_BYTES + 1)
    with pytest.raises(CacheFormatError) as info:
        read_manifest(path)
    assert info.value.reason == "too_large"


def test_a_manifest_that_is_not_a_regular_file_is_refused(tmp_path):
    os.mkfifo(tmp_path / "m.prepared.onnx")  # would block a naive reader forever
    with pytest.raises(CacheFormatError) as info:
        read_manifest(tmp_path / "m.prepared.onnx")
    assert info.value.reason == "not_a_file"


def test_too_many_entries_are_refused_before_any_is_decoded(cache, monkeypatch):
    folder, data = cache
    monkeypatch.setattr(mf, "MAX_ENTRIES", 1)
    with pytest.raises(CacheFormatError) as info:
        decode_manifest(data, folder)
    assert info.value.reason == "too_many_entries"


def test_no_manifest_is_none(tmp_path):
    assert read_manifest(tmp_path / "m.prepared.onnx") is None


@pytest.mark.parametrize("damage,reason", [("delete", "missing_file"), ("truncate", "truncated")])
def test_a_damaged_payload_file_spoils_its_entries_only(cache, damage, reason):
    folder, data = cache
    payload = folder / "m.prepared.g1.data"
    if damage == "delete":
        payload.unlink()
    else:
        os.truncate(payload, 8192 + 50)  # cuts the second entry only
    m = read_manifest(folder / "m.prepared.onnx")
    assert {d.reason for d in m.damaged} == {reason}
    if damage == "truncate":
        assert [e.key for e in m.entries] == ["P:a|int4mm.v1.bs32|cpu"]
        assert [d.entry.key for d in m.damaged] == ["P:b|int4mm.v1.bs32|cpu"]
    else:
        assert not m.entries and len(m.damaged) == 2


def test_the_sources_record_round_trips(cache):
    folder, data = cache
    m = read_manifest(folder / "m.prepared.onnx")
    assert m.sources == {"a": SourceRecord(D1, 22, (8, 2, 16))}
    assert m.source_model_digest == D2 and m.generation == 1
    assert json.loads(_prop(_model(data).metadata_props, mf.META_SOURCES).value) == {
        "a": {"digest": D1, "onnx_type": 22, "dims": [8, 2, 16]}}
    assert encode_manifest(m) == data  # decode . encode is the identity


def _one_entry_writer(folder) -> CacheWriter:
    w = CacheWriter(folder, "m", "m.prepared.onnx")
    w.append(identity("a"), np.arange(5000, dtype=np.uint8))
    return w


def _commit(w: CacheWriter):
    return w.commit(source_model_digest=D2, sources={}, keep=lambda e: True, wanted=lambda new, old: True)


def test_a_commit_refuses_a_folder_at_the_manifest_path_and_leaves_nothing(tmp_path):
    """A folder that appears where the manifest goes after the cache was opened: the
    commit refuses before it renames anything, and the writer's temporary file goes."""
    from onnx_prep.core.cache.cache_writer import CacheWriteError

    w = _one_entry_writer(tmp_path)
    (tmp_path / "m.prepared.onnx").mkdir()
    with pytest.raises(CacheWriteError) as info:
        _commit(w)
    line = info.value.one_line()
    assert "is a directory, not a manifest" in line and f"file {tmp_path / 'm.prepared.onnx'}" in line
    w.discard()
    assert os.listdir(tmp_path) == ["m.prepared.onnx"]


def test_a_commit_that_fails_after_renaming_its_payloads_takes_them_back(tmp_path, monkeypatch):
    """A publish that fails late (the manifest's rename): neither the manifest's
    temporary file nor the renamed generation is left; the live cache is as it was."""
    from onnx_prep.core.cache import cache_writer

    first = _one_entry_writer(tmp_path)
    _commit(first)
    before = {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)}
    w = _one_entry_writer(tmp_path)
    rename = os.rename

    def failing_rename(src, dst):
        if str(dst).endswith(".prepared.onnx"):
            raise OSError(5, "Input/output error")
        return rename(src, dst)

    monkeypatch.setattr(cache_writer.os, "rename", failing_rename)
    with pytest.raises(cache_writer.CacheWriteError):
        _commit(w)
    monkeypatch.undo()
    w.discard()
    assert {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)} == before


def test_a_failed_payload_rename_leaves_no_temporary_file(tmp_path):
    """The generation's file name taken by a folder: the rename fails, and the
    temporary payload file is removed by the discard that follows a failed commit."""
    from onnx_prep.core.cache.cache_writer import CacheWriteError

    w = _one_entry_writer(tmp_path)
    (tmp_path / "m.prepared.g1.data").mkdir()
    (tmp_path / "m.prepared.g1.data" / "x").write_text("keeps the folder from being replaced")
    with pytest.raises(CacheWriteError):
        _commit(w)
    w.discard()
    assert sorted(os.listdir(tmp_path)) == ["m.prepared.g1.data", "m.prepared.lock"]


def test_a_symlinked_manifest_is_refused_unless_trusted_then_read_beside_its_target(cache, tmp_path_factory):
    folder, data = cache
    elsewhere = tmp_path_factory.mktemp("checkout")
    link = elsewhere / "m.prepared.onnx"
    link.symlink_to(folder / "m.prepared.onnx")
    with pytest.raises(CacheFormatError) as info:
        read_manifest(link)
    assert info.value.reason == "symlink" and "--trust-symlinks" in info.value.one_line()
    m = read_manifest(link, trust_symlinks=True)  # its payloads are in the target's folder, not the link's
    assert [e.key for e in m.entries] == ["P:a|int4mm.v1.bs32|cpu", "P:b|int4mm.v1.bs32|cpu"] and not m.damaged
    assert mf.payload_folder(link, trust_symlinks=True) == folder.resolve() and mf.payload_folder(link) == elsewhere
