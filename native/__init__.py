"""Native (cffi) kernels. See native/onnx_prep_native.h for the C API."""
from onnx_prep.native._native import ffi, lib  # noqa: F401
