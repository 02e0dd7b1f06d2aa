"""The ``onnx-prep`` command. Each command lives in its own module under cli/ and
registers itself on ``app``; commands parse options, make one core call and render."""
from __future__ import annotations

import importlib
import sys

import typer

from onnx_prep import __version__
from onnx_prep.cli import errors

app = typer.Typer(
    name="onnx-prep",
    help="Prepare and profile ONNX models for fast loading.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Command modules; each defines its command(s) with @app.command on import.
COMMAND_MODULES = ("fixture", "resolve", "run", "demo")


def _version_cb(value: bool) -> None:
    if value:
        typer.echo(f"onnx-prep {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
    version: bool = typer.Option(
        False, "--version", callback=_version_cb, is_eager=True, help="Print the version."
    ),
) -> None:
    errors.DEBUG = debug


for _name in COMMAND_MODULES:
    try:
        importlib.import_module(f"onnx_prep.cli.{_name}")
    except ModuleNotFoundError as exc:  # a command not written yet
        if exc.name != f"onnx_prep.cli.{_name}":
            raise


def main() -> None:
    # Exit codes come from the commands (typer.Exit(code)); see cli/errors.py.
    sys.exit(app())
