"""What the INT4 kernels (int4_matmul, int4_gather) read from a quantized weight's
descriptors: the scale dtypes they take and the zero-point kind, which their layout
keys name (``.zp-<kind>.``) and their packed sizes depend on."""
from __future__ import annotations

from onnx import TensorProto

from onnx_prep.core.model.weights import WeightDescriptor

SCALE_DTYPES = ("float16", "float32")


def zero_point_kind(zp: WeightDescriptor | None) -> str | None:
    """"none" (no zero points: implicit 8), "u4" (packed 4-bit), "float" (the scales'
    type); None for a zero-point type no INT4 kernel takes."""
    if zp is None:
        return "none"
    if zp.onnx_type in (TensorProto.UINT8, TensorProto.UINT4):
        return "u4"
    if zp.dtype in SCALE_DTYPES:
        return "float"
    return None


def zero_points_of(layout: str) -> str:
    """The zero-point kind a layout key names (``.zp-<kind>.``)."""
    return layout.split(".zp-", 1)[1].split(".", 1)[0]
