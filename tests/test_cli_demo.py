"""`onnx-prep demo`: the README's main job, through the real entry point."""
from __future__ import annotations

import importlib.util

from typer.testing import CliRunner

from onnx_prep.cli.app import app


def test_demo_generates_resolves_and_runs_the_default_model(tmp_path, monkeypatch):
    monkeypatch.setenv("ONNX_PREP_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(app, ["demo", "--tokens", "4"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "onnx-prep resolve" in out and "onnx-prep run" in out
    assert "int4_matmul" in out  # resolve's kernel table
    assert "row 0:" in out and "row 1:" in out  # the run's tokens (batch 2)
    if importlib.util.find_spec("onnxruntime") is not None:
        assert "ort: tokens identical" in out
    assert list((tmp_path / "cache").rglob("*.onnx"))  # the default model was generated there


def test_demo_stops_at_the_first_failing_step(tmp_path, monkeypatch):
    """A broken default model fails the first step with its one-line error and exit 2."""
    from onnx_prep.fixtures import default_model_path

    monkeypatch.setenv("ONNX_PREP_CACHE", str(tmp_path / "cache"))
    model = default_model_path()
    model.write_bytes(b"not a protobuf")
    result = CliRunner().invoke(app, ["demo"])
    assert result.exit_code == 2
    assert "onnx-prep run" not in result.stdout  # stopped after resolve
