"""Errors decided centrally (exit codes: docs/cli.md).

- a library error (``OnnxPrepError``): one line on stderr and its exit code (2 for
  unusable input); the traceback too with ``--debug``;
- Ctrl-C: ``interrupted`` on stderr, exit 130, no traceback;
- any other exception is a bug: its traceback, one line asking to report it, exit 3.
"""
from __future__ import annotations

import traceback
from typing import Callable, TypeVar

import typer

from onnx_prep.cli import output
from onnx_prep.core.errors import EXIT_INTERNAL, EXIT_INTERRUPTED, OnnxPrepError, terminal_safe

T = TypeVar("T")

DEBUG = False

REPORT_REQUEST = ("internal error: this is a bug in onnx-prep; please report it with the command line "
                  "and the traceback above")


def run_guarded(fn: Callable[[], T]) -> T | int:
    """``fn()``'s result, or the exit code of what it raised."""
    try:
        return fn()
    except OnnxPrepError as exc:
        if DEBUG:
            _print(traceback.format_exc())
        print_error(exc.one_line())
        return exc.exit_code
    except KeyboardInterrupt:
        return interrupted()
    except (BrokenPipeError, typer.Exit, typer.Abort):
        raise  # a closed stdout (`| head`) and typer's own exits: typer handles them
    except Exception:  # noqa: BLE001 - whatever else escaped is a bug
        return internal_error()


def interrupted() -> int:
    _print("interrupted")
    return EXIT_INTERRUPTED


def internal_error() -> int:
    """Report the exception being handled as a bug: its traceback, then the request."""
    _print(traceback.format_exc())
    _print(REPORT_REQUEST)
    return EXIT_INTERNAL


def print_error(text: str) -> None:
    """``error: <text>`` on one line, its control characters escaped for the terminal."""
    _print(f"error: {terminal_safe(text)}")


def _print(text: str) -> None:
    output.stderr.print(text, markup=False, highlight=False)
