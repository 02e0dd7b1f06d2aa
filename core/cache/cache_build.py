"""The cache build: what ``onnx-prep build-cache`` does, as one core call returning one
record (schema ``onnx-prep.build-cache/3``, docs/build-cache.md).

It opens the model's prepared cache under ``build-if-missing`` and, when some prepared
object has no compatible entry, loads exactly those through the real runtime (a
:class:`Session` whose plan reads packed payloads for the entries that are compatible and
reads and prepacks the rest), persisting each object as it is built, in groups that fit
the memory budget (a session each, closed before the next); then commits one new
generation. An up-to-date cache loads nothing and writes nothing.
"""
from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from onnx_prep.core.cache.cache_policy import CachePolicy, default_cache_path
from onnx_prep.core.cache.entry_compatibility import EntryOutcome, EntryStatus
from onnx_prep.core.cache.prepared_cache import PreparedCache

__all__ = ["SCHEMA", "build_groups", "build_prepared_cache"]

SCHEMA = "onnx-prep.build-cache/3"

# The packed bytes a build holds at once by default. Nothing is gained by holding more:
# each object is written and released, and the reads, packs and writes overlap within a
# group. Measured on the 7B-shaped fixture (3.9 GB packed, 2-core VM; docs/build-cache.md):
# 4 groups of 1 GiB built in 7.9-8.3 s at 1.2 GB peak RSS, one group of everything in
# 14.3-17.2 s at 4.2 GB (fresh pages are what the single group pays for), 33 groups of
# 128 MiB in 11.2-11.5 s at 0.3 GB.
DEFAULT_GROUP_BYTES = 1 << 30

# progress(done_objects, total_objects, done_bytes, total_bytes)
BuildProgress = Callable[[int, int, int, int], None]


def build_groups(keys: list[str], size_of: Callable[[str], int | None], budget: int) -> list[list[str]]:
    """``keys`` in order, cut into consecutive groups whose packed bytes fit ``budget``
    (an object of unknown size counts as none). A single object over the budget is a
    ``UsageError`` naming what it needs."""
    from onnx_prep.core.errors import UsageError
    from onnx_prep.core.runtime.memory_size import format_size

    groups: list[list[str]] = []
    held = 0
    for k in keys:
        n = size_of(k) or 0
        if n > budget:
            raise UsageError(f"the prepared object {k} needs {format_size(n)}, over the memory budget of "
                             f"{format_size(budget)}", hint=f"give --memory-budget {-(-n // 2**20)}MiB or more")
        if not groups or held + n > budget:
            groups.append([])
            held = 0
        groups[-1].append(k)
        held += n
    return groups


