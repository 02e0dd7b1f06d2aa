"""The machine a figure was measured on, in one line.

Every benchmark prints it first: figures from different machines are not comparable,
and sessions here run on different CPUs (AVX-512 on one, AVX2 only on another).
"""
from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine() -> str:
    """``CPU <model>, <n> logical CPUs, ISA <active>[, AMX tiles] (available: ...), weight
    streaming on|off (why)``.

    The ISA part imports the native module's CPU probe; where it cannot load, says so.
    The last part is what the decode GEMVs do with their weights on this machine
    (core/ops/weight_streaming.py; it probes once a process, ~5 ms): a figure depends on it."""
    try:
        from onnx_prep.native.isa import active_isa, amx_tiles, available_isas

        amx = ", AMX tiles" if amx_tiles() else ""
        isa = f"ISA {active_isa()}{amx} (available: {', '.join(available_isas())})"
    except Exception as exc:  # the native module is not built: still describe the CPU
        return f"CPU {cpu_model()}, {os.cpu_count()} logical CPUs, ISA unknown ({type(exc).__name__}: {exc})"
    from onnx_prep.core.ops.weight_streaming import choice

    return f"CPU {cpu_model()}, {os.cpu_count()} logical CPUs, {isa}, {choice().describe()}"
