"""The batch sweep through the real runtime on the small fixture: under a budget of half
the packed size the bytes paged per emitted token fall as 1/N and the counters repeat
exactly; with an ample budget nothing is paged in after the prefill; row 0 of every
batch decodes what batch 1 does; every output format parses."""
from __future__ import annotations

import csv
import io
import json
from importlib import resources

import pytest

from onnx_prep.core.errors import UsageError
from onnx_prep.core.profile import sweep_report
from onnx_prep.core.profile.batch_sweep import SweepOptions, parse_budget, record_batch_sweep


@pytest.fixture(scope="module")
def streaming(small_llm_path):
    return record_batch_sweep(small_llm_path, SweepOptions(batches=(1, 2, 4, 8), tokens=5, budget="50%",
                                                           repeat=2, cache_policy="disabled"))


def test_bytes_paged_per_token_fall_as_one_over_n(streaming):
    rows = streaming["rows"]
    assert streaming["streaming"] and streaming["budget_bytes"] == streaming["packed_bytes"] // 2
    per_step = rows[0]["bytes_paged_per_token"] * rows[0]["batch"]
    assert per_step > 0
    for r in rows:
        ideal = per_step / r["batch"]
        assert abs(r["bytes_paged_per_token"] - ideal) <= 0.05 * ideal, (r["batch"], r["bytes_paged_per_token"], ideal)
        assert 0 < r["hit_rate"] < 1 and 0 < r["byte_hit_rate"] < 1 and r["evictions"] > 0


def test_counters_are_identical_across_repeats(streaming):
    assert all(r["counters_identical"] for r in streaming["rows"])


def test_the_budget_is_held(streaming):
    assert all(r["peak_prepared_bytes"] <= streaming["budget_bytes"] for r in streaming["rows"])


def test_row_zero_of_every_batch_decodes_what_batch_one_does(streaming):
    assert all(r["row_identity"] == {"identical": True, "first_divergence_step": None} for r in streaming["rows"])


def test_streaming_rows_carry_the_pipelining_figures(streaming):
    for r in streaming["rows"]:
        assert r["ample_step_ms"] > 0 and r["read_ms"] > 0
        assert r["pipelining"] == pytest.approx(r["step_ms"]["median"] / max(r["ample_step_ms"], r["read_ms"]))


def test_an_ample_budget_pages_nothing_in_after_the_prefill(small_llm_path):
    doc = record_batch_sweep(small_llm_path, SweepOptions(batches=(1, 2), tokens=4, budget="200%", repeat=1,
                                                          cache_policy="disabled"))
    assert not doc["streaming"]
    for r in doc["rows"]:
        assert r["page_ins"] == r["evictions"] == 0 and r["hit_rate"] == r["byte_hit_rate"] == 1.0
        assert r["pipelining"] is None


def test_from_the_cache_the_page_ins_read_packed_payloads(small_llm_path, tmp_path):
    import shutil

    from onnx_prep.core.cache.cache_build import build_prepared_cache

    m = tmp_path / "m"
    shutil.copytree(small_llm_path.parent, m)
    model = m / small_llm_path.name
    build_prepared_cache(model)
    cached = record_batch_sweep(model, SweepOptions(batches=(1, 2), tokens=4, budget="50%", repeat=2,
                                                    cache_policy="require-complete"))
    plain = record_batch_sweep(model, SweepOptions(batches=(1, 2), tokens=4, budget="50%", repeat=1,
                                                   cache_policy="disabled"))
    # the same objects are paged in either way; only where they come from differs (mapped
    # page-ins run two at a time on the mapped queue: the choices stay the plan's)
    for a, b in zip(cached["rows"], plain["rows"]):
        assert a["page_in_bytes"] == b["page_in_bytes"] and a["row_identity"]["identical"]
        assert (a["page_ins"], a["evictions"]) == (b["page_ins"], b["evictions"])
        assert a["counters_identical"] and a["peak_prepared_bytes"] <= cached["budget_bytes"]


