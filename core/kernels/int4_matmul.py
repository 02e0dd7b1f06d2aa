"""The ``int4_matmul`` kernel: com.microsoft MatMulNBits and the fused
DequantizeLinear(int4)+MatMul node (core/model/transforms.py) on one packed INT4 weight.

Takes MatMulNBits with bits 4, a ``block_size`` attribute, no ``g_idx`` (act-order has no
INT4 kernel), constant B and scales (fp16 / fp32), and constant zero points when present
(packed uint4 or the scales' float type); and every fused MatMul (the transform checked
its parts). Requirement: lineage (B, scales[, zero points]), layout
``matmul_nbits_layout``, read at input 1 in place of B, scales and zero points.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
from onnx import TensorProto

from onnx_prep.core.kernels.int4_weights import SCALE_DTYPES, zero_point_kind, zero_points_of
from onnx_prep.core.kernels.spec import (DEVICE_PREPACK, HOST_PREPACK, REFERENCE, DevicePacking, KernelChoice,
                                         KernelSpec, MatchContext, PreparedForm, node_input, power_of_two_block,
                                         prepared_choice, refuse)
from onnx_prep.core.model.prepared_key import PrepackRequest
from onnx_prep.core.model.transforms import MATMUL_NBITS_WEIGHT_LAYOUT, QDQ_WEIGHT_LAYOUT, GraphNode
from onnx_prep.core.model.weights import WeightDescriptor
from onnx_prep.core.ops import int4
from onnx_prep.core.ops.registry import MS_DOMAIN, OpImpl
from onnx_prep.native.layouts import PACK_FORMAT_VERSION

ID = "int4_matmul"
LAYOUT_NAME = "int4mm"


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
    return (f"{LAYOUT_NAME}.v{PACK_FORMAT_VERSION}.bs{block_size}.zp-{zero_points}.sc-{scale_dtype}"
            f".acc{int(accuracy_level)}")


def match(node: GraphNode, ctx: MatchContext) -> KernelChoice | None:
    if node.domain == MS_DOMAIN:
        return _matmul_nbits(node, ctx)
    return _fused_dequantize_matmul(node, ctx) if node.fused_from else None


def _matmul_nbits(node: GraphNode, ctx: MatchContext) -> KernelChoice | None:
    a = node.attributes
    check_matmul_nbits(node, ctx)
    if int(a.get("bits", 4)) != 4 or node_input(node, 4):  # g_idx (act-order) has no INT4 kernel
        return None
    b, s = ctx.constant(node, 1), ctx.constant(node, 2)
    zp = ctx.constant(node, 3)
    if b is None or s is None or (node_input(node, 3) and zp is None) or s.dtype not in SCALE_DTYPES:
        return None
    zk = zero_point_kind(zp)
    if zk is None or "block_size" not in a:
        return None
    layout = matmul_nbits_layout(block_size=int(a["block_size"]), zero_points=zk,
                                 scale_dtype=s.dtype, accuracy_level=int(a.get("accuracy_level", 0)))
    return _choice(b, s, zp, layout, ctx.device)


_SCALE_TYPES = ("float16", "float32", "bfloat16")


def check_matmul_nbits(node: GraphNode, ctx: MatchContext) -> None:
    """ONNX Runtime's MatMulNBits rules (contrib schema and CPU kernel): K, N, block_size
    required; bits 2, 4 or 8; block_size a power of two >= 16; K, N positive (an
    accuracy_level outside 0-4 is loaded, as ONNX Runtime does: transforms make it 0); B uint8 [N, ceil(K / block_size), block_size * bits / 8]; scales
    float [N * k_blocks] or [N, k_blocks]; zero points uint8 packed
    [N * ceil(k_blocks * bits / 8)] (or 2-D) or the scales' type and shape."""
    a = node.attributes
    for name in ("K", "N", "block_size"):
        if name not in a:
            raise refuse(node, f"required attribute {name} is missing")
    K, N, bs, bits = int(a["K"]), int(a["N"]), int(a["block_size"]), int(a.get("bits", 4))
    if bits not in (2, 4, 8):
        raise refuse(node, f"bits {bits} is not 2, 4 or 8")
    power_of_two_block(node, bs)
    if K <= 0 or N <= 0:
        raise refuse(node, f"K {K} and N {N} must be positive")
    kb = -(-K // bs)
    b, s, zp = ctx.constant(node, 1), ctx.constant(node, 2), ctx.constant(node, 3)
    if b is not None:
        if b.dtype != "uint8":
            raise refuse(node, f"B is {b.dtype}, expected uint8", b.name)
        if b.dims != (N, kb, bs * bits // 8):
            raise refuse(node, f"B shape {list(b.dims)} does not match K {K}, N {N}, block_size {bs}, "
                               f"bits {bits}: expected {[N, kb, bs * bits // 8]}", b.name)
    if s is not None:
        if s.dtype not in _SCALE_TYPES:
            raise refuse(node, f"scales are {s.dtype}, expected float16, float32 or bfloat16", s.name)
        if s.dims not in ((N * kb,), (N, kb)):
            raise refuse(node, f"scales shape {list(s.dims)} is not [{N * kb}] or [{N}, {kb}]", s.name)
    if zp is not None:
        zb = -(-kb * bits // 8)
        shapes = ((N * zb,), (N, zb)) if zp.dtype in ("uint8", "int32") else ((N * kb,), (N, kb))
        if zp.dtype not in ("uint8", "int32", *_SCALE_TYPES) or (s is not None and zp.dtype in
                                                                 _SCALE_TYPES and zp.dtype != s.dtype):
            raise refuse(node, f"zero points are {zp.dtype}, expected uint8 or the scales' type", zp.name)
        if zp.dims not in shapes:
            raise refuse(node, f"zero points shape {list(zp.dims)} is not {' or '.join(map(str, map(list, shapes)))}",
                         zp.name)


def _fused_dequantize_matmul(node: GraphNode, ctx: MatchContext) -> KernelChoice:
    # transforms.fuse_dequantize_matmul validated every part of this node.
    a = node.attributes
    w, s = ctx.constants[node.inputs[1]], ctx.constants[node.inputs[2]]
    zp = ctx.constant(node, 3)
    # int4 without zero points == uint4 (code + 8) with MatMulNBits' implicit 8; uint4
    # without zero points has zero point 0, which the packed form can only hold explicitly.
    zk = "u4" if zp is not None or w.onnx_type == TensorProto.UINT4 else "none"
    layout = matmul_nbits_layout(block_size=int(a["block_size"]), zero_points=zk,
                                 scale_dtype=s.dtype, accuracy_level=int(a["accuracy_level"]))
    return _choice(w, s, zp, layout, ctx.device)


def _choice(b: WeightDescriptor, s: WeightDescriptor, zp: WeightDescriptor | None, layout: str,
            device: str) -> KernelChoice:
    lineage = (b.name, s.name) + ((zp.name,) if zp else ())
    return prepared_choice(ID, PrepackRequest(b.name, lineage, layout, device), lineage)


def prepack(sources: list[np.ndarray], attrs: Mapping[str, Any], backend: str,
            out: np.ndarray | None) -> np.ndarray:
    """Sources (B, scales[, zero points]) in MatMulNBits' form or a fused node's
    DequantizeLinear form (``weight_layout`` "KN", converted on the way)."""
    b, scales, zp = int4.matmul_nbits_sources(sources, attrs)
    K, N, bs = int(attrs["K"]), int(attrs["N"]), int(attrs["block_size"])
    if backend == REFERENCE:
        return int4.dequantize_matmul_nbits(b, scales, zp, K=K, N=N, block_size=bs)
    from onnx_prep import native

    return native.prepack_matmul_nbits(
        np.ascontiguousarray(b), np.ascontiguousarray(scales).reshape(-1),
        None if zp is None else np.ascontiguousarray(zp),
        K=K, N=N, block_size=bs, accuracy_level=int(attrs.get("accuracy_level", 0)), out=out)


def packed_size(request: PrepackRequest, attrs: Mapping[str, Any],
                weights: Mapping[str, WeightDescriptor], backend: str) -> int:
    K, N = int(attrs["K"]), int(attrs["N"])
    if backend == REFERENCE:
        return K * N * 4  # float32 [K, N]
    from onnx_prep import native

    return int(native.matmul_nbits_packed_size(
        K=K, N=N, block_size=int(attrs["block_size"]), zero_points=zero_points_of(request.layout),
        accuracy_level=int(attrs.get("accuracy_level", 0))))


def device_recipe(source: int, packed: int) -> str:
    """Where an object of ``source`` bytes packing to ``packed`` bytes is packed for a
    device: on the device unless the source is the larger."""
    # NOTE: pack on the device when the source is no larger than the packed bytes.
    # Uploads are what a weight paged under a device budget repeats on every page-in,
    # so the recipe that uploads fewer bytes wins; at equal bytes, packing on the
    # device also takes the CPU prepack (~1.2 GB/s of source a worker, against tens of
    # GB/s over the link) off the load's critical path and leaves the CPU workers free.
    # For this layout the source is the smaller with every scale and zero-point type
    # the fixtures and exports use (the codes are copied as they are, fp16 scales become
    # fp32, a header is added), so the rule picks device packing; a source that packs
    # smaller is packed here, on a CPU worker.
    return DEVICE_PREPACK if source <= packed else HOST_PREPACK


def packs_on_device(attrs: Mapping[str, Any]) -> bool:
    """Whether the device-side prepack packs this node's weight: MatMulNBits' B, not a
    fused DequantizeLinear + MatMul weight (int4 ``[K, N]``, which the CPU prepack
    converts first; core/cuda/device_int4_prepack.py has no such kernel)."""
    return attrs.get("weight_layout", MATMUL_NBITS_WEIGHT_LAYOUT) != QDQ_WEIGHT_LAYOUT


def implementation(op_type: str, domain: str, opset: int | None) -> OpImpl | None:
    if (domain, op_type) in SPEC.op_types:
        return int4.matmul_nbits  # a fused node (MatMul) reads its weight_layout attribute
    return None


SPEC = KernelSpec(
    id=ID,
    op_types=frozenset({(MS_DOMAIN, "MatMulNBits"), ("", "MatMul")}),
    match=match,
    implementation=implementation,
    prepared=PreparedForm(position=1, layout_name=LAYOUT_NAME, layout=matmul_nbits_layout,
                          prepack=prepack, packed_size=packed_size,
                          devices={"cuda": DevicePacking(offers=(HOST_PREPACK, DEVICE_PREPACK),
                                                         prefers=device_recipe, on_device=packs_on_device)}),
)
