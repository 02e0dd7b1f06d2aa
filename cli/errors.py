"""Errors decided centrally: library errors become one line on stderr and a named
exit code; a traceback only with --debug. Unknown exceptions are bugs: they keep
their traceback and exit with EXIT_INTERNAL."""
from __future__ import annotations

import traceback
from typing import Callable, TypeVar

from onnx_prep.cli import output
from onnx_prep.core.errors import EXIT_INTERNAL, OnnxPrepError

T = TypeVar("T")

DEBUG = False


def run_guarded(fn: Callable[[], T]) -> T | int:
    try:
        return fn()
    except OnnxPrepError as exc:
        if DEBUG:
            output.stderr.print(traceback.format_exc(), markup=False, highlight=False)
        output.stderr.print(f"error: {exc.one_line()}", markup=False, highlight=False)
        return exc.exit_code
    except KeyboardInterrupt:
        output.stderr.print("interrupted", markup=False)
        return 130


def internal_error_exit() -> int:
    return EXIT_INTERNAL
