"""The ``gemm_packed`` kernel: fp32 Gemm (transA 0) or MatMul whose B is a constant 2-D
fp32 initializer, read from B packed once.

Requirement: lineage (B,), layout ``gemm_b_layout(trans_b)``, read at input 1 in place
of B.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
from onnx import TensorProto

from onnx_prep.core.kernels.spec import REFERENCE, KernelChoice, KernelSpec, MatchContext, PreparedForm, prepared_choice
from onnx_prep.core.model.prepared_key import PrepackRequest
from onnx_prep.core.model.transforms import GraphNode
from onnx_prep.core.model.weights import WeightDescriptor
from onnx_prep.core.ops import gemm
from onnx_prep.core.ops.registry import OpImpl
from onnx_prep.native.layouts import PACK_FORMAT_VERSION

ID = "gemm_packed"
LAYOUT_NAME = "gemmb"


def gemm_b_layout(*, trans_b: bool, dtype: str = "float32") -> str:
    """Layout of a constant B for fp32 Gemm/MatMul."""
    return f"{LAYOUT_NAME}.v{PACK_FORMAT_VERSION}.{dtype}.transB{int(trans_b)}"


def match(node: GraphNode, ctx: MatchContext) -> KernelChoice | None:
    b = ctx.constant(node, 1)
    if b is None or b.onnx_type != TensorProto.FLOAT or len(b.dims) != 2:
        return None
    trans_b = False
    if node.op_type == "Gemm":
        if int(node.attributes.get("transA", 0)) != 0:
            return None
        trans_b = bool(int(node.attributes.get("transB", 0)))
    req = PrepackRequest(b.name, (b.name,), gemm_b_layout(trans_b=trans_b), ctx.device)
    return prepared_choice(ID, req, (b.name,))


def prepack(sources: list[np.ndarray], attrs: Mapping[str, Any], backend: str,
            out: np.ndarray | None) -> np.ndarray:
    b = sources[0].astype(np.float32, copy=False)
    trans_b = bool(int(attrs.get("transB", 0)))
    if backend == REFERENCE:
        return np.ascontiguousarray(b.T if trans_b else b)  # float32 [K, N]
    from onnx_prep import native

    return native.prepack_gemm_b(np.ascontiguousarray(b), trans_b=trans_b, out=out)


def packed_size(request: PrepackRequest, attrs: Mapping[str, Any],
                weights: Mapping[str, WeightDescriptor], backend: str) -> int:
    b = weights[request.source_lineage[0]].dims
    k, n = (b[1], b[0]) if attrs.get("transB", 0) else (b[0], b[1])
    if backend == REFERENCE:
        return k * n * 4
    from onnx_prep import native

    return int(native.gemm_b_packed_size(K=k, N=n))


_IMPLEMENTATIONS = {"Gemm": gemm.gemm_packed, "MatMul": gemm.matmul_packed}


def implementation(op_type: str, domain: str, opset: int | None) -> OpImpl | None:
    return _IMPLEMENTATIONS.get(op_type) if domain == "" else None


SPEC = KernelSpec(
    id=ID,
    op_types=frozenset({("", "Gemm"), ("", "MatMul")}),
    match=match,
    implementation=implementation,
    prepared=PreparedForm(position=1, layout_name=LAYOUT_NAME, layout=gemm_b_layout,
                          prepack=prepack, packed_size=packed_size),
)
