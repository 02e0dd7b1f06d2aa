"""onnx-prep: prepare and profile ONNX models for fast loading.

The public Python API is the names in ``__all__`` (docs/api.md shows a short program).
Each is imported on first use, so ``import onnx_prep`` costs almost nothing::

    import onnx_prep

    resolved = onnx_prep.resolve_model("model.onnx")       # metadata only, no payload read
    with onnx_prep.Session(resolved) as session:
        outputs = session.run({"input_ids": ids, ...})

The import package maps onto the repository's top-level folders: ``onnx_prep.cli``
(cli/), ``onnx_prep.core`` (core/), ``onnx_prep.native`` (native/) and
``onnx_prep.fixtures`` (fixtures/); this root is package/ (pyproject.toml says why it
is not a folder named onnx_prep/). docs/architecture.md is the map.
"""
from onnx_prep.core.lazy_exports import lazy_exports

_ERRORS = ("OnnxPrepError", "ModelFormatError", "ExternalDataError", "UnsafePathError",
           "DigestError", "UnsupportedOpError", "NativeError", "ModelIOError", "BudgetError",
           "TaskFailedError", "CancelledError", "UsageError", "Where")

__all__, _getattr, __dir__ = lazy_exports(__name__, {
    # model resolution
    "resolve_model": "core.model.resolution",
    "ResolvedModel": "core.model.resolved_model",
    "WeightDescriptor": "core.model.weights",
    "PrepackRequest": "core.model.prepared_key",
    # the plan
    "build_prepared_execution_plan": "core.plan.execution_plan",
    "PreparedExecutionPlan": "core.plan.execution_plan",
    # the runtime
    "Session": "core.runtime.session",
    "SessionOptions": "core.runtime.session",
    "RuntimeContext": "core.runtime.session",
    "Workspace": "core.runtime.session",
    "MemoryBudget": "core.runtime.arenas",
    "ExecutionHandle": "core.runtime.execution_handle",
    "ExecutionStatus": "core.runtime.execution_handle",
    "RuntimeStats": "core.runtime.stats",
    # decoding
    "greedy_decode": "core.decode.generation",
    "DecoderIO": "core.decode.decoder_io",
    # the embedded default model and other deterministic fixtures
    "default_model_path": "fixtures",
    "generate": "fixtures",
    **{name: "core.errors" for name in _ERRORS},
})
__all__ = ["__version__", *__all__]


def __getattr__(name: str):
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("onnx-prep")
        except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
            return "0+unknown"
    return _getattr(name)
