"""Weight digests: computing, checking and recording the digests of a model's external
weights (``onnx-prep digest``, docs/digest.md).

The digests, all understood by resolution and checked by the reader:

- per tensor, the SHA-256 of its bytes, ``metadata_props[onnx_prep.sha256] =
  "sha256:<hex>"``, and their XXH3-64, ``metadata_props[onnx_prep.xxh3] =
  "xxh3:<hex>"`` (fine: a changed byte invalidates one tensor). A load checks the XXH3
  one (~16x faster; core/io/content_digest.py says why that suffices); the SHA-256 one
  is the weight's identity (a prepared cache's lineage) and ``check --verify-payloads``
  checks both;
- per data file, the ONNX external-data ``checksum``: the SHA-1 of the whole file, on
  every external-data entry that names the file (coarse: the whole file).

``compute_digests`` reads each data file once, front to back, through the one reader
(``ExternalDataReader.scan_file``, 1 MiB at a time: bounded memory), and feeds every
chunk to the file's SHA-1 and to the SHA-256 and XXH3 of each tensor it overlaps, so each
byte is read once for all. Digests the model already records are checked on that same pass; a
mismatch is a ``DigestError`` naming tensor, file, offset and both digests, and nothing
is written. ``write_digests`` writes a new model file carrying the missing digests,
atomically (temporary file in the target's folder, fsync, rename, fsync of the folder);
the data files are never written.

Which weights: the external initializers the model uses (resolution's payload manifest:
what the runtime reads, what ``resolve`` counts). Inline initializers get no digest:
their bytes are inside the protobuf, no reader ever reads them from a data file, and
the model file's own identity covers them. Initializers no node uses (pruned, as ONNX
Runtime drops them too) are never read, so they get only the file's ``checksum``.
"""
from __future__ import annotations

import hashlib
import os
import stat
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager

from onnx_prep.core.errors import DigestError, UsageError, Where
from onnx_prep.core.model.weights import TENSOR_DIGEST_KEY, TENSOR_FAST_DIGEST_KEY

DIGEST_SCHEMA_VERSION = 2  # 2: each tensor's xxh3
PROTOBUF_LIMIT = (1 << 31) - 1  # protobuf cannot serialize a message of 2 GiB or more

# ``progress(label, total_bytes)``: a context manager giving ``advance(nbytes)``.
Progress = Callable[[str, int], ContextManager[Callable[[int], None]]]

VERIFIED, MISSING, ADDED = "verified", "missing", "added"


@dataclass
class TensorDigest:
    """One external weight's SHA-256 and XXH3: both recorded and checked (verified),
    either absent (missing; a recorded one is still checked), or the absent ones now
    written (added)."""

    name: str
    file: str
    offset: int
    length: int
    sha256: str  # "sha256:<hex>", computed
    xxh3: str  # "xxh3:<hex>", computed
    status: str
    missing: tuple[str, ...] = ()  # the metadata keys a write adds

    def to_json(self) -> dict:
        return {"name": self.name, "file": self.file, "offset": self.offset, "length": self.length,
                "sha256": self.sha256, "xxh3": self.xxh3, "status": self.status}


@dataclass
class FileDigest:
    """One data file's SHA-1 (the ONNX ``checksum``); ``entries`` external-data entries
    name the file, ``entries_missing`` of them without a checksum. Status: verified when
    every entry recorded it, missing when some did not (those that did were checked),
    added once written."""

    file: str
    bytes: int
    sha1: str  # 40 hex digits, as the ONNX key holds it
    status: str
    entries: int
    entries_missing: int
    identity: tuple[int, int, int, int] = field(repr=False, default=(0, 0, 0, 0))

    def to_json(self) -> dict:
        return {"file": self.file, "bytes": self.bytes, "sha1": self.sha1, "status": self.status,
                "entries": self.entries, "entries_missing": self.entries_missing}


@dataclass
class WeightDigests:
    """What ``compute_digests`` found: every digest, computed, with its status."""

    model_path: Path
    model_dir: Path
    tensors: list[TensorDigest]
    files: list[FileDigest]
    inline: int  # inline initializers (no digest: the protobuf holds their bytes)
    unused: int  # external initializers no node uses (only the file checksum)
    bytes_hashed: int
    hash_s: float
    proto: object = field(repr=False, default=None)  # the ModelProto, metadata only
    model_identity: tuple[int, int, int, int] = field(repr=False, default=(0, 0, 0, 0))

    @property
    def complete(self) -> bool:
        """Every digest is recorded in the model already: a write would change nothing."""
        return all(t.status != MISSING for t in self.tensors) and all(f.status != MISSING for f in self.files)


