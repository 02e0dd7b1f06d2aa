"""Build hints: the ``onnx-prep build-cache`` command line that makes a model's prepared
cache complete, as a user would type it, for the errors and warnings that name the fix."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from onnx_prep.core.cache.cache_policy import default_cache_path
from onnx_prep.core.cache.entry_compatibility import EntryOutcome, EntryStatus

__all__ = ["build_command", "build_hint"]


def build_command(model: Path, cache: Path, *options: str) -> str:
    """``onnx-prep build-cache`` for ``model`` and its cache at ``cache`` (``-o PATH``
    where that is not the default place)."""
    where = "" if Path(cache) == default_cache_path(model) else f" -o {cache}"
    return " ".join(["onnx-prep build-cache", *options, str(model)]) + where


def build_hint(model: Path, cache: Path, outcomes: Iterable[EntryOutcome] = (), *, verb: str = "build") -> str:
    """What makes the cache complete: :func:`build_command`, after ``digest --write``
    where an entry is unverified (a source without a digest: no build can make a load
    trust it)."""
    if any(o.status is EntryStatus.UNVERIFIED for o in outcomes):
        return (f"give the weights digests, then build: onnx-prep digest --write {model}; "
                f"{build_command(model, cache)}")
    return f"{verb} it: {build_command(model, cache)}"