def build_prepared_cache(model: Path, *, output: Path | None = None, cache_dir: Path | None = None,
                         compress: str | None = None, device: str = "cpu", rebuild: bool = False,
                         verify: bool = True, write_digests: bool = False, trust_symlinks: bool = False,
                         warn: Callable[[str], None] | None = None,
                         progress: BuildProgress | None = None, memory_budget: int | None = None) -> dict:
    """Build or update ``model``'s prepared cache; the record of what it did.

    ``verify``: every entry kept is read and checked against its payload digest first
    (a damaged one is rebuilt), so a cache this reports up to date loads. ``write_digests``:
    the model's weights get their missing digests first (``onnx-prep digest --write``):
    an entry built from a weight without one is unverified, and no load uses it.
    ``memory_budget``: the packed bytes held at once (default: ``DEFAULT_GROUP_BYTES``,
    or the largest object where that is larger, within ``run``'s default budget, 80% of
    the memory available); the objects are built in groups that fit, each persisted and
    released before the next is packed."""
    from onnx_prep.core.cache.cache_writer import check_manifest_target
    from onnx_prep.core.errors import UsageError
    from onnx_prep.core.model.model_file import find_model_file
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.core.runtime.memory_size import default_memory_budget
    from onnx_prep.core.runtime.session import Session

    if output is not None and cache_dir is not None:
        raise UsageError("-o and --cache-dir name the cache twice", hint="give one of them")
    if output is not None and not str(output).endswith(".prepared.onnx"):
        raise UsageError(f"-o {output}: a prepared cache's file name ends in .prepared.onnx",
                         hint="e.g. -o model.prepared.onnx")
    t0 = time.perf_counter()
    model_file = Path(os.path.abspath(find_model_file(Path(model), folder=True)))  # as resolve_model finds it
    path = Path(output) if output is not None else default_cache_path(model_file, cache_dir)
    if not path.parent.is_dir():
        raise UsageError(f"cache folder {path.parent} does not exist", hint="create it first")
    # Before anything is read or written (the model file, with --write-digests): a
    # manifest path this build could never publish to. A symlink is refused with or
    # without --trust-symlinks (which reads through one): replacing the link would cut
    # it from its target, and writing beside the target is a folder nobody named.
    check_manifest_target(path)
    digests_added = 0
    if write_digests:
        from onnx_prep.core.model.weight_digests import digest_model

        written = digest_model(Path(model), write=True, trust_symlinks=trust_symlinks)["write"] or {}
        digests_added = written.get("tensor_digests_added", 0)
    resolved = resolve_model(model_file, trust_symlinks=trust_symlinks)
    t_resolved = time.perf_counter()
    cache = PreparedCache(resolved, path, policy=CachePolicy.BUILD_IF_MISSING, compress=compress,
                          device=device, ignore_invalid=rebuild, warn=warn, trust_symlinks=trust_symlinks)
    cache.write_errors_fatal = True  # a folder that cannot take the cache is the error, one line
    before = dict(cache.outcomes)
    previous = cache.manifest.generation if cache.manifest is not None else None
    # Built again: every object without a compatible entry; with --rebuild every object;
    # and entries stored in another encoding than asked for (--compress).
    for k, o in list(before.items()):
        if o.status is EntryStatus.HIT and (rebuild or cache.entry(k).encoding != compress):
            why = "--rebuild" if rebuild else f"stored {cache.entry(k).encoding or 'uncompressed'}"
            before[k] = replace(o, status=EntryStatus.INCOMPATIBLE, reason=why)
            cache.outcomes[k] = before[k]
            cache.replace_keys.add(k)
    verified = 0
    if verify:  # what a load would find wrong with an entry kept, found now
        for k, o in list(before.items()):
            if o.status is EntryStatus.HIT and k not in cache.replace_keys:
                problem = cache.payload_problem(cache.entry(k))
                verified += 1
                if problem is not None:
                    before[k] = cache.outcomes[k] = EntryOutcome(k, EntryStatus.DAMAGED, problem)
                    cache.replace_keys.add(k)
    todo = [k for k, o in before.items() if o.status is not EntryStatus.HIT]
    total_bytes = sum(cache.packed_size(k) or 0 for k in todo)
    if memory_budget is not None:
        budget = memory_budget
    else:  # a group's worth, or the largest object, within what run may take
        largest = max((cache.packed_size(k) or 0 for k in todo), default=0)
        budget = min(default_memory_budget(), max(DEFAULT_GROUP_BYTES, largest))
    groups: list[list[str]] = []
    source_bytes = 0
    try:
        groups = build_groups(todo, cache.packed_size, budget)
        if todo:
            done = {"n": 0, "bytes": 0}

            def persisted(nbytes: int) -> None:
                done["n"] += 1
                done["bytes"] += nbytes
                if progress is not None:
                    progress(done["n"], len(todo), done["bytes"], total_bytes)

            cache.on_persisted = persisted
            if progress is not None:
                progress(0, len(todo), 0, total_bytes)
            for group in groups:  # one session a group: its slots are released when it closes
                with Session(resolved, cache=cache, trust_symlinks=trust_symlinks, warm_slots=False) as session:
                    session.prepare(group)
                    cache.flush()  # every object of the group persisted before its slot goes
                    stats = session.stats()
                    source_bytes += stats.source_bytes_read + stats.source_bytes_mapped
        result = cache.commit(strict=True)
    finally:
        cache.close()
    t_end = time.perf_counter()
    written = result["written"]
    # an unverified entry whose sources hash, on this build's read, to what it was built
    # from is kept as it is: built again, not written
    written_keys = set(cache.committed_keys)
    outcomes = []
    for key, o in sorted(before.items()):
        action = "written" if key in written_keys else "reused"
        outcomes.append({"key": key, "was": o.status.value, "reason": o.reason, "action": action})
    live = cache.manifest
    entries = live.entries if live is not None else ()
    warnings = list(cache.warnings)
    unverifiable = cache.unverifiable()
    if unverifiable:
        # A load trusts an entry only through its sources' digests: without them every
        # load rebuilds these objects (and every build reads and packs them again).
        msg = (f"{len(unverifiable)} of {len(before)} objects come from weights without a digest "
               f"({next(iter(unverifiable.values()))}{', ...' if len(unverifiable) > 1 else ''}): no load "
               f"can check their entries, so loads rebuild them and this cache goes unused; give the "
               f"weights digests and build again: {cache.build_command('--write-digests')}")
        warnings.append(msg)
        if warn is not None:
            warn(msg)
    return {
        "schema": SCHEMA,
        "model": str(resolved.model_path),
        "cache": str(path),
        "compress": compress,
        "device": device,
        "generation": live.generation if live is not None else None,
        "previous_generation": previous,
        "objects": len(before),
        "written": written,
        "reused": len(before) - len(written_keys),
        "rebuilt": sum(1 for k in written_keys if before[k].status is not EntryStatus.MISSING),
        "bytes_written": result["bytes_written"],
        "cache_bytes": sum(e.length for e in entries),
        "packed_bytes": sum(e.decoded_length for e in entries),
        "source_bytes_read": source_bytes,
        "memory_budget": budget,
        "groups": len(groups),
        "files": sorted({e.file for e in entries}),
        "outcomes": outcomes,
        "verified": verified,
        "unverifiable": len(unverifiable),
        "digests_added": digests_added,
        "warnings": warnings,
        "timings": {"resolve_ms": (t_resolved - t0) * 1e3, "build_ms": (t_end - t_resolved) * 1e3,
                    "total_ms": (t_end - t0) * 1e3},
    }
