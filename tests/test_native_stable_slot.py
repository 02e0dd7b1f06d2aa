"""Host stable-VA slots: the address survives decommit/recommit, new bytes are read
at the same address, RSS falls after decommit, committed bytes are reported."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from onnx_prep import native

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="RSS and zero-fill semantics checked on Linux only")

MIB = 1024 * 1024
PAGE = os.sysconf("SC_PAGESIZE")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    import os
    return resident_pages * os.sysconf("SC_PAGESIZE")


def test_same_address_reads_new_bytes_after_decommit_and_recommit():
    slot = native.StableSlot(5 * MIB)
    assert slot.capacity == 6 * MIB and slot.committed_bytes == 0
    addr = slot.address
    slot.commit(3 * MIB + 5)
    assert slot.granule == PAGE and not slot.huge_pages
    assert slot.committed_bytes == 3 * MIB + PAGE  # rounded up to a whole page, not 2 MiB
    v = slot.view(3 * MIB)
    assert v.ctypes.data == addr
    v[:] = 0xAB
    del v
    slot.decommit()
    assert slot.committed_bytes == 0 and slot.address == addr
    slot.commit(3 * MIB)
    v = slot.view()
    assert v.ctypes.data == addr
    assert not v.any()  # fresh pages: the old bytes are gone
    v[: 1 * MIB] = 0x5C
    assert np.all(slot.view(1 * MIB) == 0x5C)
    del v


def test_a_small_commit_populates_pages_not_a_2_mib_granule():
    """A 4 KiB weight commits (and makes resident) one page; with huge pages asked
    for and taken, commits are whole 2 MiB granules so each can be one huge page."""
    slot = native.StableSlot(64 << 10, huge_pages=False)
    slot.commit(100)
    assert slot.committed_bytes == PAGE and slot.resident_bytes() == PAGE
    huge = native.StableSlot(64 << 10, huge_pages=True)
    if not huge.huge_pages:
        pytest.skip("this kernel has no transparent huge pages (MADV_HUGEPAGE refused)")
    huge.commit(100)
    assert huge.granule == 2 * MIB and huge.committed_bytes == 2 * MIB


def test_rss_falls_after_decommit():
    slot = native.StableSlot(64 * MIB)
    slot.commit(64 * MIB)
    v = slot.view()
    v[::4096] = 1  # touch every page
    del v
    assert slot.resident_bytes() == 64 * MIB
    before = _rss_bytes()
    slot.decommit()
    after = _rss_bytes()
    assert slot.resident_bytes() == 0
    assert before - after >= 60 * MIB, (before, after)


def test_shrinking_commit_keeps_the_prefix():
    slot = native.StableSlot(8 * MIB)
    slot.commit(8 * MIB)
    v = slot.view()
    v[:] = 7
    del v
    slot.commit(2 * MIB)
    assert slot.committed_bytes == 2 * MIB
    assert np.all(slot.view() == 7)
    assert slot.resident_bytes() == 2 * MIB


def test_packed_weights_live_in_a_slot():
    """What the prepared arena does: prepack straight into a slot view, run from it."""
    rng = np.random.default_rng(0)
    K, N, bs = 256, 40, 32
    B = rng.integers(0, 256, (N, K // bs, bs // 2), dtype=np.uint8)
    s = rng.random(N * (K // bs)).astype(np.float32)
    size = native.matmul_nbits_packed_size(K=K, N=N, block_size=bs, zero_points=None, accuracy_level=0)
    slot = native.StableSlot(size)
    slot.commit(size)
    packed = native.prepack_matmul_nbits(B, s, None, K=K, N=N, block_size=bs, out=slot.view())
    assert packed.ctypes.data == slot.address and packed.nbytes == size
    A = rng.standard_normal((2, K)).astype(np.float32)
    want = native.matmul_nbits(A, native.prepack_matmul_nbits(B, s, None, K=K, N=N, block_size=bs))
    np.testing.assert_array_equal(native.matmul_nbits(A, packed), want)


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError):
        native.StableSlot(0)
    slot = native.StableSlot(2 * MIB)
    with pytest.raises(ValueError):
        slot.commit(4 * MIB)
    with pytest.raises(ValueError):
        slot.view(1)  # nothing committed


def test_open_then_commit_populates_in_place():
    """open() makes the range accessible without memory; commit then only populates
    (the loader opens slots up front so parallel commits do not serialise)."""
    slot = native.StableSlot(8 * MIB)
    addr = slot.address
    slot.open()
    assert slot.open_bytes == 8 * MIB and slot.committed_bytes == 0
    assert slot.resident_bytes() == 0  # opening commits nothing
    slot.commit(4 * MIB)
    assert slot.resident_bytes() == 4 * MIB  # populated by commit, before any touch
    v = slot.view()
    assert v.ctypes.data == addr and v.nbytes == 4 * MIB and not v.any()
    v[:] = 7
    del v
    slot.decommit()
    assert slot.open_bytes == 0 and slot.committed_bytes == 0 and slot.resident_bytes() == 0


@pytest.mark.parametrize("committed", [0, 2])
def test_decommit_closes_an_opened_range(committed):
    """Use-after-evict still faults when the slot was opened beyond its commit."""
    import signal
    import subprocess

    code = ("import ctypes; from onnx_prep import native\n"
            "s = native.StableSlot(4 << 20); s.open()\n"
            f"s.commit({committed} << 20); s.decommit()\n"
            "print('read', ctypes.string_at(s.address + (3 << 20), 1), flush=True)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGSEGV, (p.returncode, p.stdout, p.stderr)
    assert "read" not in p.stdout


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


_THP = __import__("os").path.exists("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not _THP, reason="this kernel has no transparent huge pages")
@pytest.mark.parametrize("huge", [False, True])
def test_huge_pages_is_the_kernel_advice_and_data_survives(huge):
    slot = native.StableSlot(4 * MIB, huge_pages=huge)
    assert slot.huge_pages is huge
    assert ("hg" in _vm_flags(slot.address)) is huge  # MADV_HUGEPAGE sets VM_HUGEPAGE
    slot.commit(4 * MIB)
    assert ("hg" in _vm_flags(slot.address)) is huge  # survives the protection change
    v = slot.view()
    v[:] = 7
    del v
    slot.decommit()
    assert slot.resident_bytes() == 0
    slot.commit(2 * MIB)
    assert not slot.view().any() and slot.address == slot.view().ctypes.data


def test_huge_pages_default_comes_from_the_environment(monkeypatch):
    from onnx_prep.native.stable_slot import huge_pages_default

    monkeypatch.delenv("ONNX_PREP_HUGE_PAGES", raising=False)
    assert huge_pages_default() is False
    monkeypatch.setenv("ONNX_PREP_HUGE_PAGES", "1")
    assert huge_pages_default() is True
    if _THP:
        assert native.StableSlot(2 * MIB).huge_pages is True
    monkeypatch.setenv("ONNX_PREP_HUGE_PAGES", "yes please")
    from onnx_prep.core.errors import UsageError

    with pytest.raises(UsageError, match="ONNX_PREP_HUGE_PAGES='yes please' is not a valid setting"):
        native.StableSlot(2 * MIB)


def _data_file(tmp_path, nbytes: int, seed: int = 3):
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    path = tmp_path / "payload.bin"
    path.write_bytes(data.tobytes())
    return path, data


def test_a_file_range_maps_at_the_slot_address_without_a_copy(tmp_path):
    import os

    page = os.sysconf("SC_PAGESIZE")
    path, data = _data_file(tmp_path, 3 * MIB + 5000)
    fd = os.open(path, os.O_RDONLY)
    try:
        slot = native.StableSlot(3 * MIB)
        addr = slot.address
        slot.map_file(fd, page, 3 * MIB)  # the second page on: an offset of whole pages
        v = slot.view(3 * MIB)
        assert v.ctypes.data == addr
        assert np.array_equal(v, data[page:page + 3 * MIB])
        assert slot.mapped_bytes == slot.committed_bytes == 3 * MIB and slot.mapping_intact()
        with pytest.raises(ValueError, match="holds nothing"):
            slot.map_file(fd, 0, MIB)  # one mapping at a time
        with pytest.raises(OSError):
            native.StableSlot(MIB).map_file(fd, 100, MIB)  # not page-aligned
        del v
        slot.decommit()  # back to an inaccessible reservation at the same address
        assert slot.committed_bytes == slot.mapped_bytes == 0
        slot.commit(MIB)  # anonymous again: zeros, writable
        w = slot.view(MIB)
        assert w.ctypes.data == addr and not w.any()
        w[:] = 7
        assert data[page] != 7 or data[page + 1] != 7  # the file is untouched
        del w
        slot.decommit()
        slot.map_file(fd, 0, 5000)  # a partial last page maps too
        assert np.array_equal(slot.view(5000), data[:5000])
    finally:
        os.close(fd)
    assert path.read_bytes() == data.tobytes()


def test_a_mapped_file_that_shrinks_reads_zeros_and_says_so(tmp_path):
    import os

    page = os.sysconf("SC_PAGESIZE")
    path, data = _data_file(tmp_path, 8 * page)
    fd = os.open(path, os.O_RDONLY)
    try:
        slot = native.StableSlot(8 * page)
        slot.map_file(fd, 0, 8 * page)
        assert slot.mapping_intact()
        os.truncate(path, 2 * page)  # someone else shrinks the file under the mapping
        v = slot.view(8 * page)
        assert np.array_equal(v[:2 * page], data[:2 * page])
        assert not v[5 * page:6 * page].any()  # past the new end: zeros, not SIGBUS
        assert not slot.mapping_intact()
        del v
        slot.decommit()
        assert slot.mapping_intact()  # anonymous memory again
    finally:
        os.close(fd)


def test_a_mapping_reads_the_checksum_it_is_asked_for_in_the_same_call(tmp_path):
    """map_file(checksum_bytes=n): the XXH3-64 of the first n bytes, read as the mapping
    is made (one native call: the prepared cache's mapped payloads), equal to the
    content hasher's; none asked, none given; more than is mapped is refused."""
    import os

    from onnx_prep.core.io.content_digest import digest_of

    path, data = _data_file(tmp_path, 3 * MIB + 5000)
    fd = os.open(path, os.O_RDONLY)
    try:
        for n in (3 * MIB + 5000, 4096, 1):
            slot = native.StableSlot(4 * MIB)
            seen = slot.map_file(fd, 0, 3 * MIB + 5000, checksum_bytes=n)
            assert f"xxh3:{seen.xxh3:016x}" == digest_of(data[:n].tobytes(), "xxh3")
            assert not seen.shrunk and slot.mapping_intact()
            assert seen.pmd_bytes is None or 0 <= seen.pmd_bytes <= slot.capacity
        seen = native.StableSlot(MIB).map_file(fd, 0, MIB)
        assert seen.xxh3 is None
        with pytest.raises(ValueError, match="checksum over"):
            native.StableSlot(MIB).map_file(fd, 0, 4096, checksum_bytes=4097)
    finally:
        os.close(fd)


def test_a_mapping_over_a_file_already_shorter_says_it_shrank(tmp_path):
    """The range mapped runs past the file's end (it was cut after its size was taken):
    the call says the file shrank and gives no checksum, instead of failing, so the
    prepared cache rebuilds the object; reads past the end give zeros, not SIGBUS."""
    import os

    page = os.sysconf("SC_PAGESIZE")
    path, data = _data_file(tmp_path, 2 * page)
    fd = os.open(path, os.O_RDONLY)
    try:
        slot = native.StableSlot(8 * page)
        seen = slot.map_file(fd, 0, 8 * page, checksum_bytes=8 * page)
        assert seen.shrunk and seen.xxh3 is None  # no checksum of bytes the file lacks
        v = slot.view(8 * page)
        assert np.array_equal(v[:2 * page], data) and not v[2 * page:].any()
        assert not slot.mapping_intact()
    finally:
        os.close(fd)
