"""`onnx-prep run` through the real entry point (typer's CliRunner).

Decoding with ONNX Runtime (``--runtime ort``) and every error path run now; the
prepared-runtime paths skip, saying so, until ``onnx_prep.core.runtime.session`` exists.
"""
from __future__ import annotations

import importlib.util
import io as _io
import json
import sys
from importlib import resources

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from conftest import ort_or_skip
from decoder_toys import KV_NAMES, build_toy_decoder
from onnx_prep.cli import output
from onnx_prep.cli import run as run_cmd
from onnx_prep.cli.app import app
from onnx_prep.core.decode import run_record
from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.errors import EXIT_FINDINGS, EXIT_OK, EXIT_UNUSABLE
from onnx_prep.core.decode.generation import greedy_decode

ort_or_skip()
from onnx_prep.core.decode.ort_runner import OrtRunner  # noqa: E402

cli = CliRunner()
HAVE_SESSION = importlib.util.find_spec("onnx_prep.core.runtime.session") is not None
needs_session = pytest.mark.skipif(not HAVE_SESSION, reason="onnx_prep.core.runtime.session (the prepared "
                                   "runtime) is not written yet")


def _schema():
    jsonschema = pytest.importorskip("jsonschema")
    text = resources.files("onnx_prep.core").joinpath("schemas/run.schema.json").read_text()
    return jsonschema, json.loads(text)


def _json(args):
    result = cli.invoke(app, ["run", *args, "--json"])
    assert result.exit_code == EXIT_OK, result.output
    doc = json.loads(result.stdout)
    jsonschema, schema = _schema()
    jsonschema.validate(doc, schema)
    return doc


def _error(args):
    result = cli.invoke(app, ["run", *args])
    assert result.exit_code == EXIT_UNUSABLE, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.fixture()
def toy(tmp_path):
    return build_toy_decoder(tmp_path / "toy.onnx", layout="bshd", kv_names="flat")


def test_ort_json_matches_the_library_and_validates(small_llm_path):
    doc = _json([str(small_llm_path), "--runtime", "ort", "--prompt-ids", "5,6,7", "--tokens", "6"])
    want = greedy_decode(OrtRunner(small_llm_path), DecoderIO.from_model(small_llm_path),
                         np.array([[5, 6, 7]]), 6)
    assert doc["tokens"] == want.tokens.tolist()
    assert doc["runtime"] == "ort" and doc["batch"] == 1 and doc["prompt_ids"] == [[5, 6, 7]]
    assert doc["io"]["kv_layout"] == "bhsd" and len(doc["io"]["kv"]) == 2 and doc["compare"] is None
    assert doc["counters"] == {"kv_appended_in_place": 0, "kv_copied": 0, "matmul_splits": 0, "chunks_by_helpers": 0, "helper_sleeps": 0, "helper_wakes": 0}  # ORT: not ours
    assert len(doc["timings"]["step_ms"]) == 6 and doc["timings"]["decode_tokens_per_s"] > 0


def test_text_output_lists_rows_and_timings(toy):
    result = cli.invoke(app, ["run", str(toy), "--runtime", "ort", "--prompt-ids", "1,2,3",
                              "--tokens", "5", "--batch", "2"])
    assert result.exit_code == EXIT_OK, result.output
    want = greedy_decode(OrtRunner(toy), DecoderIO.from_model(toy), np.array([[1, 2, 3]] * 2), 5)
    for i in range(2):
        assert f"row {i}: {' '.join(map(str, want.tokens[i]))}" in result.stdout
    assert "time to first output" in result.stdout and "tokens/s" in result.stdout
    assert "kv bshd x2 layers" in result.stdout


