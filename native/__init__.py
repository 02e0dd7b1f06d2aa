"""onnx_prep.native: the cffi C core (INT4 prepack + matmul, INT4 gather, packed fp32
Gemm, grouped-query attention, row normalization, rotary embedding, host stable-VA
slots, element-wise erf and QuickGelu) behind a numpy API. See docs/architecture.md "Native" and docs/kernels.md.

Every kernel releases the GIL and works on a caller-given column range, so the
runtime's executor (not a thread pool inside C) splits the work. Importing this
package checks that the compiled module matches the package version. When the module
is missing or stale, importing still succeeds (``onnx_prep.native.layouts`` is pure
Python, so model resolution works) and the NativeError is raised at the first use of a
kernel name instead.
"""
from onnx_prep.core.errors import NativeError

try:
    from onnx_prep.native._module import NATIVE_VERSION, ffi, lib  # noqa: F401
    from onnx_prep.native.activation import quick_gelu
    from onnx_prep.native.attention import (
        GqaStep,
        attention_over_cache,
        attention_with_past,
        gqa_decode,
        group_query_attention,
    )
    from onnx_prep.native.elementwise import erf
    from onnx_prep.native.handoff import Mailbox, MatmulBatch, MatmulSplit, matmul_nbits_batch
    from onnx_prep.native.gather_block_quantized import (
        gather_block_quantized,
        gather_packed_size,
        prepack_gather_block_quantized,
    )
    from onnx_prep.native.gemm import gemm, gemm_b_packed_size, prepack_gemm_b
    from onnx_prep.native.isa import (
        ENV_VAR,
        active_isa,
        available_isas,
        cpu_features,
        kernel_variants,
        last_kernel,
        unavailable_reason,
    )
    from onnx_prep.native.matmul_nbits import (
        PANEL_N,
        matmul_nbits,
        matmul_nbits_packed_size,
        matmul_nbits_parts,
        prepack_matmul_nbits,
        probe_weight_streaming,
        set_amx,
        set_gemv_panels,
        set_weight_streaming,
    )
    from onnx_prep.native.norm import (
        NormResult,
        norm_rows,
        norm_rows_y,
        rms_norm_y,
        skip_norm_rows,
        skip_norm_sum,
    )
    from onnx_prep.native.packed import PackedHeader, packed_header
    from onnx_prep.native.rotary import rotary_embedding
    from onnx_prep.native.stable_slot import GRANULE, StableSlot
except NativeError as _error:  # not built, or built for another version
    _NATIVE_ERROR = _error

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise _NATIVE_ERROR

__all__ = [
    "ENV_VAR",
    "GRANULE",
    "Mailbox",
    "MatmulBatch",
    "MatmulSplit",
    "NATIVE_VERSION",
    "PackedHeader",
    "StableSlot",
    "PANEL_N",
    "GqaStep",
    "active_isa",
    "attention_over_cache",
    "attention_with_past",
    "available_isas",
    "cpu_features",
    "erf",
    "gather_block_quantized",
    "gather_packed_size",
    "gqa_decode",
    "group_query_attention",
    "gemm",
    "gemm_b_packed_size",
    "kernel_variants",
    "last_kernel",
    "matmul_nbits",
    "matmul_nbits_batch",
    "matmul_nbits_packed_size",
    "matmul_nbits_parts",
    "norm_rows",
    "norm_rows_y",
    "set_amx",
    "set_gemv_panels",
    "set_weight_streaming",
    "rms_norm_y",
    "skip_norm_rows",
    "skip_norm_sum",
    "NormResult",
    "packed_header",
    "prepack_gather_block_quantized",
    "prepack_gemm_b",
    "prepack_matmul_nbits",
    "probe_weight_streaming",
    "quick_gelu",
    "rotary_embedding",
    "unavailable_reason",
]
