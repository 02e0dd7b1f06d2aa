"""PreparedCache: one model's companion prepared cache, opened under a policy.

It is the plan's ``PackedPayloadIndex``: ``lookup`` answers, per prepared request, with
a compatible persisted payload or a miss; ``read_into`` reads a payload into its stable
slot, checking its digest as it reads; ``persists``/``persist`` take packed objects the
session built, to write them in the background; ``commit`` publishes them as a new
generation (``cache_writer.CacheWriter``).

Policies (docs/cache-format.md, "Policies"):

- ``disabled``: no cache is read or written;
- ``read-only`` (the default): compatible entries are used, misses are built in memory;
- ``build-if-missing``: as read-only, and every object built is persisted, at idle
  priority on a thread of its own, then committed once the caller is done;
- ``require-complete``: opening fails, naming what is missing, unless every prepared
  object has a compatible entry.

An entry is compatible when its lineage digest (``lineage.lineage_digest`` of the sources
as the model declares them now), layout, device, kernel ABI, packed format version and
size all match; otherwise it is a miss with its reason. A malformed manifest is an error
(``manifest.CacheFormatError``) under every policy but ``disabled``; a damaged entry
(payload file missing or short) is a miss with a warning, and an entry whose payload
does not match its digest when read is rebuilt from its sources in the same task (a
warning; an error under ``require-complete``).

Why one module of ~650 lines: the lookups' outcomes, the open payload files, the mapped
entries and the background writer (its queue, its hold over a session's first run, its
errors) change under one lock and are read together by ``summary`` and ``commit``; the
format itself (manifest.py), the writes (cache_writer.py), lineage and payload digests
already live in modules of their own.
"""
from __future__ import annotations

import enum
import functools
import hashlib
import mmap
import os
import queue
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np

from onnx_prep.core.cache.cache_writer import (CacheWriteError, CacheWriter, check_manifest_target,
                                               collect_leftovers)
from onnx_prep.core.cache.lineage import inline_digest, kernel_abi, lineage_digest, packed_format_version
from onnx_prep.core.cache.manifest import CacheEntry, CacheManifest, SourceRecord, payload_folder, read_manifest
from onnx_prep.core.cache.payload_digest import PayloadHasher
from onnx_prep.core.environment import flag
from onnx_prep.core.errors import OnnxPrepError, UsageError, Where
from onnx_prep.core.model.prepared_key import PrepackRequest
from onnx_prep.core.model.resolved_model import ResolvedModel
from onnx_prep.core.plan.execution_plan import RAW_LAYOUT, PackedPayloadEntry

__all__ = ["CachePolicy", "EntryStatus", "PreparedCache", "PreparedCacheError", "default_cache_path",
           "prepared_cache_findings"]

_CHUNK = 1 << 20
# What ``ignore_invalid`` (build-cache --rebuild) still raises: a manifest path holding
# something that is not a manifest file at all (a folder, a FIFO, a symlink). A commit
# would fail to rename over a folder, and would replace a link (or a FIFO) that is not
# ours to replace.
UNREPLACEABLE = ("not_a_file", "symlink")


class CachePolicy(str, enum.Enum):
    DISABLED = "disabled"
    READ_ONLY = "read-only"
    BUILD_IF_MISSING = "build-if-missing"
    REQUIRE_COMPLETE = "require-complete"


POLICIES = tuple(p.value for p in CachePolicy)


class PreparedCacheError(OnnxPrepError):
    """The cache cannot serve what the policy demands (require-complete), or a payload
    is corrupt where no fallback is allowed."""


class EntryStatus(str, enum.Enum):
    HIT = "hit"
    MISSING = "missing"  # no entry for the key
    STALE = "stale"  # the sources changed: lineage digest differs
    UNVERIFIED = "unverified"  # a source has no digest: nothing can prove the entry current
    INCOMPATIBLE = "incompatible"  # layout, device, kernel ABI, packed format or size differs
    DAMAGED = "damaged"  # its payload file is missing or too short


@dataclass(frozen=True, slots=True)
class EntryOutcome:
    key: str
    status: EntryStatus
    reason: str

    def to_json(self) -> dict:
        return {"key": self.key, "status": self.status.value, "reason": self.reason}


