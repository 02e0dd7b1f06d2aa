"""CacheWriter: how a prepared cache changes without ever being half-written.

One update is one generation (docs/cache-format.md, "Writing"):

1. packed payloads are written, 4 KiB aligned (2 MiB aligned when plain and at least
   2 MiB, the gaps that leaves left as holes or filled by smaller payloads), to a
   private temporary file in the cache's folder (``.<stem>.prepared.tmp-<pid>-<random>.data``), held under an
   exclusive ``flock`` while its writer lives;
2. ``commit``, under the cache's lock file (``<stem>.prepared.lock``): the temporary
   file is fsynced, every entry in it re-read and checked against the digest computed as
   it was written, and renamed to ``<stem>.prepared.g<generation>.data``; the new manifest
   (the live one's entries still valid, plus the new ones) is written to a temporary
   file, fsynced, renamed over the live manifest, and the folder fsynced;
3. garbage collection, still under the lock: payload files no manifest names and
   temporary files nobody holds (their writer died) are removed. A file the live
   manifest names is never removed.

A crash at any point leaves the previous complete generation or the new one visible;
whatever else it left is garbage the next commit collects. Two writers never interleave
a commit; each builds its payloads in its own temporary file, so both finish.

Test hook (tests/test_cache_crash.py): ``ONNX_PREP_CRASH_AT=N`` kills the process with
SIGKILL at the N-th crash point it passes (``NAME:N``: the N-th pass of the point
named NAME); the points are the ``crash_point("...")`` calls below.
"""
from __future__ import annotations

import errno
import fcntl
import os
import secrets
import signal
import stat
import threading
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from onnx_prep.core.cache.payload_digest import PayloadHasher, payload_digest_of
from onnx_prep.core.cache.manifest import (
    ALIGNMENT,
    HUGE_ALIGNMENT,
    CacheEntry,
    NOT_A_FILE_HINT,
    CacheManifest,
    SourceRecord,
    encode_manifest,
    read_manifest,
)
from onnx_prep.core.errors import OnnxPrepError, Where

__all__ = ["CacheWriteError", "CacheWriter", "cache_lock", "check_manifest_target", "collect_garbage",
           "collect_leftovers", "crash_point", "payload_file_name"]

_CHUNK = 1 << 20
# Payload bytes go to the file in writes of this size, each starting on a multiple of it
# in a 2 MiB-aligned payload: a buffered write of a whole aligned 2 MiB makes one 2 MiB
# folio in the page cache (where the file system has large folios; 1 MiB writes made
# none here), which a mapping at a 2 MiB-aligned address maps with one PMD entry.
_WRITE_STEP = HUGE_ALIGNMENT
ZSTD_LEVEL = 3


class CacheWriteError(OnnxPrepError):
    """The cache's folder cannot take the write (read-only, full, no permission)."""


# ------------------------------------------------------------------ crash points
_crash_lock = threading.Lock()
_crash_counts: dict[str, int] = {}


def crash_point(name: str) -> None:
    """The test hook's kill point (module docstring). Costs a dict lookup when unset."""
    spec = os.environ.get("ONNX_PREP_CRASH_AT")
    if not spec:
        return
    want_name, _, n = spec.rpartition(":")
    with _crash_lock:
        counter = want_name or "*"
        if want_name and want_name != name:
            return
        _crash_counts[counter] = _crash_counts.get(counter, 0) + 1
        if str(_crash_counts[counter]) == n:
            os.write(2, f"crash point {name}\n".encode())
            os.kill(os.getpid(), signal.SIGKILL)


# ------------------------------------------------------------------ names and locks
def payload_file_name(stem: str, generation: int) -> str:
    return f"{stem}.prepared.g{generation}.data"


def _temp_prefix(stem: str) -> str:
    return f".{stem}.prepared.tmp-"