def compute_digests(path: str | os.PathLike, *, trust_symlinks: bool = False,
                    progress: Progress | None = None) -> WeightDigests:
    """Hash every data file of the model at ``path`` once, and with it every external
    weight the model uses; check the digests it records. Raises DigestError on the first
    mismatch, and resolution's errors for a model it refuses."""
    from onnx_prep.core.io.external_data import ExternalDataReader, file_identity
    from onnx_prep.core.model.model_file import find_model_file, parse_model_file
    from onnx_prep.core.model.resolution import resolve_model

    model_path = Path(os.path.abspath(find_model_file(Path(path), folder=True)))
    # Before anything reads it: a model file replaced from here on is not overwritten.
    model_identity = file_identity(os.stat(model_path))
    resolved = resolve_model(model_path, trust_symlinks=trust_symlinks)
    model = str(resolved.model_path)
    proto = parse_model_file(resolved.model_path)
    recorded, recorded_sha1, entries = _recorded(proto)
    manifest = list(resolved.manifest)
    reader = ExternalDataReader.for_model(resolved, trust_symlinks=trust_symlinks, verify_digests=False)

    by_file: dict[str, list] = {}
    for d in manifest:
        by_file.setdefault(d.file, []).append(d)
    sizes = {f: os.stat(resolved.model_dir / f).st_size for f in by_file}
    total = sum(sizes.values())
    tensors: dict[str, TensorDigest] = {}
    files: list[FileDigest] = []
    t0 = time.perf_counter()
    with (progress("hashing", total) if progress else nullcontext(None)) as advance, \
            ThreadPoolExecutor(1, thread_name_prefix="sha1") as pool:
        for file, descs in by_file.items():
            pass_ = _FilePass(descs, advance, pool)
            st = reader.scan_file(file, pass_.visit)
            sha1 = pass_.sha1.hexdigest()
            for d in descs:
                got = {key: h.digest() for key, h in pass_.hashers[d.name].items()}
                missing = []
                for key, computed in got.items():
                    want = recorded.get((d.name, key))
                    if want is None:
                        missing.append(key)
                    elif want != computed:
                        raise DigestError(f"tensor bytes do not match their recorded digest: recorded {want}, "
                                          f"computed {computed}", Where(model=model, tensor=d.name, file=file,
                                                                        offset=d.offset),
                                          hint="the data file changed after the digest was recorded; "
                                               "nothing was written")
                tensors[d.name] = TensorDigest(d.name, file, d.offset, d.length, got[TENSOR_DIGEST_KEY],
                                               got[TENSOR_FAST_DIGEST_KEY], MISSING if missing else VERIFIED,
                                               tuple(missing))
            named = entries.get(file, [])
            for name in named:
                want = recorded_sha1.get(name)
                if want is not None and want != sha1:
                    raise DigestError(f"data file bytes do not match their recorded checksum: recorded sha1:{want}, "
                                      f"computed sha1:{sha1}", Where(model=model, tensor=name, file=file, offset=0),
                                      hint="the data file changed after the checksum was recorded; nothing was written")
            missing = sum(1 for name in named if name not in recorded_sha1)
            files.append(FileDigest(file, st.st_size, sha1, MISSING if missing else VERIFIED, len(named), missing,
                                    file_identity(st)))
    hash_s = time.perf_counter() - t0
    external = external_names(proto)
    return WeightDigests(
        model_path=resolved.model_path, model_dir=resolved.model_dir,
        tensors=[tensors[d.name] for d in sorted(manifest, key=lambda d: (d.file, d.offset, d.name))],
        files=files, inline=len(proto.graph.initializer) - len(external),
        unused=len(external - {d.name for d in manifest}), bytes_hashed=reader.counters.bytes_read,
        hash_s=hash_s, proto=proto, model_identity=model_identity)


