"""``run --compare ort`` like for like on real exports (docs/run.md, "Comparison"): ONNX
Runtime's QDQ int4 MatMuls at the prepared runtime's accuracy level, the difference under
ONNX Runtime's defaults beside it, and ``--per-node`` through the command.

Tolerances: like for like, the prefill's logits agree within 1e-5 of their range (the
fp32 agreement of two implementations; 2-4e-7 absolute on ranges ~1.3 measured); under
ONNX Runtime's defaults a QDQ export's differ by more than 1e-3 of the range (6.5e-3
measured: int8 activations). Every test skips without the ``exports`` extra.
"""
from __future__ import annotations

import json
from importlib import resources

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import ort_or_skip, real_export
from onnx_prep.cli.app import app
from onnx_prep.core.decode import run_record
from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.decode.generation import greedy_decode
from onnx_prep.core.decode.run_record import RunOptions, record_run
from onnx_prep.core.errors import EXIT_FINDINGS, EXIT_OK, EXIT_UNUSABLE
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.model.transforms import is_fused_dequantize_matmul

ort_or_skip()
from onnx_prep.core.decode.ort_runner import QDQ_ACCURACY_KEY, OrtRunner, like_for_like_config  # noqa: E402

cli = CliRunner()
LIKE_FOR_LIKE_TOL = 1e-5  # x the logit range
DEFAULT_MIN = 1e-3  # x the logit range: what int8 activations at least change
QDQ = ["quantizer-llama-qdq-sym", "quantizer-llama-qdq-asym", "builder-llama-qdq-b32"]
NBITS = ["quantizer-llama-nbits-sym", "builder-llama-acc4-b32", "builder-llama-acc1-b32-zp"]


def _record(path, **kw):
    return record_run(path, RunOptions(tokens=3, compare="ort", cache_policy="disabled", **kw))


def _validate(doc):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(resources.files("onnx_prep.core").joinpath("schemas/run.schema.json").read_text())
    jsonschema.validate(doc, schema)


@pytest.mark.parametrize("name", QDQ)
def test_qdq_export_like_for_like_is_tight_and_the_default_is_not(name):
    path = real_export(name)
    # the level set is the one the prepared runtime's fused QDQ MatMuls carry
    fused = [n for n in resolve_model(path).nodes if is_fused_dequantize_matmul(n)]
    assert fused and {int(n.attributes["accuracy_level"]) for n in fused} == {int(like_for_like_config()[QDQ_ACCURACY_KEY])}
    doc = _record(path)
    _validate(doc)
    cmp = doc["compare"]
    assert cmp["session_config"] == {QDQ_ACCURACY_KEY: "0"} and cmp["identical"]
    span = cmp["first_step_logit_range"]
    assert cmp["first_step_max_abs_logit_diff"] <= LIKE_FOR_LIKE_TOL * span
    default = cmp["ort_default"]["first_step_max_abs_logit_diff"]
    assert default > DEFAULT_MIN * span and default > 100 * cmp["first_step_max_abs_logit_diff"]


@pytest.mark.parametrize("name", NBITS)
def test_matmulnbits_export_both_tight(name):
    path = real_export(name)
    doc = _record(path)
    cmp = doc["compare"]
    assert cmp["first_step_max_abs_logit_diff"] <= LIKE_FOR_LIKE_TOL * cmp["first_step_logit_range"]
    # No DequantizeLinear: the setting has nothing to act on, so ONNX Runtime's defaults
    # are not run again (null) ...
    assert cmp["ort_default"] is None
    # ... and they compute exactly what the like-for-like session does.
    io = DecoderIO.from_model(path)
    prompt = np.array(doc["prompt_ids"])
    with OrtRunner(path) as default, OrtRunner(path, session_config=like_for_like_config()) as like:
        a = greedy_decode(default, io, prompt, 1).first_logits
        b = greedy_decode(like, io, prompt, 1).first_logits
    np.testing.assert_array_equal(a, b)


def test_the_report_line_says_how_ort_was_configured():
    out = cli.invoke(app, ["run", str(real_export("quantizer-llama-qdq-sym")), "--tokens", "2", "--compare", "ort"])
    assert out.exit_code == EXIT_OK, out.output
    line = next(s for s in out.stdout.splitlines() if s.startswith("ort: tokens identical"))
    assert "like for like (session.qdq_matmulnbits_accuracy_level=0)" in line
    assert "under ONNX Runtime's default config" in line


def test_per_node_needs_compare():
    out = cli.invoke(app, ["run", "--per-node", "--tokens", "1"])
    assert out.exit_code == EXIT_UNUSABLE
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --per-node compares with another runtime: "
                                                   "it needs --compare ort"), out.stderr


def test_per_node_exit_0_when_every_value_matches_and_1_at_a_divergence(monkeypatch):
    path = str(real_export("builder-llama-qdq-b32"))
    args = ["run", path, "--tokens", "2", "--compare", "ort", "--per-node", "--cache-policy", "disabled"]
    out = cli.invoke(app, [*args, "--json"])
    assert out.exit_code == EXIT_OK, out.output
    doc = json.loads(out.stdout)
    _validate(doc)
    pn = doc["compare"]["per_node"]
    assert pn["first_divergence"] is None and pn["compared"] > 30 and pn["largest"]["relative_diff"] < 1e-5
    assert pn["reference_config"] == {QDQ_ACCURACY_KEY: "0"}
    # ONNX Runtime at its defaults (the test's only change: the config it is given)
    monkeypatch.setattr(run_record, "_like_for_like", dict)
    out = cli.invoke(app, [*args, "--json"])
    assert out.exit_code == EXIT_FINDINGS, out.output
    doc = json.loads(out.stdout)
    _validate(doc)
    d = doc["compare"]["per_node"]["first_divergence"]
    assert d["op_type"] == "MatMul" and d["node"].endswith("qkv_proj/MatMul_matmul_Q4") and d["reason"] == "values"
    text = cli.invoke(app, args)
    assert text.exit_code == EXIT_FINDINGS
    assert f"FIRST DIVERGENCE at node '{d['node']}'" in text.stdout
    assert "  ours: shape [1, 4, " in text.stdout and "  ort:  shape [1, 4, " in text.stdout
    assert "max |diff|" in text.stdout


def test_per_node_on_one_forward_of_a_decoder(small_llm_path):
    # --shape asks for one forward: --per-node then compares that forward value by value
    out = cli.invoke(app, ["run", str(small_llm_path), "--shape", "batch=1,seq=4,past_seq=3",
                           "--compare", "ort", "--per-node", "--json"])
    assert out.exit_code == EXIT_OK, out.output
    doc = json.loads(out.stdout)
    assert doc["schema"] == "onnx-prep.graph-run/2"
    pn = doc["compare"]["per_node"]
    assert pn["first_divergence"] is None and pn["compared"] > 30 and pn["largest"]["relative_diff"] < 1e-4
