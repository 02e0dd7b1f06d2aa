"""``onnx-prep demo``: the main job on the embedded default model, as one command.

It runs the real commands in sequence, in this process, exactly as a user would type
them: ``resolve`` (the default model is generated first if absent), ``build-cache``,
``plan-dump`` (block 0), ``run`` from the cache compared with ONNX Runtime, ``profile``
of the load (both modes, without and with the cache, a Chrome trace), and a batch sweep
under a budget that forces weight streaming (a plot). ONNX Runtime joins where it is
installed. The trace and the plot go to a ``demo`` folder beside the default model; the
last lines say where.
"""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import typer

from onnx_prep.cli import output
from onnx_prep.core.errors import EXIT_OK


def demo_steps(tokens: int, out_dir: Path) -> list[tuple[str, list[str]]]:
    have_ort = importlib.util.find_spec("onnxruntime") is not None
    ort = ["--compare", "ort"] if have_ort else []
    run = ["run", "--tokens", str(tokens), "--batch", "2", *ort]
    profile = ["profile", "--mode", "both", "--cache-policy", "disabled,read-only", "--repeat", "3",
               "--trace", str(out_dir / "load-trace.json"), *ort]
    sweep = ["profile", "--batch-sweep", "1,2,4,8", "--budget", "50%", "--tokens", "8", "--repeat", "2", *ort]
    if importlib.util.find_spec("matplotlib") is not None:
        sweep += ["--plot", str(out_dir / "batch-sweep.png")]
    return [("resolve", ["resolve"]), ("build-cache", ["build-cache"]),
            ("plan-dump", ["plan-dump", "--filter", "layers.0."]), ("run", run),
            ("profile", profile), ("batch sweep", sweep)]


def demo(
    tokens: int = typer.Option(16, "--tokens", min=1, help="Tokens to generate in the run step."),
) -> None:
    """Run the main job on the embedded default model: resolve, build-cache, plan-dump, run (vs ONNX Runtime), profile, batch sweep."""
    from typer.main import get_command

    from onnx_prep.cli import errors
    from onnx_prep.cli.app import app
    from onnx_prep.fixtures import default_model_path

    cmd = get_command(app)
    out_dir = default_model_path().parent.parent / "demo"
    out_dir.mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("onnxruntime") is None:
        output.stderr.print("note: onnxruntime is not installed: nothing is compared with it")
    if importlib.util.find_spec("matplotlib") is None:
        output.stderr.print("note: matplotlib is not installed (pip install 'onnx-prep[plot]'): no plot is drawn")
    worst = EXIT_OK
    t_all = time.perf_counter()
    for title, argv in demo_steps(tokens, out_dir):
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
    if worst == EXIT_OK:
        output.stdout.rule("what the demo left")
        for what, name in (("load trace (open in https://ui.perfetto.dev)", "load-trace.json"),
                           ("batch sweep plot", "batch-sweep.png")):
            if (out_dir / name).is_file():
                output.stdout.print(f"{what}: {out_dir / name}", markup=False, highlight=False)
        output.stderr.print(f"[dim]demo: {(time.perf_counter() - t_all):.1f} s[/dim]")
    raise typer.Exit(worst)