def test_the_record_validates_and_every_format_parses(streaming, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(resources.files("onnx_prep.core").joinpath("schemas/batch-sweep.schema.json").read_text())
    jsonschema.validate(json.loads(json.dumps(streaming)), schema)
    lines = [json.loads(x) for x in sweep_report.as_jsonl(streaming).splitlines()]
    assert [x["batch"] for x in lines] == [1, 2, 4, 8] and all(x["budget"] == "50%" for x in lines)
    rows = list(csv.DictReader(io.StringIO(sweep_report.as_csv(streaming))))
    assert [int(r["batch"]) for r in rows] == [1, 2, 4, 8]
    assert list(rows[0]) == [c for c, _ in sweep_report.COLUMNS]
    md = sweep_report.as_markdown(streaming).splitlines()
    table = [x for x in md if x.startswith("|")]
    assert len(table) == 2 + 4 and all(x.count("|") == table[0].count("|") for x in table)


def test_the_plot_is_drawn(streaming, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install 'onnx-prep[plot]'): plot not drawn")
    for name in ("sweep.png", "sweep.svg"):
        sweep_report.plot(streaming, tmp_path / name)
        assert (tmp_path / name).stat().st_size > 1000
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in (tmp_path / "sweep.svg").read_bytes()[:2000]


@pytest.mark.parametrize("text,want", [("50%", 500), ("1000", 1000 << 20 if False else None), ("2MiB", 2 << 20)])
def test_budgets_parse(text, want):
    if want is None:
        with pytest.raises(UsageError):
            parse_budget(text, 1000)  # a bare number under 1 MiB is no budget
    else:
        assert parse_budget(text, 1000) == want


@pytest.mark.parametrize("options,needle", [
    (dict(batches=()), "1 to 16 batch sizes"),
    (dict(batches=(1, 1)), "repeat"),
    (dict(batches=(0,)), "--batch-sweep"),
    (dict(tokens=1), "--tokens"),
    (dict(cache_policy="build-if-missing"), "build it with onnx-prep build-cache"),
])
def test_bad_options_are_refused(options, needle):
    with pytest.raises(UsageError, match=needle):
        SweepOptions(**options)


def test_a_budget_below_the_largest_step_is_refused_before_anything_runs(small_llm_path):
    with pytest.raises(UsageError, match="below the largest step"):
        record_batch_sweep(small_llm_path, SweepOptions(batches=(1,), tokens=2, budget="1%", repeat=1))


# ------------------------------------------------------------------ the command

def _cli(*args):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).with_name("onnx-prep")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "onnx_prep"]
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, timeout=300)


def test_the_command_prints_each_format_and_draws_the_plot(small_llm_path, tmp_path):
    base = ["profile", small_llm_path, "--batch-sweep", "1,2", "--budget", "50%", "--tokens", "3",
            "--repeat", "1", "--cache-policy", "disabled"]
    outs = {}
    for fmt in ("json", "jsonl", "csv", "md", "table"):
        p = _cli(*base, "--format", fmt)
        assert p.returncode == 0, p.stderr
        outs[fmt] = p.stdout
    assert [r["batch"] for r in json.loads(outs["json"])["rows"]] == [1, 2]
    assert len(outs["jsonl"].splitlines()) == 2 and len(list(csv.DictReader(io.StringIO(outs["csv"])))) == 2
    assert outs["md"].count("\n|") == 4 and "weight streaming" in outs["table"]
    assert json.loads(_cli(*base, "--json").stdout)["schema"] == "onnx-prep.batch-sweep/2"
    pytest.importorskip("matplotlib", reason="matplotlib not installed: --plot not checked")
    p = _cli(*base, "--plot", tmp_path / "s.png")
    assert p.returncode == 0 and (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("extra,needle", [
    (["--batch-sweep", "1,x"], "comma-separated integers"),
    (["--batch-sweep", "1", "--format", "xml"], "--format must be one of"),
    (["--batch-sweep", "1", "--plot", "p.gif"], ".png or .svg"),
    (["--batch-sweep", "1", "--mode", "both"], "measures the decode"),
    (["--batch-sweep", "1", "--budget", "lots"], "--budget must be a size"),
    (["--batch-sweep", "1", "--cache-policy", "build-if-missing"], "build-cache"),
])
def test_bad_sweep_options_are_one_line_and_exit_2(small_llm_path, extra, needle):
    p = _cli("profile", small_llm_path, *extra)
    assert p.returncode == 2 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_missing_prepared_cache_is_said_once_however_many_samples(small_llm_path, tmp_path):
    # each sample opens the cache again: the warning is the command's, said once
    absent = tmp_path / "never-built.prepared.onnx"
    p = _cli("profile", small_llm_path, "--batch-sweep", "1,2", "--tokens", "3", "--repeat", "2",
             "--prepared", absent, "--json")
    assert p.returncode == 0, p.stderr
    warned = [ln for ln in p.stderr.splitlines() if ln.startswith("warning: ")]
    assert warned == [ln for ln in warned if f"no prepared cache at {absent}" in ln] and len(warned) == 1, p.stderr
    assert [r["batch"] for r in json.loads(p.stdout)["rows"]] == [1, 2] and not absent.exists()
