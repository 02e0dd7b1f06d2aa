"""The one external-data reader (core/io/external_data.py): manifest-only reads, counters,
hooks, path containment checked on every open, bounds, mapping."""
from __future__ import annotations

import dataclasses
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import example, given, strategies as st

from onnx_prep.core.errors import DigestError, ExternalDataError, UnsafePathError, Where
from onnx_prep.core.io.external_data import ExternalDataReader, check_location
from onnx_prep.core.model.resolution import resolve_model

from test_resolve_models import DATA, qdq_matmul_model, single_weight_model, tied_int4_model


@pytest.fixture
def tied(tmp_path):
    r = resolve_model(tied_int4_model(tmp_path))
    return r, ExternalDataReader.for_model(r)


def test_reads_equal_onnx_loader_and_are_counted(tied):
    r, reader = tied
    full = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(r.model_path)).graph.initializer}
    for d in r.manifest:
        raw = reader.read(d)
        assert raw.dtype == np.uint8 and raw.shape == (d.length,) and raw.flags.writeable
        np.testing.assert_array_equal(reader.read_array(d), full[d.name])
    c = reader.counters.snapshot()
    assert c["bytes_read"] == 2 * r.manifest.total_bytes and c["reads"] == 2 * len(r.manifest)
    assert c["per_tensor"] == {d.name: 2 * d.length for d in r.manifest}
    other = ExternalDataReader.for_model(r)  # counters are per reader, none process-wide
    other.read(next(iter(r.manifest)))
    assert reader.counters.snapshot()["bytes_read"] == c["bytes_read"]


def test_read_returns_a_fresh_buffer_each_time(tied):
    r, reader = tied
    d = r.manifest.entries[0]
    a, b = reader.read(d), reader.read(d)
    a[:] = 0
    assert b.any() and not np.shares_memory(a, b)


def test_int4_stays_packed_and_shaped_by_rows(tmp_path):
    r = resolve_model(qdq_matmul_model(tmp_path))
    reader = ExternalDataReader.for_model(r)
    w = r.manifest.get("W")
    arr = reader.read_array(w)
    assert arr.dtype == np.uint8 and arr.shape == (64, 16)  # int4 [64, 32] -> 16 bytes a row
    tensor = next(t for t in onnx.load(str(r.model_path)).graph.initializer if t.name == "W")
    assert arr.tobytes() == tensor.raw_data  # onnx's loader: the same packed bytes


def test_refuses_reads_outside_the_manifest(tmp_path):
    r = resolve_model(tied_int4_model(tmp_path))
    reader = ExternalDataReader.for_model(r)
    model = onnx.load(str(r.model_path), load_external_data=False)
    dead = next(t for t in model.graph.initializer if t.name == "dead.weight")  # pruned
    offset = int(next(e.value for e in dead.external_data if e.key == "offset"))
    desc = dataclasses.replace(r.manifest.get("W"), name="dead.weight", offset=offset, length=64)
    with pytest.raises(ExternalDataError, match="not in the payload manifest"):
        reader.read(desc)
    moved = dataclasses.replace(r.manifest.get("W"), offset=4096)  # same name, other bytes
    with pytest.raises(ExternalDataError, match="not in the payload manifest"):
        reader.read(moved)
    with pytest.raises(ExternalDataError, match="inline"):
        reader.read(r.weights["shape_bsh"])
    assert reader.counters.snapshot()["reads"] == 0


def test_before_read_hook_can_block_and_raise(tied):
    r, reader = tied
    d = r.manifest.entries[0]
    entered, release, done = threading.Event(), threading.Event(), threading.Event()
    result = {}

    def blocking(desc):
        entered.set()
        release.wait()

    reader.hooks.before_read = blocking

    def worker():
        result["data"] = reader.read(d)
        done.set()

    t = threading.Thread(target=worker)
    t.start()
    assert entered.wait(10)
    assert not done.is_set() and reader.counters.reads == 0  # held before any byte is read
    release.set()
    assert done.wait(10)
    t.join()
    assert result["data"].size == d.length and reader.counters.reads == 1

    class Injected(RuntimeError):
        pass

    def failing(desc):
        raise Injected(desc.name)

    reader.hooks.before_read = failing
    with pytest.raises(Injected, match=d.name):
        reader.read(d)
    assert reader.counters.reads == 1


