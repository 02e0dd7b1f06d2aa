"""One output sink: data to stdout, progress/warnings/errors to stderr, so
``--json`` output always parses."""
from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

# emoji=False: a name like ``a:ok:b`` in a model is printed as it is, not as an emoji,
# and rich's emoji table (~5 ms) is not loaded.
stdout = Console(soft_wrap=True, emoji=False)
stderr = Console(stderr=True, soft_wrap=True, emoji=False)


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


def warn(text: str) -> None:
    """``warning: <text>`` on one line of stderr, its control characters escaped."""
    from onnx_prep.core.errors import terminal_safe

    stderr.print(f"warning: {terminal_safe(text)}", markup=False, highlight=False)
