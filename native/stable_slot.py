"""Host stable virtual-address slots: reserve an address range once, then commit
and decommit physical memory underneath it while the address stays the same.

This is the CPU analogue of CUDA VMM (cuMemAddressReserve / cuMemMap): the
prepared arena keeps packed weights in slots so pointers baked into an execution
plan survive eviction (decommit) and page-in (commit + refill).

Granule: a slot's reservation is a whole multiple of :data:`GRANULE` (2 MiB) and starts
on a 2 MiB boundary; its commits are whole pages (``StableSlot.granule``), or whole
2 MiB granules when the slot asks for huge pages.

NOTE: why commits are not 2 MiB granules everywhere (as on the GPU, where the driver
imposes them): a 4 KiB norm weight then committed 2 MiB of populated memory. On the
medium fixture its 34 small weights populated 68 MiB for 0.26 MiB of data, 25 ms of a
load from the cache, and every larger weight committed up to 2 MiB past its end.

Contract for views: an array from :meth:`StableSlot.view` aliases the slot's
memory; touching it after :meth:`decommit` (or after shrinking the commit below
it) is a segmentation fault, by design (use-after-evict must not read stale or
zero bytes silently). Drop views before decommitting. A view keeps the
reservation itself alive, so the address range is never unmapped under it.
Not thread-safe: one owner (the prepared store) serialises calls per slot.
"""
from __future__ import annotations

import errno
import os
from typing import NamedTuple

import numpy as np

from onnx_prep.native._module import ffi, lib

GRANULE = 2 * 1024 * 1024

HUGE_PAGES_ENV = "ONNX_PREP_HUGE_PAGES"


def huge_pages_default() -> bool:
    """Whether new slots ask for transparent huge pages: ``ONNX_PREP_HUGE_PAGES=1``
    (``0`` or unset: no). See :class:`StableSlot`."""
    from onnx_prep.core.environment import flag

    return flag(HUGE_PAGES_ENV, default=False, on="back prepared weights with huge pages",
                off="use 4 KiB pages")


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


_PAGE = int(lib.op_page_size())


class MappedFile(NamedTuple):
    """What :meth:`StableSlot.map_file` saw as it mapped: the checksum it read (None
    when none was asked), whether the file shrank under it, its 2 MiB entries."""

    xxh3: int | None
    shrunk: bool
    pmd_bytes: int | None


def _pmd_or_none(rc: int) -> int | None:
    """op_pmd_mapped_bytes's answer: bytes, or None where the kernel cannot tell."""
    if rc in (-errno.ENOTTY, -errno.ENOSYS, -errno.ENOENT, -errno.EACCES, -errno.EPERM):
        return None
    if rc < 0:
        raise _os_error(rc, "reading the page tables (PAGEMAP_SCAN)")
    return rc


def _os_error(rc: int, what: str) -> OSError:
    code = -int(rc)
    if code == errno.ENOMEM:
        return MemoryError(f"{what}: out of memory (ENOMEM)")
    return OSError(code, f"{what}: {os.strerror(code)}")


