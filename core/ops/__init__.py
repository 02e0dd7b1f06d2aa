"""CPU op implementations: numpy kernels, native INT4 / packed-fp32 kernels, and the
``onnx.reference`` fallback for any other standard op. Which of them a node runs is
its kernel's choice (core/kernels). See docs/ops.md."""
from onnx_prep.core.ops.reference import ReferenceOp
from onnx_prep.core.ops.registry import MS_DOMAIN, NUMPY_OP_TYPES, OpImpl, numpy_op

__all__ = [
    "MS_DOMAIN",
    "NUMPY_OP_TYPES",
    "OpImpl",
    "ReferenceOp",
    "numpy_op",
]
