"""The op table: (op_type, domain, opset) -> the numpy ``OpImpl`` that computes it.

An ``OpImpl`` is a plain function::

    fn(inputs: list[np.ndarray | None], attrs: Mapping[str, Any],
       prepared: Mapping[int, np.ndarray]) -> list[np.ndarray]

``inputs`` follow the node's input order (None for an absent optional input, and for
an input a prepared object replaces); ``attrs`` are plain values
(``attributes.normalize_attributes``); ``prepared`` maps an input position to the
prepared buffer replacing it (native packed ``uint8`` or the float32 reference form).
It returns one array per declared output, in order (extra trailing outputs, e.g.
LayerNormalization's optional Mean, are ignored by the caller). A function may carry
``bind(attrs) -> OpImpl``: the action program then holds what it returns for that node
(docs/ops.md, "Action program": bound calls).

Which implementation a node runs is the kernel's choice (core/kernels: each kernel
spec names its implementations; the generic ``numpy`` kernel reads this table, and
what is not here runs through ``onnx.reference``).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from onnx_prep.core.ops import elementwise as ew
from onnx_prep.core.ops import int4, nn, reduce, shape

OpImpl = Callable[[list, Mapping[str, Any], Mapping[int, np.ndarray]], list]

# The contrib domain of ONNX Runtime's ops (MatMulNBits, GatherBlockQuantized, ...).
MS_DOMAIN = "com.microsoft"

# Default-domain ops implemented in numpy (a superset of the numpy kernel's NUMPY_OPS,
# core/kernels/numpy_ops.py; tests/test_ops_registry.py checks that every op the numpy
# kernel takes exists here).
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


def numpy_op(op_type: str, domain: str, opset: int | None) -> OpImpl | None:
    """The numpy implementation of ``domain::op_type`` at ``opset``, or None."""
    if domain in ("", "ai.onnx"):
        legacy = _LEGACY.get(op_type)
        if legacy is not None and opset is not None and opset < legacy[0]:
            return legacy[1]
        return _NUMPY.get(op_type)
    if domain == MS_DOMAIN:
        return _CONTRIB.get(op_type)
    return None