def _write_error(exc: OSError, folder: Path) -> CacheWriteError:
    what = {errno.ENOSPC: "the disk is full", errno.EROFS: "the folder is on a read-only file system",
            errno.EACCES: "no permission to write there", errno.EPERM: "no permission to write there",
            errno.EDQUOT: "the disk quota is exceeded", errno.EFBIG: "the file is too large"}
    reason = what.get(exc.errno, exc.strerror or str(exc))
    elsewhere = "build-cache --cache-dir DIR or -o PATH, then run --prepared PATH"
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    return CacheWriteError(f"cannot write the prepared cache: {reason}", Where(file=str(folder)),
                           hint=(f"free space, or put the cache elsewhere: {elsewhere}" if full
                                 else f"put the cache in a folder you can write: {elsewhere}"))


def check_manifest_target(path: Path) -> None:
    """Raise CacheWriteError unless the manifest path holds a regular file or nothing:
    the only thing a commit may rename a new manifest over. A folder there would fail
    the rename after the payloads were published; a symlink or FIFO would be replaced
    without a word (docs/cache-format.md, "Writing")."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode):
        return
    if stat.S_ISLNK(st.st_mode):
        what, hint = (f"a symlink (to {os.readlink(path)}): a cache is never written through one",
                      f"build it where the link points: -o {os.path.realpath(path)}")
    else:
        what = "a directory, not a manifest" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        hint = NOT_A_FILE_HINT
    raise CacheWriteError(f"cannot write the prepared cache: {Path(path).name} is {what}",
                          Where(file=str(path)), hint=hint)


@contextmanager
def cache_lock(folder: Path, stem: str) -> Iterator[None]:
    """The cache's commit lock: one commit (and garbage collection) at a time."""
    path = Path(folder) / f"{stem}.prepared.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as exc:
        raise _write_error(exc, Path(folder)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ the writer
class CacheWriter:
    """Appends payloads to one private temporary file; ``commit`` publishes them.
    ``append`` is thread-safe (one writer thread or several)."""

    def __init__(self, folder: Path, stem: str, manifest_name: str, *, compress: str | None = None) -> None:
        self.folder, self.stem, self.manifest_name = Path(folder), stem, manifest_name
        self.compress = compress
        self.temp = self.folder / f"{_temp_prefix(stem)}{os.getpid()}-{secrets.token_hex(4)}.data"
        try:
            self._fd = os.open(self.temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            raise _write_error(exc, self.folder) from None
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # alive: garbage collection leaves it alone
        self._renamed = False  # the temporary file became a generation's payload file
        self._lock = threading.Lock()
        self._end = 0
        self._gaps: list[tuple[int, int]] = []  # [start, end) before 2 MiB-aligned payloads, unwritten
        self.entries: list[CacheEntry] = []  # file = the temporary name until commit
        self.bytes_written = 0

    def append(self, identity: CacheEntry, data: np.ndarray) -> CacheEntry:
        """Write ``data`` (the packed object's bytes) for the entry ``identity``
        describes (its key, lineage and ABI fields; file, offset, lengths and digest are
        filled here). Returns the entry as it will be published."""
        raw = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        blob, encoding = raw, None
        if self.compress == "zstd":
            blob, encoding = _zstd(raw), "zstd"
        digest = payload_digest_of(blob)
        with self._lock:
            offset = self._place(len(blob), huge=encoding is None and len(blob) >= HUGE_ALIGNMENT)
            try:
                for lo in range(0, len(blob), _WRITE_STEP):
                    crash_point("payload_write")
                    _pwrite_all(self._fd, blob[lo:lo + _WRITE_STEP], offset + lo)
            except OSError as exc:
                raise _write_error(exc, self.folder) from None
            entry = replace(identity, file=self.temp.name, offset=offset, length=len(blob),
                            payload_digest=digest, encoding=encoding, decoded_length=len(raw))
            self.entries.append(entry)
            self.bytes_written += len(blob)
        return entry

    def _place(self, n: int, *, huge: bool) -> int:
        """The offset for ``n`` more bytes (under the lock). ``huge``: the next 2 MiB
        boundary, the space skipped to reach it kept as a gap (a hole in the file: never
        written, no disk block); otherwise the first gap it fits in, else the end, 4 KiB
        aligned."""
        end = _round_up(self._end, ALIGNMENT)
        if huge:
            offset = _round_up(self._end, HUGE_ALIGNMENT)
            if offset > end:
                self._gaps.append((end, offset))
        else:
            for i, (lo, hi) in enumerate(self._gaps):
                if hi - lo >= n:
                    rest = _round_up(lo + n, ALIGNMENT)
                    self._gaps[i:i + 1] = [(rest, hi)] if rest < hi else []
                    return lo
            offset = end
        self._end = offset + n
        return offset

    def discard(self) -> None:
        """Drop the temporary file (nothing was committed, or the commit used none, or
        it failed: then its descriptor is closed already, and the file is still removed
        rather than left for the next commit's garbage collection)."""
        if not self._renamed:
            _unlink_quietly(self.temp)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def commit(self, *, source_model_digest: str, sources: dict[str, SourceRecord],
               keep: Callable[[CacheEntry], bool], wanted: Callable[[CacheEntry, CacheEntry | None], bool]
               ) -> tuple[CacheManifest | None, list[CacheEntry]]:
        """Publish a new generation: the live manifest's entries for which ``keep(e)``,
        plus each appended entry for which ``wanted(new, live_entry_for_its_key)``. No
        new generation when nothing changes. Returns (the manifest now live, the entries
        this commit added)."""
        manifest_path = self.folder / self.manifest_name
        check_manifest_target(manifest_path)  # before the lock: a refusal leaves no lock file either
        with cache_lock(self.folder, self.stem):
            crash_point("commit_locked")
            check_manifest_target(manifest_path)  # again, now that no other commit can change it
            live = _live_manifest(manifest_path)
            live_by_key = live.by_key if live is not None else {}
            added = [e for e in self.entries if wanted(e, live_by_key.get(e.key))]
            kept = [e for e in (live.entries if live else ()) if keep(e)
                    and e.key not in {a.key for a in added}]
            dropped = live is not None and (len(kept) != len(live.entries) or live.damaged)
            if not added and not dropped and live is not None:
                self.discard()
                self._collect(live)
                return live, []
            generation = (live.generation if live else 0) + 1
            final = payload_file_name(self.stem, generation)
            published = False
            try:
                if added:
                    self._seal()
                    crash_point("payload_rename")
                    os.rename(self.temp, self.folder / final)
                    self._renamed = True
                    crash_point("payload_renamed")
                else:
                    self.discard()
                new = CacheManifest(
                    generation=generation, source_model_digest=source_model_digest,
                    sources={**(dict(live.sources) if live else {}), **sources},
                    entries=tuple(kept + [replace(e, file=final) for e in added]))
                published = _publish(manifest_path, encode_manifest(new))
                crash_point("manifest_renamed")
                _fsync_dir(self.folder)
            except OSError as exc:
                raise _write_error(exc, self.folder) from None
            finally:
                if self._renamed and not published:
                    # The live manifest is still the previous one, which cannot name this
                    # generation's file (we hold the lock): it goes now, not at the next commit.
                    _unlink_quietly(self.folder / final)
                if self._fd >= 0:
                    os.close(self._fd)  # renamed or not: its lock goes with it
                    self._fd = -1
            self._collect(new)
            return new, [replace(e, file=final) for e in added]

    def _seal(self) -> None:
        """fsync the temporary file, then re-read every entry and check its digest."""
        crash_point("payload_fsync")
        os.fsync(self._fd)
        for e in self.entries:
            h = PayloadHasher.matching(e.payload_digest)
            for lo in range(0, e.length, _CHUNK):
                n = min(_CHUNK, e.length - lo)
                chunk = os.pread(self._fd, n, e.offset + lo)
                if len(chunk) != n:
                    raise OnnxPrepError(f"prepared cache payload {self.temp.name} is short after writing",
                                        Where(file=str(self.temp), tensor=e.key, offset=e.offset))
                h.update(chunk)
            if h.digest() != e.payload_digest:
                raise OnnxPrepError("prepared cache payload does not read back as written",
                                    Where(file=str(self.temp), tensor=e.key, offset=e.offset))
        crash_point("payload_validated")

    def _collect(self, live: CacheManifest) -> None:
        crash_point("gc")
        collect_garbage(self.folder, self.stem, live)


def _live_manifest(path: Path) -> CacheManifest | None:
    """The live manifest, or None when there is none or it is unusable (a commit
    replaces an invalid manifest; only ``build-cache`` decides to get here)."""
    from onnx_prep.core.cache.manifest import CacheFormatError

    try:
        return read_manifest(path)
    except CacheFormatError:
        return None


def _publish(path: Path, data: bytes) -> bool:
    """Write ``data`` to a temporary file beside ``path``, fsync it and rename it over
    ``path`` (the caller fsyncs the folder). Returns True, the new manifest live; an
    error leaves the old one live and no temporary file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        crash_point("manifest_write")
        _pwrite_all(fd, memoryview(data), 0)
        crash_point("manifest_fsync")
        os.fsync(fd)
        os.close(fd)
        fd = -1
        crash_point("manifest_rename")
        os.rename(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        _unlink_quietly(tmp)
        raise
    return True


def collect_garbage(folder: Path, stem: str, live: CacheManifest | None) -> list[str]:
    """Remove payload files ``live`` does not name and temporary files no live writer
    holds. Call under :func:`cache_lock`. Returns the names removed."""
    folder = Path(folder)
    removed = []
    for name, temporary in _garbage(folder, stem, live):
        path = folder / name
        if not temporary or not _held(path):
            crash_point("gc_unlink")
            _unlink(path, removed)
    return removed


def collect_leftovers(folder: Path, stem: str, manifest_name: str) -> list[str]:
    """Garbage collection alone, for a build that had nothing to commit: what an
    interrupted commit left (its temporary files, the generation it replaced, when it
    was killed after publishing) goes now, not at the cache's next change. Takes the
    lock only when there is something to collect. Returns the names removed."""
    folder = Path(folder)
    live = _live_manifest(folder / manifest_name)
    if live is None or not _garbage(folder, stem, live):
        return []
    with cache_lock(folder, stem):
        live = _live_manifest(folder / manifest_name)  # another commit may have run meanwhile
        if live is None:
            return []
        try:
            return collect_garbage(folder, stem, live)
        except OSError as exc:
            raise _write_error(exc, folder) from None


def _garbage(folder: Path, stem: str, live: CacheManifest | None) -> list[tuple[str, bool]]:
    """(name, is a temporary file) of each file garbage collection considers: payload
    files ``live`` does not name, and temporary files (removed unless a writer holds them)."""
    named = live.files if live is not None else set()
    prefix, gen_prefix = _temp_prefix(stem), f"{stem}.prepared.g"
    manifest_tmp = f".{stem}.prepared.onnx.tmp-"
    out = []
    for name in sorted(os.listdir(folder)):
        if name.startswith(gen_prefix) and name.endswith(".data") and name not in named:
            out.append((name, False))
        elif name.startswith(prefix) or name.startswith(manifest_tmp):
            out.append((name, True))
    return out


def _held(path: Path) -> bool:
    """Whether a live writer holds ``path``'s flock (it is still being written)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _unlink(path: Path, removed: list[str]) -> None:
    try:
        os.unlink(path)
        removed.append(path.name)
    except FileNotFoundError:
        pass


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
    done = 0
    while done < len(mv):
        done += os.pwrite(fd, mv[done:], offset + done)


def _zstd(raw: memoryview) -> bytes:
    """Compress in 1 MiB steps (a crash point between them)."""
    import zstandard

    cobj = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compressobj(size=len(raw))
    out = []
    for lo in range(0, len(raw), _CHUNK):
        crash_point("compress")
        out.append(cobj.compress(raw[lo:lo + _CHUNK]))
    out.append(cobj.flush())
    return b"".join(out)
