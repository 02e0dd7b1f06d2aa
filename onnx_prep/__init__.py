"""onnx-prep: prepare and profile ONNX models for fast loading.

The import package maps onto the repository's top-level folders:
``onnx_prep.cli`` (cli/), ``onnx_prep.core`` (core/), ``onnx_prep.native``
(native/) and ``onnx_prep.fixtures`` (fixtures/). This folder holds only the
package root.
"""
from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("onnx-prep")
except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
    __version__ = "0+unknown"

__all__ = ["__version__"]
