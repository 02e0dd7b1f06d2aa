"""Instruction-set selection for the native kernels.

The CPU's best ISA is chosen by feature detection (CPUID plus the OS's XGETBV
register-state check, done in C). ``ONNX_PREP_ISA`` forces one of a closed set of
values, for tests and benchmarks; an unknown value, or an ISA this CPU or build
cannot run, raises :class:`NativeError` naming the valid choices.
"""
from __future__ import annotations

import os

from onnx_prep.core.errors import NativeError
from onnx_prep.native._module import lib

ENV_VAR = "ONNX_PREP_ISA"
ISAS: tuple[str, ...] = ("scalar", "avx2", "avx512")  # best last
# Kernel variants a caller may name in a kernel's `isa=` argument (tests, benchmarks)
# besides the ISAs: AVX-512 without VNNI, to exercise that path on a VNNI CPU.
VARIANTS: tuple[str, ...] = ("avx512-novnni",)
_IDS = {"scalar": lib.OP_ISA_SCALAR, "avx2": lib.OP_ISA_AVX2, "avx512": lib.OP_ISA_AVX512,
        "avx512-novnni": lib.OP_ISA_AVX512_NOVNNI}


def cpu_features() -> dict[str, bool]:
    """The named CPU predicates the dispatcher uses (each includes OS support)."""
    return {
        "avx2_fma": bool(lib.op_cpu_has_avx2_fma()),
        "avx512": bool(lib.op_cpu_has_avx512()),
        "avx512_vnni": bool(lib.op_cpu_has_avx512_vnni()),
    }


def available_isas() -> tuple[str, ...]:
    """ISAs this build contains and this CPU/OS can run, scalar first."""
    return tuple(name for name in ISAS if lib.op_isa_supported(_IDS[name]))


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
        why = "this build has no code for it" if not lib.op_isa_compiled(_IDS[name]) else \
            "this CPU (or its OS) does not support it"
        raise NativeError(f"{ENV_VAR}={name} was forced but {why}",
                          hint=f"available here: {', '.join(avail)}")
    return name


_cache: tuple[str | None, str] | None = None


def active_isa() -> str:
    """The ISA kernels use by default: ``ONNX_PREP_ISA`` if set, else the best detected.

    Re-reads the environment variable (cheaply) so tests can switch it."""
    global _cache
    env = os.environ.get(ENV_VAR)
    cached = _cache
    if cached is not None and cached[0] == env:
        return cached[1]
    name = select_isa(env)
    _cache = (env, name)
    return name


def kernel_variants() -> tuple[str, ...]:
    """Every kernel path runnable here: :func:`available_isas` plus the variants."""
    return available_isas() + tuple(v for v in VARIANTS if lib.op_isa_supported(_IDS[v]))


def isa_id(isa: str | None) -> int:
    """The C enum value for ``isa`` (None = :func:`active_isa`), validated; a kernel
    variant name is accepted here (not in ONNX_PREP_ISA)."""
    if isa is None:
        return _IDS[active_isa()]
    if isa in VARIANTS:
        if isa not in kernel_variants():
            raise NativeError(f"kernel variant {isa} is not available here",
                              hint=f"available: {', '.join(kernel_variants())}")
        return _IDS[isa]
    return _IDS[select_isa(isa)]
