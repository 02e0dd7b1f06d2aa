"""One output sink: data to stdout, progress/warnings/errors to stderr, so
``--json`` output always parses.

``stdout`` and ``stderr`` are rich consoles made on first use (PEP 562): a command
that prints only JSON (``run --json``) and meets no warning or error never imports
rich (~25 ms of a run's start-up; tests/test_cli_startup.py pins it)."""
from __future__ import annotations

import json
import sys
import threading
from typing import Any

_made = threading.Lock()


def __getattr__(name: str):
    if name not in ("stdout", "stderr"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from rich.console import Console

    with _made:  # one console per stream, whichever thread asks first
        console = globals().get(name)
        if console is None:
            # emoji=False: a name like ``a:ok:b`` in a model is printed as it is, not as
            # an emoji, and rich's emoji table (~5 ms) is not loaded.
            console = globals()[name] = Console(stderr=name == "stderr", soft_wrap=True, emoji=False)
    return console


def emit_json(data: Any) -> None:
    """Write one JSON document to stdout (plain print: no rich markup or wrapping)."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=_default) + "\n")
    sys.stdout.flush()


def emit_record(doc: Any, as_json: bool, render) -> None:
    """A command's record: one JSON document with ``--json``, else ``render(doc)``."""
    if as_json:
        emit_json(doc)
    else:
        render(doc)


def _default(obj: Any) -> Any:
    if hasattr(obj, "to_json"):
        return obj.to_json()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


_warned: set[str] = set()  # this command's warnings so far (app's callback clears it)


def warn(text: str) -> None:
    """``warning: <text>`` on one line of stderr, its control characters escaped; a
    warning said once in a command is not said again (a sweep opens the same missing
    cache for every sample)."""
    from onnx_prep.core.errors import terminal_safe

    if text in _warned:
        return
    _warned.add(text)
    console = __getattr__("stderr")  # a bare global name would not reach __getattr__
    console.print(f"warning: {terminal_safe(text)}", markup=False, highlight=False)
