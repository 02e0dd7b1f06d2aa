"""`onnx-prep run --logits-out FILE.npz`: every decode step's logits, written whole,
against ONNX Runtime on the same sequences."""
from __future__ import annotations

import json
from importlib import resources

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import ort_or_skip
from decoder_toys import prefix_recompute_logits
from onnx_prep.cli.app import app
from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.decode.run_memory import estimate_run_memory
from onnx_prep.core.errors import EXIT_OK

cli = CliRunner()


def _json(args: list[str]) -> dict:
    jsonschema = pytest.importorskip("jsonschema")
    result = cli.invoke(app, ["run", *args, "--json"])
    assert result.exit_code == EXIT_OK, result.output
    doc = json.loads(result.stdout)
    schema = json.loads(resources.files("onnx_prep.core").joinpath("schemas/run.schema.json").read_text())
    jsonschema.validate(doc, schema)
    return doc


def test_logits_out_holds_every_step_as_ort_gives_it(tiny_zp_llm_path, tmp_path):
    ort_or_skip()
    from onnx_prep.core.decode.ort_runner import OrtRunner

    out = tmp_path / "logits.npz"
    out.write_bytes(b"an older file, replaced whole")
    steps = 6
    doc = _json([str(tiny_zp_llm_path), "--prompt-ids", "5,6,7", "--prompt-ids", "90,11,4", "--tokens", str(steps),
                 "--logits-out", str(out)])
    assert doc["logits_file"] == str(out) and not list(tmp_path.glob(".logits.npz.*"))  # no temp file left
    with np.load(out) as z:
        logits, tokens = z["logits"], z["tokens"]
    assert logits.dtype == np.float32 and logits.shape == (steps, 2, 8192)  # [steps, batch, vocab]
    assert tokens.tolist() == doc["tokens"]
    assert np.array_equal(np.argmax(logits, axis=-1).T, tokens)  # each step's argmax is the token emitted
    # ONNX Runtime on the same sequences (the prompt, then each emitted token appended),
    # its feeds written by the test: step 0 is its first-step logits, and so on
    io = DecoderIO.from_model(tiny_zp_llm_path)
    seq = np.array(doc["prompt_ids"], np.int64)
    with OrtRunner(tiny_zp_llm_path) as runner:
        for step in range(steps):
            ref = prefix_recompute_logits(runner, io, seq)
            scale = float((ref.max(-1) - ref.min(-1)).max())
            assert np.abs(logits[step] - ref).max() <= 1e-5 * scale, step  # docs/testing.md's bound
            seq = np.concatenate([seq, tokens[:, step:step + 1]], axis=1)


def test_without_logits_out_the_record_is_unchanged(small_llm_path):
    doc = _json([str(small_llm_path), "--tokens", "2"])
    assert "logits_file" not in doc


def test_logits_out_counts_in_the_memory_estimate(small_llm_path):
    io = DecoderIO.from_model(small_llm_path)
    plain = estimate_run_memory(io, 2, 4, 10)
    kept = estimate_run_memory(io, 2, 4, 10, keep_logits=True)
    assert kept.records - plain.records == 3 * 4 * 2 * 10 * io.vocab_size  # kept, stacked, the file's buffer