class StableSlot:
    """A reserved address range of ``capacity`` bytes (rounded up to the granule)
    with a committed prefix of ``committed_bytes``; ``address`` never changes.

    ``huge_pages`` (default :func:`huge_pages_default`, i.e. ``ONNX_PREP_HUGE_PAGES``)
    asks the kernel to back the slot with transparent huge pages (MADV_HUGEPAGE):
    the slot starts on a 2 MiB boundary and commits whole 2 MiB granules, so each
    granule can be one huge page. Measured here: committing 596 MB took 57 ms instead
    of 190 ms with memory the process had used before, but 1.4 s on first use on this
    VM, whose host takes free memory back (docs/runtime.md). The attribute
    ``huge_pages`` says whether the advice was taken (False where the kernel has no
    THP)."""

    def __init__(self, capacity: int, *, huge_pages: bool | None = None):
        if int(capacity) <= 0:
            raise ValueError(f"StableSlot capacity must be positive, got {capacity}")
        self.capacity = _round_up(int(capacity), GRANULE)
        want_huge = huge_pages_default() if huge_pages is None else bool(huge_pages)
        out = ffi.new("void **")
        rc = lib.op_slot_reserve(self.capacity, out)
        if rc:
            raise _os_error(rc, f"reserving {self.capacity} bytes of address space")
        # The gc'd pointer owns the reservation; views hold it (via their buffer)
        # so the range is unmapped only after the slot and every view are gone.
        self._base = ffi.gc(ffi.cast("uint8_t *", out[0]), self._releaser(self.capacity))
        self.address = int(ffi.cast("uintptr_t", self._base))
        self.huge_pages = False
        self.granule = int(lib.op_page_size())  # what commits round up to (see the module note)
        if want_huge:
            rc = lib.op_slot_advise_huge(self._base, self.capacity)
            if rc and rc != -errno.EINVAL:  # EINVAL: no THP in this kernel; plain pages
                raise _os_error(rc, f"advising huge pages for {self.capacity} bytes at {self.address:#x}")
            self.huge_pages = rc == 0
            if self.huge_pages:  # whole 2 MiB granules, so each can be one huge page
                self.granule = GRANULE
        self.committed_bytes = 0
        self.open_bytes = 0  # accessible prefix (>= committed_bytes); see open()
        self.mapped_bytes = 0  # > 0: the committed prefix is a file mapping; see map_file()
        self._guard = -1  # the source guard's slot over the mapping (source_guard.c)

    def __del__(self) -> None:
        guard = getattr(self, "_guard", -1)
        if guard >= 0:
            lib.op_guard_remove(guard)

    @staticmethod
    def _releaser(size: int):
        def release(p):
            lib.op_slot_release(p, size)
        return release

    def commit(self, nbytes: int) -> None:
        """Make the first ``nbytes`` (rounded up to the granule) usable. Growing
        commits new zero-filled pages; shrinking decommits the tail. The address is
        unchanged. Raises MemoryError when the OS refuses the commit."""
        want = _round_up(int(nbytes), self.granule)
        if want < 0 or want > self.capacity:
            raise ValueError(f"commit of {nbytes} bytes exceeds the slot's capacity {self.capacity}")
        if self.mapped_bytes:
            self._unmap()
        have = self.committed_bytes
        if want > have:
            if want > self.open_bytes:
                self.open(want)
            rc = lib.op_slot_populate(self._base + have, want - have)
            if rc:
                raise _os_error(rc, f"committing {want - have} bytes at {self.address + have:#x}")
        elif want < have:
            top = max(have, self.open_bytes)  # an open tail past the commit closes too
            rc = lib.op_slot_decommit(self._base + want, top - want)
            if rc:
                raise _os_error(rc, f"decommitting {top - want} bytes")
            self.open_bytes = want
        self.committed_bytes = want

    def map_file(self, fd: int, offset: int, nbytes: int, *, checksum_bytes: int = 0) -> MappedFile:
        """Make the first ``nbytes`` the bytes of file ``fd`` from ``offset`` (a multiple
        of the page size): a read-only private mapping at the slot's address, its pages
        faulted in now (2 MiB at a time, the GIL released). No page is allocated or
        copied: with the file in the page cache, this costs page-table updates only.
        The slot must hold nothing (a fresh or decommitted slot). Writing to the view
        faults; :meth:`commit` or :meth:`decommit` replace the mapping by anonymous
        memory again. A file shorter than the range faults (SIGBUS) when touched: the
        caller checks the length first.

        Returns what the one native call (``op_slot_map_payload``) saw: with
        ``checksum_bytes`` > 0 the XXH3-64 of the first that many bytes, read from the
        page cache as the mapping is made; whether the file shrank while it was read;
        the bytes mapped by 2 MiB page-table entries (:meth:`pmd_mapped_bytes`)."""
        n = _round_up(int(nbytes), _PAGE)
        if self.committed_bytes or self.mapped_bytes:
            raise ValueError("map_file needs a slot that holds nothing (decommit it first)")
        if n <= 0 or n > self.capacity:
            raise ValueError(f"mapping {nbytes} bytes into a slot of {self.capacity}")
        if not 0 <= checksum_bytes <= nbytes:
            raise ValueError(f"a checksum over {checksum_bytes} of {nbytes} mapped bytes")
        out = ffi.new("op_mapped_payload *")
        # A file that shrinks under the mapping reads zeros past its new end instead of
        # killing the process (SIGBUS): the call guards it; mapping_intact() says
        # whether that happened.
        rc = lib.op_slot_map_payload(self._base, n, self.capacity, int(fd), int(offset), int(checksum_bytes), out)
        if rc:
            raise _os_error(rc, f"mapping {n} bytes of fd {fd} at offset {offset} to {self.address:#x}")
        self.mapped_bytes = self.committed_bytes = n
        self._guard = int(out.guard)
        return MappedFile(xxh3=int(out.xxh3) if checksum_bytes and not out.shrunk else None, shrunk=bool(out.shrunk),
                          pmd_bytes=_pmd_or_none(int(out.pmd_bytes)))

    def _unmap(self) -> None:
        """Replace the file mapping (and any open tail) by an inaccessible reservation."""
        n = max(self.mapped_bytes, self.open_bytes)
        rc = lib.op_slot_unmap_file(self._base, n)
        if rc:
            raise _os_error(rc, f"unmapping {n} bytes at {self.address:#x}")
        if self._guard >= 0:
            lib.op_guard_remove(self._guard)
            self._guard = -1
        self.mapped_bytes = self.committed_bytes = self.open_bytes = 0

    def mapping_intact(self) -> bool:
        """False once a read of the file mapping found the file shorter than mapped (the
        guard gave zeros there instead of a SIGBUS); True for anonymous memory."""
        return self._guard < 0 or lib.op_guard_hit(self._guard) != 1

    def open(self, nbytes: int | None = None) -> None:
        """Make the first ``nbytes`` (default: the whole capacity, rounded up to the
        granule) accessible without committing memory: a later :meth:`commit` inside
        it only populates pages. Reads of an open, uncommitted page see zeros.

        NOTE: why: changing protections (like mapping and unmapping) takes the
        process's memory-map lock exclusively, so it waits for and blocks every other
        thread's page population. A loader that opens its slots up front, before its
        workers start committing, lets those commits run in parallel (see
        stable_slot.c). Decommit closes the range again (use-after-evict still
        faults)."""
        want = self.capacity if nbytes is None else _round_up(int(nbytes), self.granule)
        if want < 0 or want > self.capacity:
            raise ValueError(f"open of {nbytes} bytes exceeds the slot's capacity {self.capacity}")
        if want > self.open_bytes:
            rc = lib.op_slot_open(self._base + self.open_bytes, want - self.open_bytes)
            if rc:
                raise _os_error(rc, f"opening {want - self.open_bytes} bytes at {self.address + self.open_bytes:#x}")
            self.open_bytes = want

    def decommit(self) -> None:
        """Return every physical page (RSS falls at once); the range stays reserved
        and inaccessible until the next :meth:`commit`, which reads zeros."""
        self.commit(0)
        if self.open_bytes:  # opened but never committed: close it too
            rc = lib.op_slot_decommit(self._base, self.open_bytes)
            if rc:
                raise _os_error(rc, f"decommitting {self.open_bytes} bytes")
            self.open_bytes = 0

    def view(self, nbytes: int | None = None) -> np.ndarray:
        """A writable uint8 array over the first ``nbytes`` (default: all committed)
        at the stable address. See the module note on views and decommit."""
        n = self.committed_bytes if nbytes is None else int(nbytes)
        if n < 0 or n > self.committed_bytes:
            raise ValueError(f"view of {n} bytes exceeds the {self.committed_bytes} committed bytes")
        if n == 0:
            return np.empty(0, dtype=np.uint8)
        return np.frombuffer(ffi.buffer(self._base, n), dtype=np.uint8)

    def resident_bytes(self) -> int:
        """Bytes of the reservation currently resident in RAM (mincore)."""
        rc = lib.op_resident_bytes(self._base, self.capacity)
        if rc < 0:
            raise _os_error(rc, "mincore")
        return int(rc)

    def pmd_mapped_bytes(self) -> int | None:
        """Bytes of the slot mapped by 2 MiB page-table entries (a file mapping's 2 MiB
        page-cache folios, or anonymous huge pages), read from the page tables; None where
        the kernel cannot tell (no PAGEMAP_SCAN before Linux 6.7, not Linux)."""
        return _pmd_or_none(int(lib.op_pmd_mapped_bytes(self._base, self.capacity)))

    def __repr__(self) -> str:
        return (f"StableSlot(address={self.address:#x}, capacity={self.capacity}, "
                f"committed_bytes={self.committed_bytes})")