class _FilePass:
    """The hashes of one pass over a data file: the file's SHA-1, and the SHA-256 and
    XXH3 of each tensor, fed the parts of each chunk that fall inside it (tensors may
    overlap).

    NOTE: with ``pool`` (one worker thread), the chunk's SHA-1 runs there while this
    thread runs its SHA-256s: hashlib releases the GIL for large buffers, so the two
    hashes share a chunk on two cores. On the medium fixture (563 MB, warm page cache,
    2 vCPUs shared with other work, 7 runs min / median / max): 0.63 / 0.64 / 0.65 s
    one after the other, 0.35 / 0.48 / 0.65 s side by side (docs/digest.md)."""

    def __init__(self, descs, advance: Callable[[int], None] | None, pool=None) -> None:
        self._pool = pool
        from onnx_prep.core.io.content_digest import ContentHasher

        self.sha1 = hashlib.sha1()
        self.hashers = {d.name: {TENSOR_DIGEST_KEY: ContentHasher("sha256"), TENSOR_FAST_DIGEST_KEY: ContentHasher()}
                        for d in descs}
        self._spans = sorted(((d.offset, d.offset + d.length, self.hashers[d.name]) for d in descs if d.length),
                             key=lambda s: s[0])
        self._next = 0  # the first span not yet begun
        self._open: list[tuple[int, int, object]] = []  # begun, not finished
        self._advance = advance

    def visit(self, pos: int, view: memoryview) -> None:
        end = pos + len(view)
        sha1 = self._pool.submit(self.sha1.update, view) if self._pool is not None else self.sha1.update(view)
        while self._next < len(self._spans) and self._spans[self._next][0] < end:
            self._open.append(self._spans[self._next])
            self._next += 1
        still = []
        for lo, hi, hashers in self._open:
            part = view[max(lo, pos) - pos:min(hi, end) - pos]
            for h in hashers.values():
                h.update(part)
            if hi > end:
                still.append((lo, hi, hashers))
        self._open = still
        if sha1 is not None:
            sha1.result()  # the view is reused for the next chunk once both are done
        if self._advance is not None:
            self._advance(len(view))


def external_names(proto) -> set[str]:
    """The names of the graph's initializers stored as external data."""
    from onnx import TensorProto

    return {t.name for t in proto.graph.initializer if t.data_location == TensorProto.EXTERNAL}


def _recorded(proto) -> tuple[dict[tuple[str, str], str], dict[str, str], dict[str, list[str]]]:
    """From the protobuf: each initializer's recorded per-tensor digests, keyed (name,
    metadata key), lowercase as resolution reads them; each external initializer's
    recorded checksum (lowercase); and per data file location the initializers whose
    entries name it."""
    from onnx import TensorProto

    recorded: dict[tuple[str, str], str] = {}
    sha1: dict[str, str] = {}
    entries: dict[str, list[str]] = {}
    for t in proto.graph.initializer:
        for p in t.metadata_props:
            if p.key in (TENSOR_DIGEST_KEY, TENSOR_FAST_DIGEST_KEY):
                recorded[(t.name, p.key)] = p.value.lower()
        if t.data_location != TensorProto.EXTERNAL:
            continue
        ext = {e.key: e.value for e in t.external_data}
        if "location" in ext:
            entries.setdefault(ext["location"], []).append(t.name)
        if "checksum" in ext:
            sha1[t.name] = ext["checksum"].lower()
    return recorded, sha1, entries


# -------------------------------------------------------------------------- writing

def write_digests(digests: WeightDigests, out: str | os.PathLike | None = None, *,
                  trust_symlinks: bool = False) -> dict:
    """Write the model with every missing digest recorded: to ``out`` (a file in the
    model's folder, where the data files' relative locations still point), else over the
    model file itself. Only metadata changes: each external-data entry is kept as it is,
    plus a ``checksum`` where it had none, and each weight gains the ``onnx_prep.sha256``
    and ``onnx_prep.xxh3`` it lacked; the data files are never opened for writing. In place with
    every digest recorded already, nothing is written. Returns the record's ``write``
    part; the statuses of what was written become ``added``."""
    import onnx

    from onnx_prep.core.io.external_data import file_identity, stat_external_file

    model = str(digests.model_path)
    target = _target(digests, out)
    in_place = target == digests.model_path
    if in_place and digests.complete:
        return {"path": str(target), "written": False, "tensor_digests_added": 0, "checksums_added": 0,
                "bytes": 0}
    proto = onnx.ModelProto()
    proto.CopyFrom(digests.proto)
    by_file = {f.file: f for f in digests.files}
    by_name = {t.name: t for t in digests.tensors if t.status == MISSING}
    checksums = 0
    for t in proto.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        ext = {e.key: e.value for e in t.external_data}
        f = by_file.get(ext.get("location"))
        if f is not None and "checksum" not in ext:
            t.external_data.add(key="checksum", value=f.sha1)
            checksums += 1
        if t.name in by_name:
            computed = by_name[t.name]
            for key in computed.missing:
                t.metadata_props.add(key=key, value=computed.sha256 if key == TENSOR_DIGEST_KEY else computed.xxh3)
    size = proto.ByteSize()
    if size > PROTOBUF_LIMIT:
        raise UsageError(f"the model with its digests would be a {size:,}-byte protobuf, over protobuf's 2 GiB "
                         "limit", Where(model=model),
                         hint="move the large inline initializers to external data first")
    # The files must still be the ones hashed: a digest of other bytes would be a lie.
    try:
        unchanged = file_identity(os.stat(digests.model_path)) == digests.model_identity
    except OSError:
        unchanged = False
    if not unchanged:
        raise UsageError("the model file changed while its digests were computed", Where(model=model),
                         hint="nothing was written; run again")
    for f in digests.files:
        st = stat_external_file(digests.model_dir, f.file, trust_symlinks=trust_symlinks,
                                where=Where(model=model, file=f.file))
        if file_identity(st) != f.identity:
            raise UsageError("the data file changed while its digests were computed",
                             Where(model=model, file=f.file), hint="nothing was written; run again")
    payload = proto.SerializeToString(deterministic=True)
    write_atomic(target, payload, like=digests.model_path)
    for t in by_name.values():
        t.status = ADDED
    for f in digests.files:
        if f.status == MISSING:
            f.status = ADDED
    return {"path": str(target), "written": True, "tensor_digests_added": len(by_name),
            "checksums_added": checksums, "bytes": len(payload)}