def test_batch_repeats_one_prompt_or_takes_one_row_per_prompt(toy):
    repeated = _json([str(toy), "--runtime", "ort", "--prompt-ids", "4,5", "--batch", "3", "--tokens", "4"])
    assert repeated["prompt_ids"] == [[4, 5]] * 3 and repeated["batch"] == 3
    assert repeated["tokens"][0] == repeated["tokens"][1] == repeated["tokens"][2]
    rows = _json([str(toy), "--runtime", "ort", "--prompt-ids", "4,5", "--prompt-ids", "9,1", "--tokens", "4"])
    assert rows["prompt_ids"] == [[4, 5], [9, 1]]
    alone = _json([str(toy), "--runtime", "ort", "--prompt-ids", "9,1", "--tokens", "4"])
    assert rows["tokens"][0] == repeated["tokens"][0] and rows["tokens"][1] == alone["tokens"][0]


def test_default_model_is_the_embedded_tiny_llm(tmp_path, monkeypatch):
    monkeypatch.setenv("ONNX_PREP_CACHE", str(tmp_path / "cache"))
    doc = _json(["--runtime", "ort", "--tokens", "2"])
    assert doc["model"].startswith(str(tmp_path / "cache")) and doc["model"].endswith("tiny-llm.onnx")
    assert doc["prompt_ids"] == [[1, 2, 3, 4]] and doc["io"]["vocab_size"] == 8192
    assert len(doc["io"]["kv"]) == 4


def test_io_map_makes_an_opaque_model_decodable(tmp_path):
    path = build_toy_decoder(tmp_path / "m.onnx", kv_names="opaque")
    line = _error([str(path), "--runtime", "ort", "--tokens", "2"])
    assert "'kin0a'" in line and "'kin1b'" in line and "--io-map" in line
    mapping = {"kv": [dict(zip(("past_key", "past_value", "present_key", "present_value"), KV_NAMES["opaque"](l)))
                      for l in range(2)]}
    map_file = tmp_path / "io.json"
    map_file.write_text(json.dumps(mapping))
    doc = _json([str(path), "--runtime", "ort", "--tokens", "3", "--io-map", str(map_file)])
    assert doc["io"]["source"] == "io-map" and len(doc["tokens"][0]) == 3


