"""External data: THE one reader of external-data bytes, and the path rules it enforces.

Every payload byte the project reads from a model's external data files goes through
``ExternalDataReader``; it owns the byte counters, so "resolution reads 0 payload
bytes" holds by construction and is tested through them.

Why one module of ~800 lines: it is one security boundary. The path rules, the bounds
checks and every way of reaching the bytes (read, read into a slot, the shared mapping
and its release, the digest checks, the source guard) stay side by side, so no read path
can skip a check that another has.

Path rules (ONNX has shipped path-traversal CVEs in exactly this place:
CVE-2022-25882, CVE-2024-27318, CVE-2026-27489 and friends), applied by
``check_location`` (lexical), ``stat_external_file`` (resolution: ``lstat`` only, no
open, no read) and ``open_external_file`` (the reader, on EVERY open):

- the location is relative: not absolute, no drive letter, no NUL;
- no ``..`` component (checked before any normalisation, so ``a/../b`` is refused too);
- no symlink in any component below the model folder, final or parent, unless
  ``trust_symlinks`` (Hugging Face cache snapshots are folders of symlinks into a
  shared ``blobs/`` folder; trusting them is an explicit opt-in);
- the target is a regular file (not a FIFO, device or folder) with exactly one hard
  link unless trusted (a hard link is a symlink that ``lstat`` cannot see);
- ``offset``/``length`` are non-negative and ``offset + length <= file size``.

NOTE: the reader opens component by component with ``O_NOFOLLOW`` relative to the
previous folder's descriptor (``openat``), so a symlink swapped in after resolution
validated the path is still refused: there is no check-then-open window.
"""
from __future__ import annotations

import errno
import hashlib
import mmap
import os
import re
import stat
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from onnx_prep.core.errors import DigestError, ExternalDataError, UnsafePathError, Where
from onnx_prep.core.io.content_digest import ContentHasher, digest_of
from onnx_prep.core.model.dtypes import DTYPES
from onnx_prep.core.model.resolved_model import PayloadManifest
from onnx_prep.core.model.weights import DigestSource, WeightDescriptor

_TRUST_HINT = ("if this is a Hugging Face cache snapshot (files are symlinks into blobs/), "
               "trust it explicitly (--trust-symlinks / trust_symlinks=True)")
_HAVE_OPENAT = os.open in os.supports_dir_fd and hasattr(os, "O_NOFOLLOW")
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_BINARY = getattr(os, "O_BINARY", 0)
_DRIVE = re.compile(r"^[A-Za-z]:")


# --------------------------------------------------------------------------- paths

def check_location(location: str, where: Where) -> tuple[str, ...]:
    """Lexical rules for an external-data ``location``; returns its path components.

    Both ``/`` and ``\\`` separate components (a model written on Windows uses either),
    ``.`` and empty components are dropped. Raises UnsafePathError.
    """
    if not location or "\x00" in location:
        raise UnsafePathError("external data location is empty or contains NUL", where)
    if location.startswith(("/", "\\")) or _DRIVE.match(location) or os.path.isabs(location):
        raise UnsafePathError("external data location is absolute", where,
                              hint="locations must be relative to the model's folder")
    parts = tuple(p for p in re.split(r"[/\\]", location) if p not in ("", "."))
    if ".." in parts:
        raise UnsafePathError("external data location escapes the model folder ('..')", where)
    if not parts:
        raise UnsafePathError("external data location names no file", where)
    return parts


def _check_file_stat(st: os.stat_result, where: Where, *, trust_symlinks: bool) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError("external data location is not a regular file", where)
    if st.st_nlink > 1 and not trust_symlinks:
        raise UnsafePathError(
            f"external data file has {st.st_nlink} hard links (it may alias a file outside the "
            "model folder)", where, hint=_TRUST_HINT)


def _missing(where: Where) -> ExternalDataError:
    return ExternalDataError("external data file not found", where,
                             hint="copy the data file next to the model, or fix its location")


def stat_external_file(model_dir: Path, location: str, *, trust_symlinks: bool = False,
                       where: Where | None = None) -> os.stat_result:
    """Validate ``location`` under ``model_dir`` and return the file's stat, WITHOUT opening
    or reading it (resolution's check). Applies every path rule in the module docstring."""
    where = where or Where(file=location)
    parts = check_location(location, where)
    path = Path(model_dir)
    try:
        for i, part in enumerate(parts):
            path = path / part
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                if not trust_symlinks:
                    what = "is a symlink" if i == len(parts) - 1 else f"goes through a symlink ({part})"
                    raise UnsafePathError(f"external data location {what}", where, hint=_TRUST_HINT)
                st = os.stat(path)
            if i < len(parts) - 1 and not stat.S_ISDIR(st.st_mode):
                raise _missing(where)
    except FileNotFoundError:
        raise _missing(where) from None
    except NotADirectoryError:
        raise _missing(where) from None
    except OSError as exc:
        raise ExternalDataError(f"cannot stat external data file: {exc.strerror}", where) from None
    _check_file_stat(st, where, trust_symlinks=trust_symlinks)
    return st


