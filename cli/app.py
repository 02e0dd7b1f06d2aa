"""The ``onnx-prep`` command: the typer app and its commands, registered here by name.

Each command lives in its own module under cli/ (options, one core call, rendering);
a missing module is an ImportError here, never a silent gap. Start-up stays fast
because a command module imports only typer and the CLI's own modules at the top:
numpy, onnx and the rest of the load path are imported inside the command, when it
runs (``onnx-prep --help``, ``--version`` and usage errors import neither; tested in
tests/test_cli_startup.py, measured by scripts/bench_startup.py).

Exit codes (docs/cli.md): 0 ok, 1 findings, 2 unusable input, 3 internal error (a
bug: the traceback and a request to report it), 130 interrupted (Ctrl-C).
"""
from __future__ import annotations

import sys

import typer

from onnx_prep.cli import demo, errors, fixture, resolve, run

app = typer.Typer(
    name="onnx-prep",
    help="Prepare and profile ONNX models for fast loading.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version_cb(value: bool) -> None:
    if value:
        from onnx_prep import __version__

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


app.command("fixture")(fixture.fixture)
app.command("resolve")(resolve.resolve)
app.command("run")(run.run)
app.command("demo")(demo.demo)


def main() -> None:
    """The console script. Commands return their exit code through ``typer.Exit``
    (``cli/errors.run_guarded``); what escapes them is mapped here."""
    try:
        app(prog_name="onnx-prep")  # exits with the command's code
    except KeyboardInterrupt:  # outside a command: while parsing, say
        sys.exit(errors.interrupted())
    except Exception:  # noqa: BLE001 - a bug outside any command
        sys.exit(errors.internal_error())
