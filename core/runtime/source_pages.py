"""Source pages: what a session does with a source tensor's page-cache pages once its
prepack is done (docs/design.md, "Source pages").

The policy lives here, with the runtime that applies it; the reader
(``core/io/external_data.py``) only carries it out (``release_shared(drop=True)``,
``drop_cached``). Light on purpose: the command line validates ``--source-pages``
against :data:`SOURCE_PAGES` before it imports numpy or onnx.
"""
from __future__ import annotations

from onnx_prep.core.errors import UsageError

SOURCE_PAGES = ("keep", "drop", "auto")


def drop_source_pages(policy: str, payload_bytes: int, available_bytes: int | None) -> bool:
    """Whether a load drops each source tensor from the page cache once it is prepacked
    (``Session(source_pages=...)``): ``keep`` never, ``drop`` always; ``auto`` when the
    payload is more than a quarter of the memory available (``available_bytes``, e.g.
    :func:`available_memory_bytes`; None, unknown: keep). Past that point the cached
    source and its packed copy together take half of what was free, and the kernel
    would reclaim the source's pages anyway, on the allocations of the load and the
    runs after it."""
    if policy not in SOURCE_PAGES:
        raise UsageError(f"unknown source pages policy {policy!r}", hint=f"choose one of {', '.join(SOURCE_PAGES)}")
    if policy != "auto":
        return policy == "drop"
    return available_bytes is not None and payload_bytes * 4 > available_bytes


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux): memory that can be had without swapping,
    the page cache's reclaimable part included; None where unknown."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
