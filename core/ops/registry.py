"""Op lookup: (op_type, domain, kernel id, opset) -> an ``OpImpl``, and prepacking.

An ``OpImpl`` is a plain function::

    fn(inputs: list[np.ndarray | None], attrs: Mapping[str, Any],
       prepared: Mapping[int, np.ndarray]) -> list[np.ndarray]

``inputs`` follow the node's input order (None for an absent optional input, and for
an input a prepared object replaces); ``attrs`` are plain values
(``attributes.normalize_attributes``); ``prepared`` maps an input position to the
prepared buffer replacing it (native packed ``uint8`` or the float32 reference form).
It returns one array per declared output, in order (extra trailing outputs, e.g.
LayerNormalization's optional Mean, are ignored by the caller).

Kernel ids are the kernel registry's (core/kernels/registry.py): ``int4_matmul``,
``int4_gather``, ``gemm_packed``, ``numpy``, ``reference``.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from onnx_prep.core.errors import UnsupportedOpError, Where
from onnx_prep.core.ops import elementwise as ew
from onnx_prep.core.ops import gemm as gm
from onnx_prep.core.ops import int4, nn, reduce, shape
from onnx_prep.core.ops.attributes import N_OUTPUTS, ROW_SHAPE, normalize_attributes
from onnx_prep.core.ops.reference import ReferenceOp, run_reference

OpImpl = Callable[[list, Mapping[str, Any], Mapping[int, np.ndarray]], list]

MS_DOMAIN = "com.microsoft"

# Default-domain ops implemented in numpy (a superset of kernel_registry.NUMPY_OPS;
# tests/test_ops_registry.py checks that every op the kernel registry sends here exists).
_NUMPY: dict[str, OpImpl] = {
    "Add": ew.add, "Sub": ew.sub, "Mul": ew.mul, "Div": ew.div, "Pow": ew.pow_,
    "Sqrt": ew.sqrt, "Reciprocal": ew.reciprocal, "Neg": ew.neg, "Exp": ew.exp, "Log": ew.log,
    "Tanh": ew.tanh, "Sigmoid": ew.sigmoid, "Relu": ew.relu, "Cos": ew.cos, "Sin": ew.sin,
    "Abs": ew.abs_, "Floor": ew.floor, "Ceil": ew.ceil,
    "Max": ew.max_, "Min": ew.min_, "Sum": ew.sum_,
    "Equal": ew.equal, "Less": ew.less, "LessOrEqual": ew.less_or_equal, "Greater": ew.greater,
    "GreaterOrEqual": ew.greater_or_equal, "And": ew.logical_and, "Or": ew.logical_or,
    "Xor": ew.logical_xor, "Not": ew.logical_not,
    "Where": ew.where, "Identity": ew.identity, "Cast": ew.cast, "CastLike": ew.cast_like,
    "Softmax": nn.softmax, "LogSoftmax": nn.log_softmax, "MatMul": nn.matmul, "Gemm": nn.gemm,
    "LayerNormalization": nn.layer_normalization, "Erf": nn.erf, "Gelu": nn.gelu,
    "ReduceMean": reduce.reduce_mean, "ReduceSum": reduce.reduce_sum, "ReduceMax": reduce.reduce_max,
    "ReduceMin": reduce.reduce_min, "ReduceProd": reduce.reduce_prod,
    "ReduceSumSquare": reduce.reduce_sum_square, "ArgMax": reduce.arg_max, "ArgMin": reduce.arg_min,
    "Reshape": shape.reshape, "Transpose": shape.transpose, "Concat": shape.concat, "Slice": shape.slice_,
    "Gather": shape.gather, "Unsqueeze": shape.unsqueeze, "Squeeze": shape.squeeze, "Shape": shape.shape,
    "Size": shape.size, "Expand": shape.expand, "Tile": shape.tile, "Range": shape.range_,
    "ConstantOfShape": shape.constant_of_shape, "Constant": shape.constant, "Split": shape.split,
    "Trilu": shape.trilu, "Flatten": shape.flatten,
}

# Ops whose meaning changed at an opset: below the version, the legacy variant applies.
_LEGACY: dict[str, tuple[int, OpImpl]] = {
    "Softmax": (13, nn.softmax_legacy),
    "LogSoftmax": (13, nn.log_softmax_legacy),
}

# com.microsoft ops with a numpy reference here (INT4; prepared forms optional).
_CONTRIB: dict[str, OpImpl] = {
    "MatMulNBits": int4.matmul_nbits,
    "GatherBlockQuantized": int4.gather_block_quantized,
}

NUMPY_OP_TYPES = frozenset(_NUMPY)

# Kernel id -> {op_type: impl} for the prepared kernels.
_PREPARED: dict[str, dict[str, OpImpl]] = {
    # MatMul: the fused DequantizeLinear(int4)+MatMul node (weight_layout "KN").
    "int4_matmul": {"MatMulNBits": int4.matmul_nbits, "MatMul": int4.matmul_nbits},
    "int4_gather": {"GatherBlockQuantized": int4.gather_block_quantized},
    "gemm_packed": {"Gemm": gm.gemm_packed, "MatMul": gm.matmul_packed},
}

# The input position a kernel's prepared object is delivered at (the op reads it there).
PREPARED_POSITION = {"int4_matmul": 1, "int4_gather": 0, "gemm_packed": 1}


def _numpy_impl(op_type: str, domain: str, opset: int | None) -> OpImpl | None:
    if domain in ("", "ai.onnx"):
        legacy = _LEGACY.get(op_type)
        if legacy is not None and opset is not None and opset < legacy[0]:
            return legacy[1]
        return _NUMPY.get(op_type)
    if domain == MS_DOMAIN:
        return _CONTRIB.get(op_type)
    return None


def get_op(op_type: str, domain: str = "", kernel_id: str | None = "numpy", opset: int | None = None) -> OpImpl:
    """The implementation of one op for one kernel id.

    For ``reference`` (and for a numpy op type without a numpy implementation) the
    returned function instantiates the ``onnx.reference`` op per distinct attribute
    set on first call; ``bind_node`` builds it once per node instead.
    Raises UnsupportedOpError when nothing can run the op.
    """
    if kernel_id in _PREPARED:
        impl = _PREPARED[kernel_id].get(op_type)
        if impl is None:
            raise UnsupportedOpError(f"kernel {kernel_id!r} has no implementation for {op_type}")
        return impl
    if kernel_id in ("numpy", "reference"):
        impl = _numpy_impl(op_type, domain, opset) if kernel_id == "numpy" else None
        if impl is not None:
            return impl

        def via_reference(inputs, attrs, prepared, _t=op_type, _d=domain, _o=opset):
            return run_reference(_t, _d, attrs, inputs, _o)

        via_reference.__name__ = f"reference_{op_type}"
        return via_reference
    raise UnsupportedOpError(f"no kernel for {domain or 'ai.onnx'}::{op_type} (kernel id {kernel_id!r})")


class BoundOp(NamedTuple):
    fn: OpImpl
    attrs: dict[str, Any]
    implicit_inputs: tuple[str, ...]  # outer-scope values the subgraphs read, passed after the inputs


def bind_node(node, opsets: Mapping[str, int], weights: Mapping[str, Any] | None = None) -> BoundOp:
    """The implementation of one ``NodeKernel``, resolved once at compile time.

    Adds the reserved attributes the ops read (``N_OUTPUTS``; ``ROW_SHAPE`` for a
    prepacked gather, from the data's WeightDescriptor), instantiates the reference
    implementation for ``reference`` nodes, and lists the outer-scope values a
    control-flow node's subgraphs read (the caller appends them to the inputs).
    """
    if node.kernel is None:
        raise UnsupportedOpError(f"no kernel for {node.domain or 'ai.onnx'}::{node.op_type}",
                                 Where(node=node.name))
    domain = "" if node.domain == "ai.onnx" else node.domain
    opset = opsets.get(domain, opsets.get("ai.onnx")) if domain == "" else opsets.get(domain)
    attrs = normalize_attributes(node.attributes)
    attrs[N_OUTPUTS] = len(node.outputs)
    if node.kernel == "int4_gather" and weights is not None and node.inputs[0] in weights:
        attrs[ROW_SHAPE] = _gather_row_shape(weights[node.inputs[0]], attrs)
    if node.kernel == "reference" or (node.kernel == "numpy" and _numpy_impl(node.op_type, domain, opset) is None):
        implicit = tuple(node.implicit_inputs)
        fn = ReferenceOp(node.op_type, domain, attrs, opset, node_name=node.name, opsets=opsets,
                         present_inputs=[bool(n) for n in node.inputs], implicit_inputs=implicit)
        return BoundOp(fn, attrs, implicit)
    try:
        return BoundOp(get_op(node.op_type, domain, node.kernel, opset), attrs, ())
    except UnsupportedOpError as e:
        raise UnsupportedOpError(e.message, Where(node=node.name)) from None


def _gather_row_shape(desc, attrs) -> tuple[int, ...]:
    dims = list(desc.dims)
    qa = int(attrs.get("quantize_axis", 1))
    qa = qa + len(dims) if qa < 0 else qa
    if desc.dtype == "uint8":
        dims[qa] *= 2  # two 4-bit codes per byte along the quantized axis
    ga = int(attrs.get("gather_axis", 0))
    ga = ga + len(dims) if ga < 0 else ga
    return tuple(dims[ga + 1:])


# The prepack entry points live in prepack.py; re-exported here for callers that look
# them up beside get_op (the plan's size estimate calls registry.packed_size).
from onnx_prep.core.ops.prepack import packed_size, prepack  # noqa: E402,F401
