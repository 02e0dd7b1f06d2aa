"""PayloadFiles: a prepared cache's payload files, each opened once, and an entry's
stored bytes read out of them, checked against its payload digest as they are read:
into the packed object's slot (decoded where the entry is compressed), or whole, only to
check them (docs/cache-format.md: payloads are opened with ``O_NOFOLLOW`` and MUST be
regular files; each digest is checked in the algorithm it names)."""
from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import numpy as np

from onnx_prep.core.cache.manifest import CacheEntry
from onnx_prep.core.cache.payload_digest import PayloadHasher

__all__ = ["PayloadFiles", "PayloadUnusable", "payload_problem", "read_payload"]

_CHUNK = 1 << 20


class PayloadUnusable(Exception):
    """An entry's stored bytes cannot be used; the message says why in one line (the
    cache records it as a warning and the object is rebuilt from its sources)."""


class PayloadFiles:
    """The payload files of one cache's folder, opened on first use and kept open until
    :meth:`close`: a later commit's garbage collection may unlink one, but cannot take
    it from under this reader. Thread-safe."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._sizes: dict[str, int] = {}  # each file's size when it was opened

    def fd(self, name: str) -> int:
        """The open descriptor of payload file ``name``. Raises OSError, or
        PayloadUnusable for a file that is not a regular one."""
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                fd = os.open(self.folder / name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                             | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    os.close(fd)
                    raise PayloadUnusable(f"{name} is not a regular file")
                # NOTE: its size as opened is what ``PreparedCache.mapping`` checks an
                # entry against (one fstat a file, not one a payload: each released the
                # GIL to a waiting worker). A file that shrinks later is the guard's to
                # catch (``StableSlot.mapping_intact``; ``read_payload`` reads short).
                self._sizes[name] = st.st_size
                self._fds[name] = fd
            return fd

    def size(self, name: str) -> int:
        """Payload file ``name``'s size when :meth:`fd` opened it (set once, before
        :meth:`fd` returns, never changed: read without the lock)."""
        return self._sizes[name]

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


def read_payload(fd: int, e: CacheEntry, buf: np.ndarray, hasher: PayloadHasher | None) -> None:
    """Fill ``buf`` (uint8, exactly ``e.decoded_length`` bytes) with entry ``e``'s bytes
    from ``fd``, decoded, feeding the stored bytes to ``hasher`` as they are read (the
    caller compares its digest). Raises PayloadUnusable or OSError."""
    if buf.nbytes != e.decoded_length:
        raise PayloadUnusable(f"slot is {buf.nbytes} bytes, entry decodes to {e.decoded_length}")
    if e.encoding is not None:
        _decode_zstd(fd, e, buf, hasher)
        return
    mv = memoryview(buf)
    got = 0
    while got < e.length:
        n = os.preadv(fd, [mv[got:min(e.length, got + _CHUNK)]], e.offset + got)
        if n == 0:
            raise PayloadUnusable("payload file ended early (truncated while in use)")
        if hasher is not None:
            hasher.update(mv[got:got + n])
        got += n


def payload_problem(files: PayloadFiles, e: CacheEntry) -> str | None:
    """Entry ``e``'s stored bytes read whole and checked against its digest (1 MiB at a
    time: bounded memory); what is wrong with them, or None."""
    try:
        fd = files.fd(e.file)
        h = PayloadHasher.matching(e.payload_digest)
        for lo in range(0, e.length, _CHUNK):
            chunk = os.pread(fd, min(_CHUNK, e.length - lo), e.offset + lo)
            if not chunk:
                raise PayloadUnusable("payload file ended early")
            h.update(chunk)
        if h.digest() != e.payload_digest:
            raise PayloadUnusable(f"payload does not match its digest {e.payload_digest}")
    except (OSError, PayloadUnusable) as exc:
        return str(exc)
    return None


def _decode_zstd(fd: int, e: CacheEntry, buf: np.ndarray, h) -> None:
    import zstandard

    dobj = zstandard.ZstdDecompressor().decompressobj()
    pos = 0
    for lo in range(0, e.length, _CHUNK):
        chunk = os.pread(fd, min(_CHUNK, e.length - lo), e.offset + lo)
        if not chunk:
            raise PayloadUnusable("payload file ended early (truncated while in use)")
        if h is not None:
            h.update(chunk)
        try:
            out = dobj.decompress(chunk)
        except zstandard.ZstdError as exc:
            raise PayloadUnusable(f"payload does not decompress ({exc})") from None
        if pos + len(out) > buf.nbytes:
            raise PayloadUnusable("payload decompresses to more bytes than recorded")
        buf[pos:pos + len(out)] = np.frombuffer(out, dtype=np.uint8)
        pos += len(out)
    if pos != buf.nbytes:
        raise PayloadUnusable(f"payload decompresses to {pos} bytes, {buf.nbytes} recorded")