def open_external_file(model_dir: Path, location: str, *, trust_symlinks: bool = False,
                       where: Where | None = None) -> int:
    """Open ``location`` under ``model_dir`` for reading and return the descriptor (caller
    closes it). Every path rule is enforced at open time: untrusted opens walk the path
    with ``openat(O_NOFOLLOW)``, so no component can be a symlink, even one swapped in
    after a previous check."""
    where = where or Where(file=location)
    parts = check_location(location, where)
    flags = os.O_RDONLY | _O_CLOEXEC | _O_BINARY
    try:
        if trust_symlinks or not _HAVE_OPENAT:
            # Trusted (symlinks followed on purpose) or a platform without openat: open by
            # path; the untrusted fallback re-validates and compares the inode it opened.
            pre = None if trust_symlinks else stat_external_file(model_dir, location, where=where)
            fd = os.open(os.path.join(model_dir, *parts), flags | _O_NONBLOCK)
            if pre is not None:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) != (pre.st_dev, pre.st_ino):
                    os.close(fd)
                    raise UnsafePathError("external data file changed while it was opened", where)
        else:
            dir_fd = os.open(model_dir, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
            try:
                for part in parts[:-1]:
                    nxt = os.open(part, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC,
                                  dir_fd=dir_fd)
                    os.close(dir_fd)
                    dir_fd = nxt
                # O_NONBLOCK: opening a FIFO must not hang; it is refused just below.
                fd = os.open(parts[-1], flags | _O_NOFOLLOW | _O_NONBLOCK, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
    except UnsafePathError:
        raise
    except FileNotFoundError:
        raise _missing(where) from None
    except OSError as exc:
        if not trust_symlinks and exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            # O_NOFOLLOW met a symlink (ELOOP; ENOTDIR/EMLINK on some systems) or a parent
            # is not a folder: the lstat walk names which, unless the path changed meanwhile.
            try:
                stat_external_file(model_dir, location, where=where)
            except ExternalDataError as precise:
                raise precise from None
            raise UnsafePathError("external data location goes through a symlink", where,
                                  hint=_TRUST_HINT) from None
        raise ExternalDataError(f"cannot open external data file: {exc.strerror}", where) from None
    try:
        _check_file_stat(os.fstat(fd), where, trust_symlinks=trust_symlinks)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_bounds(offset: int, length: int, file_size: int, where: Where) -> None:
    """``[offset, offset + length)`` must lie inside a file of ``file_size`` bytes."""
    if offset < 0:
        raise ExternalDataError(f"negative external data offset {offset}", where)
    if length < 0:
        raise ExternalDataError(f"negative external data length {length}", where)
    if offset + length > file_size:
        raise ExternalDataError(
            f"tensor bytes [{offset}, {offset + length}) run past the end of the file "
            f"({file_size} bytes)", where, hint="the data file is truncated or the offset is wrong")


# ------------------------------------------------------------------------ counters

@dataclass
class ReadCounters:
    """Deterministic byte counters of one reader (none is process-wide: a session's
    record reads its own reader's). Thread-safe; ``snapshot()`` for a consistent copy.
    ``bytes_mapped``/``maps`` count ``map()`` calls (mapped bytes are
    not read until touched, so they are kept apart from ``bytes_read``)."""

    bytes_read: int = 0
    reads: int = 0
    per_tensor: dict[str, int] = field(default_factory=dict)  # bytes read, per tensor
    mapped_per_tensor: dict[str, int] = field(default_factory=dict)  # bytes mapped, per tensor
    bytes_mapped: int = 0
    maps: int = 0
    bytes_dropped: int = 0  # tensor bytes advised out of the page cache (drop_cached)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def _add_read(self, name: str, n: int) -> None:
        with self._lock:
            self.bytes_read += n
            self.reads += 1
            self.per_tensor[name] = self.per_tensor.get(name, 0) + n

    def _add_bytes(self, n: int) -> None:
        """A read of file bytes that belong to no one tensor (:meth:`ExternalDataReader.scan_file`)."""
        with self._lock:
            self.bytes_read += n
            self.reads += 1

    def _add_map(self, name: str, n: int) -> None:
        with self._lock:
            self.bytes_mapped += n
            self.maps += 1
            self.mapped_per_tensor[name] = self.mapped_per_tensor.get(name, 0) + n

    def _add_dropped(self, n: int) -> None:
        with self._lock:
            self.bytes_dropped += n

    def snapshot(self) -> dict:
        with self._lock:
            return {"bytes_read": self.bytes_read, "reads": self.reads,
                    "per_tensor": dict(self.per_tensor),
                    "mapped_per_tensor": dict(self.mapped_per_tensor),
                    "bytes_mapped": self.bytes_mapped, "maps": self.maps,
                    "bytes_dropped": self.bytes_dropped}

    def totals(self) -> dict[str, int]:
        """``snapshot()`` without ``per_tensor`` (cheap: a run's record takes it twice)."""
        with self._lock:
            return {"bytes_read": self.bytes_read, "reads": self.reads, "bytes_mapped": self.bytes_mapped,
                    "maps": self.maps, "bytes_dropped": self.bytes_dropped}

    def reset(self) -> None:
        with self._lock:
            self.bytes_read = self.reads = self.bytes_mapped = self.maps = self.bytes_dropped = 0
            self.per_tensor.clear()
            self.mapped_per_tensor.clear()


@dataclass
class ReadHooks:
    """Test hooks. ``before_read(desc)`` runs before each read or map, outside any lock,
    on the reading thread: it may block (on a threading.Event) or raise, and what it
    raises propagates unchanged. ``after_read(desc, nbytes)`` runs after a read."""

    before_read: Callable[[WeightDescriptor], None] | None = None
    after_read: Callable[[WeightDescriptor, int], None] | None = None


# -------------------------------------------------------------------------- reader

class ExternalDataReader:
    """THE one reader of external-data bytes (see module docstring for the path rules).

    Reads only descriptors present, unchanged, in ``manifest``; every read opens the file
    afresh with every path rule and bounds check applied (``map_shared`` applies them
    when it first maps a file, and checks bounds per tensor). Thread-safe: no shared file
    position (``preadv``), counters under a lock.
    """

    def __init__(self, model_dir: Path, manifest: PayloadManifest, *, trust_symlinks: bool = False,
                 model: str | None = None, verify_digests: bool = True,
                 compute_digests: bool = False, verify_every_digest: bool = False) -> None:
        if not isinstance(manifest, PayloadManifest):
            raise TypeError(f"expected a frozen PayloadManifest, got {type(manifest).__name__}")
        self.model_dir = Path(model_dir)
        self.manifest = manifest
        self.trust_symlinks = trust_symlinks
        self.model = model or str(self.model_dir)
        self.verify_digests = verify_digests  # check trusted digests as bytes are read (_Digest)
        # each per-tensor digest recorded (xxh3 and sha256), not only the one a load checks
        self.verify_every_digest = verify_every_digest
        # hash tensors that have no digest as they are read, for content_digest (a
        # prepared cache records what its entries were built from)
        self.compute_digests = compute_digests
        self._computed: dict[str, str] = {}
        self.counters = ReadCounters()
        self.hooks = ReadHooks()
        self._shared: dict[str, mmap.mmap] = {}  # one mapping per data file (map_shared)
        self._shared_lock = threading.Lock()
        self._populating: dict[str, threading.Lock] = {}  # one populating thread per file
        self._guards: dict[str, int] = {}  # per mapped data file, its source-guard slot (_guard)
        # per data file, for the releases (_released_run): its tensors' [lo, hi) by offset,
        # name -> index, and which are released
        self._file_order: dict[str, tuple[list[tuple[int, int]], dict[str, int], list[bool]]] = {}
        self._advice_fds: dict[str, int] = {}  # per data file, opened once for page-cache advice
        weakref.finalize(self, _close_all, self._advice_fds)  # a reader dropped without close_shared
        weakref.finalize(self, _unguard_all, self._guards)

    @classmethod
    def for_model(cls, resolved, *, trust_symlinks: bool = False,
                  verify_digests: bool = True, compute_digests: bool = False) -> "ExternalDataReader":
        """The reader of a ResolvedModel's manifest."""
        return cls(resolved.model_dir, resolved.manifest, trust_symlinks=trust_symlinks,
                   model=str(resolved.model_path), verify_digests=verify_digests,
                   compute_digests=compute_digests)

    def content_digest(self, desc: WeightDescriptor) -> str | None:
        """The digest the bytes this reader read for ``desc`` are known to have: its
        trusted digest when this reader verifies (a read that did not match raised), the
        SHA-256 computed while reading when it has none (``compute_digests``), else None."""
        if desc.trusted:
            return desc.digest if self.verify_digests else None
        return self._computed.get(desc.name)

    # -- public API
    def read(self, desc: WeightDescriptor, *, verify: bool | None = None) -> np.ndarray:
        """A fresh uint8 array of ``desc.length`` bytes. ``verify`` (default: the
        reader's ``verify_digests``) checks the tensor's trusted digest while reading and
        raises DigestError on a mismatch (see :class:`_Digest`)."""
        out = np.empty(desc.length, dtype=np.uint8)
        self.read_into(desc, out, verify=verify)
        return out

    def read_into(self, desc: WeightDescriptor, out: np.ndarray, *, verify: bool | None = None) -> np.ndarray:
        """Fill ``out`` (C-contiguous, writable, exactly ``desc.length`` bytes, e.g. a
        StableSlot view) with the tensor's bytes; returns ``out`` viewed as uint8."""
        where = self._admit(desc)
        buf = out.reshape(-1).view(np.uint8)
        if buf.nbytes != desc.length or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"out must be a writable C-contiguous buffer of {desc.length} bytes")
        digest = self._digest(desc, where, verify)
        fd = self._open_checked(desc, where)
        try:
            if digest is not None:
                digest.check_file(fd)
            _pread_exact(fd, memoryview(buf), desc.offset, where, digest)
        finally:
            os.close(fd)
        self.counters._add_read(desc.name, desc.length)
        if digest is not None:
            digest.finish()
        if self.hooks.after_read is not None:
            self.hooks.after_read(desc, desc.length)
        return buf

    def read_array(self, desc: WeightDescriptor, *, verify: bool | None = None) -> np.ndarray:
        """The tensor typed and shaped (little-endian payload). Packed sub-byte types
        (int4, uint4, float4, int2, uint2) stay packed uint8: shaped
        ``dims[:-1] + (packed bytes per row,)`` when rows are byte-aligned, else flat."""
        return as_array(desc, self.read(desc, verify=verify))

    def scan_file(self, file: str, visit: Callable[[int, memoryview], None], *,
                  chunk: int = 0) -> os.stat_result:
        """Read the whole data file ``file`` (one the manifest names) front to back and
        call ``visit(offset, view)`` for each chunk read; the view is valid only during
        the call (one buffer of ``chunk`` bytes, default 1 MiB, is reused: memory stays
        bounded whatever the file's size). Each byte is read once, so a caller hashes the
        whole file and every tensor inside it in one pass (``core/model/weight_digests``).
        Every path rule applies at the open; counted in ``bytes_read`` and ``reads``.
        Returns the file's stat as the scan found it; a file whose size, modification
        time or inode changed during the scan is an ExternalDataError."""
        if not any(d.file == file for d in self.manifest):
            raise ExternalDataError("read refused: no tensor of the payload manifest is in this file",
                                    Where(model=self.model, file=file))
        where = Where(model=self.model, file=file, offset=0)
        fd = open_external_file(self.model_dir, file, trust_symlinks=self.trust_symlinks, where=where)
        try:
            before = os.fstat(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            buf = memoryview(bytearray(chunk or _HASH_CHUNK))
            pos = 0
            while pos < before.st_size:
                n = os.preadv(fd, [buf], pos) if hasattr(os, "preadv") else os.readv(fd, [buf])
                if n == 0:
                    break
                self.counters._add_bytes(n)
                visit(pos, buf[:n])
                pos += n
            after = os.fstat(fd)
        finally:
            os.close(fd)
        if pos != before.st_size or file_identity(after) != file_identity(before):
            raise ExternalDataError("external data file changed while it was read", where,
                                    hint="do not modify a model's files while they are read; run again")
        return before

    def map(self, desc: WeightDescriptor) -> np.ndarray:
        """A READ-ONLY uint8 view of the tensor's bytes through a private file mapping
        (zero copy; the mapping lives as long as the returned array). Counted in
        ``bytes_mapped``. NOTE: pages are faulted in on first touch, so a map costs no
        read until then; page-aligned offsets (the fixtures use 4 KiB) map exactly.
        The runtime's loads use :meth:`map_shared` instead (one mapping per file)."""
        where = self._admit(desc)
        fd = self._open_checked(desc, where)
        try:
            if desc.length == 0:
                arr = np.empty(0, dtype=np.uint8)
            else:
                start = desc.offset - desc.offset % mmap.ALLOCATIONGRANULARITY
                mm = mmap.mmap(fd, desc.offset + desc.length - start, offset=start,
                               access=mmap.ACCESS_READ)
                arr = np.frombuffer(mm, dtype=np.uint8, count=desc.length,
                                    offset=desc.offset - start)
        finally:
            os.close(fd)
        self.counters._add_map(desc.name, desc.length)
        return arr

    def map_shared(self, desc: WeightDescriptor, *, populate: bool = False,
                   verify: bool | None = None) -> np.ndarray:
        """Like :meth:`map`, but a view into ONE read-only private mapping of the
        tensor's data file, made on first use (path rules applied then) and shared by
        every later call on this reader; bounds are checked per tensor against it.
        ``populate=True`` faults the tensor's pages in now (MADV_POPULATE_READ), on the
        calling thread. :meth:`release_shared` drops them from the mapping again.
        ``verify`` (default: the reader's ``verify_digests``) checks the tensor's trusted
        digest as its pages are populated, one chunk at a time: each chunk is hashed
        right after it is faulted in, while it is still in the CPU's cache, so the check
        costs no second pass over memory (nor a read: the pages are the ones the prepack
        then consumes). Verifying populates, whatever ``populate`` says.

        NOTE: why one mapping: mapping and unmapping change the process's memory map,
        which takes its lock exclusively, waiting for and blocking every other
        thread's page population (the prepack workers committing stable slots). With a
        map and an unmap per source tensor, the two CPU workers of the medium fixture's
        load slept ~70-85 ms each; with one mapping, ~10-15 ms (docs/runtime.md)."""
        where = self._admit(desc)
        if self.hooks.before_read is not None:
            self.hooks.before_read(desc)
        mm = self._shared_mapping(desc, where)
        check_bounds(desc.offset, desc.length, len(mm), where)
        if desc.length:
            with self._shared_lock:  # in use (again): neighbours' page work leaves it alone
                spans, index, released = self._order(desc.file)
                released[index[desc.name]] = False
        # The file as it is now: one truncated after mapping fails here, clearly, not
        # with a SIGBUS when the view (populated now or lazily) touches a page past its end.
        try:
            now = os.stat(self.model_dir / desc.file).st_size
        except OSError as exc:
            raise ExternalDataError(f"cannot read external data: {exc.strerror}", where) from None
        check_bounds(desc.offset, desc.length, now, where)
        digest = self._digest(desc, where, verify)
        if digest is not None and digest.needs_file:
            fd = open_external_file(self.model_dir, desc.file, trust_symlinks=self.trust_symlinks,
                                    where=where)
            try:
                digest.check_file(fd)
            finally:
                os.close(fd)
        if desc.length == 0:
            arr = np.empty(0, dtype=np.uint8)
        else:
            arr = np.frombuffer(mm, dtype=np.uint8, count=desc.length, offset=desc.offset)
            if populate or digest is not None:
                # NOTE: one thread populates a file at a time. Two I/O threads populating
                # one file from a cold page cache at once break its streaming readahead:
                # every tensor of the medium fixture, with two CPU-bound threads beside,
                # took 459-475 ms from two populating threads and 274-314 ms from one.
                with self._populating[desc.file]:
                    if digest is None or not digest.hashes:
                        _populate(arr, desc.offset, where)
                    else:
                        for lo in range(0, desc.length, _HASH_CHUNK):
                            chunk = arr[lo:lo + _HASH_CHUNK]
                            _populate(chunk, desc.offset + lo, where)
                            digest.update(chunk)
        self.check_unchanged(desc)  # before the digest: a truncation is named as one
        if digest is not None:
            digest.finish()
        self.counters._add_map(desc.name, desc.length)
        return arr

    def check_unchanged(self, desc: WeightDescriptor) -> None:
        """Raise ExternalDataError if the tensor's data file shrank under the shared
        mapping since it was mapped: some access met a page past the file's new end, and
        read zeros there instead of dying of SIGBUS (``native/source_guard.c``). Whoever
        consumes a :meth:`map_shared` view calls this after it, before using what it made."""
        slot = self._guards.get(desc.file)
        if slot is not None and _guard_hit(slot):
            raise ExternalDataError(
                "external data file was truncated or rewritten while it was being read",
                Where(model=self.model, tensor=desc.name, file=desc.file, offset=desc.offset),
                hint="do not modify a model's files while it loads; run again")

    def release_shared(self, desc: WeightDescriptor, *, drop: bool = False) -> None:
        """Done with the tensor's view of the shared mapping: drop its pages from the
        mapping (MADV_DONTNEED; the page cache keeps them), and with ``drop=True`` from
        the page cache too (:meth:`drop_cached`). Safe even while a view is alive: a
        private read-only file mapping refaults the same bytes from the file. A page
        shared with a neighbouring tensor goes once that tensor is released too
        (:meth:`_released_run`)."""
        self._release(desc, drop=drop)

    def drop_cached(self, desc: WeightDescriptor) -> bool:
        """Done with the tensor's bytes (read by :meth:`read` / :meth:`read_into`, or
        mapped): ask the kernel to drop them from the page cache (POSIX_FADV_DONTNEED),
        after dropping them from the shared mapping if it maps them. Other readers of the
        file simply read it from storage again; the bytes cannot change. Advice only:
        where the file cannot be opened any more, or the OS has no such advice, nothing
        happens and it returns False."""
        return self._release(desc, drop=True)

    def _release(self, desc: WeightDescriptor, *, drop: bool) -> bool:
        """Mark the tensor released; unmap, and with ``drop`` advise out of the page
        cache, the range around it that only released tensors (and padding) occupy.

        NOTE: why around it. The page cache may hold a file in large folios (2 MiB on
        the machine of docs/runtime.md), and the kernel drops only folios wholly inside
        the advised range, and none a mapping still maps: populating a tensor also maps
        its neighbours' cached pages (fault-around). So both reach ``_FOLIO_REACH``
        either side of the tensor, inside its released run: a folio shared by two
        tensors goes when the second is released, and the pages readahead brought in
        for the next tensor stay."""
        if desc.file is None or desc.length == 0:
            return False
        self._admit(desc)  # a tensor of the manifest, unchanged
        run_lo, run_hi = self._released_run(desc)
        a = max(run_lo, desc.offset - _FOLIO_REACH)
        b = min(run_hi, desc.offset + desc.length + _FOLIO_REACH)
        with self._shared_lock:
            mm = self._shared.get(desc.file)
        if mm is not None and hasattr(mm, "madvise") and len(mm) > 0:
            page = mmap.PAGESIZE
            lo = -(-a // page) * page
            # whole pages only, but the file's last page, partial or not, when b reaches it
            hi = len(mm) if b >= len(mm) else b // page * page
            if hi > lo:
                mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)  # the kernel rounds the length up
        if not drop or not hasattr(os, "posix_fadvise"):
            return False
        fd = self._advice_fd(desc)
        if fd is None:
            return False
        os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_DONTNEED)
        self.counters._add_dropped(desc.length)
        return True

    def _advice_fd(self, desc: WeightDescriptor) -> int | None:
        """A descriptor of the tensor's data file for page-cache advice, opened (with the
        path rules) on first use and kept until :meth:`close_shared`, as the shared
        mapping is: one open per file, not one per dropped tensor. None where the file
        cannot be opened any more."""
        with self._shared_lock:
            fd = self._advice_fds.get(desc.file)
        if fd is not None:
            return fd
        where = Where(model=self.model, tensor=desc.name, file=desc.file, offset=desc.offset)
        try:
            fd = open_external_file(self.model_dir, desc.file, trust_symlinks=self.trust_symlinks, where=where)
        except (ExternalDataError, UnsafePathError):
            return None
        with self._shared_lock:
            kept = self._advice_fds.setdefault(desc.file, fd)
        if kept != fd:  # another thread opened it first
            os.close(fd)
        return kept

    def _released_run(self, desc: WeightDescriptor) -> tuple[int, int]:
        """Mark the tensor released, and return the byte range of the run of released
        tensors of its file around it, out to the tensors not released yet on either
        side (the padding between included): page work on behalf of a released tensor
        stays inside it, so a page or folio shared with a neighbour in use stays.
        :meth:`map_shared` marks a tensor in use again."""
        with self._shared_lock:
            spans, index, released = self._order(desc.file)
            i = index[desc.name]
            released[i] = True
            left = i
            while left > 0 and released[left - 1]:
                left -= 1
            right = i
            while right + 1 < len(spans) and released[right + 1]:
                right += 1
        run_lo = spans[left - 1][1] if left > 0 else 0
        run_hi = spans[right + 1][0] if right + 1 < len(spans) else 1 << 62
        return run_lo, run_hi

    def _order(self, file: str):
        """(caller holds _shared_lock) The file's tensors' [lo, hi) by offset, name ->
        index, and which are released."""
        order = self._file_order.get(file)
        if order is None:
            entries = sorted((d for d in self.manifest if d.file == file), key=lambda d: d.offset)
            order = self._file_order[file] = ([(d.offset, d.offset + d.length) for d in entries],
                                              {d.name: i for i, d in enumerate(entries)},
                                              [False] * len(entries))
        return order

    def close_shared(self) -> None:
        """Forget the shared mappings (each is unmapped once its last view is gone) and
        close the descriptors kept for page-cache advice."""
        with self._shared_lock:
            self._shared.clear()
        _unguard_all(self._guards)
        _close_all(self._advice_fds)

    # -- internals
    def _shared_mapping(self, desc: WeightDescriptor, where: Where) -> mmap.mmap:
        with self._shared_lock:
            mm = self._shared.get(desc.file)
            if mm is None:
                fd = open_external_file(self.model_dir, desc.file, trust_symlinks=self.trust_symlinks,
                                        where=where)
                try:
                    size = os.fstat(fd).st_size
                    check_bounds(desc.offset, desc.length, size, where)
                    if size == 0:
                        return mmap.mmap(-1, 1)  # nothing to map: an empty file holds only empty tensors
                    mm = self._shared[desc.file] = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                                                             prot=mmap.PROT_READ)
                    slot = _guard(mm)
                    if slot is not None:
                        self._guards[desc.file] = slot
                    self._populating.setdefault(desc.file, threading.Lock())
                    # NOTE: MADV_SEQUENTIAL: populating faults use the file's streaming
                    # readahead instead of read-around. Two I/O threads populating the
                    # medium fixture's tensors from a cold page cache: 275-292 ms with it,
                    # 284-407 ms without (one thread: ~272 either way).
                    if hasattr(mm, "madvise"):
                        mm.madvise(mmap.MADV_SEQUENTIAL)
                finally:
                    os.close(fd)
            return mm

    def _open_checked(self, desc: WeightDescriptor, where: Where) -> int:
        """Run the before-read hook, open the tensor's file with the containment checks,
        and check its bounds against the file as it is now. The caller closes the fd."""
        if self.hooks.before_read is not None:
            self.hooks.before_read(desc)
        fd = open_external_file(self.model_dir, desc.file, trust_symlinks=self.trust_symlinks,
                                where=where)
        try:
            check_bounds(desc.offset, desc.length, os.fstat(fd).st_size, where)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _digest(self, desc: WeightDescriptor, where: Where, verify: bool | None) -> "_Digest | None":
        """The check of the tensor's trusted digest, or None (not verifying, or none)."""
        if not desc.trusted:
            return _Digest(desc, where, self._computed) if self.compute_digests else None
        if not (self.verify_digests if verify is None else verify):
            return None
        return _Digest(desc, where, every=self.verify_every_digest)

    def _admit(self, desc: WeightDescriptor) -> Where:
        where = Where(model=self.model, tensor=desc.name, file=desc.file, offset=desc.offset)
        if desc.file is None:
            raise ExternalDataError("tensor is stored inline in the model, not in external data",
                                    where, hint="use ResolvedModel.inline_values")
        if self.manifest.get(desc.name) != desc:
            raise ExternalDataError("read refused: tensor is not in the payload manifest", where)
        return where


