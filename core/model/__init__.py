"""Model resolution: metadata-only parse, transforms, weights, prepared keys, and the
facts about a model every family shares (element types, the model file)."""
from onnx_prep.core.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "resolve_model": "resolution",
    "resolution_report": "resolution_report",
    "schema_path": "resolution_report",
    "RESOLVE_SCHEMA_VERSION": "resolution_report",
    "ResolvedModel": "resolved_model",
    "NodeKernel": "resolved_model",
    "PayloadManifest": "resolved_model",
    "ValueInfo": "resolved_model",
    "graph_value_infos": "resolved_model",
    "UnsupportedOp": "resolved_model",
    "ResolutionStats": "resolved_model",
    "require_frozen": "resolved_model",
    "WeightDescriptor": "weights",
    "DigestSource": "weights",
    "TENSOR_DIGEST_KEY": "weights",
    "PrepackRequest": "prepared_key",
    "PreparedKey": "prepared_key",
    "GraphNode": "transforms",
    "TransformResult": "transforms",
    "run_transforms": "transforms",
    "DType": "dtypes",
    "DTYPES": "dtypes",
    "dtype_of_type_string": "dtypes",
    "find_model_file": "model_file",
    "parse_model_file": "model_file",
})
