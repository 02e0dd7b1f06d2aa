"""Writing a whole file atomically: a reader (or a crash) sees the old file or the
whole new one, never a part (fixture models, the JUnit report of ``onnx-prep check``)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """``data`` to ``path`` through a temporary file in the same folder, fsynced, then
    renamed over it (``mode``: mkstemp's 0600 is too private for a model or a report).
    Raises OSError; the temporary file is gone either way."""
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        os.chmod(tmp, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
