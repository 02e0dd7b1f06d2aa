"""EntryCompatibility: whether a cache entry holds what this model and this build of
onnx-prep would pack for a prepared request, and if not, why; ``EntryStatus`` and
``EntryOutcome``, that answer per prepared key (docs/cache-format.md, "Identity").

An entry is compatible when its lineage digest (``lineage.lineage_digest`` of the
sources as the model declares them now), layout, device, kernel ABI, packed format
version and decoded size all match; otherwise it is a miss with its reason. Nothing
here reads a payload byte (an inline source is hashed, the first time an entry is
compared)."""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from onnx_prep.core.cache.lineage import inline_digest, kernel_abi, lineage_digest, packed_format_version
from onnx_prep.core.cache.manifest import CacheEntry, CacheManifest
from onnx_prep.core.errors import OnnxPrepError
from onnx_prep.core.model.prepared_key import PrepackRequest
from onnx_prep.core.model.resolved_model import ResolvedModel
from onnx_prep.core.plan.execution_plan import RAW_LAYOUT

__all__ = ["EntryCompatibility", "EntryOutcome", "EntryStatus"]


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


class EntryCompatibility:
    """The model's cacheable requests (every packed layout; a raw request is never
    cached), each judged against the entry a manifest holds for its key."""

    def __init__(self, resolved: ResolvedModel) -> None:
        from onnx_prep.core.kernels.prepack import packing_nodes

        self.resolved = resolved
        self.requests = {k: r for k, r in resolved.requests.items() if r.layout != RAW_LAYOUT}
        self.abi = kernel_abi()
        self._consumer = packing_nodes(resolved.nodes)  # key -> its packing node (its attributes size the object)

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

    def undigested(self, req: PrepackRequest) -> str | None:
        """The first of ``req``'s sources without a declared digest, or None."""
        return next((n for n in req.source_lineage if self.declared.get(n) is None), None)

    def unverifiable(self) -> dict[str, str]:
        """Each object whose entry no load can check, with its first source that has no
        digest: a load trusts an entry only through its sources' digests."""
        return {key: self.undigested(req) for key, req in self.requests.items()
                if self.expected_lineage(req) is None}

    def outcome(self, key: str, manifest: CacheManifest | None) -> EntryOutcome:
        """What ``manifest`` holds for the request ``key``: a hit, or the reason for a miss."""
        damaged = next((d for d in (manifest.damaged if manifest else ()) if d.entry.key == key), None)
        if damaged is not None:
            return EntryOutcome(key, EntryStatus.DAMAGED, damaged.message)
        e = manifest.by_key.get(key) if manifest else None
        if e is None:
            return EntryOutcome(key, EntryStatus.MISSING, "no entry")
        why = self.incompatibility(e, self.requests[key])
        if why is not None:
            return why
        return EntryOutcome(key, EntryStatus.HIT, "compatible")

    def incompatibility(self, e: CacheEntry, req: PrepackRequest) -> EntryOutcome | None:
        why = self.structural_incompatibility(e, req)
        if why is not None:
            return why
        expected = self.expected_lineage(req)
        if expected is None:
            return EntryOutcome(e.key, EntryStatus.UNVERIFIED, f"source {self.undigested(req)} has no digest "
                                "(onnx-prep digest --write gives it one)")
        if e.lineage_digest != expected:
            return EntryOutcome(e.key, EntryStatus.STALE, "the source bytes changed (lineage digest differs)")
        return None

    def structural_incompatibility(self, e: CacheEntry, req: PrepackRequest) -> EntryOutcome | None:
        """What makes ``e`` another object than this build packs for ``req``, its sources'
        bytes aside: layout, device, kernel ABI, packed format, source names, size."""
        key = e.key
        for field, have, want in (("layout", e.layout, req.layout), ("device", e.device, req.device),
                                  ("kernel ABI", e.kernel_abi, self.abi),
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
            return packed_size(node.kernel, self.requests[key], self.resolved, node=node)
        except OnnxPrepError:
            return None

    def compatible(self, e: CacheEntry) -> bool:
        req = self.requests.get(e.key)
        return req is not None and self.incompatibility(e, req) is None
