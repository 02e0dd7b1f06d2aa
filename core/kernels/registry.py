"""Kernel choice per node, and the prepared objects (PrepackRequests) each choice needs.

Kernel ids, first match wins:

==============  ==========================================================================
``int4_matmul`` com.microsoft MatMulNBits (bits 4, constant B/scales[/zero points]) and
                the fused DequantizeLinear(int4)+MatMul node (``transforms.py``).
                Requirement: lineage (B, scales[, zero_points]), ``matmul_nbits_layout``.
``int4_gather`` com.microsoft GatherBlockQuantized (bits 4, uint8 data, gather_axis 0,
                quantize_axis last, constant data/scales[/zero points]).
                Requirement: lineage (data, scales[, zero_points]), ``gather_block_quantized_layout``.
``gemm_packed`` Gemm (transA 0) or MatMul whose B is a constant 2-D fp32 initializer.
                Requirement: lineage (B,), ``gemm_b_layout(trans_b)``.
``numpy``       a default-domain op in ``NUMPY_OPS`` (implemented in ``core/ops``).
``reference``   any other op ``onnx.reference`` implements (default and ai.onnx.ml
                domains, schemas with a function body, model-local functions).
``None``        no kernel: the node is listed in ``ResolvedModel.unsupported``.
==============  ==========================================================================

"Constant" means an initializer that is not also a graph input (an initializer listed
as a graph input is only a default the caller may override, so it cannot be prepacked).

Layout keys come from ``native/layouts.py`` and name every parameter that changes the
packed bytes; two nodes asking for the same (lineage, layout, device) share one
prepared object (``PrepackRequest.key``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from onnx import TensorProto

from onnx_prep.core.model.prepared_key import PrepackRequest, PreparedKey
from onnx_prep.core.model.transforms import GraphNode
from onnx_prep.core.model.weights import WeightDescriptor
from onnx_prep.native.layouts import (
    gather_block_quantized_layout,
    gemm_b_layout,
    matmul_nbits_layout,
)

INT4_MATMUL = "int4_matmul"
INT4_GATHER = "int4_gather"
GEMM_PACKED = "gemm_packed"
NUMPY = "numpy"
REFERENCE = "reference"
KERNELS = (INT4_MATMUL, INT4_GATHER, GEMM_PACKED, NUMPY, REFERENCE)

MS_DOMAIN = "com.microsoft"

# Default-domain ops the ``numpy`` kernel (core/ops) implements. core/ops matches this
# set; everything else standard falls back to ``reference``.
NUMPY_OPS = frozenset({
    # elementwise
    "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Neg", "Exp", "Log", "Tanh",
    "Sigmoid", "Relu", "Cos", "Sin", "Abs", "Erf", "Max", "Min", "Not", "And", "Or",
    "Where", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Cast", "Identity",
    # nn / reductions
    "Softmax", "ReduceMean", "ReduceSum", "MatMul", "Gemm",
    # shape and data movement
    "Reshape", "Transpose", "Concat", "Slice", "Gather", "Unsqueeze", "Squeeze", "Shape",
    "Size", "Expand", "Tile", "Flatten", "Split", "Trilu", "Range", "ConstantOfShape",
    "Constant",
})

_SCALE_DTYPES = ("float16", "float32")


@dataclass(frozen=True)
class KernelChoice:
    kernel: str | None
    requirements: tuple[PrepackRequest, ...] = ()
    prepared_inputs: Mapping[PreparedKey, tuple[str, ...]] = field(
        default_factory=lambda: MappingProxyType({}))


UNSUPPORTED = KernelChoice(None)
_NUMPY_CHOICE = KernelChoice(NUMPY)
_REFERENCE_CHOICE = KernelChoice(REFERENCE)


def _single(req: PrepackRequest, replaces: tuple[str, ...], kernel: str) -> KernelChoice:
    return KernelChoice(kernel, (req,), MappingProxyType({req.key: replaces}))


def _input(node: GraphNode, i: int) -> str | None:
    return node.inputs[i] if len(node.inputs) > i and node.inputs[i] else None


def choose_kernel(node: GraphNode, constants: Mapping[str, WeightDescriptor], *,
                  opsets: Mapping[str, int], local_functions: frozenset[tuple[str, str]] = frozenset(),
                  device: str = "cpu") -> KernelChoice:
    """The kernel for ``node`` and the prepared objects it consumes. Pure: no I/O."""
    if node.domain == "" and node.op_type in NUMPY_OPS and node.op_type not in ("MatMul", "Gemm"):
        return _NUMPY_CHOICE  # the common case, first
    if node.domain == MS_DOMAIN:
        if node.op_type == "MatMulNBits":
            return _matmul_nbits(node, constants, device) or _fallback(node, opsets, local_functions)
        if node.op_type == "GatherBlockQuantized":
            return _gather_bq(node, constants, device) or _fallback(node, opsets, local_functions)
    if node.domain == "" and node.fused_from and node.op_type == "MatMul":
        return _fused_qdq_matmul(node, constants, device)
    if node.domain == "" and node.op_type in ("Gemm", "MatMul"):
        choice = _gemm(node, constants, device)
        if choice is not None:
            return choice
    return _fallback(node, opsets, local_functions)


def _fallback(node: GraphNode, opsets: Mapping[str, int],
              local_functions: frozenset[tuple[str, str]]) -> KernelChoice:
    if node.domain == "" and node.op_type in NUMPY_OPS:
        return _NUMPY_CHOICE
    if (node.domain, node.op_type) in local_functions:
        return _REFERENCE_CHOICE
    version = opsets.get(node.domain, opsets.get("ai.onnx" if node.domain == "" else node.domain))
    if reference_implements(node.domain, node.op_type, version):
        return _REFERENCE_CHOICE
    return UNSUPPORTED


# -- INT4 kernels

def _zp_kind(zp: WeightDescriptor | None) -> str | None:
    if zp is None:
        return "none"
    if zp.onnx_type in (TensorProto.UINT8, TensorProto.UINT4):
        return "u4"
    if zp.dtype in _SCALE_DTYPES:
        return "float"
    return None


def _matmul_nbits(node: GraphNode, consts: Mapping[str, WeightDescriptor], device: str) -> KernelChoice | None:
    a = node.attributes
    if int(a.get("bits", 4)) != 4 or _input(node, 4):  # g_idx (act-order) has no INT4 kernel
        return None
    b, s = consts.get(_input(node, 1) or ""), consts.get(_input(node, 2) or "")
    zp_name = _input(node, 3)
    zp = consts.get(zp_name) if zp_name else None
    if b is None or s is None or (zp_name and zp is None) or s.dtype not in _SCALE_DTYPES:
        return None
    zk = _zp_kind(zp)
    if zk is None or "block_size" not in a:
        return None
    layout = matmul_nbits_layout(block_size=int(a["block_size"]), zero_points=zk,
                                 scale_dtype=s.dtype, accuracy_level=int(a.get("accuracy_level", 0)))
    lineage = (b.name, s.name) + ((zp.name,) if zp else ())
    return _single(PrepackRequest(b.name, lineage, layout, device), lineage, INT4_MATMUL)


def _fused_qdq_matmul(node: GraphNode, consts: Mapping[str, WeightDescriptor], device: str) -> KernelChoice:
    # transforms.fuse_dequantize_matmul validated every part of this node.
    a = node.attributes
    w, s = consts[node.inputs[1]], consts[node.inputs[2]]
    zp = consts.get(_input(node, 3) or "")
    # int4 without zero points == uint4 (code + 8) with MatMulNBits' implicit 8; uint4
    # without zero points has zero point 0, which the packed form can only hold explicitly.
    zk = "u4" if zp is not None or w.onnx_type == TensorProto.UINT4 else "none"
    layout = matmul_nbits_layout(block_size=int(a["block_size"]), zero_points=zk,
                                 scale_dtype=s.dtype, accuracy_level=int(a["accuracy_level"]))
    lineage = (w.name, s.name) + ((zp.name,) if zp else ())
    return _single(PrepackRequest(w.name, lineage, layout, device), lineage, INT4_MATMUL)


def _gather_bq(node: GraphNode, consts: Mapping[str, WeightDescriptor], device: str) -> KernelChoice | None:
    a = node.attributes
    data, s = consts.get(_input(node, 0) or ""), consts.get(_input(node, 2) or "")
    zp_name = _input(node, 3)
    zp = consts.get(zp_name) if zp_name else None
    if data is None or s is None or (zp_name and zp is None) or s.dtype not in _SCALE_DTYPES:
        return None
    rank = len(data.dims)
    quantize_axis = int(a.get("quantize_axis", 1))
    if int(a.get("bits", 4)) != 4 or data.onnx_type != TensorProto.UINT8 or rank < 2:
        return None
    if int(a.get("gather_axis", 0)) not in (0, -rank) or quantize_axis not in (rank - 1, -1):
        return None
    zk = _zp_kind(zp)
    if zk is None:
        return None
    layout = gather_block_quantized_layout(block_size=int(a.get("block_size", 128)),
                                           zero_points=zk, scale_dtype=s.dtype)
    lineage = (data.name, s.name) + ((zp.name,) if zp else ())
    return _single(PrepackRequest(data.name, lineage, layout, device), lineage, INT4_GATHER)


# -- fp32 Gemm / MatMul with a constant B

def _gemm(node: GraphNode, consts: Mapping[str, WeightDescriptor], device: str) -> KernelChoice | None:
    b = consts.get(_input(node, 1) or "")
    if b is None or b.onnx_type != TensorProto.FLOAT or len(b.dims) != 2:
        return None
    trans_b = False
    if node.op_type == "Gemm":
        if int(node.attributes.get("transA", 0)) != 0:
            return None
        trans_b = bool(int(node.attributes.get("transB", 0)))
    req = PrepackRequest(b.name, (b.name,), gemm_b_layout(trans_b=trans_b), device)
    return _single(req, (b.name,), GEMM_PACKED)


# -- onnx.reference coverage

_REFERENCE_DOMAINS = {"": "onnx.reference.ops._op_list",
                      "ai.onnx": "onnx.reference.ops._op_list",
                      "ai.onnx.ml": "onnx.reference.ops.aionnxml._op_list"}


@functools.lru_cache(maxsize=None)
def reference_implements(domain: str, op_type: str, version: int | None) -> bool:
    """Whether ``onnx.reference`` can run ``domain::op_type`` at opset ``version``: a
    registered implementation, or a schema whose (context-dependent) function body the
    reference evaluator expands.

    NOTE: imports onnx.reference lazily (~0.1 s) on the first op outside NUMPY_OPS and
    the INT4 kernels, so a model made only of those never pays for it.
    """
    module_name = _REFERENCE_DOMAINS.get(domain)
    if module_name is None:
        return False
    import importlib

    mod = importlib.import_module(module_name)
    from onnx.reference.op_run import RuntimeContextError

    try:
        mod.load_op("" if domain == "ai.onnx" else domain, op_type, version)
    except RuntimeContextError:
        return True  # a context-dependent function body: the evaluator expands it per node
    except AssertionError:
        return True  # a function body: load_op wants the evaluator class to expand it
    except Exception:  # noqa: BLE001 - NotImplementedError, SchemaError: no implementation
        return False
    return True
