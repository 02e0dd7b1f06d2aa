"""CUDA C source compiled at run time with NVRTC (cuda-python's ``cuda.bindings.nvrtc``,
``cuda.nvrtc`` before 12.6): the image the driver loads (``cuModuleLoadData``).

NVRTC is a compiler library, not the driver: it runs without a GPU, so the kernels'
source is compiled in tests wherever cuda-python and the NVRTC library
(``nvidia-cuda-nvrtc``, in the ``cuda`` extra) are installed (tests/test_cuda_nvrtc.py).

The target is the device's own architecture: ``--gpu-architecture=sm_XY`` from its
compute capability, and the CUBIN (machine code: nothing left for the driver to JIT).
A device newer than this NVRTC knows gets PTX for the newest virtual architecture
NVRTC has below it (``compute_XY``), which the driver compiles when loading it. A
failed compilation raises :class:`KernelCompileError` carrying NVRTC's log.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from onnx_prep.core.errors import EXIT_INTERNAL, DeviceError

__all__ = ["CompiledProgram", "KernelCompileError", "compile_program", "import_nvrtc", "target_architecture"]

NVRTC_MODULES = ("cuda.bindings.nvrtc", "cuda.nvrtc")
NVRTC_MISSING = "NVRTC is not usable ({}); pip install 'onnx-prep[cuda]' brings cuda-python and nvidia-cuda-nvrtc"


class KernelCompileError(DeviceError):
    """NVRTC refused a kernel source: ``log`` is its compilation log (also in the
    message, after the first line)."""


@dataclass(frozen=True)
class CompiledProgram:
    image: bytes  # what cuModuleLoadData takes: a CUBIN, or NUL-terminated PTX
    kind: str  # "cubin" | "ptx"
    architecture: str  # the --gpu-architecture value: "sm_90", "compute_90"
    nvrtc_version: tuple[int, int]
    log: str  # NVRTC's log (warnings), "" when it had nothing to say


def import_nvrtc() -> Any:
    """cuda-python's NVRTC module, the NVRTC library loaded behind it (its version
    asked), or :class:`DeviceError` saying what is missing."""
    for name in NVRTC_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        try:
            _check(module, "nvrtcVersion", module.nvrtcVersion())
        except DeviceError:
            raise
        except Exception as exc:  # the library is loaded on the first call: its loader's error, whatever its type
            raise DeviceError(NVRTC_MISSING.format(f"{type(exc).__name__}: {exc}")) from None
        return module
    raise DeviceError(NVRTC_MISSING.format("cuda-python not installed"))


def _check(nvrtc: Any, call: str, result: tuple) -> Any:
    err, *values = result
    if int(err) != 0:
        got, text = nvrtc.nvrtcGetErrorString(err)
        name = text.decode() if int(got) == 0 and text else f"nvrtcResult {int(err)}"
        raise DeviceError(f"{call} failed: {name} ({int(err)})")
    return values[0] if len(values) == 1 else tuple(values)


def target_architecture(capability: tuple[int, int], supported: list[int]) -> tuple[str, str]:
    """``(architecture, kind)`` for a device of ``capability`` given the ``sm`` numbers
    NVRTC supports: its own ``sm_XY`` and a CUBIN where NVRTC knows it, else PTX for the
    newest ``compute_XY`` below it (the driver JITs it); DeviceError where NVRTC knows
    none at or below it."""
    want = capability[0] * 10 + capability[1]
    if want in supported:
        return f"sm_{want}", "cubin"
    older = [a for a in supported if a < want]
    if not older:
        raise DeviceError(f"this NVRTC cannot compile for compute capability {capability[0]}.{capability[1]} "
                          f"(it supports sm_{min(supported)} to sm_{max(supported)})")
    return f"compute_{max(older)}", "ptx"


def compile_program(source: str, name: str, capability: tuple[int, int], *, options: tuple[str, ...] = ()
                    ) -> CompiledProgram:
    """Compile ``source`` (one translation unit, no includes) for a device of compute
    ``capability``; ``name`` names it in the log and the errors."""
    nvrtc = import_nvrtc()
    version = tuple(int(v) for v in _check(nvrtc, "nvrtcVersion", nvrtc.nvrtcVersion()))
    supported = [int(a) for a in _check(nvrtc, "nvrtcGetSupportedArchs", nvrtc.nvrtcGetSupportedArchs())]
    architecture, kind = target_architecture(capability, supported)
    prog = _check(nvrtc, "nvrtcCreateProgram", nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []))
    try:
        opts = [f"--gpu-architecture={architecture}".encode(), *(o.encode() for o in options)]
        err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        log = _log(nvrtc, prog)
        if int(err) != 0:
            got, text = nvrtc.nvrtcGetErrorString(err)
            what = text.decode() if int(got) == 0 and text else f"nvrtcResult {int(err)}"
            error = KernelCompileError(f"NVRTC could not compile {name} for {architecture}: {what} ({int(err)})"
                                       + (f"\n{log}" if log else ""), exit_code=EXIT_INTERNAL)
            error.log = log
            raise error
        if kind == "cubin":
            size = _check(nvrtc, "nvrtcGetCUBINSize", nvrtc.nvrtcGetCUBINSize(prog))
            image = b" " * size
            _check(nvrtc, "nvrtcGetCUBIN", nvrtc.nvrtcGetCUBIN(prog, image))
        else:
            size = _check(nvrtc, "nvrtcGetPTXSize", nvrtc.nvrtcGetPTXSize(prog))
            image = b" " * size
            _check(nvrtc, "nvrtcGetPTX", nvrtc.nvrtcGetPTX(prog, image))
        return CompiledProgram(image, kind, architecture, version, log)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _log(nvrtc: Any, prog: Any) -> str:
    size = _check(nvrtc, "nvrtcGetProgramLogSize", nvrtc.nvrtcGetProgramLogSize(prog))
    if size <= 1:
        return ""
    buf = b" " * size
    _check(nvrtc, "nvrtcGetProgramLog", nvrtc.nvrtcGetProgramLog(prog, buf))
    return buf.rstrip(b"\0").decode(errors="replace").strip()