def _target(digests: WeightDigests, out: str | os.PathLike | None) -> Path:
    """Where the digested model goes, refused where its data would not be found or a
    data file would be overwritten."""
    model = str(digests.model_path)
    if out is None:
        if os.path.islink(digests.model_path):
            raise UsageError("the model file is a symlink; replacing it would replace the link",
                             Where(model=model), hint="write a new file beside it with -o")
        return digests.model_path
    target = Path(os.path.abspath(out))
    where = Where(model=str(target))
    if target.is_dir():
        raise UsageError("-o names a folder, not a model file", where)
    try:
        same_folder = os.path.samefile(target.parent, digests.model_dir)
    except OSError:
        same_folder = False
    if not same_folder:
        raise UsageError(f"-o must be in the model's folder ({digests.model_dir}): the data files' locations "
                         "are relative to the model file", where, hint="give a file name in that folder")
    if target.exists() and os.path.samefile(target, digests.model_path):
        return digests.model_path
    for f in digests.files:
        if target.exists() and os.path.samefile(target, digests.model_dir / f.file):
            raise UsageError(f"-o names the model's data file {f.file}", where,
                             hint="give a new file name for the model")
    return target


def write_atomic(path: Path, payload: bytes, *, like: Path | None = None) -> None:
    """Replace ``path`` by ``payload`` atomically: a temporary file in the same folder,
    written, flushed and fsynced, renamed over ``path``, then the folder fsynced so the
    rename survives a crash. Any failure leaves ``path`` as it was and no temporary
    file. The new file takes the mode of ``path`` if it exists, else of ``like``."""
    where = Where(model=str(path))
    try:
        mode = stat.S_IMODE(os.stat(path if path.exists() else like or path).st_mode)
    except OSError:
        mode = 0o644
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        dir_fd = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise UsageError(f"cannot write the model file: {exc.strerror or exc}", where,
                         hint="the model file is unchanged") from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


# --------------------------------------------------------------------------- record

def schema_path() -> Path:
    """The JSON Schema (draft 2020-12) of ``digest_model``'s record."""
    return Path(__file__).parents[1] / "schemas" / "digest.schema.json"


def digest_model(path: str | os.PathLike, *, write: bool = False, out: str | os.PathLike | None = None,
                 trust_symlinks: bool = False, progress: Progress | None = None) -> dict:
    """``onnx-prep digest``'s one core call: compute and check the digests, write them
    when asked (``out`` implies ``write``), and return the record (docs/digest.md,
    ``schema_path()``)."""
    digests = compute_digests(path, trust_symlinks=trust_symlinks, progress=progress)
    written = None
    if write or out is not None:
        written = write_digests(digests, out, trust_symlinks=trust_symlinks)
    return digest_report(digests, written)


def digest_report(digests: WeightDigests, written: dict | None = None) -> dict:
    """The stable JSON record of ``digests`` (and of the write, if any). No I/O."""
    from onnx_prep import __version__

    def count(items, status: str) -> int:
        return sum(1 for x in items if x.status == status)

    t, f = digests.tensors, digests.files
    return {
        "schema_version": DIGEST_SCHEMA_VERSION,
        "tool": {"name": "onnx-prep", "version": __version__},
        "model": {"path": str(digests.model_path), "dir": str(digests.model_dir)},
        "files": [x.to_json() for x in f],
        "tensors": [x.to_json() for x in t],
        "totals": {
            "tensors": len(t), "verified": count(t, VERIFIED), "missing": count(t, MISSING),
            "added": count(t, ADDED),
            "files": len(f), "files_verified": count(f, VERIFIED), "files_missing": count(f, MISSING),
            "files_added": count(f, ADDED),
            "inline": digests.inline, "unused": digests.unused,
        },
        "hashing": {"bytes": digests.bytes_hashed, "seconds": round(digests.hash_s, 6)},
        "write": written,
    }
