"""onnx_prep.native: the cffi C core (INT4 prepack + matmul, INT4 gather, packed fp32
Gemm, host stable-VA slots) behind a numpy API. See docs/architecture.md "Native"
and docs/kernels.md.

Every kernel releases the GIL and works on a caller-given column range, so the
runtime's executor (not a thread pool inside C) splits the work. Importing this
package checks that the compiled module matches the package version.
"""
from onnx_prep.native._module import NATIVE_VERSION, ffi, lib  # noqa: F401
from onnx_prep.native.gather_block_quantized import (
    gather_block_quantized,
    gather_packed_size,
    prepack_gather_block_quantized,
)
from onnx_prep.native.gemm import gemm, gemm_b_packed_size, prepack_gemm_b
from onnx_prep.native.isa import ENV_VAR, active_isa, available_isas, cpu_features, kernel_variants
from onnx_prep.native.matmul_nbits import (
    PANEL_N,
    matmul_nbits,
    matmul_nbits_packed_size,
    prepack_matmul_nbits,
)
from onnx_prep.native.packed import PackedHeader, packed_header
from onnx_prep.native.stable_slot import GRANULE, StableSlot

__all__ = [
    "ENV_VAR",
    "GRANULE",
    "NATIVE_VERSION",
    "PackedHeader",
    "StableSlot",
    "PANEL_N",
    "active_isa",
    "available_isas",
    "cpu_features",
    "gather_block_quantized",
    "gather_packed_size",
    "gemm",
    "gemm_b_packed_size",
    "kernel_variants",
    "matmul_nbits",
    "matmul_nbits_packed_size",
    "packed_header",
    "prepack_gather_block_quantized",
    "prepack_gemm_b",
    "prepack_matmul_nbits",
]
