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

import atexit
import gc
import os
import sys
import threading

try:  # Ctrl-C during the start-up imports: one line and 130, never a traceback
    import typer
    from typer._click.exceptions import ClickException  # typer's own click (typer < 0.29)

    from onnx_prep.cli import (build_cache, check, demo, devices, digest, errors, fixture, output, plan_dump, profile,
                               resolve, run)
except KeyboardInterrupt:
    sys.stderr.write("interrupted\n")
    raise SystemExit(130) from None

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
    output._warned.clear()  # each command says each warning once
    if not debug:  # numpy's RuntimeWarnings (overflow, invalid value) are not for the user
        import warnings

        warnings.simplefilter("ignore", RuntimeWarning)


app.command("fixture")(fixture.fixture)
app.command("resolve")(resolve.resolve)
app.command("run")(run.run)
app.command("build-cache")(build_cache.build_cache)
app.command("demo")(demo.demo)
app.command("plan-dump")(plan_dump.plan_dump)
app.command("digest")(digest.digest)
app.command("check")(check.check)
app.command("profile")(profile.profile)
app.command("devices")(devices.devices)


def main() -> None:
    """The command line (the console script is ``entry``). Commands return their exit
    code through ``typer.Exit`` (``cli/errors.run_guarded``); what escapes them is
    mapped here."""
    try:
        code = app(prog_name="onnx-prep", standalone_mode=False)  # the command's code
    except ClickException as exc:  # a usage error: one line, like every other error
        ctx = getattr(exc, "ctx", None)
        if exc.format_message():  # empty: no arguments, the help was the answer
            errors.print_error(exc.format_message() + (f"; see '{ctx.command_path} --help'" if ctx else ""))
        code = exc.exit_code
    except KeyboardInterrupt:  # outside a command: while parsing, say
        code = errors.interrupted()
    except Exception:  # noqa: BLE001 - a bug outside any command
        code = errors.internal_error()
    sys.exit(code if isinstance(code, int) else 0)



# The console script's threshold for the collector's youngest generation (Python's: 700).
# A run's start-up and load keep nearly every object they make (modules, the parsed graph,
# the plan): at 700 the collector ran ~120 times and walked the whole heap once, 47-65 ms
# of a run from a prepared cache on medium, to free 393 objects (and as many after 64
# tokens). At 100,000 it runs every 100,000 objects still made: a command that makes
# garbage cycles has them collected as before, in fewer, larger passes.
GC_YOUNG_THRESHOLD = 100_000

# NOTE: OpenBLAS (numpy's BLAS) starts one thread per core when numpy is imported, and
# each idle thread spins before it sleeps (2^28 cycles by default, ~0.1 s). On a 2-core
# machine that spin takes a core from the import and the load that follow it: on the
# medium fixture's run from its cache, one BLAS thread spun ~100 ms (13% of the process's
# CPU samples) without a single BLAS call; `import numpy` took 75-118 ms instead of
# 54-60 ms. A short spin (2^4 cycles) keeps the threads for the float GEMMs that use them,
# which then pay a wake-up each. The user's own setting wins.
BLAS_SPIN = ("OPENBLAS_THREAD_TIMEOUT", "4")


def quiet_blas_threads(environ=os.environ) -> None:
    """Shorten OpenBLAS's idle spin (``BLAS_SPIN``) unless the environment sets it; only
    before numpy is imported does it take effect."""
    environ.setdefault(*BLAS_SPIN)


def entry() -> None:
    """The console script (and ``python -m onnx_prep``): ``main()``, then, once its
    answer is written, the process ends without tearing the interpreter down.

    Tearing it down frees, one by one, every object the command left (a session's
    arrays, the parsed model, the modules): ~65 ms after ``run`` on the medium fixture,
    for memory the kernel takes back at exit anyway (scripts/startup_profile.py, the
    ``exit`` phase). So, after flushing stdout and stderr, the exit handlers run (what
    ``atexit`` and ``weakref.finalize`` registered: logging's flush, a temporary
    folder's removal) and ``os._exit`` ends the process with ``main()``'s code. While a
    non-daemon thread still runs, or a flush fails (a closed pipe), the exit is the
    usual one, which waits for the thread or reports the pipe as before. ``main()``
    itself returns through ``SystemExit`` as before: a program that calls it in-process
    keeps its interpreter.

    The collector's youngest threshold is raised for the command first
    (``GC_YOUNG_THRESHOLD``), and OpenBLAS's idle spin shortened (``BLAS_SPIN``)."""
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    quiet_blas_threads()
    try:
        main()
        code = 0
    except SystemExit as exc:
        if not isinstance(exc.code, int):
            raise
        code = exc.code
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed pipe or stream: the usual exit reports it
        sys.exit(code)
    atexit._run_exitfuncs()  # noqa: SLF001 - CPython's own atexit runner, the one os._exit skips
    try:  # what a handler wrote
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os._exit(code)