def file_identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What says a file is still the one read: device, inode, size, modification time."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _close_all(fds: dict[str, int]) -> None:
    """Close and forget every descriptor of ``fds`` (the reader's advice descriptors)."""
    while fds:
        try:
            _, fd = fds.popitem()
        except KeyError:  # emptied meanwhile by another closer
            return
        os.close(fd)


def _guard(mm: mmap.mmap) -> int | None:
    """Register a shared mapping with the native source guard; its slot, or None where
    there is none (no native module, no SIGBUS on the platform, every slot in use): a
    file truncated under the mapping then kills the process with SIGBUS, as any mmap
    reader would."""
    try:
        from onnx_prep.native._module import ffi, lib
    except ImportError:
        return None
    addr = ffi.cast("void *", ffi.from_buffer(mm))
    slot = lib.op_guard_add(addr, len(mm))
    return slot if slot >= 0 else None


def _guard_hit(slot: int) -> bool:
    from onnx_prep.native._module import lib

    return lib.op_guard_hit(slot) == 1


def _unguard_all(guards: dict[str, int]) -> None:
    """Unregister the reader's mappings from the source guard (their views may outlive
    this: a fault through one then takes the previous SIGBUS disposition)."""
    while guards:
        try:
            _, slot = guards.popitem()
        except KeyError:
            return
        from onnx_prep.native._module import lib

        lib.op_guard_remove(slot)


