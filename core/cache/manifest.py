"""CacheManifest: the companion prepared model's index, and its one reader and writer.

The manifest is an ONNX ``ModelProto`` with no nodes: one UINT8 initializer
``prepared/<key>`` per persisted packed object, its bytes in external data (a payload
file beside the manifest), its identity in the tensor's ``metadata_props``; the
container's format version, generation and the source model's identity in the model's
``metadata_props``. docs/cache-format.md is the specification; this module is the only
code that encodes or decodes it.

Decoding validates before it trusts, field by field, as a header reader must: the file's
size is capped before it is parsed, every count and number is checked before it sizes
anything, payloads are in bounds, aligned and never overlap, and every failure is one
:class:`CacheFormatError` with a named ``reason``. Damage confined to one entry's payload
file (the file is missing, or shorter than the entry says) does not spoil the others: the
entry is listed in ``CacheManifest.damaged`` instead of ``entries``.
"""
from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from onnx_prep.core.cache.payload_digest import PAYLOAD_DIGEST
from onnx_prep.core.errors import OnnxPrepError, Where

__all__ = [
    "ALIGNMENT", "CACHE_FORMAT_VERSION", "HUGE_ALIGNMENT", "CacheEntry", "CacheFormatError", "CacheManifest",
    "DamagedEntry", "ENCODINGS", "SourceRecord", "decode_manifest", "encode_manifest", "payload_folder",
    "read_manifest",
]

CACHE_FORMAT_VERSION = 3  # the container's version (model metadata); entries carry the packed format's
# Versions this reader reads: they differ only in the payload digests their writer made
# (1 sha256, 2 xxh64, 3 xxh3; payload_digest.py), which the reader checks in the
# algorithm each digest names, so an entry kept from an older cache keeps its digest.
READABLE_VERSIONS = (1, 2, 3)
ALIGNMENT = 4096  # every payload starts on a 4 KiB boundary: it can be read straight into its slot
# The writer starts each plain (not compressed) payload of at least this size on a
# boundary of it: mapped at its slot (which starts on one), its whole 2 MiB units can be
# 2 MiB page-cache folios mapped by one page-table entry each. The reader does not
# require it (a 4 KiB-aligned payload of any size stays valid).
HUGE_ALIGNMENT = 2 << 20
ENCODINGS = ("zstd",)  # stored-bytes encodings besides none

MAX_MANIFEST_BYTES = 64 << 20  # ~300 bytes per entry: room for ~200,000 entries
MAX_ENTRIES = 1 << 20
MAX_PAYLOAD_BYTES = 1 << 44  # 16 TiB: any length or offset past this is not a payload
MAX_TEXT = 1 << 16  # longest metadata value (a lineage of many names, the sources record)

# Model metadata keys
META_FORMAT = "onnx_prep.prepared_cache.format_version"
META_GENERATION = "onnx_prep.prepared_cache.generation"
META_SOURCE_MODEL = "onnx_prep.prepared_cache.source_model_digest"
META_SOURCES = "onnx_prep.prepared_cache.sources"
# Tensor metadata keys: the prepack convention's names, so another reader of that
# convention finds the same fields.
PREFIX = "onnx_light.prepack."
T_LINEAGE_DIGEST = PREFIX + "source_lineage_digest"
T_LINEAGE = PREFIX + "source_lineage"
T_LAYOUT = PREFIX + "layout"
T_DEVICE = PREFIX + "device"
T_KERNEL_ABI = PREFIX + "kernel_abi"
T_FORMAT = PREFIX + "format_version"
T_PAYLOAD_DIGEST = PREFIX + "payload_digest"
T_ENCODING = PREFIX + "encoding"
T_DECODED_LENGTH = PREFIX + "decoded_length"
REQUIRED_TENSOR_KEYS = (T_LINEAGE_DIGEST, T_LINEAGE, T_LAYOUT, T_DEVICE, T_KERNEL_ABI, T_FORMAT,
                        T_PAYLOAD_DIGEST)
TENSOR_NAME_PREFIX = "prepared/"

_SHA256 = re.compile(r"^sha256:[0-9a-f]{64}$")
_DIGITS = re.compile(r"^[0-9]{1,20}$")  # ASCII decimal only: no sign, no spaces, no other digits
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")  # a bare name in the cache folder
_UINT8 = 2  # onnx.TensorProto.UINT8
_EXTERNAL = 1  # onnx.TensorProto.EXTERNAL


