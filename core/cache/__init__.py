"""The companion prepared cache: packed objects persisted beside a model so a later
load reads them instead of reading and repacking the source weights (docs/cache-format.md).

It sits above the runtime: the plan and the runtime know a cache only through the plan's
``PackedPayloadIndex`` protocol; this family implements it, writes generations, and runs
the preflight that checks a model and its cache."""
from onnx_prep.core.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {})
