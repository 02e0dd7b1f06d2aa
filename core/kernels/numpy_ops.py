"""The ``numpy`` kernel: default-domain ops in ``NUMPY_OPS``, computed by the numpy ops
of core/ops (the op table, core/ops/registry.py). Generic: what the table lacks at the
node's opset runs through ``onnx.reference``. MatMul and Gemm come here when
``gemm_packed`` does not take them (B not a constant 2-D fp32 initializer, transA)."""
from __future__ import annotations

from onnx_prep.core.kernels.spec import KernelChoice, KernelSpec, MatchContext
from onnx_prep.core.model.transforms import GraphNode
from onnx_prep.core.ops.registry import numpy_op

ID = "numpy"

# Default-domain ops this kernel takes. core/ops implements each one (tested); every
# other standard op falls back to the ``reference`` kernel.
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

_CHOICE = KernelChoice(ID)


def match(node: GraphNode, ctx: MatchContext) -> KernelChoice:
    return _CHOICE  # op_types is the whole check


SPEC = KernelSpec(
    id=ID,
    op_types=frozenset(("", op) for op in NUMPY_OPS),
    match=match,
    implementation=numpy_op,
    generic=True,
)
