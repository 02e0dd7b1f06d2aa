"""Sizes of memory as users write them (``8GiB``, ``512MiB``, ``2GB``) and the default
memory budget of a command that loads a model or builds its cache: 80% of the memory
available (``MemAvailable``), capped by the process's address-space limit."""
from __future__ import annotations

import re

from onnx_prep.core.errors import UsageError
from onnx_prep.core.option_ranges import MAX_MEMORY_BUDGET, MIN_MEMORY_BUDGET

__all__ = ["DEFAULT_BUDGET_FRACTION", "FALLBACK_BUDGET", "default_memory_budget", "format_size", "parse_size"]

DEFAULT_BUDGET_FRACTION = 0.8  # of MemAvailable: the rest is the weights', the page cache's, others'
FALLBACK_BUDGET = 4 << 30  # where the memory available is unknown (not Linux)

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}
_SIZE = re.compile(r"([0-9]{1,15}(?:\.[0-9]{1,6})?)\s*([a-z]{0,3})", re.ASCII)


def parse_size(text: str, *, option: str = "--memory-budget") -> int:
    """Bytes of a size written ``8GiB``, ``512M`` (binary), ``2GB`` (decimal), ``1.5g`` or
    a plain byte count; ``UsageError`` (naming ``option``) for anything else or outside
    1 MiB to 1 EiB."""
    m = _SIZE.fullmatch(text.strip().lower())
    if m is None or m.group(2) not in _UNITS:
        raise UsageError(f"{option} must be a size like 8GiB, 512MiB or 2GB, got {text!r}")
    value = int(float(m.group(1)) * _UNITS[m.group(2)])
    if not MIN_MEMORY_BUDGET <= value <= MAX_MEMORY_BUDGET:
        raise UsageError(f"{option} must be between 1 MiB and 1 EiB, got {text!r}")
    return value


def format_size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def default_memory_budget() -> int:
    """80% of MemAvailable (4 GiB where unknown), at most the soft address-space limit."""
    from onnx_prep.core.runtime.source_pages import available_memory_bytes

    available = available_memory_bytes()
    budget = FALLBACK_BUDGET if available is None else int(available * DEFAULT_BUDGET_FRACTION)
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            budget = min(budget, soft)
    except (ImportError, OSError, ValueError):
        pass
    return budget
