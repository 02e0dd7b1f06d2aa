"""``onnx-prep demo``: the main job on the embedded default model, as one command.

It runs the real commands in sequence, in this process, exactly as a user would type
them: ``resolve`` (the default model is generated first if absent), then ``run`` through
the prepared runtime, compared with ONNX Runtime where it is installed. Later steps
(build-cache, plan-dump, profile) join this list as they land.
"""
from __future__ import annotations

import importlib.util
import time

import typer

from onnx_prep.cli import output
from onnx_prep.core.errors import EXIT_OK


def demo_steps(tokens: int) -> list[tuple[str, list[str]]]:
    run = ["run", "--tokens", str(tokens), "--batch", "2"]
    if importlib.util.find_spec("onnxruntime") is not None:
        run += ["--compare", "ort"]
    return [("resolve", ["resolve"]), ("run", run)]


def demo(
    tokens: int = typer.Option(16, "--tokens", min=1, help="Tokens to generate in the run step."),
) -> None:
    """Run the main job on the embedded default model: resolve, then run (vs ONNX Runtime)."""
    from typer.main import get_command

    from onnx_prep.cli import errors
    from onnx_prep.cli.app import app

    cmd = get_command(app)
    if importlib.util.find_spec("onnxruntime") is None:
        output.stderr.print("note: onnxruntime is not installed: the run is not compared with it")
    worst = EXIT_OK
    for title, argv in demo_steps(tokens):
        output.stdout.rule(f"onnx-prep {' '.join(argv)}")
        t0 = time.perf_counter()
        if errors.DEBUG:
            argv = ["--debug", *argv]
        # standalone_mode=False: click returns a command's exit code instead of exiting
        code = cmd.main(argv, prog_name="onnx-prep", standalone_mode=False) or EXIT_OK
        output.stderr.print(f"[dim]{title}: {(time.perf_counter() - t0):.2f} s, exit {code}[/dim]")
        worst = max(worst, code)
        if code not in (EXIT_OK,):
            break
    raise typer.Exit(worst)
