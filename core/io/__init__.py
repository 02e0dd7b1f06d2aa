"""The one reader of external data (and later of cache payloads), content digests, and atomic
file writes."""
from onnx_prep.core.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "ExternalDataReader": "external_data",
    "ReadCounters": "external_data",
    "ReadHooks": "external_data",
    "check_location": "external_data",
    "check_bounds": "external_data",
    "verify_tensor_digest": "external_data",
    "write_atomically": "atomic_file",
    "ContentHasher": "content_digest",
    "digest_of": "content_digest",
})
