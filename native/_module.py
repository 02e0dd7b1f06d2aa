"""Loading of the compiled module, its version check, and status -> error mapping.

The C module is built from this package's sources at install time; a module left
over from another version would silently disagree with the Python side about
packed formats, so import refuses it (rebuild with ``make install``).
"""
from __future__ import annotations

from onnx_prep.core.errors import NativeError

try:
    from onnx_prep.native._native import ffi, lib
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    raise NativeError(
        f"the native module onnx_prep.native._native is missing ({exc})",
        hint="rebuild it: `make install` (or `pip install -e .`) in the repository",
    ) from exc

NATIVE_VERSION: str = ffi.string(lib.op_native_version()).decode()


def _check_version() -> None:
    from onnx_prep import __version__

    # NOTE: a bare checkout (no installed metadata) reports "0+unknown"; there is
    # nothing to compare against then, so only a known version is enforced.
    if __version__ != "0+unknown" and __version__ != NATIVE_VERSION:
        raise NativeError(
            f"native module version {NATIVE_VERSION} does not match onnx-prep {__version__}",
            hint="rebuild it: `make install` (or `pip install -e .`) in the repository",
        )


_check_version()


def check(status: int, what: str) -> None:
    """Raise the error a negative op_status stands for; ``what`` names the call."""
    if status == lib.OP_OK:
        return
    text = ffi.string(lib.op_status_string(status)).decode()
    if status == lib.OP_E_HEADER:
        raise NativeError(f"{what}: {text}",
                          hint="the buffer is not a packed buffer of this kind and format version; repack it")
    if status == lib.OP_E_ISA:
        raise NativeError(f"{what}: {text}")
    if status == lib.OP_E_NOMEM:
        raise MemoryError(f"{what}: {text}")
    raise ValueError(f"{what}: {text} (status {status})")
