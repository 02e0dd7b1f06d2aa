"""Kernels: one spec per kernel (which nodes it takes, its prepared object and layout
key, prepack, exact packed size, implementation), registered in ``registry.KERNEL_SPECS``."""
from onnx_prep.core.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "KernelChoice": "spec",
    "KernelSpec": "spec",
    "MatchContext": "spec",
    "PreparedForm": "spec",
    "choose_kernel": "registry",
    "kernel_spec": "registry",
    "prepared_position": "registry",
    "KERNELS": "registry",
    "KERNEL_SPECS": "registry",
    "MS_DOMAIN": "registry",
    "NUMPY_OPS": "numpy_ops",
    "BoundOp": "binding",
    "bind_node": "binding",
    "get_op": "binding",
    "prepack": "prepack",
    "packed_size": "prepack",
    "prepack_all": "prepack",
    "source_loader": "prepack",
    "consumer_node": "prepack",
})
