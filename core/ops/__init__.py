"""CPU op implementations: numpy kernels, native INT4 / packed-fp32 kernels, and the
``onnx.reference`` fallback for any other standard op. See docs/ops.md."""
from onnx_prep.core.ops.prepack import NATIVE, REFERENCE, packed_size, prepack
from onnx_prep.core.ops.reference import ReferenceOp
from onnx_prep.core.ops.registry import NUMPY_OP_TYPES, OpImpl, bind_node, get_op

__all__ = [
    "NATIVE",
    "NUMPY_OP_TYPES",
    "OpImpl",
    "REFERENCE",
    "ReferenceOp",
    "bind_node",
    "get_op",
    "packed_size",
    "prepack",
]