def test_concurrent_reads_count_exactly(tied):
    r, reader = tied
    entries = list(r.manifest)
    n_threads, rounds = 8, 20
    errors = []

    def worker():
        try:
            for _ in range(rounds):
                for d in entries:
                    assert reader.read(d).size == d.length
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    c = reader.counters.snapshot()
    assert c["reads"] == n_threads * rounds * len(entries)
    assert c["bytes_read"] == n_threads * rounds * r.manifest.total_bytes


def test_map_is_zero_copy_read_only_and_counted_apart(tied):
    r, reader = tied
    for d in r.manifest:
        m = reader.map(d)
        assert not m.flags.writeable
        np.testing.assert_array_equal(m, reader.read(d))
    c = reader.counters.snapshot()
    assert c["maps"] == len(r.manifest) and c["bytes_mapped"] == r.manifest.total_bytes
    assert c["bytes_read"] == r.manifest.total_bytes  # only the comparison reads


def test_map_shared_is_one_zero_copy_mapping_counted_and_hooked(tied):
    r, reader = tied
    seen = []
    reader.hooks.before_read = seen.append
    views = {d.name: reader.map_shared(d, populate=True) for d in r.manifest}
    reader.hooks.before_read = None
    assert [d.name for d in seen] == [d.name for d in r.manifest]  # the hook runs per tensor
    # One mapping of the one data file: every view sits at its file offset from one base.
    assert len({views[d.name].ctypes.data - d.offset for d in r.manifest if d.length}) == 1
    for d in r.manifest:
        assert not views[d.name].flags.writeable
        np.testing.assert_array_equal(views[d.name], reader.read(d))
    c = reader.counters.snapshot()
    assert c["maps"] == len(r.manifest) and c["bytes_mapped"] == r.manifest.total_bytes
    assert c["bytes_read"] == r.manifest.total_bytes  # only the comparison reads


def _rss_file_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no RssFile in /proc/self/status")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="RSS checked through Linux /proc")
def test_release_shared_drops_the_pages_and_the_bytes_stay_readable(tiny_llm_path):
    r = resolve_model(tiny_llm_path)
    reader = ExternalDataReader.for_model(r)
    d = max(r.manifest, key=lambda d: d.length)
    assert d.length >= 2 << 20
    before = _rss_file_bytes()
    v = reader.map_shared(d, populate=True)
    populated = _rss_file_bytes()
    assert populated - before >= d.length // 2  # mapped in by the call, before any touch
    reader.release_shared(d)
    assert populated - _rss_file_bytes() >= d.length // 2  # gone from this process
    np.testing.assert_array_equal(v, reader.read(d))  # a later touch refaults the same bytes


def test_read_into_fills_a_given_buffer(tied):
    r, reader = tied
    d = r.manifest.get("W")
    out = np.zeros(d.length, dtype=np.uint8)
    reader.read_into(d, out)
    np.testing.assert_array_equal(out, reader.read(d))
    with pytest.raises(ValueError):
        reader.read_into(d, np.zeros(d.length + 1, dtype=np.uint8))


def test_verify_detects_changed_bytes(tmp_path):
    r = resolve_model(single_weight_model(tmp_path))
    d = r.manifest.entries[0]
    reader = ExternalDataReader.for_model(r)
    reader.read(d, verify=True)
    with open(tmp_path / DATA, "r+b") as f:
        f.seek(d.offset)
        f.write(b"\xff")
    with pytest.raises(DigestError, match="do not match") as e:
        reader.read(d, verify=True)
    assert (e.value.where.tensor, e.value.where.file, e.value.where.offset) == ("W", DATA, d.offset)


# ---------------------------------------------- path rules, enforced at every open

