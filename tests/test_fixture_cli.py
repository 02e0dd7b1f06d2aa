"""`onnx-prep fixture` through the real entry point (typer's CliRunner)."""
from __future__ import annotations

import hashlib
import json

from typer.testing import CliRunner

from onnx_prep.cli.app import app
from onnx_prep.core.errors import EXIT_UNUSABLE
from onnx_prep.fixtures import FixtureConfig, generate

runner = CliRunner()
SMALL_ARGS = ["--layers", "1", "--hidden", "128", "--intermediate", "256", "--heads", "4", "--vocab", "512"]


def test_fixture_tiny_llm_writes_the_preset(tmp_path):
    result = runner.invoke(app, ["fixture", "tiny-llm", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "fixture tiny-llm" in result.output and "tensors" in result.output
    model = tmp_path / "out" / "tiny-llm.onnx"
    ref = generate("tiny-llm", tmp_path / "ref")
    for name in ("tiny-llm.onnx", "tiny-llm.onnx.data"):
        assert hashlib.sha256((model.parent / name).read_bytes()).digest() == \
            hashlib.sha256((ref.parent / name).read_bytes()).digest(), name


def test_fixture_json_parses_and_applies_overrides(tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["fixture", "tiny-llm", str(out), *SMALL_ARGS, "--block-size", "64",
                                 "--fp16-scales", "--zero-points", "--seed", "7", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    cfg = doc["config"]
    assert (cfg["layers"], cfg["hidden"], cfg["intermediate"], cfg["heads"], cfg["vocab"]) == (1, 128, 256, 4, 512)
    assert (cfg["block_size"], cfg["fp16_scales"], cfg["zero_points"], cfg["seed"]) == (64, True, True, 7)
    assert doc["model"] == str(out / "tiny-llm.onnx")
    assert doc["data_bytes"] == (out / "tiny-llm.onnx.data").stat().st_size
    expected = FixtureConfig.preset("tiny-llm").replace(layers=1, hidden=128, intermediate=256, heads=4, vocab=512,
                                                        block_size=64, fp16_scales=True, zero_points=True, seed=7)
    assert doc["config_hash"] == expected.config_hash


def test_fixture_unknown_preset_is_one_line_exit_2(tmp_path):
    result = runner.invoke(app, ["fixture", "huge", str(tmp_path)])
    assert result.exit_code == EXIT_UNUSABLE
    assert "unknown fixture preset 'huge'" in result.output
    assert "Traceback" not in result.output


def test_fixture_bad_size_is_one_line_exit_2(tmp_path):
    result = runner.invoke(app, ["fixture", "tiny-llm", str(tmp_path), "--hidden", "500"])
    assert result.exit_code == EXIT_UNUSABLE
    assert "not a multiple of block_size" in result.output
    assert not list(tmp_path.iterdir()), "wrote files for a bad config"


def test_fixture_out_dir_that_is_a_file_is_exit_2(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    result = runner.invoke(app, ["fixture", "tiny-llm", str(target)])
    assert result.exit_code == EXIT_UNUSABLE
    assert "Traceback" not in result.output


def test_fixture_attention_and_kv_heads_options(tmp_path):
    result = runner.invoke(app, ["fixture", "tiny-llm", str(tmp_path / "out"), *SMALL_ARGS, "--attention", "gqa",
                                 "--kv-heads", "2", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["config"]["attention"], doc["config"]["kv_heads"]) == ("gqa", 2)
    expected = FixtureConfig.preset("tiny-llm").replace(layers=1, hidden=128, intermediate=256, heads=4, vocab=512,
                                                        attention="gqa", kv_heads=2)
    assert doc["config_hash"] == expected.config_hash
    text = runner.invoke(app, ["fixture", "tiny-gqa", str(tmp_path / "preset"), *SMALL_ARGS])
    assert text.exit_code == 0 and "gqa, 2 kv heads" in text.output, text.output


def test_fixture_kv_heads_not_dividing_heads_is_one_line_exit_2(tmp_path):
    result = runner.invoke(app, ["fixture", "tiny-gqa", str(tmp_path), "--kv-heads", "3"])
    assert result.exit_code == EXIT_UNUSABLE
    assert result.output.strip().splitlines() == [
        "error: invalid fixture config 'tiny-gqa': kv_heads=3 does not divide heads=8"]
    assert not list(tmp_path.iterdir()), "wrote files for a bad config"
