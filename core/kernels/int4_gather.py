"""The ``int4_gather`` kernel: com.microsoft GatherBlockQuantized gathering rows of a
packed INT4 table (an embedding).

Takes bits 4, uint8 data of rank >= 2, gather_axis 0, quantize_axis last, constant data
and scales (fp16 / fp32), constant zero points when present. Requirement: lineage (data,
scales[, zero points]), layout ``gather_block_quantized_layout``, read at input 0 in
place of data, scales and zero points.

Data may be a folded view of an initializer (``DATA_VIEW``, core/model/weight_views.py:
the genai builder's tied embedding reads the LM head's ``[V, K/bs, bs/2]`` weight as
``[V, K/2]``): the rules and the row shape use the view's dims. The packed bytes do
not depend on them (V is scales' first dim, the rows are the same bytes).

A tied embedding (the LM head's MatMulNBits reads the same table alike:
core/kernels/tied_embedding.py) reads the matmul's ``int4mm`` object instead: resolution
replaces this kernel's request with the matmul's, so the weight is packed once; the
``int4gather`` layout is for untied tables.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
from onnx import TensorProto

from onnx_prep.core.kernels.int4_matmul import LAYOUT_NAME as MATMUL_LAYOUT_NAME
from onnx_prep.core.kernels.int4_weights import SCALE_DTYPES, zero_point_kind, zero_points_of
from onnx_prep.core.kernels.spec import (REFERENCE, KernelChoice, KernelSpec, MatchContext, PreparedForm,
                                         node_input, power_of_two_block, prepared_choice, refuse)
from onnx_prep.core.model.prepared_key import PrepackRequest
from onnx_prep.core.model.transforms import GraphNode
from onnx_prep.core.model.weight_views import DATA_VIEW
from onnx_prep.core.model.weights import WeightDescriptor
from onnx_prep.core.ops import int4
from onnx_prep.core.ops.attributes import ROW_SHAPE, ROWS_AS_COLUMNS
from onnx_prep.core.ops.registry import MS_DOMAIN, OpImpl
from onnx_prep.native.layouts import PACK_FORMAT_VERSION

ID = "int4_gather"
LAYOUT_NAME = "int4gather"
DEFAULT_BLOCK_SIZE = 128  # the op's default


def gather_block_quantized_layout(
    *, block_size: int, bits: int = 4, zero_points: str, scale_dtype: str
) -> str:
    """Layout of the INT4 row gather (GatherBlockQuantized, quantize_axis = last).
    zero_points: "none" | "u4" | "float"; scale_dtype as for the matmul."""
    if bits != 4:
        raise ValueError(f"only 4-bit weights are supported, got bits={bits}")
    return f"{LAYOUT_NAME}.v{PACK_FORMAT_VERSION}.bs{block_size}.zp-{zero_points}.sc-{scale_dtype}"


def data_dims(attrs: Mapping[str, Any], data: WeightDescriptor) -> tuple[int, ...]:
    """The dims the node reads data as: a folded view's, else the initializer's."""
    view = attrs.get(DATA_VIEW)
    return tuple(int(d) for d in view) if view is not None else tuple(data.dims)


def check_gather_block_quantized(node: GraphNode, ctx: MatchContext) -> None:
    """ONNX Runtime's GatherBlockQuantized rules (contrib schema): bits 4 or 8;
    block_size a power of two >= 16; gather_axis and quantize_axis within data's rank;
    data int4, uint4 or uint8; scales float of data's rank, data's dims but
    ceil(codes / block_size) along quantize_axis; zero points data's type, scales' shape."""
    a = node.attributes
    bits, bs = int(a.get("bits", 4)), int(a.get("block_size", DEFAULT_BLOCK_SIZE))
    if bits not in (4, 8):
        raise refuse(node, f"bits {bits} is not 4 or 8")
    power_of_two_block(node, bs)
    data, s, zp = ctx.constant(node, 0), ctx.constant(node, 2), ctx.constant(node, 3)
    if data is None:
        return
    shape = data_dims(a, data)
    rank = len(shape)
    for name, default in (("gather_axis", 0), ("quantize_axis", 1)):
        if not -rank <= int(a.get(name, default)) < rank:
            raise refuse(node, f"{name} {a.get(name, default)} is outside data's rank {rank}")
    if data.dtype not in ("int4", "uint4", "uint8"):
        raise refuse(node, f"data is {data.dtype}, expected int4, uint4 or uint8", data.name)
    qa = int(a.get("quantize_axis", 1)) % rank
    dims = list(shape)
    dims[qa] = -(-dims[qa] * (8 // bits if data.dtype == "uint8" else 1) // bs)
    if s is not None:
        if s.dtype not in ("float16", "float32", "bfloat16"):
            raise refuse(node, f"scales are {s.dtype}, expected float16, float32 or bfloat16", s.name)
        if list(s.dims) != dims:
            raise refuse(node, f"scales shape {list(s.dims)} does not match data {list(shape)} "
                               f"and block_size {bs}: expected {dims}", s.name)
    if zp is not None and zp.dtype != data.dtype:
        raise refuse(node, f"zero points are {zp.dtype}, expected data's {data.dtype}", zp.name)


def match(node: GraphNode, ctx: MatchContext) -> KernelChoice | None:
    a = node.attributes
    check_gather_block_quantized(node, ctx)
    data, s = ctx.constant(node, 0), ctx.constant(node, 2)
    zp = ctx.constant(node, 3)
    if data is None or s is None or (node_input(node, 3) and zp is None) or s.dtype not in SCALE_DTYPES:
        return None
    rank = len(data_dims(a, data))
    quantize_axis = int(a.get("quantize_axis", 1))
    if int(a.get("bits", 4)) != 4 or data.onnx_type != TensorProto.UINT8 or rank < 2:
        return None
    if int(a.get("gather_axis", 0)) not in (0, -rank) or quantize_axis not in (rank - 1, -1):
        return None
    zk = zero_point_kind(zp)
    if zk is None:
        return None
    layout = gather_block_quantized_layout(block_size=int(a.get("block_size", DEFAULT_BLOCK_SIZE)),
                                           zero_points=zk, scale_dtype=s.dtype)
    lineage = (data.name, s.name) + ((zp.name,) if zp else ())
    return prepared_choice(ID, PrepackRequest(data.name, lineage, layout, ctx.device), lineage)


def prepack(sources: list[np.ndarray], attrs: Mapping[str, Any], backend: str,
            out: np.ndarray | None) -> np.ndarray:
    """Sources (data, scales[, zero points]) as the op reads them."""
    data, scales = sources[0], sources[1]
    zp = sources[2] if len(sources) > 2 else None
    bs = int(attrs.get("block_size", DEFAULT_BLOCK_SIZE))
    if backend == REFERENCE:
        if attrs.get(DATA_VIEW) is not None:
            data = data.reshape(tuple(attrs[DATA_VIEW]))
        return int4.dequantize_block_quantized(data, scales, zp, quantize_axis=int(attrs.get("quantize_axis", 1)),
                                               block_size=bs, bits=int(attrs.get("bits", 4)))
    from onnx_prep import native

    v = scales.shape[0]  # gather_axis 0: data's and scales' first dim (data may be a view)
    kb = scales.size // v
    return native.prepack_gather_block_quantized(
        np.ascontiguousarray(data).reshape(v, kb, bs // 2),
        np.ascontiguousarray(scales).reshape(v, kb, 1),
        None if zp is None else np.ascontiguousarray(zp), block_size=bs, out=out)


def packed_size(request: PrepackRequest, attrs: Mapping[str, Any],
                weights: Mapping[str, WeightDescriptor], backend: str) -> int:
    d = weights[request.source_lineage[0]].dims
    v, elems = weights[request.source_lineage[1]].dims[0], int(np.prod(d)) * 2  # scales' V; two codes a byte
    if backend == REFERENCE:
        return elems * 4  # the float32 table
    bs = int(attrs.get("block_size", DEFAULT_BLOCK_SIZE))
    from onnx_prep import native

    return int(native.gather_packed_size(V=v, n_blocks=elems // v // bs, block_size=bs,
                                         zero_points=zero_points_of(request.layout)))


def bind_attrs(node: Any, attrs: dict, weights: Mapping[str, WeightDescriptor]) -> None:
    """The shape of one gathered row (``ROW_SHAPE``): the native gather returns
    ``[..., row elements]``; ORT's output keeps data's trailing dimensions. A gather
    reading its LM head's object (core/kernels/tied_embedding.py) takes rows as its
    columns (``ROWS_AS_COLUMNS``)."""
    if any(key.rsplit("|", 2)[1].startswith(MATMUL_LAYOUT_NAME + ".")
           for key in getattr(node, "prepared_inputs", ())):
        attrs[ROWS_AS_COLUMNS] = True
    desc = weights.get(node.inputs[0]) if weights is not None else None
    if desc is None:
        return
    dims = list(data_dims(attrs, desc))
    qa = int(attrs.get("quantize_axis", 1))
    qa = qa + len(dims) if qa < 0 else qa
    if desc.dtype == "uint8":
        dims[qa] *= 2  # two 4-bit codes per byte along the quantized axis
    ga = int(attrs.get("gather_axis", 0))
    ga = ga + len(dims) if ga < 0 else ga
    attrs[ROW_SHAPE] = tuple(dims[ga + 1:])


def implementation(op_type: str, domain: str, opset: int | None) -> OpImpl | None:
    return int4.gather_block_quantized if (domain, op_type) in SPEC.op_types else None


SPEC = KernelSpec(
    id=ID,
    op_types=frozenset({(MS_DOMAIN, "GatherBlockQuantized")}),
    match=match,
    implementation=implementation,
    prepared=PreparedForm(position=0, layout_name=LAYOUT_NAME, layout=gather_block_quantized_layout,
                          prepack=prepack, packed_size=packed_size),
    bind_attrs=bind_attrs,
)
