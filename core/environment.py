"""Switches read from the environment (README, "Environment variables")."""
from __future__ import annotations

import os

from onnx_prep.core.errors import UsageError


def flag(name: str, *, default: bool, on: str, off: str) -> bool:
    """``name=1`` -> True, ``name=0`` -> False, unset or empty -> ``default``; any other
    value is a UsageError naming the variable and both settings (``on`` / ``off`` say
    what each does)."""
    raw = os.environ.get(name, "").strip()
    if raw == "":
        return default
    if raw in ("0", "1"):
        return raw == "1"
    raise UsageError(f"{name}={raw!r} is not a valid setting",
                     hint=f"set {name}=1 to {on}, or {name}=0 to {off} (default: {int(default)})")
