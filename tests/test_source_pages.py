"""Source pages: a load can drop each source tensor from the page cache once it is
prepacked (``Session(source_pages=...)``, ``ExternalDataReader.drop_cached``), checked
against the kernel's own residency (mincore over a mapping of the data file)."""
from __future__ import annotations

import mmap
import os
import shutil

import numpy as np
import pytest

from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.errors import UsageError
from onnx_prep.core.io.external_data import ExternalDataReader
from onnx_prep.core.runtime.source_pages import available_memory_bytes, drop_source_pages
from onnx_prep.core.decode.generation import step_feeds
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.runtime.session import Session

linux = pytest.mark.skipif(not hasattr(os, "posix_fadvise") or not os.path.exists("/proc/meminfo"),
                           reason="page-cache advice and residency need Linux (posix_fadvise, mincore)")


def test_policy():
    assert drop_source_pages("keep", 10**12, 1) is False
    assert drop_source_pages("drop", 1, 10**12) is True
    # auto: drop when the payload is over a quarter of the available memory
    assert drop_source_pages("auto", 1001, 4000) is True
    assert drop_source_pages("auto", 1000, 4000) is False
    assert drop_source_pages("auto", 10**12, None) is False  # unknown memory: keep
    with pytest.raises(UsageError, match="unknown source pages policy 'evict'"):
        drop_source_pages("evict", 1, 1)


@linux
def test_available_memory_is_meminfos():
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    got = available_memory_bytes()
    assert got is not None and 0 < got <= total


def _model_copy(src, tmp_path):
    """A private copy of the model and its data (no other test touches its page cache)."""
    dst = tmp_path / "model"
    shutil.copytree(src.parent, dst)
    return dst / src.name


def _resident_range(path, offset: int, length: int) -> int:
    """Bytes of [offset, offset + length) of the file in the page cache (mincore over a
    read-only mapping; offset page-aligned), counted in whole pages."""
    from onnx_prep.native._module import ffi, lib

    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        view = np.frombuffer(mm, dtype=np.uint8)
        n = lib.op_resident_bytes(ffi.cast("void *", view.ctypes.data + offset), length)
        del view
    finally:
        mm.close()
    assert n >= 0
    return n


def _resident(path) -> int:
    """Bytes of the whole file in the page cache."""
    size = os.path.getsize(path)
    return min(_resident_range(path, 0, size), size)


def _evict(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # a file just copied is dirty, and dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _require_droppable(path) -> None:
    """Skip where the file system keeps a file's pages whatever the advice (tmpfs: the
    page cache is its storage), or the page cache does not keep the file at all."""
    _evict(path)
    if _resident(path) != 0:
        pytest.skip("the file system keeps the file's pages (tmpfs?): page-cache advice has no effect")
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass
    if _resident(path) < os.path.getsize(path):
        pytest.skip("the page cache did not keep the file (memory pressure): nothing to measure")


def _data_file(resolved):
    files = {d.file for d in resolved.manifest}
    assert len(files) == 1, files
    return resolved.model_dir / files.pop()


@linux
def test_drop_cached_drops_each_tensor_and_the_folios_it_shares(small_llm_path, tmp_path):
    resolved = resolve_model(_model_copy(small_llm_path, tmp_path))
    data = _data_file(resolved)
    _require_droppable(data)  # and leaves the whole file in the page cache
    reader = ExternalDataReader.for_model(resolved)
    entries = sorted(resolved.manifest, key=lambda d: d.offset)
    page = mmap.PAGESIZE
    # every other tensor first: the advice never reaches into a tensor not dropped yet,
    # so each of those stays whole in the page cache (a folio it shares with a dropped
    # neighbour stays too)
    for d in entries[::2]:
        assert reader.drop_cached(d)
    for d in entries[1::2]:
        lo = -(-d.offset // page) * page
        n = (d.offset + d.length) // page * page - lo
        if n > 0:
            assert _resident_range(data, lo, n) == n, d.name
    for d in entries[1::2]:
        assert reader.drop_cached(d)
    # every tensor dropped: nothing of the file is left (its tensors and their padding
    # tile it)
    assert _resident(data) == 0
    assert reader.counters.snapshot()["bytes_dropped"] == sum(d.length for d in entries)


@linux
@pytest.mark.parametrize("source_io", ["map", "read"])
def test_a_drop_session_leaves_the_sources_out_of_the_page_cache(small_llm_path, tmp_path, source_io):
    resolved = resolve_model(_model_copy(small_llm_path, tmp_path))
    data = _data_file(resolved)
    _require_droppable(data)
    io = DecoderIO.discover(resolved.inputs, resolved.outputs)
    ids = np.array([[3, 1, 4, 1, 5]])
    feeds = step_feeds(io, ids, io.empty_past(1), 0)
    outputs = {}
    for policy in ("keep", "drop"):
        _evict(data)
        with Session(resolved, source_pages=policy, source_io=source_io) as s:
            assert s.source_pages == policy
            s.prepare()
            resident = _resident(data)
            dropped = s.stats().source_bytes_dropped
            outputs[policy] = s.run(feeds)
        if policy == "keep":
            assert dropped == 0
            if resident < os.path.getsize(data):
                pytest.skip("the page cache did not keep the file (memory pressure): nothing to compare")
        else:
            assert dropped == resolved.manifest.total_bytes  # every source once
            assert resident == 0
    for name, v in outputs["keep"].items():
        assert np.array_equal(v, outputs["drop"][name]), name


def test_auto_resolves_to_a_choice(small_llm_path):
    resolved = resolve_model(small_llm_path)
    with Session(resolved, source_pages="auto") as s:
        assert s.source_pages == ("drop" if drop_source_pages("auto", resolved.manifest.total_bytes,
                                                                available_memory_bytes()) else "keep")
    with pytest.raises(UsageError, match="unknown source pages policy"):
        Session(resolved, source_pages="sometimes")
