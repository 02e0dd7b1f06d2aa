"""Decoder I/O discovery, greedy generation, ONNX Runtime as a runner, the record of a run."""
from onnx_prep.core.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "DecoderIO": "decoder_io",
    "TensorSlot": "decoder_io",
    "KVPair": "decoder_io",
    "load_io_map": "io_map",
    "validate_io_map": "io_map",
    "Runner": "generation",
    "GenerationResult": "generation",
    "GenerationComparison": "generation",
    "greedy_decode": "generation",
    "compare_generations": "generation",
    "OrtRunner": "ort_runner",
    "import_onnxruntime": "ort_runner",
    "RunOptions": "run_record",
    "record_run": "run_record",
})
