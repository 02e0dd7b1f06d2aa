"""PreparedCache: one model's companion prepared cache, opened under a policy.

It is the plan's ``PackedPayloadIndex``: ``lookup`` answers, per prepared request, with
a compatible persisted payload or a miss; ``mapping``/``accept_mapped`` and
``read_into`` put a payload into its stable slot, checking its digest on its first use
in the process; ``persists``/``persist`` take packed objects the session built, to
write them in the background; ``commit`` publishes them as a new generation.

This module holds what those share: the outcome of each lookup, the counters, the
warnings, and what a read found unusable (recorded once, read by ``summary`` and
``commit``). Its parts live apart: the policies (cache_policy.py), whether an entry is
compatible (entry_compatibility.py), the payload files and reads (payload_files.py), the
background writer (background_writer.py), the command lines a hint names
(build_hints.py); the format (manifest.py) and the writes (cache_writer.py).

A malformed manifest is an error (``manifest.CacheFormatError``) under every policy but
``disabled``; a damaged entry (payload file missing or short) is a miss with a warning,
and an entry whose payload does not match its digest when read is rebuilt from its
sources in the same task (a warning; an error under ``require-complete``).
"""
from __future__ import annotations

import mmap
import threading
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np

from onnx_prep.core.cache import build_hints
from onnx_prep.core.cache.background_writer import BackgroundWriter
from onnx_prep.core.cache.cache_policy import POLICIES, CachePolicy, PreparedCacheError, default_cache_path
from onnx_prep.core.cache.entry_compatibility import EntryCompatibility, EntryOutcome, EntryStatus
from onnx_prep.core.cache.lineage import lineage_digest, packed_format_version
from onnx_prep.core.cache.manifest import CacheEntry, CacheManifest, SourceRecord, payload_folder, read_manifest
from onnx_prep.core.cache.payload_digest import PayloadHasher
from onnx_prep.core.cache.payload_files import PayloadFiles, PayloadUnusable, payload_problem, read_payload
from onnx_prep.core.environment import flag
from onnx_prep.core.errors import UsageError, Where
from onnx_prep.core.model.prepared_key import PrepackRequest
from onnx_prep.core.model.resolved_model import ResolvedModel
from onnx_prep.core.plan.execution_plan import PackedPayloadEntry

# The policy and outcome names are importable from here, where callers have always
# found them.
__all__ = ["POLICIES", "CachePolicy", "EntryOutcome", "EntryStatus", "PreparedCache", "PreparedCacheError",
           "default_cache_path"]

