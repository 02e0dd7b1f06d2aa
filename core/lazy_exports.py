"""Package surfaces that import nothing until a name is used.

Each family package (``core/model``, ``core/runtime``, ...) lists its public names in
``__all__`` and maps each to the module that defines it. Importing the package costs
nothing: a name's module is imported on first access (PEP 562). That keeps start-up
fast (``onnx-prep --help`` must not import onnx or numpy) and lets modules of one
family import modules of another without import cycles through ``__init__`` files.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[list[str], Callable, Callable]:
    """``exports`` maps a public name to its module, relative to ``package``.

    Returns ``(__all__, __getattr__, __dir__)`` for the package to bind."""

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        return value

    def __dir__() -> list[str]:
        return sorted(exports)

    return sorted(exports), __getattr__, __dir__
