"""CompiledKernels: one CUDA source's entries, compiled once per process and device;
KernelLaunch: one launch of an entry, decided and checked on the host.

Each device kernel family (the INT4 matmul, the INT4 prepack, the tensor ops, the
decoder ops) compiles its source with NVRTC through the driver protocol
(``module_from_source``) the first time a launcher on a device asks for it, and looks
its entries up once (``module_function``); later launchers on the same device reuse
them. The cache is keyed by the driver object and the device ordinal, holding the
driver weakly: a dropped driver's ``id`` may be given to a new one, which must compile
again (its modules are not the old driver's).
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from onnx_prep.core.cuda.driver import DeviceDriver, KernelArg

__all__ = ["CompiledKernels", "KernelLaunch"]


@dataclass(frozen=True)
class KernelLaunch:
    """One launch, decided: the entry's name, its grid and block, its arguments
    (``(ctype, value)`` in the entry's parameter order), those parameters' names, and
    the dynamic shared memory (0: the kernels' shared memory is static)."""

    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[KernelArg, ...]
    params: tuple[str, ...] = ()
    shared_bytes: int = 0

    def arg(self, name: str) -> Any:
        return self.args[self.params.index(name)][1]


class CompiledKernels:
    """``entries`` of the source ``source()`` returns (named ``name`` for NVRTC's messages)."""

    def __init__(self, source: Callable[[], str], name: str, entries: Iterable[str]) -> None:
        self.source, self.name, self.entries = source, name, tuple(entries)
        # (id(driver), ordinal) -> (the driver, weakly; its module; {entry: function})
        self.loaded: dict[tuple[int, int], tuple[weakref.ref, Any, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def functions(self, driver: DeviceDriver, ordinal: int) -> dict[str, Any]:
        """``{entry: function}`` on ``driver``'s device ``ordinal``, compiled on first use."""
        with self._lock:
            hit = self.loaded.get((id(driver), ordinal))
            if hit is not None and hit[0]() is driver:
                return hit[2]
            driver.use_device(ordinal)
            module = driver.module_from_source(self.source(), self.name, ordinal)
            functions = {name: driver.module_function(module, name) for name in self.entries}
            self.loaded[(id(driver), ordinal)] = (weakref.ref(driver), module, functions)
            return functions
