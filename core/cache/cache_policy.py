"""CachePolicy: what a load may do with a model's prepared cache (read it, write it,
require it), the error a policy raises when the cache cannot serve it, and where the
cache lives by default (docs/cache-format.md, "Policies")."""
from __future__ import annotations

import enum
from pathlib import Path

from onnx_prep.core.errors import OnnxPrepError

__all__ = ["POLICIES", "CachePolicy", "PreparedCacheError", "default_cache_path"]


class CachePolicy(str, enum.Enum):
    """- ``disabled``: no cache is read or written;
    - ``read-only`` (the default): compatible entries are used, misses are built in memory;
    - ``build-if-missing``: as read-only, and every object built is persisted, at idle
      priority on a thread of its own, then committed once the caller is done;
    - ``require-complete``: opening fails, naming what is missing, unless every prepared
      object has a compatible entry."""

    DISABLED = "disabled"
    READ_ONLY = "read-only"
    BUILD_IF_MISSING = "build-if-missing"
    REQUIRE_COMPLETE = "require-complete"


POLICIES = tuple(p.value for p in CachePolicy)


class PreparedCacheError(OnnxPrepError):
    """The cache cannot serve what the policy demands (require-complete), or a payload
    is corrupt where no fallback is allowed."""


def default_cache_path(model_path: Path, cache_dir: Path | None = None) -> Path:
    """``<model stem>.prepared.onnx`` beside the model, or in ``cache_dir``."""
    model_path = Path(model_path)
    return Path(cache_dir or model_path.parent) / f"{model_path.stem}.prepared.onnx"
