"""cffi API-mode build of ``onnx_prep.native._native``.

The header ``onnx_prep_native.h`` is the single declaration of the C API: the
text between its CDEF markers is handed to ``ffibuilder.cdef`` unchanged.
"""
from __future__ import annotations

import pathlib
import re
import sys

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent


def _version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M)
    if not m:
        raise RuntimeError("no version in pyproject.toml")
    return m.group(1)


def _cdef() -> str:
    text = (HERE / "onnx_prep_native.h").read_text()
    m = re.search(r"/\* CDEF-BEGIN \*/(.*)/\* CDEF-END \*/", text, re.S)
    if not m:
        raise RuntimeError("onnx_prep_native.h lacks CDEF markers")
    return m.group(1)


C_SOURCES = sorted(p.name for p in HERE.glob("*.c") if p.name != "_native.c")


def builder(extra_compile_args: tuple[str, ...] = (), extra_link_args: tuple[str, ...] = ()) -> FFI:
    """The module's FFI builder; the extra flags are for instrumented builds
    (scripts/sanitize_native.py), never the installed module."""
    ffi = FFI()
    ffi.cdef(_cdef())
    ffi.set_source(
        "onnx_prep.native._native",
        '#include "onnx_prep_native.h"',
        sources=[str((HERE / s).relative_to(ROOT)) for s in C_SOURCES],
        include_dirs=[str(HERE.relative_to(ROOT))],
        define_macros=[("ONNX_PREP_VERSION", f'"{_version()}"')],
        # -O3 for the kernels; ISA-specific code is enabled per file with
        # `#pragma GCC target`, never globally, so the module still loads on any x86-64.
        extra_compile_args=["-O3", "-std=c11", "-fno-strict-aliasing", *extra_compile_args],
        extra_link_args=list(extra_link_args),
        libraries=[] if sys.platform == "win32" else ["m"],  # erf() (elementwise.c)
    )
    return ffi


ffibuilder = builder()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
