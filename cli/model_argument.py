"""The MODEL argument of ``resolve`` and ``run``: the path given, or else the embedded
default model (the tiny INT4 LLM in the user cache, ``fixtures/cache.py``), generated
first if absent, with a one-line note on stderr saying so."""
from __future__ import annotations

from pathlib import Path

from onnx_prep.cli import output


def model_path(model: Path | None) -> Path:
    if model is not None:
        return model
    from onnx_prep.fixtures import FixtureConfig, cached_model_path, default_model_path
    from onnx_prep.fixtures.cache import DEFAULT_FIXTURE

    target = cached_model_path(FixtureConfig.preset(DEFAULT_FIXTURE))
    if not target.is_file():
        output.stderr.print(f"note: generating the default model ({DEFAULT_FIXTURE}) into {target.parent}",
                            markup=False, highlight=False)
    return default_model_path()
