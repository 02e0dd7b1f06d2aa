"""Layout keys: names for packed formats. A layout key names EVERY parameter that
changes the packed bytes, so equal keys over equal sources mean equal bytes (the
prepared cache relies on this). Pure Python: resolution computes keys without
loading the native module.

NOTE: the packed formats are ISA-independent: every ISA path (scalar reference,
AVX2, AVX-512) reads the same bytes, so a cache built on one machine serves
another. The panel width (64 columns) is fixed by the format version, not chosen
per ISA.
"""
from __future__ import annotations

PACK_FORMAT_VERSION = 1


def matmul_nbits_layout(
    *, block_size: int, bits: int = 4, zero_points: str, scale_dtype: str, accuracy_level: int
) -> str:
    """Layout of the INT4 matmul kernel (MatMulNBits and DequantizeLinear+MatMul).

    zero_points: "none" (implicit 8), "u4" (packed uint4) or "float" (scales' type).
    scale_dtype: "float16" | "float32" (the source's; packed scales are always fp32,
    the header records the source type).
    accuracy_level: 0-4, ORT's attribute. The packed header records it (it is the
    kernels' default compute mode: 0-3 block floating point, 4 int8), so it
    is in the key even though the tile bytes do not depend on it.
    """
    if bits != 4:
        raise ValueError(f"only 4-bit weights are supported, got bits={bits}")
    if int(accuracy_level) not in (0, 1, 2, 3, 4):
        raise ValueError(f"accuracy_level must be 0-4, got {accuracy_level}")
    return (f"int4mm.v{PACK_FORMAT_VERSION}.bs{block_size}.zp-{zero_points}.sc-{scale_dtype}"
            f".acc{int(accuracy_level)}")


def gather_block_quantized_layout(
    *, block_size: int, bits: int = 4, zero_points: str, scale_dtype: str
) -> str:
    """Layout of the INT4 row gather (GatherBlockQuantized, quantize_axis = last).
    zero_points: "none" | "u4" | "float"; scale_dtype as for the matmul."""
    if bits != 4:
        raise ValueError(f"only 4-bit weights are supported, got bits={bits}")
    return f"int4gather.v{PACK_FORMAT_VERSION}.bs{block_size}.zp-{zero_points}.sc-{scale_dtype}"


def gemm_b_layout(*, trans_b: bool, dtype: str = "float32") -> str:
    """Layout of a constant B for fp32 Gemm/MatMul."""
    return f"gemmb.v{PACK_FORMAT_VERSION}.{dtype}.transB{int(trans_b)}"