def default_cache_path(model_path: Path, cache_dir: Path | None = None) -> Path:
    """``<model stem>.prepared.onnx`` beside the model, or in ``cache_dir``."""
    model_path = Path(model_path)
    return Path(cache_dir or model_path.parent) / f"{model_path.stem}.prepared.onnx"


def source_model_digest(model_path: Path) -> str:
    h = hashlib.sha256()
    with open(model_path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


class PreparedCache:
    """See the module docstring. Thread-safe: lookups and reads from the session's
    workers, persists from its prepack tasks."""

    def __init__(self, resolved: ResolvedModel, path: Path | None = None, *,
                 policy: CachePolicy | str = CachePolicy.READ_ONLY, compress: str | None = None,
                 device: str = "cpu", ignore_invalid: bool = False, verify_payloads: bool = True,
                 warn: Callable[[str], None] | None = None, map_payloads: bool = True,
                 trust_symlinks: bool = False) -> None:
        self.resolved = resolved
        self.policy = CachePolicy(policy)
        self.path = Path(path) if path is not None else default_cache_path(resolved.model_path)
        # A symlinked manifest is read through only when trusted, its payloads beside its
        # target; nothing is ever written through it (persist: check_manifest_target).
        self.trust_symlinks = trust_symlinks
        self.folder = payload_folder(self.path, trust_symlinks=trust_symlinks)
        self.stem = self.path.name[:-len(".prepared.onnx")] if self.path.name.endswith(".prepared.onnx") \
            else self.path.stem
        if compress not in (None, "zstd"):
            raise UsageError(f"unknown compression {compress!r}", hint="choose zstd, or none")
        if device != "cpu":
            raise UsageError(f"device {device!r} has no prepared cache here", hint="use --device cpu")
        self.compress, self.device = compress, device
        self.verify_payloads = verify_payloads  # hash each payload as it is read (--verify-digests)
        # Map plain payloads into their slots (mapping) instead of reading them into fresh
        # pages: the page cache is the slot, nothing copied (ONNX_PREP_MAP_CACHE=0: read).
        self.map_payloads = map_payloads and flag(
            "ONNX_PREP_MAP_CACHE", default=True, on="map prepared cache payloads into their slots",
            off="read them into fresh pages")
        self._warn = warn
        self.warnings: list[str] = []
        self.counters = {"packed_reads": 0, "packed_bytes": 0, "mapped_bytes": 0, "pmd_mapped_bytes": 0,
                         "fallbacks": 0, "persisted": 0, "persisted_bytes": 0}
        self._lock = threading.Lock()
        # The background writer runs while this is set (hold_writes clears it).
        self._writes_open = threading.Event()
        self._writes_open.set()
        self._holds = 0
        self._fds: dict[str, int] = {}
        self._sizes: dict[str, int] = {}  # each payload file's size when it was opened (_fd)
        self._writer: CacheWriter | None = None
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._write_error: str | None = None
        self.on_persisted: Callable[[int], None] | None = None  # after each object written or kept (progress)
        self.replace_keys: set[str] = set()  # persisted even over a compatible entry (build-cache)
        self._verified: set[str] = set()  # entries whose payload digest a read checked
        self._confirmed: dict[str, str] = {}  # unverified entries whose sources this read matched: kept
        self.committed_keys: list[str] = []  # the entries the last commit wrote
        self.write_errors_fatal = False  # build-cache: commit(strict=True) raises them, so no warning too
        self.manifest: CacheManifest | None = None
        self.outcomes: dict[str, EntryOutcome] = {}
        self._abi = kernel_abi()
        self._requests = {k: r for k, r in resolved.requests.items() if r.layout != RAW_LAYOUT}
        from onnx_prep.core.kernels.prepack import packing_nodes

        self._consumer = packing_nodes(resolved.nodes)  # key -> its packing node (its attributes size the object)
        if self.policy is CachePolicy.DISABLED:
            return
        from onnx_prep.core.cache.manifest import CacheFormatError

        try:
            self.manifest = read_manifest(self.path, trust_symlinks=trust_symlinks)
        except CacheFormatError as exc:
            if not ignore_invalid or exc.reason in UNREPLACEABLE:
                raise
            self.manifest = None  # build-cache --rebuild: replaced at commit
        for d in (self.manifest.damaged if self.manifest else ()):
            self._note(f"prepared cache entry {d.entry.key} is unusable: {d.message}")
        for key, req in self._requests.items():
            self.outcomes[key] = self._outcome(key, req)
        # The payload files of the entries to be used, opened now: a later commit's garbage
        # collection may unlink them, but cannot take them from under this reader.
        for name in sorted({self.manifest.by_key[k].file for k, o in self.outcomes.items()
                            if o.status is EntryStatus.HIT}):
            try:
                self._fd(name)
            except (OSError, _Unusable) as exc:
                for k, o in self.outcomes.items():
                    if o.status is EntryStatus.HIT and self.manifest.by_key[k].file == name:
                        self.outcomes[k] = EntryOutcome(k, EntryStatus.DAMAGED, f"cannot open {name}: {exc}")
        if self.policy is CachePolicy.REQUIRE_COMPLETE:
            missing = [o for o in self.outcomes.values() if o.status is not EntryStatus.HIT]
            if missing:
                first = "; ".join(f"{o.key}: {o.reason}" for o in missing[:3])
                raise PreparedCacheError(
                    f"prepared cache is incomplete: {len(missing)} of {len(self.outcomes)} objects have "
                    f"no compatible entry ({first}{'; ...' if len(missing) > 3 else ''})",
                    Where(file=str(self.path)), hint=self.build_hint(missing))

    def build_command(self, *options: str) -> str:
        """``onnx-prep build-cache`` for this model and cache, as a user would type it
        (``-o PATH`` where the cache is not in the default place)."""
        model = self.resolved.model_path
        where = "" if self.path == default_cache_path(model) else f" -o {self.path}"
        return " ".join(["onnx-prep build-cache", *options, str(model)]) + where

    def build_hint(self, outcomes: Iterable[EntryOutcome] = (), *, verb: str = "build") -> str:
        """What makes this cache complete: :meth:`build_command`, after ``digest --write``
        where an entry is unverified (a source without a digest: no build can make a load
        trust it)."""
        if any(o.status is EntryStatus.UNVERIFIED for o in outcomes):
            return (f"give the weights digests, then build: onnx-prep digest --write "
                    f"{self.resolved.model_path}; {self.build_command()}")
        return f"{verb} it: {self.build_command()}"

    def _undigested(self, req: PrepackRequest) -> str | None:
        """The first of ``req``'s sources without a declared digest, or None."""
        return next((n for n in req.source_lineage if self.declared.get(n) is None), None)

    def unverifiable(self) -> dict[str, str]:
        """Each object whose entry no load can check, with its first source that has no
        digest: a load trusts an entry only through its sources' digests."""
        return {key: self._undigested(req) for key, req in self._requests.items()
                if self.expected_lineage(req) is None}

    def payload_problem(self, e: CacheEntry) -> str | None:
        """Entry ``e``'s payload read whole and checked against its digest (1 MiB at a
        time: bounded memory); what is wrong with it, or None."""
        try:
            fd = self._fd(e.file)
            h = PayloadHasher.matching(e.payload_digest)
            for lo in range(0, e.length, _CHUNK):
                chunk = os.pread(fd, min(_CHUNK, e.length - lo), e.offset + lo)
                if not chunk:
                    raise _Unusable("payload file ended early")
                h.update(chunk)
            if h.digest() != e.payload_digest:
                raise _Unusable(f"payload does not match its digest {e.payload_digest}")
        except (OSError, _Unusable) as exc:
            return str(exc)
        return None

    # ---------------------------------------------------------------- compatibility
    @functools.cached_property
    def declared(self) -> dict[str, str | None]:
        """Each source's content digest as the model declares it (inline weights: hashed,
        the first time an entry is compared or persisted; a run with no cache hashes
        nothing)."""
        out: dict[str, str | None] = {}
        for name, wd in self.resolved.weights.items():
            if wd.external:
                out[name] = wd.digest if wd.trusted else None
            elif name in self.resolved.inline_values:
                out[name] = inline_digest(self.resolved.inline_values[name])
        return out

    def expected_lineage(self, req: PrepackRequest) -> str | None:
        return lineage_digest(req, self.resolved.weights, self.declared)

    def _outcome(self, key: str, req: PrepackRequest) -> EntryOutcome:
        m = self.manifest
        damaged = next((d for d in (m.damaged if m else ()) if d.entry.key == key), None)
        if damaged is not None:
            return EntryOutcome(key, EntryStatus.DAMAGED, damaged.message)
        e = m.by_key.get(key) if m else None
        if e is None:
            return EntryOutcome(key, EntryStatus.MISSING, "no entry")
        why = self._incompatibility(e, req)
        if why is not None:
            return why
        return EntryOutcome(key, EntryStatus.HIT, "compatible")

    def _incompatibility(self, e: CacheEntry, req: PrepackRequest) -> EntryOutcome | None:
        why = self._structural_incompatibility(e, req)
        if why is not None:
            return why
        expected = self.expected_lineage(req)
        if expected is None:
            return EntryOutcome(e.key, EntryStatus.UNVERIFIED, f"source {self._undigested(req)} has no digest "
                                "(onnx-prep digest --write gives it one)")
        if e.lineage_digest != expected:
            return EntryOutcome(e.key, EntryStatus.STALE, "the source bytes changed (lineage digest differs)")
        return None

    def _structural_incompatibility(self, e: CacheEntry, req: PrepackRequest) -> EntryOutcome | None:
        """What makes ``e`` another object than this build packs for ``req``, its sources'
        bytes aside: layout, device, kernel ABI, packed format, source names, size."""
        key = e.key
        for field, have, want in (("layout", e.layout, req.layout), ("device", e.device, req.device),
                                  ("kernel ABI", e.kernel_abi, self._abi),
                                  ("packed format version", e.format_version, packed_format_version()),
                                  ("source lineage", list(e.source_lineage), list(req.source_lineage))):
            if have != want:
                return EntryOutcome(key, EntryStatus.INCOMPATIBLE, f"{field} {have} (this build: {want})")
        size = self.packed_size(key)
        if size is not None and e.decoded_length != size:
            return EntryOutcome(key, EntryStatus.INCOMPATIBLE, f"size {e.decoded_length} bytes (expected {size})")
        return None

    def packed_size(self, key: str) -> int | None:
        """The packed object's exact size for this model, or None where unknown."""
        from onnx_prep.core.kernels.prepack import packed_size

        node = self._consumer.get(key)
        if node is None:
            return None
        try:
            return packed_size(node.kernel, self._requests[key], self.resolved, node=node)
        except OnnxPrepError:
            return None

    def compatible(self, e: CacheEntry) -> bool:
        req = self._requests.get(e.key)
        return req is not None and self._incompatibility(e, req) is None

    def _kept(self, e: CacheEntry) -> bool:
        """Whether a commit carries live entry ``e`` into the new generation: compatible,
        or unverified and found on this read to hold what these sources pack to."""
        return self.compatible(e) or self._confirmed.get(e.key) == e.lineage_digest

    # ---------------------------------------------------------------- the index
    def lookup(self, request: PrepackRequest) -> PackedPayloadEntry | None:
        o = self.outcomes.get(request.key)
        if o is None or o.status is not EntryStatus.HIT:
            return None
        e = self.manifest.by_key[request.key]
        return PackedPayloadEntry(key=e.key, file=e.file, offset=e.offset, length=e.length,
                                  mapped=self._mappable(e))

    def _mappable(self, e: CacheEntry) -> bool:
        """Whether entry ``e``'s stored bytes can be mapped into a slot as they are:
        mapping on, stored plain (not encoded), at an offset on the page size."""
        return self.map_payloads and e.encoding is None and e.offset % mmap.PAGESIZE == 0

    def entry(self, key: str) -> CacheEntry:
        return self.manifest.by_key[key]

    def mapping(self, payload: PackedPayloadEntry) -> tuple[int, int] | None:
        """``(fd, offset)`` to map the entry's stored bytes straight into its slot, or
        None when they must be read instead: an encoded (compressed) entry, an offset
        off the page size, mapping switched off, or a file that cannot be opened or is
        shorter than the entry (``read_into`` then reports why)."""
        e = self.manifest.by_key[payload.key]
        if not self._mappable(e):
            return None
        try:
            fd = self._fd(e.file)
            if self._sizes[e.file] < e.offset + e.length:
                return None
        except (OSError, _Unusable):
            return None
        return fd, e.offset

    def mapped_checksum_bytes(self, payload: PackedPayloadEntry) -> int:
        """How many bytes of the entry the mapping should checksum as it maps them (its
        length when its ``xxh3`` digest is to be checked now, else 0): what
        :meth:`accept_mapped` then takes as ``xxh3``."""
        e = self.manifest.by_key[payload.key]
        return e.length if self._verify_now(e) and e.payload_digest.startswith("xxh3:") else 0

    def accept_mapped(self, payload: PackedPayloadEntry, view: np.ndarray, *, xxh3: int | None = None) -> bool:
        """An entry mapped into its slot (``mapping``): check its digest on its first
        use in this process (``xxh3``: the checksum the mapping read over
        :meth:`mapped_checksum_bytes`, else it is computed here). False when it does not
        match (recorded as for ``read_into``; the caller rebuilds from sources); raises
        under ``require-complete``."""
        e = self.manifest.by_key[payload.key]
        verify = self._verify_now(e)
        if verify:
            if xxh3 is not None and e.payload_digest.startswith("xxh3:"):
                digest = f"xxh3:{xxh3:016x}"
            else:
                h = PayloadHasher.matching(e.payload_digest)
                h.update(view.reshape(-1).view(np.uint8)[:e.length])
                digest = h.digest()
            if digest != e.payload_digest:
                return self._unusable(e, f"payload does not match its digest {e.payload_digest}")
        return self._accepted(e, verified=verify, mapped=True)

    def mapped_damaged(self, payload: PackedPayloadEntry) -> bool:
        """A mapped entry whose file shrank while it was read: recorded as unusable
        (the caller rebuilds it from sources); raises under ``require-complete``."""
        e = self.manifest.by_key[payload.key]
        return self._unusable(e, "payload file shrank while mapped")  # False, as the readers return

    def read_into(self, payload: PackedPayloadEntry, out: np.ndarray) -> bool:
        """Fill ``out`` (the packed object's slot view) with the entry's bytes, decoded,
        checking the payload digest as it reads (the first read of each entry: a page-in
        after an eviction reads bytes this cache already accepted; the files were opened
        once, at open). False when the entry proves unusable
        (a warning is recorded; the caller rebuilds from sources); raises instead under
        ``require-complete``."""
        e = self.manifest.by_key[payload.key]
        try:
            fd = self._fd(e.file)
            buf = out.reshape(-1).view(np.uint8)
            if buf.nbytes != e.decoded_length:
                raise _Unusable(f"slot is {buf.nbytes} bytes, entry decodes to {e.decoded_length}")
            # verified on its first read in this process; a later read of the same entry
            # (a page-in after an eviction) is of bytes already accepted
            h = PayloadHasher.matching(e.payload_digest) \
                if self._verify_now(e) else None
            if e.encoding is None:
                mv = memoryview(buf)
                got = 0
                while got < e.length:
                    n = os.preadv(fd, [mv[got:min(e.length, got + _CHUNK)]], e.offset + got)
                    if n == 0:
                        raise _Unusable("payload file ended early (truncated while in use)")
                    if h is not None:
                        h.update(mv[got:got + n])
                    got += n
            else:
                _decode_zstd(fd, e, buf, h)
            if h is not None and h.digest() != e.payload_digest:
                raise _Unusable(f"payload does not match its digest {e.payload_digest}")
        except (_Unusable, OSError) as exc:
            return self._unusable(e, str(exc))
        return self._accepted(e, verified=h is not None, mapped=False)

    def _verify_now(self, e: CacheEntry) -> bool:
        """Whether entry ``e``'s digest is checked on this read: the cache checks
        payloads, and this process has not accepted ``e`` yet (a page-in after an
        eviction reads bytes already accepted)."""
        return self.verify_payloads and e.key not in self._verified

    def _accepted(self, e: CacheEntry, *, verified: bool, mapped: bool) -> bool:
        """Count entry ``e`` as read (mapped or copied); ``verified``: its checksum was
        checked on this read, so a later read in this process skips it. Returns True."""
        with self._lock:
            self.counters["packed_reads"] += 1
            self.counters["packed_bytes"] += e.length
            if mapped:
                self.counters["mapped_bytes"] += e.length
            if verified:
                self._verified.add(e.key)
        return True

    def count_pmd_mapped(self, nbytes: int | None) -> None:
        """Of a mapped entry's bytes, ``nbytes`` were mapped by 2 MiB page-table entries
        (the page tables say so after the mapping was populated); None: the kernel cannot
        tell, and the summary's ``pmd_mapped_bytes`` is null from then on."""
        with self._lock:
            have = self.counters["pmd_mapped_bytes"]
            self.counters["pmd_mapped_bytes"] = None if have is None or nbytes is None else have + nbytes

    def _unusable(self, e: CacheEntry, reason: str) -> bool:
        """Record entry ``e`` as unusable (a warning; it is rebuilt from its sources and,
        under build-if-missing, replaced); raise instead under ``require-complete``.
        Returns False, what the readers return for it."""
        msg = f"prepared cache entry {e.key} is unusable: {reason}"
        if self.policy is CachePolicy.REQUIRE_COMPLETE:
            where = Where(file=str(self.folder / e.file), offset=e.offset)  # the message names the entry
            raise PreparedCacheError(msg, where, hint=self.build_hint(verb="rebuild"))
        self._note(msg + "; rebuilt from its sources")
        with self._lock:
            self.counters["fallbacks"] += 1
            self.outcomes[e.key] = EntryOutcome(e.key, EntryStatus.DAMAGED, reason)
            self.replace_keys.add(e.key)  # build-if-missing writes the rebuilt one over it
        return False

    def _fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                fd = os.open(self.folder / name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                             | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    os.close(fd)
                    raise _Unusable(f"{name} is not a regular file")
                # NOTE: its size as opened is what ``mapping`` checks an entry against
                # (one fstat a file, not one a payload: each released the GIL to a
                # waiting worker). A file that shrinks later is the guard's to catch
                # (``StableSlot.mapping_intact``; ``read_into`` reads short).
                self._sizes[name] = st.st_size
                self._fds[name] = fd
            return fd

    # ---------------------------------------------------------------- persistence
    @property
    def persisting(self) -> bool:
        return self.policy is CachePolicy.BUILD_IF_MISSING and self._write_error is None

    def persists(self, request: PrepackRequest) -> bool:
        """Whether a packed object the session builds for ``request`` is to be persisted."""
        o = self.outcomes.get(request.key)
        return self.persisting and o is not None and o.status is not EntryStatus.HIT

    def persist(self, request: PrepackRequest, packed: np.ndarray, source_digests: Mapping[str, str | None],
                done: Callable[[], None]) -> None:
        """Queue ``packed`` (a view of the published object; the caller pinned it) for
        the background writer; ``done()`` runs once it is written or dropped."""
        digests = {**self.declared, **{k: v for k, v in source_digests.items() if v is not None}}
        lineage = lineage_digest(request, self.resolved.weights, digests)
        if lineage is None or not self.persisting:  # a source read without a digest: cannot persist
            done()
            return
        old = self.manifest.by_key.get(request.key) if self.manifest is not None else None
        o = self.outcomes.get(request.key)
        if (old is not None and o is not None and o.status is EntryStatus.UNVERIFIED
                and request.key not in self.replace_keys and old.lineage_digest == lineage
                and self._structural_incompatibility(old, request) is None):
            # An unverified entry (its sources declare no digest) whose sources hash, on
            # this read, to what it was built from: it holds these bytes already. Kept
            # as it is, not written again.
            with self._lock:
                self._confirmed[request.key] = lineage
            if self.on_persisted is not None:
                self.on_persisted(packed.nbytes)
            done()
            return
        identity = CacheEntry(key=request.key, file="", offset=0, length=0, payload_digest="",
                              lineage_digest=lineage, source_lineage=request.source_lineage,
                              layout=request.layout, device=request.device, kernel_abi=self._abi,
                              format_version=packed_format_version())
        sources = {n: SourceRecord(digests[n], self.resolved.weights[n].onnx_type,
                                   tuple(self.resolved.weights[n].dims)) for n in request.source_lineage}
        with self._lock:
            if self._thread is None:
                try:
                    check_manifest_target(self.path)  # a symlink (trusted for reading) or a folder
                    self._writer = CacheWriter(self.folder, self.stem, self.path.name, compress=self.compress)
                except CacheWriteError as exc:
                    self._write_failed(exc)
                    done()
                    return
                self._queue = queue.Queue()
                self._sources: dict[str, SourceRecord] = {}
                self._thread = threading.Thread(target=self._write_loop, name="onnx-prep-cache-writer",
                                                daemon=True)
                self._thread.start()
            self._sources.update(sources)
        self._queue.put((identity, packed, done))

    def read_only(self) -> PreparedCache:
        """The same cache opened again under ``read-only``: what a reader that must not
        write sees (a device session reads a cache this one has just completed)."""
        return PreparedCache(self.resolved, self.path, policy=CachePolicy.READ_ONLY, compress=self.compress,
                             verify_payloads=self.verify_payloads, warn=self._warn, map_payloads=self.map_payloads,
                             trust_symlinks=self.trust_symlinks)

    def hold_writes(self) -> Callable[[], None]:
        """Hold the background writer until the returned ``release()`` is called (once;
        later calls do nothing), or until :meth:`flush`. A session holds it over its first
        run: the writer's page-cache writes and checksums, though at idle priority, took
        the first output of a first build of the medium fixture from 679 to 838 ms
        (medians of 3, in process, 2 vCPUs); held, the objects are written right after
        the first output instead."""
        with self._lock:
            self._holds += 1
            self._writes_open.clear()
        released = [False]

        def release() -> None:
            with self._lock:
                if released[0]:
                    return
                released[0] = True
                self._holds = max(0, self._holds - 1)  # a flush in between zeroed it
                if self._holds == 0:
                    self._writes_open.set()
        return release

    def _write_loop(self) -> None:
        from onnx_prep.core.runtime.slot_pool import to_idle_priority

        to_idle_priority()  # never competes with the load for a core
        while True:
            self._writes_open.wait()  # hold_writes: not before the first output
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            identity, packed, done = item
            try:
                if self._write_error is None:
                    self._writer.append(identity, packed)
                    with self._lock:
                        self.counters["persisted"] += 1
                        self.counters["persisted_bytes"] += packed.nbytes
                    if self.on_persisted is not None:
                        self.on_persisted(packed.nbytes)
            except CacheWriteError as exc:
                self._write_failed(exc)
            except BaseException as exc:  # noqa: BLE001 - recorded, the run goes on
                self._write_failed(OnnxPrepError(f"prepared cache write failed: {exc!r}"))
            finally:
                done()
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every object handed to :meth:`persist` is written (or dropped) and
        unpinned: a session calls this before it releases its objects. It ends any
        :meth:`hold_writes`."""
        with self._lock:
            self._holds = 0
            self._writes_open.set()
        q = self._queue if self.policy is CachePolicy.BUILD_IF_MISSING else None
        if q is not None:
            q.join()

    def _write_failed(self, exc: OnnxPrepError) -> None:
        if self._write_error is None:
            self._write_error = exc.one_line()
            if not self.write_errors_fatal:
                self._note(f"{exc.one_line()}; going on without persisting")

    def commit(self, *, strict: bool = False) -> dict:
        """Wait for queued writes, then publish them as a new generation. Returns what
        changed: {"generation", "written", "bytes_written", "error"}. A write that
        failed (read-only folder, full disk) is a warning in ``error``, and nothing is
        published; with ``strict`` (``build-cache``) it raises CacheWriteError."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        writer, self._writer = self._writer, None
        out = {"generation": self.manifest.generation if self.manifest else None, "written": 0,
               "bytes_written": 0, "error": self._write_error}
        if writer is None:
            if strict and self._write_error is not None:
                raise CacheWriteError(self._write_error)
            if strict and self.manifest is not None:  # build-cache, up to date: a crash's leftovers go
                try:
                    collect_leftovers(self.folder, self.stem, self.path.name)
                except CacheWriteError as exc:
                    self._note(f"{exc.one_line()}; stale files left for the next build")
            return out
        if self._write_error is not None:
            writer.discard()
            if strict:
                raise CacheWriteError(self._write_error)
            return out
        try:
            live, added = writer.commit(
                source_model_digest=source_model_digest(self.resolved.model_path), sources=self._sources,
                keep=self._kept,
                wanted=lambda new, old: new.key in self.replace_keys or old is None
                or old.lineage_digest != new.lineage_digest or not self._kept(old))
        except CacheWriteError as exc:
            writer.discard()
            if strict:
                raise
            self._write_failed(exc)
            out["error"] = self._write_error
            return out
        self.manifest = live
        out.update(generation=live.generation if live else None, written=len(added),
                   bytes_written=sum(e.length for e in added))
        self.committed_keys = [e.key for e in added]
        return out

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def _note(self, msg: str) -> None:
        self.warnings.append(msg)
        if self._warn is not None:
            self._warn(msg)

    # ---------------------------------------------------------------- summary
    def summary(self) -> dict:
        counts = {s.value: 0 for s in EntryStatus}
        for o in self.outcomes.values():
            counts[o.status.value] += 1
        return {"path": str(self.path), "policy": self.policy.value,
                "exists": self.manifest is not None,
                "generation": self.manifest.generation if self.manifest else None,
                "entries": counts, **self.counters, "warnings": list(self.warnings)}


class _Unusable(Exception):
    pass


def prepared_cache_findings(resolved: ResolvedModel, prepared_path: Path | None = None, *,
                            require_complete: bool = False, verify_payloads: bool = False,
                            trust_symlinks: bool = False) -> list[dict]:
    """What ``onnx-prep check`` reports about a model's prepared cache: one finding per
    problem, ``{"check", "subject", "message", "where", "severity"}``. A malformed
    manifest is one error; an entry that cannot be used is a warning (an error with
    ``require_complete``, which also makes every object without a compatible entry an
    error); with ``verify_payloads`` every payload is read and checked against its digest
    (bounded memory: 1 MiB at a time). ``trust_symlinks``: a symlinked manifest is read
    through (else it is one error)."""
    from onnx_prep.core.cache.manifest import CacheFormatError

    path = Path(prepared_path) if prepared_path is not None else default_cache_path(resolved.model_path)
    findings: list[dict] = []

    def add(subject: str, message: str, where: Where, error: bool) -> None:
        findings.append({"check": "prepared_cache", "subject": subject, "message": message,
                         "where": {k: v for k, v in vars(where).items() if v is not None},
                         "severity": "error" if error else "warning"})

    try:
        cache = PreparedCache(resolved, path, policy=CachePolicy.READ_ONLY, trust_symlinks=trust_symlinks)
    except CacheFormatError as exc:
        add(path.name, exc.one_line(), exc.where, True)
        return findings
    try:
        if cache.manifest is None:
            if require_complete:
                add(path.name, f"no prepared cache at {path}; {cache.build_hint()}",
                    Where(file=str(path)), True)
            return findings
        for key, o in sorted(cache.outcomes.items()):
            if o.status is EntryStatus.HIT:
                continue
            if o.status is EntryStatus.MISSING and not require_complete:
                continue  # an incomplete cache is a cache, unless completeness is required
            add(key, f"{o.status.value}: {o.reason}", Where(file=str(path), tensor=key),
                require_complete or o.status is EntryStatus.DAMAGED)
        if verify_payloads:
            for e in cache.manifest.entries:
                problem = cache.payload_problem(e)
                if problem is not None:
                    add(e.key, f"payload unusable: {problem}; {cache.build_hint(verb='rebuild')}",
                        Where(file=str(cache.folder / e.file), tensor=e.tensor_name, offset=e.offset), True)
    finally:
        cache.close()
    return findings


def _decode_zstd(fd: int, e: CacheEntry, buf: np.ndarray, h) -> None:
    import zstandard

    dobj = zstandard.ZstdDecompressor().decompressobj()
    pos = 0
    for lo in range(0, e.length, _CHUNK):
        chunk = os.pread(fd, min(_CHUNK, e.length - lo), e.offset + lo)
        if not chunk:
            raise _Unusable("payload file ended early (truncated while in use)")
        if h is not None:
            h.update(chunk)
        try:
            out = dobj.decompress(chunk)
        except zstandard.ZstdError as exc:
            raise _Unusable(f"payload does not decompress ({exc})") from None
        if pos + len(out) > buf.nbytes:
            raise _Unusable("payload decompresses to more bytes than recorded")
        buf[pos:pos + len(out)] = np.frombuffer(out, dtype=np.uint8)
        pos += len(out)
    if pos != buf.nbytes:
        raise _Unusable(f"payload decompresses to {pos} bytes, {buf.nbytes} recorded")
