"""`onnx-prep demo`: the README's main job, through the real entry point."""
from __future__ import annotations

import importlib.util
import json

from typer.testing import CliRunner

from onnx_prep.cli.app import app


def test_demo_is_the_full_tour_of_the_default_model(tmp_path, monkeypatch):
    monkeypatch.setenv("ONNX_PREP_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(app, ["demo", "--tokens", "4"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    for step in ("onnx-prep resolve", "onnx-prep build-cache", "onnx-prep plan-dump", "onnx-prep run",
                 "onnx-prep profile --mode both", "onnx-prep profile --batch-sweep"):
        assert step in out, step
    assert "int4_matmul" in out  # resolve's kernel table
    assert "generation 1" in out  # build-cache wrote the cache ...
    assert "prepared cache: " in out and "objects read from it" in out  # ... and run read it
    assert "row 0:" in out and "row 1:" in out  # the run's tokens (batch 2)
    assert "weight streaming" in out and "yes" in out  # the sweep's counters
    if importlib.util.find_spec("onnxruntime") is not None:
        assert "ort: tokens identical" in out
    assert list((tmp_path / "cache").rglob("*.onnx"))  # the default model was generated there
    trace = next((tmp_path / "cache").rglob("load-trace.json"))
    assert json.loads(trace.read_text())["traceEvents"]
    assert f"load trace (open in https://ui.perfetto.dev): {trace}" in out
    if importlib.util.find_spec("matplotlib") is not None:
        plot = next((tmp_path / "cache").rglob("batch-sweep.png"))
        assert plot.read_bytes()[:4] == b"\x89PNG" and f"batch sweep plot: {plot}" in out


def test_demo_stops_at_the_first_failing_step(tmp_path, monkeypatch):
    """A broken default model fails the first step with its one-line error and exit 2."""
    from onnx_prep.fixtures import default_model_path

    monkeypatch.setenv("ONNX_PREP_CACHE", str(tmp_path / "cache"))
    model = default_model_path()
    model.write_bytes(b"not a protobuf")
    result = CliRunner().invoke(app, ["demo"])
    assert result.exit_code == 2
    assert "onnx-prep run" not in result.stdout  # stopped after resolve