# How far around a released tensor its page work reaches (ExternalDataReader._release):
# the largest page-cache folio (PMD size on x86-64 and arm64 with 4 KiB pages).
_FOLIO_REACH = 2 << 20

def _populate(arr: np.ndarray, offset: int, where: Where) -> None:
    """Fault in the pages under ``arr`` (a view at file ``offset`` of a shared mapping).

    NOTE: through the native module, not ``mmap.madvise``: CPython holds the GIL across
    madvise, and MADV_POPULATE_READ of a cold tensor waits for the disk, so every other
    Python thread (the prepack workers) stalled behind each read."""
    lead = offset % mmap.PAGESIZE
    try:
        from onnx_prep.native._module import ffi, lib
    except ImportError:  # no native module: touching faults the pages in (GIL held)
        lib = None
    if lib is not None:
        rc = lib.op_populate_read(ffi.cast("void *", arr.ctypes.data - lead), arr.nbytes + lead)
        if rc == 0:
            return
        if rc != -errno.EINVAL:  # EINVAL: kernel < 5.14
            raise ExternalDataError(f"cannot read external data: {os.strerror(-rc)}", where)
    int(arr[::mmap.PAGESIZE].sum())


def _pread_exact(fd: int, mv: memoryview, offset: int, where: Where, digest: "_Digest | None" = None) -> None:
    """Fill ``mv`` from ``fd`` at ``offset``; with a digest, read in chunks and hash each
    one as it lands, while it is still in the CPU's cache (no second pass)."""
    got, total = 0, len(mv)
    step = _HASH_CHUNK if digest is not None and digest.hashes else total
    while got < total:
        end = min(total, got + step)
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [mv[got:end]], offset + got)
        else:  # pragma: no cover - platforms without preadv
            chunk = os.pread(fd, end - got, offset + got)
            n = len(chunk)
            mv[got:got + n] = chunk
        if n == 0:
            raise ExternalDataError(f"external data file ended after {got} of {total} bytes "
                                    "(it was truncated or rewritten during the load)", where)
        if digest is not None:
            digest.update(mv[got:got + n])
        got += n