NOT_A_FILE_HINT = "move it away, or put the cache elsewhere: build-cache -o PATH, then run --prepared PATH"


class CacheFormatError(OnnxPrepError):
    """The prepared cache's manifest is malformed. ``reason`` names the rule broken
    (docs/cache-format.md, "Validation"); the message says which entry and field."""

    def __init__(self, reason: str, message: str, where: Where | None = None, hint: str | None = None):
        self.reason = reason
        super().__init__(f"prepared cache is invalid ({reason}): {message}", where or Where(),
                         hint or "rebuild it: onnx-prep build-cache --rebuild")


@dataclass(frozen=True, slots=True)
class SourceRecord:
    """A source weight the cache was built from: its digest, element type and dims."""

    digest: str
    onnx_type: int
    dims: tuple[int, ...]

    def to_json(self) -> dict:
        return {"digest": self.digest, "onnx_type": self.onnx_type, "dims": list(self.dims)}


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """One persisted packed object. ``length`` is the stored bytes at ``offset`` of
    ``file`` (a name in the cache's folder); ``decoded_length`` the packed object's size
    once decoded (equal to ``length`` without an encoding)."""

    key: str
    file: str
    offset: int
    length: int
    payload_digest: str  # xxh3 (or xxh64, sha256) of the stored bytes: payload_digest.py
    lineage_digest: str
    source_lineage: tuple[str, ...]
    layout: str
    device: str
    kernel_abi: str
    format_version: int  # the packed format's version
    encoding: str | None = None
    decoded_length: int = 0

    def __post_init__(self) -> None:
        if not self.decoded_length:
            object.__setattr__(self, "decoded_length", self.length)

    @property
    def tensor_name(self) -> str:
        return TENSOR_NAME_PREFIX + self.key

    def to_json(self) -> dict:
        return {"key": self.key, "file": self.file, "offset": self.offset, "length": self.length,
                "decoded_length": self.decoded_length, "encoding": self.encoding,
                "payload_digest": self.payload_digest, "lineage_digest": self.lineage_digest,
                "source_lineage": list(self.source_lineage), "layout": self.layout,
                "device": self.device, "kernel_abi": self.kernel_abi,
                "format_version": self.format_version}


@dataclass(frozen=True, slots=True)
class DamagedEntry:
    """An entry whose payload file is missing or too short: unusable, the rest stands."""

    entry: CacheEntry
    reason: str  # "missing_file" | "truncated"
    message: str


@dataclass(frozen=True)
class CacheManifest:
    generation: int
    source_model_digest: str
    sources: Mapping[str, SourceRecord]
    entries: tuple[CacheEntry, ...]
    damaged: tuple[DamagedEntry, ...] = ()
    format_version: int = CACHE_FORMAT_VERSION
    by_key: Mapping[str, CacheEntry] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_key", {e.key: e for e in self.entries})

    @property
    def files(self) -> set[str]:
        """Payload files the manifest names, damaged entries' included."""
        return {e.file for e in self.entries} | {d.entry.file for d in self.damaged}


# --------------------------------------------------------------------------- encode

def encode_manifest(manifest: CacheManifest) -> bytes:
    """The manifest's bytes: deterministic (entries sorted by key, sources by name, no
    timestamps), so equal caches are equal files (tests pin them)."""
    import onnx

    model = onnx.ModelProto()
    model.ir_version = 8
    model.producer_name = "onnx-prep"
    model.opset_import.add(domain="", version=17)
    graph = model.graph
    graph.name = "onnx-prep prepared cache"
    for e in sorted(manifest.entries, key=lambda e: e.key):
        t = graph.initializer.add()
        t.name = e.tensor_name
        t.data_type = _UINT8
        t.dims.append(e.length)
        t.data_location = _EXTERNAL
        for k, v in (("location", e.file), ("offset", str(e.offset)), ("length", str(e.length))):
            t.external_data.add(key=k, value=v)
        props = [(T_LINEAGE_DIGEST, e.lineage_digest), (T_LINEAGE, json.dumps(list(e.source_lineage))),
                 (T_LAYOUT, e.layout), (T_DEVICE, e.device), (T_KERNEL_ABI, e.kernel_abi),
                 (T_FORMAT, str(e.format_version)), (T_PAYLOAD_DIGEST, e.payload_digest)]
        if e.encoding is not None:
            props += [(T_ENCODING, e.encoding), (T_DECODED_LENGTH, str(e.decoded_length))]
        for k, v in props:
            t.metadata_props.add(key=k, value=v)
    sources = {n: manifest.sources[n].to_json() for n in sorted(manifest.sources)}
    for k, v in ((META_FORMAT, str(manifest.format_version)), (META_GENERATION, str(manifest.generation)),
                 (META_SOURCE_MODEL, manifest.source_model_digest),
                 (META_SOURCES, json.dumps(sources, separators=(",", ":")))):
        model.metadata_props.add(key=k, value=v)
    return model.SerializeToString(deterministic=True)


