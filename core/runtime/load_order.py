"""Whether a load reads every object before its first step (``reads_first``), or starts
the step as soon as the step's own objects are in (every other load: the run loop's
pipelined default, docs/runtime.md, "Cold path")."""
from __future__ import annotations

import mmap

from onnx_prep.core.plan.execution_plan import RAW_LAYOUT, READ_PACKED_PAYLOAD, PreparedExecutionPlan
from onnx_prep.core.runtime.arenas import Arena, MemoryBudget

__all__ = ["READS_FIRST_MAX_SOURCE_BYTES", "reads_first"]

# Non-mapped bytes (raw weights read from their source) a load may read and still read
# first: the medium fixture's norm weights are 0.26 MiB.
READS_FIRST_MAX_SOURCE_BYTES = 16 << 20


def reads_first(plan: PreparedExecutionPlan, budget: MemoryBudget) -> bool:
    """Whether a cold run waits for every object before its first step, instead of
    starting as soon as the first step's objects are in.

    True when every object is a cache payload mapped into its slot (or a raw weight, at
    most READS_FIRST_MAX_SOURCE_BYTES of them in all), each payload's first page is in
    the page cache (``_resident``) and no limit makes the load stream.
    NOTE: why: such a load builds nothing; it maps pages and checks checksums, CPU work
    on the same cores the first step's compute needs. Overlapping the two buys nothing
    and costs contention (docs/runtime.md, "Reading first", has the figures). On more
    cores the mapped reads are what the first step waits for either way. A load that
    prepacks, streams under a limit, or finds its payloads out of the page cache keeps
    overlapping: its reads wait on storage or its prepacks are the work."""
    if budget.global_limit is not None or budget.limit(Arena.PREPARED) is not None:
        return False
    source = 0
    for r in plan.requirements:
        if r.selected.kind == READ_PACKED_PAYLOAD:
            if not r.selected.payload.mapped or not _resident(plan.cache, r.selected.payload):
                return False
        elif r.request.layout == RAW_LAYOUT:
            source += r.read_bytes
        else:
            return False
    return source <= READS_FIRST_MAX_SOURCE_BYTES and any(
        r.selected.kind == READ_PACKED_PAYLOAD for r in plan.requirements)


def _resident(cache, payload) -> bool:
    """Whether the payload's first page is in the page cache: mincore over a one-page
    mapping of it, which reads nothing (a read that may not wait, RWF_NOWAIT, starts
    readahead: its small folios then kept the payload's 2 MiB units from 2 MiB
    page-table entries). Where that cannot be asked, True."""
    mapping = cache.mapping(payload) if cache is not None else None
    if mapping is None:
        return False
    fd, offset = mapping
    try:
        from onnx_prep.native._module import ffi, lib

        page = mmap.PAGESIZE
        with mmap.mmap(fd, page, offset=offset - offset % page, access=mmap.ACCESS_READ) as mm:
            view = ffi.from_buffer(mm)
            try:
                return lib.op_resident_bytes(view, page) != 0  # < 0: mincore failed, say resident
            finally:
                ffi.release(view)
    except Exception:  # noqa: BLE001 - no native module, no mmap of this file: cannot tell
        return True
