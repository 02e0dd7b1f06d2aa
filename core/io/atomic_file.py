"""Writing a whole file atomically: a reader (or a crash) sees the old file or the
whole new one, never a part (fixture models, the JUnit report of ``onnx-prep check``,
the arrays ``onnx-prep run`` writes: ``--logits-out``, ``--outputs-out``)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    import numpy as np


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


def write_arrays_atomically(path: Path, arrays: Mapping[str, "np.ndarray"]) -> None:
    """``arrays`` as an uncompressed ``.npz`` (numpy's format: member ``NAME.npy`` per
    array, read back by name with ``np.load``), written with ``write_atomically``. Written
    member by member rather than through ``np.savez``, whose keyword form cannot take
    every name (``file``). Raises OSError."""
    import io
    import zipfile

    from numpy.lib import format as npy

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                npy.write_array(member, array, allow_pickle=False)
    write_atomically(Path(path), buf.getbuffer())