@pytest.mark.parametrize("args, match", [
    (["--prompt-ids", "1,x"], "comma-separated non-negative integers"),
    (["--prompt-ids", ""], "comma-separated"),
    (["--prompt-ids", "1,2", "--prompt-ids", "3"], "same length"),
    (["--prompt-ids", "1,2", "--prompt-ids", "3,4", "--batch", "3"], "disagrees"),
    (["--batch", "0"], "--batch must be at least 1"),
    (["--tokens", "0"], "--tokens must be at least 1"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--runtime", "tvm"], "--runtime must be one of"),
    (["--compare", "tvm"], "--compare supports only 'ort'"),
    (["--compare", "ort"], "compares ONNX Runtime with itself"),
    (["--prompt-ids", "99"], "outside the vocabulary"),
])
def test_bad_options_exit_2_with_one_line(toy, args, match):
    line = _error([str(toy), "--runtime", "ort", *args])
    assert match in line


def test_bad_model_and_io_map_files_exit_2(tmp_path, toy):
    assert "not found" in _error([str(tmp_path / "absent.onnx"), "--runtime", "ort"])
    bad_map = tmp_path / "io.json"
    bad_map.write_text('{"logitz": "x"}')
    assert "unknown keys" in _error([str(toy), "--runtime", "ort", "--io-map", str(bad_map)])


def test_a_prepared_path_with_no_cache_is_said(tmp_path, toy):
    # --prepared names a file that is not there (a typo, a cache never built): read-only
    # loads without it and says so once; require-complete refuses it in one line.
    absent = tmp_path / "typo.prepared.onnx"
    result = cli.invoke(app, ["run", str(toy), "--prompt-ids", "1,2,3", "--tokens", "2", "--prepared", str(absent)])
    assert result.exit_code == EXIT_OK, result.output
    warned = [ln for ln in result.stderr.splitlines() if ln.startswith("warning: ")]
    assert len(warned) == 1 and f"no prepared cache at {absent}" in warned[0], result.stderr
    assert f"onnx-prep build-cache {toy} -o {absent}" in warned[0]
    line = _error([str(toy), "--prompt-ids", "1,2,3", "--tokens", "2", "--prepared", str(absent),
                   "--cache-policy", "require-complete"])
    assert f"no prepared cache there (file {absent})" in line and "build-cache" in line
    assert not absent.exists()  # nothing written under read-only or a refusal
    # the default place, never built: no warning (a model without a cache is the usual case)
    result = cli.invoke(app, ["run", str(toy), "--prompt-ids", "1,2,3", "--tokens", "2"])
    assert result.exit_code == EXIT_OK and "warning" not in result.stderr, result.stderr


def test_missing_prepared_runtime_is_a_clear_error(toy, monkeypatch):
    # A build without core/runtime/session.py: None in sys.modules makes its import fail.
    monkeypatch.setitem(sys.modules, "onnx_prep.core.runtime.session", None)
    line = _error([str(toy)])
    assert "prepared runtime" in line and "--runtime ort" in line


@needs_session
def test_bad_huge_pages_setting_is_one_line(toy, monkeypatch):
    monkeypatch.setenv("ONNX_PREP_HUGE_PAGES", "on")
    line = _error([str(toy), "--prompt-ids", "1,2", "--tokens", "2"])
    assert "ONNX_PREP_HUGE_PAGES='on' is not a valid setting" in line and "=1" in line


@needs_session
def test_bad_spin_helpers_setting_is_one_line(toy, monkeypatch):
    monkeypatch.setenv("ONNX_PREP_SPIN_HELPERS", "yes")
    line = _error([str(toy), "--prompt-ids", "1,2", "--tokens", "2"])
    assert "ONNX_PREP_SPIN_HELPERS='yes' is not a valid setting" in line and "=0" in line


@needs_session
def test_bad_weight_streaming_setting_is_one_line(toy):
    """Read once a process, when its first session opens: a fresh process says it."""
    import os
    import subprocess

    code = "import sys; from onnx_prep.cli.app import entry; sys.argv[0] = 'onnx-prep'; entry()"
    env = dict(os.environ, ONNX_PREP_WEIGHT_STREAMING="auto")
    out = subprocess.run([sys.executable, "-c", code, "run", str(toy), "--prompt-ids", "1,2", "--tokens", "2"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == EXIT_UNUSABLE, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "ONNX_PREP_WEIGHT_STREAMING='auto' is not a valid setting" in lines[0], out.stderr


@needs_session
def test_spin_helpers_off_gives_the_same_tokens(toy, monkeypatch):
    runs = []
    for value in ("0", "1"):
        monkeypatch.setenv("ONNX_PREP_SPIN_HELPERS", value)
        result = cli.invoke(app, ["run", str(toy), "--prompt-ids", "1,2,3", "--tokens", "6", "--json"])
        assert result.exit_code == EXIT_OK, result.output
        runs.append(json.loads(result.stdout)["tokens"])
    assert runs[0] == runs[1]


def test_progress_bar_draws_on_stderr_for_long_runs(toy, monkeypatch):
    term = Console(file=_io.StringIO(), force_terminal=True, width=100)
    monkeypatch.setattr(output, "stderr", term)
    result = cli.invoke(app, ["run", str(toy), "--runtime", "ort", "--tokens", "8", "--json"])
    assert result.exit_code == EXIT_OK, result.output
    json.loads(result.stdout)  # the bar never reaches stdout
    assert "ort decode" in term.file.getvalue() and "8/8" in term.file.getvalue()
    term.file.seek(0), term.file.truncate()
    cli.invoke(app, ["run", str(toy), "--runtime", "ort", "--tokens", str(run_cmd.PROGRESS_MIN_TOKENS - 1)])
    assert "ort decode" not in term.file.getvalue()


# -- --compare ort


@needs_session
def test_compare_identical_when_the_runtime_matches_ort(toy):
    # The real prepared runtime against ONNX Runtime on the toy (no near ties: its
    # top-2 margins are far above fp32 reassociation): identical tokens, close logits.
    doc = _json([str(toy), "--compare", "ort", "--tokens", "6", "--batch", "2"])
    cmp = doc["compare"]
    assert doc["runtime"] == "prepared" and cmp["runtime"] == "ort"
    assert cmp["identical"] and cmp["agrees"] and cmp["tokens"] == doc["tokens"]
    assert cmp["first_divergence_step"] is None and cmp["first_step_max_abs_logit_diff"] < 1e-4
    ref = greedy_decode(OrtRunner(toy, threads=1), DecoderIO.from_model(toy), np.array(doc["prompt_ids"]), 6)
    assert cmp["tokens"] == ref.tokens.tolist()  # what ONNX Runtime decodes by itself
    text = cli.invoke(app, ["run", str(toy), "--compare", "ort", "--tokens", "6"])
    assert text.exit_code == EXIT_OK and "ort: tokens identical" in text.stdout


def test_compare_reports_a_real_divergence_with_exit_1(tmp_path, toy, monkeypatch):
    # Same I/O, other weights: the "runtime" is wrong on purpose.
    other = build_toy_decoder(tmp_path / "other.onnx", layout="bshd", kv_names="flat", seed=1)
    monkeypatch.setattr(run_record, "open_prepared_runner", lambda resolved, threads, source_pages, **kw: OrtRunner(other))
    result = cli.invoke(app, ["run", str(toy), "--compare", "ort", "--tokens", "4", "--json"])
    assert result.exit_code == EXIT_FINDINGS, result.output
    cmp = json.loads(result.stdout)["compare"]
    assert not cmp["identical"] and not cmp["near_tie"] and cmp["first_divergence_step"] == 0
    assert cmp["first_step_max_abs_logit_diff"] > 1e-2
    text = cli.invoke(app, ["run", str(toy), "--compare", "ort", "--tokens", "4"])
    assert text.exit_code == EXIT_FINDINGS and "DIVERGED at step 0" in text.stdout
    assert "ort row 0:" in text.stdout


# -- the prepared runtime (skipped until core/runtime/session.py lands)


@needs_session
def test_prepared_runtime_matches_ort_on_the_fixture(small_llm_path):
    doc = _json([str(small_llm_path), "--compare", "ort", "--prompt-ids", "1,2,3,4,5", "--tokens", "32",
                 "--batch", "4"])
    assert doc["runtime"] == "prepared" and doc["compare"]["agrees"]
    assert doc["compare"]["first_step_max_abs_logit_diff"] <= 1e-5 * doc["compare"]["first_step_logit_range"]
    assert all(row == doc["tokens"][0] for row in doc["tokens"])
    # KV cache: the prefill makes one buffer per K/V Concat (2 blocks), sized for the
    # whole decode, and each of the 31 decode steps appends in place; no matmul of this
    # small model reaches intra_op.MIN_SPLIT_WORK, so no matmul splits. Its attention,
    # once the 4 rows' caches pass intra_op.MIN_ATTENTION_SPLIT_BYTES, shares its units
    # with lent helpers: how many chunks they took is timing's
    c = doc["counters"]
    assert {k: c[k] for k in ("kv_appended_in_place", "kv_copied", "matmul_splits")} == {
        "kv_appended_in_place": 31 * 2 * 2, "kv_copied": 2 * 2, "matmul_splits": 0}
    assert c["chunks_by_helpers"] >= 0 and c["helper_wakes"] <= c["helper_sleeps"]
    # what its GEMVs did with their weights on this machine, and why (weight_streaming.py)
    from onnx_prep.core.ops.weight_streaming import choice

    assert doc["weight_streaming"] == choice().as_dict()


@needs_session
def test_prepared_runtime_counts_its_intra_op_splits(tiny_llm_path):
    import os

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: the runtime splits no matmul")
    doc = _json([str(tiny_llm_path), "--prompt-ids", "1,2,3,4,5,6,7,8", "--tokens", "3"])
    c = doc["counters"]
    # Whether a matmul splits depends only on its packed bytes and rows
    # (intra_op.worth_splitting), so the count is exact: 15 for this prompt and length.
    # Which chunks the lent helpers take, and whether they slept, depends on timing:
    # those three are only bounded by what the run could have handed over.
    assert c["matmul_splits"] == 15
    assert all(isinstance(c[k], int) and c[k] >= 0 for k in ("chunks_by_helpers", "helper_sleeps", "helper_wakes"))
    assert c["helper_wakes"] <= c["helper_sleeps"]  # only a sleeping helper can be woken


@needs_session
def test_threads_bounds_the_threads_that_compute_one_op(tiny_llm_path):
    """``--threads N`` counts the calling thread, as ONNX Runtime's intra-op threads do:
    with 1 no matmul splits (it once still split in two: the caller plus one worker);
    with 2 the same 15 splits as the default on a 2-core machine, each in two parts."""
    import os

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: the runtime splits no matmul whatever --threads says")
    args = [str(tiny_llm_path), "--prompt-ids", "1,2,3,4,5,6,7,8", "--tokens", "3"]
    one = _json([*args, "--threads", "1"])
    two = _json([*args, "--threads", "2"])
    assert one["counters"]["matmul_splits"] == 0 and one["counters"]["chunks_by_helpers"] == 0
    assert two["counters"]["matmul_splits"] == 15
    assert one["tokens"] == two["tokens"]  # a split column is computed as in a whole call


@needs_session
@pytest.mark.parametrize("kw", [
    dict(), dict(kv_names="dot", kv_dtype=10),
    dict(kv_names="underscore", extras=("seqlens_k", "total_sequence_length", "cache_position")),
    dict(layers=0),
], ids=["hf-bhsd", "dot-fp16", "gqa-extras", "no-kv"])
def test_prepared_runtime_matches_ort_on_toy_conventions(tmp_path, kw):
    path = build_toy_decoder(tmp_path / "m.onnx", **kw)
    doc = _json([str(path), "--compare", "ort", "--tokens", "10", "--batch", "2"])
    assert doc["compare"]["identical"], doc["compare"]


@needs_session
def test_prepared_runtime_text_output(toy):
    result = cli.invoke(app, ["run", str(toy), "--tokens", "4"])
    assert result.exit_code == EXIT_OK, result.output
    assert "runtime prepared" in result.stdout and "row 0:" in result.stdout


# -- the model is parsed once per run

# ``main()`` of the console script in a fresh interpreter whose audit hook counts the
# opens of the model file (sys.argv[1]); ONNX Runtime reads it in C++, unseen.
COUNT_OPENS = """
import os, sys
model = os.path.realpath(sys.argv[1])
opens = []
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) and os.path.realpath(args[0]) == model:
        opens.append(event)
sys.addaudithook(hook)
sys.argv = ["onnx-prep", "run", *sys.argv[1:]]
from onnx_prep.cli.app import main
try:
    main()
finally:
    sys.stderr.write(f"\\nmodel opens: {len(opens)}\\n")
"""


@pytest.mark.parametrize("args", [["--compare", "ort"], ["--runtime", "ort"]], ids=["prepared+ort", "ort"])
def test_run_parses_the_model_once(small_llm_path, args):
    import subprocess

    p = subprocess.run([sys.executable, "-c", COUNT_OPENS, str(small_llm_path), *args, "--tokens", "2", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == EXIT_OK, p.stderr
    assert p.stderr.strip().splitlines()[-1] == "model opens: 1"
    doc = json.loads(p.stdout)
    assert doc["tokens"] and (doc["compare"] is None or doc["compare"]["identical"])