# Bytes hashed per step when verifying: small enough to be still in the CPU's cache when
# hashed right after they are read or faulted in, large enough that the per-step
# overhead (a syscall, a hashlib call that releases the GIL) is noise.
_HASH_CHUNK = 1 << 20


class _Digest:
    """The check of one tensor's trusted digest during one read.

    - TENSOR_METADATA (``xxh3:<hex>`` and/or ``sha256:<hex>`` of the tensor's bytes):
      the bytes are hashed as they are read (``update``) and compared at the end
      (``finish``). A load checks one: the XXH3 digest where the model records it
      (``WeightDescriptor.load_digest``; content_digest.py says why that suffices);
      ``every=True`` (``check --verify-payloads``) checks each one recorded.
    - FILE_CHECKSUM (the ONNX ``checksum`` key: SHA-1 of the WHOLE data file): checked
      once per file per process (``check_file``), keyed by the file's identity, size and
      modification time, so a file rewritten later is checked again. It costs one pass
      over the whole file, the first time.

    A tensor with no digest (DigestSource.NONE) cannot be checked: corrupted bytes load.
    With a ``sink`` (the reader's ``compute_digests``) its SHA-256 is computed as it is
    read and recorded there instead."""

    __slots__ = ("desc", "where", "_checks", "_sink")

    def __init__(self, desc: WeightDescriptor, where: Where, sink: dict[str, str] | None = None, *,
                 every: bool = False) -> None:
        self.desc, self.where, self._sink = desc, where, sink
        if sink is not None and not desc.trusted:  # computed, not compared
            self._checks: list[tuple[str | None, ContentHasher]] = [(None, ContentHasher("sha256"))]
        else:
            wanted = desc.tensor_digests if every else tuple(d for d in (desc.load_digest,) if d)
            self._checks = [(d, ContentHasher.matching(d)) for d in wanted]

    @property
    def hashes(self) -> bool:
        return bool(self._checks)

    @property
    def needs_file(self) -> bool:
        return self.desc.digest_source is DigestSource.FILE_CHECKSUM

    def update(self, chunk) -> None:
        for _, h in self._checks:
            h.update(chunk)

    def finish(self) -> None:
        for expected, h in self._checks:
            if expected is None:
                self._sink[self.desc.name] = h.digest()
            else:
                _compare(expected, h.digest(), "tensor bytes", self.where)

    def check_file(self, fd: int) -> None:
        if self.needs_file:
            _check_file_checksum(fd, self.desc, self.where)


