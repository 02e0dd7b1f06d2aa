"""Which kernel runs each node, and its prepared requirements."""
from onnx_prep.core.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "KernelChoice": "registry",
    "choose_kernel": "registry",
    "KERNELS": "registry",
    "MS_DOMAIN": "registry",
})