def _resolved_single(tmp_path: Path):
    r = resolve_model(single_weight_model(tmp_path))
    return r, ExternalDataReader.for_model(r), r.manifest.entries[0]


def test_symlink_swapped_in_after_resolution_is_refused(tmp_path):
    r, reader, d = _resolved_single(tmp_path / "m")
    data = tmp_path / "m" / DATA
    outside = tmp_path / "outside.bin"
    shutil.move(data, outside)
    os.symlink(outside, data)
    with pytest.raises(UnsafePathError, match="symlink") as e:
        reader.read(d)
    assert e.value.where.file == DATA and e.value.where.tensor == "W"
    assert reader.counters.reads == 0


def test_parent_folder_symlink_is_refused(tmp_path):
    src = single_weight_model(tmp_path / "src")
    model = onnx.load(str(src), load_external_data=False)
    for e in model.graph.initializer[0].external_data:
        if e.key == "location":
            e.value = "sub/" + DATA
    m = tmp_path / "m"
    m.mkdir()
    onnx.save(model, str(m / "model.onnx"))
    real = tmp_path / "elsewhere"
    real.mkdir()
    shutil.copy2(src.with_name(DATA), real / DATA)
    os.symlink(real, m / "sub")
    with pytest.raises(UnsafePathError, match=r"through a symlink \(sub\)"):
        resolve_model(m / "model.onnx")
    # The reader refuses the same path at open time even given a trusted resolution.
    r = resolve_model(m / "model.onnx", trust_symlinks=True)
    with pytest.raises(UnsafePathError, match="symlink"):
        ExternalDataReader.for_model(r).read(r.manifest.entries[0])
    assert ExternalDataReader.for_model(r, trust_symlinks=True).read(r.manifest.entries[0]).size == 32


def test_hard_linked_data_file_is_refused_unless_trusted(tmp_path):
    r, reader, d = _resolved_single(tmp_path / "m")
    os.link(tmp_path / "m" / DATA, tmp_path / "alias.bin")
    with pytest.raises(UnsafePathError, match="2 hard links"):
        reader.read(d)
    with pytest.raises(UnsafePathError, match="hard links"):
        resolve_model(r.model_path)
    trusted = ExternalDataReader.for_model(r, trust_symlinks=True)
    assert trusted.read(d).size == d.length


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_fifo_is_refused_without_blocking(tmp_path):
    r, reader, d = _resolved_single(tmp_path / "m")
    (tmp_path / "m" / DATA).unlink()
    os.mkfifo(tmp_path / "m" / DATA)
    with pytest.raises(UnsafePathError, match="not a regular file"):
        reader.read(d)
    with pytest.raises(UnsafePathError, match="not a regular file"):
        resolve_model(r.model_path)


def _read_by(reader, how: str, d):
    """One of the reader's ways to get a tensor's bytes, by name."""
    if how == "read_into":
        return reader.read_into(d, np.empty(d.length, np.uint8))
    if how.startswith("map_shared"):
        return reader.map_shared(d, populate=how.endswith("populate"))
    return getattr(reader, how)(d)


READ_PATHS = ["read", "read_into", "read_array", "map", "map_shared", "map_shared_populate"]


@pytest.mark.parametrize("how", READ_PATHS)
def test_file_truncated_after_resolution_fails_the_read_with_bounds(tmp_path, how):
    """Every read path checks the tensor's range against the file as opened: one byte
    short gives the bounds error, naming model, tensor, file and offset and the size the
    file has now (not pread's short read, mmap's ValueError or a SIGBUS on touch)."""
    r, reader, d = _resolved_single(tmp_path / "m")
    size = d.offset + d.length - 1
    os.truncate(tmp_path / "m" / DATA, size)
    with pytest.raises(ExternalDataError, match=rf"run past the end of the file \({size} bytes\)") as e:
        _read_by(reader, how, d)
    assert (e.value.where.tensor, e.value.where.file, e.value.where.offset) == ("W", DATA, d.offset)
    assert f"tensor 'W', file {DATA}, offset {d.offset}" in str(e.value)
    c = reader.counters.snapshot()
    assert (c["reads"], c["maps"]) == (0, 0)  # nothing counted for a refused read


