"""The model file: finding it, checking it and parsing its protobuf (never its
external data). Resolution and decoder I/O discovery both start here, so a missing,
unreadable or foreign file gets the same one-line error whichever command met it.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from onnx_prep.core.errors import ModelFormatError, UsageError, Where

if TYPE_CHECKING:
    import onnx


def find_model_file(path: Path, *, folder: bool = False) -> Path:
    """``path`` checked to be an existing file; with ``folder``, a folder stands for the
    one ``.onnx`` file it holds, not counting a prepared cache's manifest
    (``*.prepared.onnx``, docs/cache-format.md). Raises ``UsageError`` naming the path."""
    if folder and path.is_dir():
        found = sorted(p for p in path.glob("*.onnx") if not p.name.endswith(".prepared.onnx"))
        if len(found) != 1:
            raise UsageError(f"folder holds {len(found)} .onnx files, expected exactly one",
                             Where(model=str(path)), hint="pass the model file itself")
        path = found[0]
    if not path.exists():
        raise UsageError("model file not found", Where(model=str(path)))
    if not path.is_file():
        raise UsageError("model path is not a file", Where(model=str(path)),
                         hint="pass the .onnx file itself")
    return path


def parse_model_file(path: Path) -> "onnx.ModelProto":
    """The model's protobuf, external data left unread. A file that does not parse, or
    parses to no model (an empty or foreign file can), is a ``ModelFormatError``; one
    that cannot be read, a ``UsageError``."""
    import onnx
    from google.protobuf.message import DecodeError

    where = Where(model=str(path))
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except DecodeError as exc:
        raise ModelFormatError(f"not an ONNX protobuf or truncated file ({exc})", where) from None
    except OSError as exc:
        raise UsageError(f"cannot read the model file: {exc.strerror}", where) from None
    except Exception as exc:  # noqa: BLE001 - onnx wraps some decode failures in other types
        raise ModelFormatError(f"not an ONNX protobuf ({type(exc).__name__}: {exc})", where) from None
    if proto.ir_version <= 0 or not proto.HasField("graph"):
        raise ModelFormatError("not an ONNX model (no ir_version or no graph; truncated file?)", where)
    return proto