# --------------------------------------------------------------------------- decode

def payload_folder(path: Path, *, trust_symlinks: bool = False) -> Path:
    """The folder the manifest at ``path`` names its payload files in: its own. A
    symlinked manifest (read only with ``trust_symlinks``) is its target: the writer put
    the payloads beside the file it published, which is the target, not the link."""
    path = Path(path)
    if trust_symlinks and os.path.islink(path):
        return Path(os.path.realpath(path)).parent
    return path.parent


def read_manifest(path: Path, *, trust_symlinks: bool = False) -> CacheManifest | None:
    """The manifest at ``path``, validated (payload files stat'ed in
    :func:`payload_folder`, never read), or None when there is none. A symlink is refused
    (reason ``symlink``) unless ``trust_symlinks``, and then read through. Raises
    :class:`CacheFormatError`."""
    path = Path(path)
    where = Where(file=str(path))
    real = path
    if os.path.islink(path):
        if not trust_symlinks:
            raise CacheFormatError("symlink", f"{path.name} is a symlink (to {os.readlink(path)})", where,
                                   hint=f"name its target instead ({os.path.realpath(path)}), or trust the "
                                   "link: --trust-symlinks")
        real = Path(os.path.realpath(path))  # what is opened is what the payloads are found beside
    try:
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None  # a link to nothing, when trusted, is no cache either
    except OSError as exc:
        raise CacheFormatError("unreadable", f"cannot open the manifest: {exc.strerror}", where) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            # NOTE: not "rebuild it": --rebuild replaces a malformed manifest file, never a
            # folder or a FIFO in its place (prepared_cache.py, UNREPLACEABLE).
            what = "a directory, not a manifest" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise CacheFormatError("not_a_file", f"{path.name} is {what}", where, hint=NOT_A_FILE_HINT)
        if st.st_size > MAX_MANIFEST_BYTES:
            raise CacheFormatError("too_large", f"the manifest is {st.st_size:,} bytes, over the "
                                   f"{MAX_MANIFEST_BYTES:,}-byte cap", where)
        data = bytearray()
        while len(data) < st.st_size + 1:  # one byte more: a file that grew is still capped
            chunk = os.read(fd, st.st_size + 1 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if len(data) > MAX_MANIFEST_BYTES:
        raise CacheFormatError("too_large", "the manifest grew past the cap while read", where)
    return decode_manifest(bytes(data), real.parent, where=where)


def decode_manifest(data: bytes, folder: Path, *, where: Where | None = None) -> CacheManifest:
    """Decode and validate manifest bytes; payload files are looked up in ``folder``."""
    import onnx
    from google.protobuf.message import DecodeError

    where = where or Where()
    if len(data) > MAX_MANIFEST_BYTES:
        raise CacheFormatError("too_large", f"{len(data):,} bytes, over the cap", where)
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise CacheFormatError("unparseable", f"not an ONNX protobuf ({exc})", where) from None
    meta = _unique_props(model.metadata_props, where, "model metadata")
    version = _int_field(meta, META_FORMAT, where, "model metadata")
    if version not in READABLE_VERSIONS:
        raise CacheFormatError("format_version", f"container format version {version}; this "
                               f"onnx-prep reads versions {', '.join(map(str, READABLE_VERSIONS))}", where)
    generation = _int_field(meta, META_GENERATION, where, "model metadata")
    source_model = _digest_field(meta, META_SOURCE_MODEL, where, "model metadata")
    sources = _sources(meta.get(META_SOURCES), where)
    if model.graph.node:
        raise CacheFormatError("has_nodes", "a prepared cache holds initializers only", where)
    if len(model.graph.initializer) > MAX_ENTRIES:
        raise CacheFormatError("too_many_entries", f"{len(model.graph.initializer):,} entries, over "
                               f"the {MAX_ENTRIES:,} cap", where)
    entries: list[CacheEntry] = []
    seen: set[str] = set()
    for t in model.graph.initializer:
        e = _entry(t, Where(file=where.file, tensor=t.name))
        if e.key in seen:
            raise CacheFormatError("duplicate_entry", "two entries for one key",
                                   Where(file=where.file, tensor=t.name))
        seen.add(e.key)
        entries.append(e)
    good, damaged = _check_payload_files(entries, Path(folder), where)
    return CacheManifest(generation=generation, source_model_digest=source_model, sources=sources,
                         entries=tuple(good), damaged=tuple(damaged), format_version=version)


def _unique_props(props, where: Where, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for p in props:
        if p.key in out:
            raise CacheFormatError("duplicate_key", f"{what} has {p.key!r} twice", where)
        if len(p.value) > MAX_TEXT:
            raise CacheFormatError("value_too_long", f"{what} {p.key!r} is {len(p.value):,} "
                                   f"characters, over {MAX_TEXT:,}", where)
        out[p.key] = p.value
    return out


def _required(props: Mapping[str, str], key: str, where: Where, what: str) -> str:
    value = props.get(key)
    if value is None:
        raise CacheFormatError("missing_field", f"{what} has no {key!r}", where)
    return value


def _int_field(props: Mapping[str, str], key: str, where: Where, what: str, *, cap: int = MAX_PAYLOAD_BYTES) -> int:
    value = _required(props, key, where, what)
    if not _DIGITS.match(value) or int(value) > cap:
        raise CacheFormatError("bad_number", f"{what} {key!r} is {value!r}, not a decimal in [0, {cap}]", where)
    return int(value)


def _digest_field(props: Mapping[str, str], key: str, where: Where, what: str) -> str:
    value = _required(props, key, where, what)
    if not _SHA256.match(value):
        raise CacheFormatError("bad_digest", f"{what} {key!r} is not sha256:<64 hex digits>", where)
    return value


def _payload_digest_field(props: Mapping[str, str], where: Where) -> str:
    value = _required(props, T_PAYLOAD_DIGEST, where, "metadata_props")
    if not PAYLOAD_DIGEST.match(value):
        raise CacheFormatError("bad_digest", f"metadata_props {T_PAYLOAD_DIGEST!r} is not "
                               "xxh3:<16 hex digits>, xxh64:<16 hex digits> or sha256:<64 hex digits>",
                               where)
    return value


def _sources(text: str | None, where: Where) -> dict[str, SourceRecord]:
    if text is None:
        raise CacheFormatError("missing_field", f"model metadata has no {META_SOURCES!r}", where)
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        out = {}
        for name, rec in doc.items():
            dims = rec["dims"]
            if not (isinstance(rec["onnx_type"], int) and isinstance(dims, list)
                    and all(isinstance(d, int) and 0 <= d <= MAX_PAYLOAD_BYTES for d in dims)
                    and isinstance(rec["digest"], str)):
                raise ValueError(f"source {name!r}")
            out[name] = SourceRecord(rec["digest"], rec["onnx_type"], tuple(dims))
        return out
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CacheFormatError("bad_sources", f"{META_SOURCES!r} is not a sources record ({exc})", where) from None


def _entry(t, where: Where) -> CacheEntry:
    if not t.name.startswith(TENSOR_NAME_PREFIX):
        raise CacheFormatError("bad_name", f"entry name does not start with {TENSOR_NAME_PREFIX!r}", where)
    if t.data_type != _UINT8 or len(t.dims) != 1:
        raise CacheFormatError("bad_tensor", "an entry is a 1-D UINT8 tensor", where)
    if t.data_location != _EXTERNAL or t.raw_data or t.int32_data:
        raise CacheFormatError("not_external", "an entry's bytes are in external data, never inline", where)
    ext = _unique_props(t.external_data, where, "external_data")
    unknown = set(ext) - {"location", "offset", "length", "checksum"}
    if unknown:
        raise CacheFormatError("unknown_key", f"external_data has unknown key(s) {sorted(unknown)}", where)
    location = _required(ext, "location", where, "external_data")
    if not _FILE_NAME.match(location):
        raise CacheFormatError("bad_location", f"payload location {location!r} is not a bare file "
                               "name in the cache's folder", where)
    offset = _int_field(ext, "offset", where, "external_data")
    length = _int_field(ext, "length", where, "external_data")
    where = Where(file=where.file, tensor=where.tensor, offset=offset)
    if offset % ALIGNMENT:
        raise CacheFormatError("misaligned", f"payload offset {offset} is not a multiple of {ALIGNMENT}", where)
    if t.dims[0] != length:
        raise CacheFormatError("length_mismatch", f"dims say {t.dims[0]} bytes, external_data {length}", where)
    props = _unique_props(t.metadata_props, where, "metadata_props")
    for k in REQUIRED_TENSOR_KEYS:
        _required(props, k, where, "metadata_props")
    try:
        lineage = json.loads(props[T_LINEAGE])
        if not (isinstance(lineage, list) and lineage and all(isinstance(n, str) for n in lineage)):
            raise ValueError
    except (ValueError, RecursionError):
        raise CacheFormatError("bad_lineage", f"{T_LINEAGE!r} is not a JSON list of names", where) from None
    layout, device = props[T_LAYOUT], props[T_DEVICE]
    key = t.name[len(TENSOR_NAME_PREFIX):]
    if key != f"P:{'+'.join(lineage)}|{layout}|{device}":
        raise CacheFormatError("key_mismatch", "the entry's name is not the key of its lineage, "
                               "layout and device", where)
    encoding = props.get(T_ENCODING)
    if encoding is not None and encoding not in ENCODINGS:
        raise CacheFormatError("unknown_encoding", f"encoding {encoding!r}; known: {', '.join(ENCODINGS)}", where)
    if (encoding is None) != (T_DECODED_LENGTH not in props):
        raise CacheFormatError("missing_field", f"{T_DECODED_LENGTH!r} goes with {T_ENCODING!r}", where)
    decoded = _int_field(props, T_DECODED_LENGTH, where, "metadata_props") if encoding else length
    return CacheEntry(
        key=key, file=location, offset=offset, length=length,
        payload_digest=_payload_digest_field(props, where),
        lineage_digest=_digest_field(props, T_LINEAGE_DIGEST, where, "metadata_props"),
        source_lineage=tuple(lineage), layout=layout, device=device, kernel_abi=props[T_KERNEL_ABI],
        format_version=_int_field(props, T_FORMAT, where, "metadata_props", cap=1 << 31),
        encoding=encoding, decoded_length=decoded)


def _check_payload_files(entries: list[CacheEntry], folder: Path, where: Where
                         ) -> tuple[list[CacheEntry], list[DamagedEntry]]:
    """Per payload file: no two entries overlap (structural), and each entry lies
    inside the file as it is now (else the entry alone is damaged). Stat only."""
    by_file: dict[str, list[CacheEntry]] = {}
    for e in entries:
        by_file.setdefault(e.file, []).append(e)
    good: list[CacheEntry] = []
    damaged: list[DamagedEntry] = []
    for name, es in sorted(by_file.items()):
        es.sort(key=lambda e: e.offset)
        for a, b in zip(es, es[1:]):
            if a.offset + a.length > b.offset:
                raise CacheFormatError("overlap", f"entries {a.key!r} and {b.key!r} overlap in {name}",
                                       Where(file=where.file, tensor=b.tensor_name, offset=b.offset))
        try:
            st = os.lstat(folder / name)
            size = st.st_size if stat.S_ISREG(st.st_mode) else None
        except FileNotFoundError:
            size = None
        for e in es:
            if size is None:
                damaged.append(DamagedEntry(e, "missing_file", f"payload file {name} is missing or not a regular file"))
            elif e.offset + e.length > size:
                damaged.append(DamagedEntry(e, "truncated", f"payload [{e.offset}, {e.offset + e.length}) "
                                            f"is past the end of {name} ({size} bytes)"))
            else:
                good.append(e)
    return good, damaged
