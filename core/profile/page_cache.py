"""Files in the page cache: how much of each is resident, and dropping them, so that a
cold load reads from the device (``onnx-prep profile --cold``).

:func:`drop_files` asks the kernel to drop each file's pages (``fsync`` first, then
``posix_fadvise(POSIX_FADV_DONTNEED)``: no root needed, any file we can open), then
measures what is still resident with ``mincore`` over a fresh read-only mapping (the
native module's ``op_resident_bytes``). The kernel keeps pages that another process
maps or locks, and dirty pages it could not write back: the record says how many bytes
stayed, so a drop that did not take is reported, never assumed.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

__all__ = ["resident_bytes", "drop_files"]


def resident_bytes(path: Path) -> int | None:
    """Bytes of ``path`` in the page cache now (None where mincore is unavailable)."""
    try:
        import numpy as np

        from onnx_prep.native._module import ffi, lib
    except ImportError:
        return None
    size = os.path.getsize(path)
    if size == 0:
        return 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mm:
        view = np.frombuffer(mm, dtype=np.uint8)
        try:
            # whole pages: the mapping covers the last partial page too
            pages = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
            n = lib.op_resident_bytes(ffi.cast("const void *", view.ctypes.data), pages)
        finally:
            del view  # the mapping closes only once no buffer refers to it
    return None if n < 0 else min(int(n), size)


def drop_files(paths) -> dict:
    """Drop each file's pages; ``{"files", "bytes", "resident_after", "dropped"}``:
    ``resident_after`` is what stayed (None: could not be measured), ``dropped`` whether
    nothing did (None: unknown). A file that cannot be opened raises OSError."""
    total, resident, known = 0, 0, True
    files = sorted({Path(p) for p in paths})
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        total += os.path.getsize(p)
        r = resident_bytes(p)
        if r is None:
            known = False
        else:
            resident += r
    return {"files": len(files), "bytes": total, "resident_after": resident if known else None,
            "dropped": (resident == 0) if known else None}