@pytest.mark.parametrize("how", ["map_shared", "map_shared_populate"])
def test_mapped_tensor_past_the_end_of_a_file_cut_after_resolution(tmp_path, how):
    """The shared mapping is made from the file as it is at the first map: a later
    tensor whose range runs past the (truncated) end is refused with the bounds error,
    while the tensors still inside the file map and read as before."""
    src = resolve_model(tied_int4_model(tmp_path / "m"))
    ref = {d.name: ExternalDataReader.for_model(src).read(d) for d in src.manifest}
    r = resolve_model(src.model_path)
    reader = ExternalDataReader.for_model(r)
    descs = sorted((d for d in r.manifest if d.length), key=lambda d: d.offset)
    first, last = descs[0], descs[-1]
    assert first.offset + first.length < last.offset
    os.truncate(tmp_path / "m" / last.file, last.offset + last.length // 2)
    np.testing.assert_array_equal(_read_by(reader, how, first), ref[first.name])
    with pytest.raises(ExternalDataError, match="run past the end of the file") as e:
        _read_by(reader, how, last)
    assert (e.value.where.tensor, e.value.where.file, e.value.where.offset) == (last.name, last.file, last.offset)
    assert reader.counters.snapshot()["maps"] == 1


@pytest.mark.parametrize("populate", [True, False], ids=["populate", "lazy"])
def test_file_truncated_after_it_was_mapped_fails_with_bounds_not_a_crash(tiny_llm_path, tmp_path, populate):
    """The shared mapping outlives single reads: a data file cut short afterwards gives
    the bounds error (and no SIGBUS) on the next map of a tensor past its new end,
    populating or not (a lazy view would fault on its first touch)."""
    shutil.copytree(tiny_llm_path.parent, tmp_path / "m")
    r = resolve_model(tmp_path / "m" / tiny_llm_path.name)
    reader = ExternalDataReader.for_model(r)
    descs = sorted(r.manifest, key=lambda d: d.offset)
    reader.map_shared(descs[0], populate=True)  # the file's mapping exists from here on
    last = descs[-1]
    os.truncate(tmp_path / "m" / last.file, descs[len(descs) // 2].offset)
    with pytest.raises(ExternalDataError, match="run past the end of the file") as e:
        reader.map_shared(last, populate=populate)
    assert (e.value.where.tensor, e.value.where.offset) == (last.name, last.offset)


def test_reader_accepts_only_a_payload_manifest(tmp_path):
    with pytest.raises(TypeError, match="PayloadManifest"):
        ExternalDataReader(tmp_path, [])  # type: ignore[arg-type]


_component = st.sampled_from(["a", "b.bin", ".", "..", "", "x y", "..."])


# The '..' forms a path check most often gets wrong, always tried (a random draw of
# components finds some of them only now and then): alone, inside, after '.', repeated.
@example([".."], "/", "")
@example(["a", "..", "b"], "/", "")
@example([".", ".."], "/", "")
@example(["a", ".", "..", ".."], "/", "")
@example(["a", ".."], "/", "")
@example(["..", "a"], "/", "")
@example(["a", "", "..", "b"], "/", "")
@example(["a", "..", "b"], "\\", "")
@example([".", "..", "b.bin"], "\\", "")
@example(["a", "b", "..", "..", ".."], "/", "")
@given(st.lists(_component, min_size=1, max_size=6), st.sampled_from(["/", "\\"]),
       st.sampled_from(["", "/", "\\", "C:", "c:\\"]))
def test_check_location_refuses_exactly_absolute_and_dotdot(parts, sep, prefix):
    location = prefix + sep.join(parts)
    named = [p for p in parts if p not in ("", ".")]
    where = Where(file=location)
    if prefix or location.startswith(("/", "\\")) or ".." in named or not named:
        with pytest.raises(UnsafePathError):
            check_location(location, where)
    else:
        assert check_location(location, where) == tuple(named)
