"""The io-map: a small JSON file that names a decoder's I/O roles where discovery cannot
(format: docs/run.md), read bounded and validated (``load_io_map``), and the role and
layout names it shares with discovery (core/decode/decoder_io.py)."""
from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from onnx_prep.core.errors import UsageError, Where

__all__ = ["EXTRA_ROLES", "IO_MAP_KEYS", "IO_MAP_KV_KEYS", "IO_MAP_MAX_BYTES", "IO_MAP_MAX_DEPTH", "KV_LAYOUTS",
           "load_io_map", "validate_io_map"]

KV_LAYOUTS = ("bhsd", "bshd")

# Extra inputs computed from the sequence lengths at each step; see generation.py.
#   seqlens_k              int32 [batch]: total length - 1 (GroupQueryAttention)
#   total_sequence_length  int32 scalar: total length (GroupQueryAttention)
#   cache_position         int64 [seq]: positions of the new tokens (HF exports)
#   use_cache_branch       bool [1]: past is non-empty (optimum merged decoders)
EXTRA_ROLES = ("seqlens_k", "total_sequence_length", "cache_position", "use_cache_branch")

IO_MAP_KEYS = ("input_ids", "attention_mask", "position_ids", "logits", "kv", "kv_layout",
               "kv_heads", "head_dim") + EXTRA_ROLES
IO_MAP_KV_KEYS = ("past_key", "past_value", "present_key", "present_value")

IO_MAP_MAX_BYTES = 1 << 20  # the format needs a few KiB even for a hundred layers
IO_MAP_MAX_DEPTH = 16  # the format nests 3 deep
_JSON_TOKEN = re.compile(rb'\\.|[\[\]{}"]', re.DOTALL)


def load_io_map(path: str | Path) -> dict[str, Any]:
    """Read and validate an io-map JSON file (format: docs/run.md).

    Read bounded: only a regular file (a FIFO, device or folder is refused, and the
    open never blocks), at most ``IO_MAP_MAX_BYTES``, nested at most
    ``IO_MAP_MAX_DEPTH`` deep. Raises ``UsageError`` with the file as Where for any of
    those, unreadable JSON, unknown keys or wrong value types; names are checked
    against the model later, by ``discover``."""
    where = Where(file=str(path))
    data = _read_bounded(Path(path), where)
    depth = _json_depth(data)
    if depth > IO_MAP_MAX_DEPTH:
        raise UsageError(f"io-map nests {depth} levels deep, more than {IO_MAP_MAX_DEPTH}", where)
    try:
        return validate_io_map(json.loads(data.decode("utf-8")), where)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"io-map is not valid JSON: {exc}", where) from exc


def _read_bounded(path: Path, where: Where) -> bytes:
    """The bytes of a regular file of at most ``IO_MAP_MAX_BYTES``. O_NONBLOCK: opening
    a FIFO with no writer returns at once (then refused as not a regular file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as exc:
        raise UsageError("io-map file not found", where) from exc
    except OSError as exc:
        raise UsageError(f"cannot open the io-map: {exc.strerror}", where) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError("io-map is not a regular file", where)
        if st.st_size > IO_MAP_MAX_BYTES:
            raise UsageError(f"io-map is {st.st_size:,} bytes, more than {IO_MAP_MAX_BYTES:,}", where)
        chunks, size = [], 0
        while size <= IO_MAP_MAX_BYTES:  # a file grown since the fstat is still read bounded
            chunk = os.read(fd, IO_MAP_MAX_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise UsageError(f"cannot read the io-map: {exc.strerror}", where) from exc
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > IO_MAP_MAX_BYTES:
        raise UsageError(f"io-map is more than {IO_MAP_MAX_BYTES:,} bytes", where)
    return data


def _json_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text, brackets inside strings
    skipped; measured before parsing, whose recursion it bounds."""
    depth = deepest = 0
    in_string = False
    for m in _JSON_TOKEN.finditer(data):
        c = m.group()
        if len(c) == 2:  # an escape: never a quote or a bracket
            continue
        if c == b'"':
            in_string = not in_string
        elif in_string:
            continue
        elif c in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def validate_io_map(data: Any, where: Where = Where()) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise UsageError("io-map must be a JSON object", where)
    unknown = sorted(set(data) - set(IO_MAP_KEYS))
    if unknown:
        raise UsageError(f"io-map has unknown keys {unknown}", where,
                         hint=f"valid keys: {', '.join(IO_MAP_KEYS)}")
    for key in ("input_ids", "attention_mask", "position_ids", "logits") + EXTRA_ROLES:
        if key in data and data[key] is not None and not isinstance(data[key], str):
            raise UsageError(f"io-map {key!r} must be a tensor name (string) or null", where)
    if "kv_layout" in data and data["kv_layout"] not in KV_LAYOUTS:
        raise UsageError(f"io-map kv_layout must be one of {list(KV_LAYOUTS)}", where)
    for key in ("kv_heads", "head_dim"):
        if key in data and (not isinstance(data[key], int) or isinstance(data[key], bool)
                            or data[key] <= 0):
            raise UsageError(f"io-map {key!r} must be a positive integer", where)
    if "kv" in data:
        if not isinstance(data["kv"], list):
            raise UsageError("io-map 'kv' must be a list of per-layer objects", where)
        for i, entry in enumerate(data["kv"]):
            if (not isinstance(entry, dict) or set(entry) != set(IO_MAP_KV_KEYS)
                    or not all(isinstance(v, str) for v in entry.values())):
                raise UsageError(f"io-map kv[{i}] must map exactly {list(IO_MAP_KV_KEYS)} to names",
                                 where)
    return dict(data)
