"""Instruction-set selection for the native kernels, and which kernel code ran.

The CPU's best ISA is chosen by feature detection (CPUID plus the OS's XGETBV
register-state check, done in C). ``ONNX_PREP_ISA`` forces one of a closed set of
values, for tests and benchmarks; an unknown value, or an ISA this CPU or build
cannot run, raises :class:`NativeError` naming the valid choices.

The names (:data:`ISAS`, :data:`VARIANTS`, :data:`KERNEL_CODES`) are the one list of
them in the package and import without the compiled module; the functions load it at
their first call.
"""
from __future__ import annotations

import os

from onnx_prep.core.errors import NativeError

ENV_VAR = "ONNX_PREP_ISA"
ISAS: tuple[str, ...] = ("scalar", "avx2", "avx512")  # best last
# Kernel variants a caller may name in a kernel's `isa=` argument (tests, benchmarks)
# besides the ISAs: AVX-512 without VNNI, to exercise that path on a VNNI CPU.
VARIANTS: tuple[str, ...] = ("avx512-novnni",)
# What op_last_kernel() reports, by op_kernel_code value (0, none, is None): the code
# that computed, which for "avx512" is "avx512-vnni" on the integer paths of a VNNI CPU.
KERNEL_CODES: tuple[str, ...] = ("scalar", "avx2", "avx512", "avx512-vnni", "amx")
# What a CPU must have (with the OS saving the register state) to run each name.
_NEEDS = {"avx2": "avx2/fma/f16c (with YMM state saved by the OS)",
          "avx512": "avx512f/avx512bw/avx512vl/avx512dq (with ZMM and opmask state saved by the OS)"}
_NEEDS["avx512-novnni"] = _NEEDS["avx512"]


_loaded: tuple[object, dict[str, int]] | None = None  # (lib, name -> OP_ISA_* value)


def _native() -> tuple[object, dict[str, int]]:
    global _loaded
    if _loaded is None:
        from onnx_prep.native._module import lib
        _loaded = (lib, {"scalar": lib.OP_ISA_SCALAR, "avx2": lib.OP_ISA_AVX2, "avx512": lib.OP_ISA_AVX512,
                         "avx512-novnni": lib.OP_ISA_AVX512_NOVNNI})
    return _loaded


def _lib():
    return _native()[0]


def _id(name: str) -> int:
    return _native()[1][name]


def cpu_features() -> dict[str, bool]:
    """The named CPU predicates the dispatcher uses (each includes OS support)."""
    lib = _lib()
    return {
        "avx2_fma": bool(lib.op_cpu_has_avx2_fma()),
        "avx512": bool(lib.op_cpu_has_avx512()),
        "avx512_vnni": bool(lib.op_cpu_has_avx512_vnni()),
        "amx": bool(lib.op_cpu_has_amx()),
    }


def unavailable_reason(name: str) -> str | None:
    """Why the ISA or kernel variant ``name`` cannot run here, or None if it can."""
    lib = _lib()
    if name not in ISAS and name not in VARIANTS:
        raise ValueError(f"{name!r} is not an ISA or kernel variant name")
    if lib.op_isa_supported(_id(name)):
        return None
    if not lib.op_isa_compiled(_id(name)):
        return f"{name}: this build has no code for it (SIMD kernels need x86-64 and GCC)"
    found = ", ".join(k for k, v in cpu_features().items() if v) or "none"
    return f"{name}: CPU lacks {_NEEDS[name]}; it has: {found}"


def available_isas() -> tuple[str, ...]:
    """ISAs this build contains and this CPU/OS can run, scalar first."""
    return tuple(name for name in ISAS if unavailable_reason(name) is None)


def select_isa(requested: str | None) -> str:
    """The ISA to use for ``requested`` (None or "" = the best available)."""
    avail = available_isas()
    if not requested:
        return avail[-1]
    name = requested.strip().lower()
    if name not in ISAS:
        raise NativeError(f"{ENV_VAR}={requested!r} is not an ISA name",
                          hint=f"use one of: {', '.join(ISAS)} (unset = detect)")
    if name not in avail:
        why = unavailable_reason(name) or f"{name}: not available here"
        raise NativeError(f"{ENV_VAR}={name} was forced but {why}",
                          hint=f"available here: {', '.join(avail)}")
    return name


_cache: tuple[str | None, str] | None = None

# NOTE: every kernel call without an explicit ISA asks active_isa, ~150 times a decode
# step. os.environ.get of an unset variable raises and catches a KeyError inside the
# Mapping: ~2 us a call here (2-vCPU Intel Xeon, 2026-12-02). CPython's os.environ
# writes through to the dict it keeps in ``_data`` (keys and values encoded by its own
# encodekey / decodevalue), where the same lookup is a dict get; any other mapping falls
# back to get.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(ENV_VAR) if _ENV_DATA is not None and hasattr(os.environ, "encodekey") else None


def _env_isa() -> str | None:
    if _ENV_KEY is not None:
        v = _ENV_DATA.get(_ENV_KEY)
        return None if v is None else os.environ.decodevalue(v)
    return os.environ.get(ENV_VAR)


def active_isa() -> str:
    """The ISA kernels use by default: ``ONNX_PREP_ISA`` if set, else the best detected.

    Re-reads the environment variable (cheaply) so tests can switch it."""
    global _cache
    env = _env_isa()
    cached = _cache
    if cached is not None and cached[0] == env:
        return cached[1]
    name = select_isa(env)
    _cache = (env, name)
    return name


def amx_tiles() -> bool:
    """Whether the INT4 matmuls of several rows run on AMX tiles by default here: the
    active ISA is avx512 and the CPU has AMX-INT8 that the OS lets this process use
    (native/kernels_amx.c; ``set_amx`` turns them off)."""
    return active_isa() == "avx512" and cpu_features()["amx"]


def kernel_variants() -> tuple[str, ...]:
    """Every kernel path runnable here: :func:`available_isas` plus the variants."""
    return available_isas() + tuple(v for v in VARIANTS if unavailable_reason(v) is None)


def isa_id(isa: str | None) -> int:
    """The C enum value for ``isa`` (None = :func:`active_isa`), validated; a kernel
    variant name is accepted here (not in ONNX_PREP_ISA)."""
    if isa is None:
        return _id(active_isa())
    if isa in VARIANTS:
        if isa not in kernel_variants():
            raise NativeError(f"kernel variant {isa} is not available here",
                              hint=f"available: {', '.join(kernel_variants())}")
        return _id(isa)
    return _id(select_isa(isa))


def last_kernel() -> str | None:
    """The kernel code that computed the last kernel call (matmul, gemm, gather,
    prepack, erf, norm, rotary, the payload checksum's XXH3 update) made on the calling
    thread: one of :data:`KERNEL_CODES`, or None when
    that call computed nothing (an error, an empty column range) or there was none.

    Written by the kernels themselves, not by the dispatcher, so it shows which table
    ran, not which was asked for: ``isa="avx512"`` reports "avx512-vnni" for the
    integer paths on a VNNI CPU and "avx512" for fp32; gather, prepack and erf have one
    portable implementation and report "scalar" whatever the ISA."""
    code = _lib().op_last_kernel()
    return None if code == 0 else KERNEL_CODES[code - 1]
