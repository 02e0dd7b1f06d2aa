"""The MODEL argument of every command that loads a model (``resolve``, ``run``): the
path given, a folder standing for the one ``.onnx`` file it holds, or else the embedded
default model (the tiny INT4 LLM in the user cache, ``fixtures/cache.py``), generated
first if absent, with a one-line note on stderr saying so. Each command that loads
also takes ``--trust-symlinks`` (``TRUST_SYMLINKS``) and has ``ONNX_PREP_ISA`` checked
here, so the same model path and ISA rules hold whichever command met them; ``run`` and
``profile`` take ``--device`` (``DEVICE``), checked by their options in core, and
``--inputs`` / ``--shape`` (``INPUTS``, ``SHAPE``: one forward of any model on the feeds
core/decode/graph_feeds.py makes)."""
from __future__ import annotations

import os
from pathlib import Path

import typer

from onnx_prep.cli import output

FUSE = typer.Option(
    True, "--fuse/--no-fuse",
    help="Fuse standard-op RMSNorm, rotary and KV-cache attention chains into single native-kernel nodes at resolve (docs/resolve.md).")
TRUST_SYMLINKS = typer.Option(
    False, "--trust-symlinks",
    help="Accept external data reached through symlinks or hard links (Hugging Face cache snapshots).")
INPUTS = typer.Option(
    None, "--inputs", metavar="FILE",
    help="One forward of the graph (any model) on these inputs: FILE.npz (arrays by input name) or "
         "NAME=FILE.npy; repeatable (docs/run.md).")
SHAPE = typer.Option(
    None, "--shape", metavar="NAME=N",
    help="Bind symbolic dims (e.g. batch=1,seq=8) for one forward on generated inputs; repeatable.")
DEVICE = typer.Option(
    "cpu", "--device", metavar="DEVICE",
    help="Run on: cpu, or cuda (checked first: without a usable CUDA device, or with this build's CUDA path "
         "incomplete, one line saying why, exit 2; never a silent CPU fallback; docs/cuda.md).")


def model_path(model: Path | None) -> Path:
    _check_isa()
    if model is not None:
        from onnx_prep.core.model.model_file import find_model_file

        return find_model_file(model, folder=True)
    from onnx_prep.fixtures import FixtureConfig, cached_model_path, default_model_path
    from onnx_prep.fixtures.cache import DEFAULT_FIXTURE

    target = cached_model_path(FixtureConfig.preset(DEFAULT_FIXTURE))
    if not target.is_file():
        output.stderr.print(f"note: generating the default model ({DEFAULT_FIXTURE}) into {target.parent}",
                            markup=False, highlight=False)
    return default_model_path()


def _check_isa() -> None:
    """A bad ``ONNX_PREP_ISA`` is refused before anything loads (the native module is
    imported only when the variable is set)."""
    if os.environ.get("ONNX_PREP_ISA", "").strip():
        from onnx_prep.native import active_isa

        active_isa()
