"""The ranges of the commands' integer options (docs/run.md and docs/fixture.md,
"Ranges"), and ``check_range``, which enforces one before anything is allocated.

Light on purpose (no numpy, no onnx): the commands check their options before the
load path is imported. A range bounds what one option can ask for; what a
combination of options costs is admitted separately (``core/decode/run_memory``).
"""
from __future__ import annotations

import numbers

from onnx_prep.core.errors import UsageError

INT64_MAX = (1 << 63) - 1

# run
MAX_TOKENS = 1 << 20  # a million positions: past any decoder's context
MAX_BATCH = 1 << 16
MAX_THREADS = 256  # more than any CPU this runs on has cores
MAX_TOKEN_ID = INT64_MAX  # the token ids' dtype; the vocabulary is checked once the model is read
MIN_MEMORY_BUDGET, MAX_MEMORY_BUDGET = 1 << 20, 1 << 60  # --memory-budget: 1 MiB to 1 EiB

# fixture: option -> (low, high); the config's own rules (multiples, powers of two) come after
FIXTURE_RANGES = {
    "--layers": (1, 1024),
    "--hidden": (1, 1 << 16),
    "--intermediate": (1, 1 << 18),
    "--heads": (1, 1024),
    "--vocab": (1, 1 << 20),
    "--block-size": (16, 4096),
    "--seed": (0, INT64_MAX),
    "--kv-heads": (0, 1024),
}


def check_range(option: str, value: int, low: int, high: int) -> None:
    """``UsageError`` unless ``value`` is an integer in [low, high] (``bool`` is not one)."""
    text = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise UsageError(f"{option} must be an integer from {low:,} to {high:,}, got {text}")
    if not low <= value <= high:
        side = f"at least {low:,}" if value < low else f"at most {high:,}"
        raise UsageError(f"{option} must be {side} (range {low:,} to {high:,}), got {text}")