def _compare(expected: str, actual: str, what: str, where: Where) -> None:
    if actual != expected:
        raise DigestError(f"{what} do not match their declared digest: expected {expected}, got {actual}",
                          where, hint="the data file changed after the model was written",
                          expected=expected, actual=actual)


_SHA1_DIGEST = re.compile(r"^sha1:([0-9a-f]{40})@")
_files_verified: set[tuple] = set()  # (dev, ino, size, mtime_ns, sha1) checked in this process
_files_lock = threading.Lock()  # one whole-file check at a time: the second waits, then skips


def _check_file_checksum(fd: int, desc: WeightDescriptor, where: Where) -> None:
    """The whole data file's SHA-1 against the ``checksum`` entry, once per file (as it
    is now) per process."""
    m = _SHA1_DIGEST.match(desc.digest or "")
    if m is None:
        raise DigestError(f"malformed file checksum digest {desc.digest!r}", where)
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, m.group(1))
    with _files_lock:
        if key in _files_verified:
            return
        h, pos, buf = hashlib.sha1(), 0, bytearray(_HASH_CHUNK)
        mv = memoryview(buf)
        while True:
            n = os.preadv(fd, [mv], pos) if hasattr(os, "preadv") else os.readv(fd, [mv])
            if n == 0:
                break
            h.update(mv[:n])
            pos += n
        _compare(f"sha1:{m.group(1)}", f"sha1:{h.hexdigest()}", "data file bytes",
                 Where(model=where.model, tensor=where.tensor, file=where.file, offset=0))
        _files_verified.add(key)


def as_array(desc: WeightDescriptor, raw: np.ndarray) -> np.ndarray:
    """View ``raw`` (uint8, ``desc.length`` bytes) as the tensor (see ``read_array``)."""
    dt = DTYPES[desc.onnx_type]
    if dt.packed:  # packed uint8: rows of whole bytes when the last axis fills them, else flat
        if desc.dims and (desc.dims[-1] * dt.bits) % 8 == 0:
            return raw.reshape(desc.dims[:-1] + (desc.dims[-1] * dt.bits // 8,))
        return raw
    return raw.view(dt.numpy.newbyteorder("<")).reshape(desc.dims)


def verify_tensor_digest(desc: WeightDescriptor, data: np.ndarray, where: Where) -> None:
    """Raise DigestError when ``data`` (the tensor's bytes, already in memory) does not
    match the per-tensor digest a load checks (``load_digest``). The reader hashes while
    reading instead."""
    expected = desc.load_digest
    if expected is None:
        return
    _compare(expected, digest_of(data, expected.split(":", 1)[0]), "tensor bytes", where)