# What ``ignore_invalid`` (build-cache --rebuild) still raises: a manifest path holding
# something that is not a manifest file at all (a folder, a FIFO, a symlink). A commit
# would fail to rename over a folder, and would replace a link (or a FIFO) that is not
# ours to replace.
UNREPLACEABLE = ("not_a_file", "symlink")


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
        # target; nothing is ever written through it (BackgroundWriter.put refuses).
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
        self._files = PayloadFiles(self.folder)
        self._writes = BackgroundWriter(self.path, self.folder, self.stem, compress=compress,
                                        written=self._written, note=self._note)
        self.on_persisted: Callable[[int], None] | None = None  # after each object written or kept (progress)
        self.replace_keys: set[str] = set()  # persisted even over a compatible entry (build-cache)
        self._verified: set[str] = set()  # entries whose payload digest a read checked
        self._confirmed: dict[str, str] = {}  # unverified entries whose sources this read matched: kept
        self.committed_keys: list[str] = []  # the entries the last commit wrote
        self.manifest: CacheManifest | None = None
        self.outcomes: dict[str, EntryOutcome] = {}
        self._compat = EntryCompatibility(resolved)
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
        for key in self._compat.requests:
            self.outcomes[key] = self._compat.outcome(key, self.manifest)
        # The payload files of the entries to be used, opened now: a later commit's garbage
        # collection may unlink them, but cannot take them from under this reader.
        for name in sorted({self.manifest.by_key[k].file for k, o in self.outcomes.items()
                            if o.status is EntryStatus.HIT}):
            try:
                self._files.fd(name)
            except (OSError, PayloadUnusable) as exc:
                for k, o in self.outcomes.items():
                    if o.status is EntryStatus.HIT and self.manifest.by_key[k].file == name:
                        self.outcomes[k] = EntryOutcome(k, EntryStatus.DAMAGED, f"cannot open {name}: {exc}")
        if self.manifest is None and self.policy is not CachePolicy.BUILD_IF_MISSING:
            if self.policy is CachePolicy.REQUIRE_COMPLETE:
                raise PreparedCacheError("no prepared cache there", Where(file=str(self.path)),
                                         hint=self.build_hint())
            if path is not None:  # named by the user (--prepared): a typo must not pass silently
                self._note(f"no prepared cache at {self.path}, so the model loads without one; "
                           f"{self.build_hint()}")
        if self.policy is CachePolicy.REQUIRE_COMPLETE:
            missing = [o for o in self.outcomes.values() if o.status is not EntryStatus.HIT]
            if missing:
                first = "; ".join(f"{o.key}: {o.reason}" for o in missing[:3])
                raise PreparedCacheError(
                    f"prepared cache is incomplete: {len(missing)} of {len(self.outcomes)} objects have "
                    f"no compatible entry ({first}{'; ...' if len(missing) > 3 else ''})",
                    Where(file=str(self.path)), hint=self.build_hint(missing))

    def build_command(self, *options: str) -> str:
        """``onnx-prep build-cache`` for this model and cache, as a user would type it."""
        return build_hints.build_command(self.resolved.model_path, self.path, *options)

    def build_hint(self, outcomes: Iterable[EntryOutcome] = (), *, verb: str = "build") -> str:
        """What makes this cache complete (``build_hints.build_hint``)."""
        return build_hints.build_hint(self.resolved.model_path, self.path, outcomes, verb=verb)

    def unverifiable(self) -> dict[str, str]:
        """Each object whose entry no load can check, with its first source that has no
        digest: a load trusts an entry only through its sources' digests."""
        return self._compat.unverifiable()

    def packed_size(self, key: str) -> int | None:
        """The packed object's exact size for this model, or None where unknown."""
        return self._compat.packed_size(key)

    def payload_problem(self, e: CacheEntry) -> str | None:
        """Entry ``e``'s payload read whole and checked against its digest (1 MiB at a
        time: bounded memory); what is wrong with it, or None."""
        return payload_problem(self._files, e)

    def _kept(self, e: CacheEntry) -> bool:
        """Whether a commit carries live entry ``e`` into the new generation: compatible,
        or unverified and found on this read to hold what these sources pack to."""
        return self._compat.compatible(e) or self._confirmed.get(e.key) == e.lineage_digest

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
            fd = self._files.fd(e.file)
            if self._files.size(e.file) < e.offset + e.length:
                return None
        except (OSError, PayloadUnusable):
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
            fd = self._files.fd(e.file)
            # verified on its first read in this process; a later read of the same entry
            # (a page-in after an eviction) is of bytes already accepted
            h = PayloadHasher.matching(e.payload_digest) if self._verify_now(e) else None
            read_payload(fd, e, out.reshape(-1).view(np.uint8), h)
            if h is not None and h.digest() != e.payload_digest:
                raise PayloadUnusable(f"payload does not match its digest {e.payload_digest}")
        except (PayloadUnusable, OSError) as exc:
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

    # ---------------------------------------------------------------- persistence
    @property
    def persisting(self) -> bool:
        return self.policy is CachePolicy.BUILD_IF_MISSING and self._writes.error is None

    @property
    def write_errors_fatal(self) -> bool:
        """build-cache sets it: ``commit(strict=True)`` raises a write error, so it is
        not a warning too."""
        return self._writes.fatal

    @write_errors_fatal.setter
    def write_errors_fatal(self, fatal: bool) -> None:
        self._writes.fatal = fatal

    @property
    def writes_open(self) -> bool:
        """Whether the background writer may write now (no :meth:`hold_writes` in force)."""
        return self._writes.open

    def persists(self, request: PrepackRequest) -> bool:
        """Whether a packed object the session builds for ``request`` is to be persisted."""
        o = self.outcomes.get(request.key)
        return self.persisting and o is not None and o.status is not EntryStatus.HIT

    def persist(self, request: PrepackRequest, packed: np.ndarray, source_digests: Mapping[str, str | None],
                done: Callable[[], None]) -> None:
        """Queue ``packed`` (a view of the published object; the caller pinned it) for
        the background writer; ``done()`` runs once it is written or dropped."""
        digests = {**self._compat.declared, **{k: v for k, v in source_digests.items() if v is not None}}
        lineage = lineage_digest(request, self.resolved.weights, digests)
        if lineage is None or not self.persisting:  # a source read without a digest: cannot persist
            done()
            return
        old = self.manifest.by_key.get(request.key) if self.manifest is not None else None
        o = self.outcomes.get(request.key)
        if (old is not None and o is not None and o.status is EntryStatus.UNVERIFIED
                and request.key not in self.replace_keys and old.lineage_digest == lineage
                and self._compat.structural_incompatibility(old, request) is None):
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
                              layout=request.layout, device=request.device, kernel_abi=self._compat.abi,
                              format_version=packed_format_version())
        sources = {n: SourceRecord(digests[n], self.resolved.weights[n].onnx_type,
                                   tuple(self.resolved.weights[n].dims)) for n in request.source_lineage}
        self._writes.put(identity, packed, sources, done)

    def _written(self, nbytes: int) -> None:
        """The background writer wrote one object of ``nbytes``."""
        with self._lock:
            self.counters["persisted"] += 1
            self.counters["persisted_bytes"] += nbytes
        if self.on_persisted is not None:
            self.on_persisted(nbytes)

    def read_only(self) -> PreparedCache:
        """The same cache opened again under ``read-only``: what a reader that must not
        write sees (a device session reads a cache this one has just completed)."""
        return PreparedCache(self.resolved, self.path, policy=CachePolicy.READ_ONLY, compress=self.compress,
                             verify_payloads=self.verify_payloads, warn=self._warn, map_payloads=self.map_payloads,
                             trust_symlinks=self.trust_symlinks)

    def hold_writes(self) -> Callable[[], None]:
        """Hold the background writer over a session's first run, until the returned
        ``release()`` (or :meth:`flush`): ``BackgroundWriter.hold`` says why."""
        return self._writes.hold()

    def flush(self) -> None:
        """Wait until every object handed to :meth:`persist` is written (or dropped) and
        unpinned: a session calls this before it releases its objects. It ends any
        :meth:`hold_writes`."""
        self._writes.flush()

    def commit(self, *, strict: bool = False) -> dict:
        """Wait for queued writes, then publish them as a new generation. Returns what
        changed: {"generation", "written", "bytes_written", "error"}. A write that
        failed (read-only folder, full disk) is a warning in ``error``, and nothing is
        published; with ``strict`` (``build-cache``) it raises CacheWriteError."""
        published = self._writes.commit(
            live=self.manifest, model_path=self.resolved.model_path, strict=strict, keep=self._kept,
            wanted=lambda new, old: new.key in self.replace_keys or old is None
            or old.lineage_digest != new.lineage_digest or not self._kept(old))
        added: list[CacheEntry] = []
        if published is not None:
            self.manifest, added = published
            self.committed_keys = [e.key for e in added]
        return {"generation": self.manifest.generation if self.manifest else None, "written": len(added),
                "bytes_written": sum(e.length for e in added), "error": self._writes.error}

    def close(self) -> None:
        self._files.close()

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
