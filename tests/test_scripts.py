"""The benchmark scripts still run and their counters are consistent (smoke runs on the
small models; the timings themselves are not asserted: benchmarks are not timed tests)."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str], env_cache: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a script to its end. On a timeout (its own or the test's) the script is killed
    with every process it started (bench_kernels measures in worker processes), so a
    failed smoke run leaves nothing behind burning CPU."""
    env = dict(os.environ, ONNX_PREP_CACHE=str(env_cache))
    p = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _check_activity(a: dict, stdout: str) -> None:
    """Every benchmark reports what else ran on the machine while it measured."""
    assert "other work on the machine" in stdout
    if a["available"]:
        assert a["own_cpu_s"] > 0 and a["foreign_cpu_s"] >= 0 and a["steal_s"] >= 0


def test_bench_load_smoke(tmp_path):
    from onnx_prep.core.model.resolution import resolve_model

    out = tmp_path / "load.json"
    p = _run(["scripts/bench_load.py", "--preset", "tiny-llm", "--repeats", "2", "--hot-repeats", "2",
              "--warm-cache", "--json", str(out)], tmp_path / "cache")
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert doc["verify_digests"] is True  # the default, as the session's
    manifest = resolve_model(doc["model"]).manifest.total_bytes
    for mode in ("sequential", "init", "ttfo"):
        c = doc["counters"][mode]
        assert c["bytes_read"] + c["bytes_mapped"] == manifest  # every source byte once
        assert c["peak_prepared"] > 0 and c["max_in_flight"] >= c["peak_prepared"]
        assert c["session_tasks"] == doc["counters"]["sequential"]["session_tasks"]  # the same task set
    seq, ttfo = doc["samples"]["sequential"][0], doc["samples"]["ttfo"][0]
    assert seq["init_plus_run_ms"] >= seq["init_ms"] + seq["first_run_ms"] * 0.99  # run timed after init
    assert ttfo["first_output_ms"] >= ttfo["first_step_ms"]
    # the reads: every one ends inside its load (before the prepare that needs it returns)
    for mode, end in (("sequential", "init_ms"), ("init", "init_ms"), ("ttfo", "all_ready_ms")):
        x = doc["samples"][mode][0]
        assert 0 < x["read_tasks_ms"] and 0 < x["reads_end_ms"] <= x[end]
    assert "parallel init: its last read ends at" in p.stdout
    assert set(doc["ratios"]) == {"parallel_init_over_sequential", "ttfo_over_sequential_init_plus_run",
                                  "ttfo_over_longest_stage", "hot_overhead_median"}
    # Stages are measured in every repeat, and each paired ratio is that repeat's own.
    assert len(doc["stage_runs"]) == 2 and len(doc["ratios_paired_runs"]) == 2
    for i, (run, pr) in enumerate(zip(doc["stage_runs"], doc["ratios_paired_runs"])):
        ttfo_i = doc["samples"]["ttfo"][i]["first_output_ms"]
        assert pr["ttfo_over_longest_stage"] == pytest.approx(ttfo_i / max(run.values()))
    st = doc["ratios_paired"]["parallel_init_over_sequential"]
    assert st["min"] <= st["median"] <= st["max"]
    # slot warming: never in a sequential session, never once a run has started (ttfo)
    assert doc["slot_mib_warmed"]["sequential"]["max"] == 0 and doc["slot_mib_warmed"]["ttfo"]["max"] == 0
    assert doc["slot_mib_warmed"]["init"]["min"] >= 0
    _check_activity(doc["machine_activity"], p.stdout)
    # per mode, the free memory the VM handed back to its host around each load, where
    # the kernel reports it (a VM with free page reporting), else nothing
    reporting = os.path.exists("/sys/module/page_reporting/parameters/reported_kib")
    assert set(doc["host_returned_mib"]) == ({"sequential", "init", "ttfo"} if reporting else set())
    assert all(st["min"] >= 0 for st in doc["host_returned_mib"].values())
    assert ("handed back to its host since the previous load" in p.stdout) == reporting
    assert doc["source_pages"] == "keep" and all(doc["counters"][m]["bytes_dropped"] == 0 for m in doc["counters"])


def test_bench_load_without_digest_verification(tmp_path):
    """--verify-digests off: the other half of the pair that measures the check's cost."""
    out = tmp_path / "load.json"
    p = _run(["scripts/bench_load.py", "--preset", "tiny-llm", "--repeats", "1", "--hot-repeats", "2",
              "--warm-cache", "--verify-digests", "off", "--json", str(out)], tmp_path / "cache")
    assert p.returncode == 0, p.stderr
    assert json.loads(out.read_text())["verify_digests"] is False and "verify digests off" in p.stderr


def test_bench_load_cold_with_sources_dropped(tmp_path):
    """Cold page cache, --source-pages drop: every load drops every source once."""
    from onnx_prep.core.model.resolution import resolve_model

    out = tmp_path / "load.json"
    p = _run(["scripts/bench_load.py", "--preset", "tiny-llm", "--repeats", "1", "--hot-repeats", "2",
              "--source-pages", "drop", "--json", str(out)], tmp_path / "cache")
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    manifest = resolve_model(doc["model"]).manifest.total_bytes
    assert doc["source_pages"] == "drop" and not doc["warm_cache"]
    assert {m: c["bytes_dropped"] for m, c in doc["counters"].items()} == dict.fromkeys(doc["counters"], manifest)
    # a warm page cache cannot stay warm when every load drops it: refused, one line
    p = _run(["scripts/bench_load.py", "--preset", "tiny-llm", "--warm-cache", "--source-pages", "drop"],
             tmp_path / "cache")
    assert p.returncode == 2 and "every load would leave the file cold" in p.stderr.strip().splitlines()[-1]


def test_bench_resolve_smoke(tmp_path):
    from onnx_prep.core.model.resolution import resolve_model

    p = _run(["scripts/bench_resolve.py", "--models", "tiny-llm", "--repeats", "3", "--json"], tmp_path / "cache")
    assert p.returncode == 0, p.stderr
    (rec,) = json.loads(p.stdout)["records"]
    # the figure the benchmark exists for: three resolutions, no data file opened or
    # mapped (the script's audit hook counts both)
    assert rec["model"] == "tiny-llm" and rec["repeats"] == 3 and len(rec["samples_ms"]) == 3
    assert rec["data_file_opens"] == 0
    resolved = resolve_model(rec["path"])
    assert rec["payload_bytes"] == resolved.manifest.total_bytes > 0
    assert rec["nodes"] == resolved.stats.nodes_total


@pytest.mark.slow
def test_bench_kernels_smoke(tmp_path):
    p = _run(["scripts/bench_kernels.py", "--quick", "--no-numpy", "--shapes", "256x512", "--ms", "1",
              "--reps", "2"], tmp_path / "cache")
    assert p.returncode == 0, p.stderr
    assert "256x512" in p.stdout
    # the code the kernels report having run, not only the ISA asked for
    from onnx_prep import native
    from test_native_reference import expected_kernel
    want = {lv: expected_kernel(native.active_isa(), "int") for lv in (0, 1, 4)}
    assert "kernel code that ran: " + "; ".join(f"level {lv}: {k}" for lv, k in want.items()) in p.stdout
    assert p.stdout.count("other work on the machine") == 2  # one line per thread count
    # every streamed buffer (ours and the read probe) on 4 KiB pages: none on huge pages
    assert "4 KiB pages asked, 0 of " in p.stdout


def test_bench_intra_op_smoke(tmp_path):
    out = tmp_path / "intra.json"
    p = _run(["scripts/bench_intra_op.py", "--preset", "tiny-llm", "--repeats", "1", "--json", str(out)],
             tmp_path / "cache")
    assert p.returncode == 0, p.stderr  # includes the wake == spin == whole output check
    doc = json.loads(out.read_text())
    _check_activity(doc["machine_activity"], p.stdout)
    times = doc["times_ms"]
    assert set(times) == {f"{c}.{m}" for c in ("prefill8", "decode1") for m in ("whole", "wake", "spin")}
    assert all(len(v) == 1 and v[0] > 0 for v in times.values())


def test_bench_attention_smoke(tmp_path):
    out = tmp_path / "attention.json"
    p = _run(["scripts/bench_attention.py", "--pasts", "40", "300", "--reps", "3", "--warmup", "1",
              "--json", str(out)], tmp_path / "cache")
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    _check_activity(doc["machine_activity"], p.stdout)
    from onnx_prep import native
    # every ISA the CPU has ran under its own name (the kernel's report, not the request)
    assert set(doc["times_us"]) == {f"{i}.{past}" for i in native.available_isas() for past in (40, 300)}
    assert all(len(v) == 3 and min(v) > 0 for v in doc["times_us"].values())


def test_bench_decode_smoke(tmp_path):
    out = tmp_path / "decode.json"
    p = _run(["scripts/bench_decode.py", "--preset", "tiny-llm", "--tokens", "60", "--json", str(out)],
             tmp_path / "cache")
    assert p.returncode == 0, p.stderr
    assert "tokens and logits identical" in p.stdout
    doc = json.loads(out.read_text())
    _check_activity(doc["machine_activity"], p.stdout)
    kv = 2 * 4  # K and V Concats of the 4 blocks
    # the 8-token prefill makes one buffer per KV Concat with room for 64 more rows: the
    # 59 decode steps (past 8 -> 67) all append in place
    assert doc["counters"]["append"] == {"appended_in_place": 59 * kv, "copied": kv}
    assert doc["counters"]["copy"] == {"appended_in_place": 0, "copied": 0}
    # grow (no length announced): the 8 buffers get 50, 54, ..., 78 rows of room after the
    # prefill's 8 (append_buffer.room_after); the three with room for 58, 62 and 66 rows
    # run out before the past reaches 67, each once
    assert doc["counters"]["grow"] == {"appended_in_place": 59 * kv - 3, "copied": kv + 3}
    assert [len(run) for run in doc["step_ms"]["append"]] == [60, 60]
    assert [len(run) for run in doc["step_ms"]["grow"]] == [60, 60]


def test_bench_read_contention_smoke(tmp_path):
    out = tmp_path / "contention.json"
    p = _run(["scripts/bench_read_contention.py", "--preset", "tiny-llm", "--repeats", "2", "--json", str(out)],
             tmp_path / "cache")
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    _check_activity(doc["machine_activity"], p.stdout)
    cases = {"reads_alone", "reads_beside_cpu", "reads_beside_commits", "reads_and_commits_wall", "commits_alone"}
    assert set(doc["samples_ms"]) == cases
    assert all(len(v) == 2 and min(v) > 0 for v in doc["samples_ms"].values())
    # the overlapped wall time covers the reads measured inside it
    assert all(w >= r for w, r in zip(doc["samples_ms"]["reads_and_commits_wall"],
                                      doc["samples_ms"]["reads_beside_commits"]))


def test_profile_ops_smoke(tmp_path):
    p = _run(["scripts/profile_ops.py", "--preset", "tiny-llm", "--past", "4", "--repeats", "2", "--json"],
             tmp_path / "cache")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    ops = {row["op"]: row for row in doc["per_op"]}
    assert ops["MatMulNBits [int4_matmul]"]["count"] == 17  # 4 per block + the LM head
    # the rotary tables' concat (the rotate-half concats and the KV caches' are fused)
    assert ops["Concat [numpy]"]["count"] == 1
    assert ops["Attention [gqa]"]["count"] == 4  # one per block
    assert doc["actions"] == sum(row["count"] for row in doc["per_op"])
    assert abs(sum(row["share"] for row in doc["per_op"]) - 1.0) < 1e-3


def test_profile_ops_on_builder_export(tmp_path):
    """A genai builder export (symbolic KV head dims, attention mask, seqlens_k) is
    profiled with its inputs found as `run` finds them."""
    from conftest import real_export

    model = real_export("builder-qwen2-acc4-b32")
    p = _run(["scripts/profile_ops.py", "--model", str(model), "--past", "4", "--repeats", "2", "--json"],
             tmp_path / "cache")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    ops = {row["op"]: row for row in doc["per_op"]}
    assert ops["GroupQueryAttention [gqa]"]["count"] == 2  # one per block of the tiny Qwen2
    assert doc["model"] == str(model) and doc["actions"] == sum(row["count"] for row in doc["per_op"])


def test_bench_cache_smoke(tmp_path):
    """The prepared-cache benchmark runs end to end on the tiny model (--quick) and prints
    its tables and the issue's targets; what each load read is consistent."""
    out = tmp_path / "cache.json"
    p = _run(["scripts/bench_cache.py", "--quick", "--json", str(out)], tmp_path / "cache")
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert doc["repeats"] == 1 and doc["states"][0] == "warm"
    compiled = doc["bytecode"]["compiled"]  # the processes spawned read bytecode, as after pip install
    assert compiled["current"] == compiled["modules"] > 50 and "bytecode: onnx_prep" in p.stdout
    assert doc["states"] == (["warm", "cold"] if hasattr(os, "posix_fadvise") else ["warm"])
    for header in ("in-process load (ms)", "packed bytes read alone", "whole process", "zstd:",
                   "bytes on disk (allocated: st_blocks x 512):", "targets (ratios of medians in this run):"):
        assert header in p.stdout
    have_ort = importlib.util.find_spec("onnxruntime") is not None
    assert len(doc["targets"]) == 2 * len(doc["states"]) + 3 + 3 * have_ort
    for t in doc["targets"]:
        assert f"{'PASS' if t['pass'] else 'FAIL'}  {t['target']}: " in p.stdout
    sizes = doc["sizes"]
    for state in doc["states"]:
        loads = {c: xs[0] for c, xs in doc["in_process"][state].items()}
        assert set(loads) == {"none", "build", "cache", "cache-zstd"}
        # every packed object from the cache when it is complete, none when there is none
        assert loads["cache"]["packed_bytes"] == sizes["packed"]
        assert loads["cache-zstd"]["packed_bytes"] == sizes["zstd_stored"]
        assert loads["none"]["packed_bytes"] == loads["build"]["packed_bytes"] == 0
        assert loads["cache"]["source_bytes"] < loads["none"]["source_bytes"] == loads["build"]["source_bytes"]
        assert loads["build"]["persisted_ms"] >= loads["build"]["first_output_ms"] > 0
        # all-ready runs from the first run's start: the open comes before it
        assert all(x["open_ms"] > 0 and x["all_ready_ms"] > 0 for x in loads.values())
        assert all(x["first_output_ms"] > x["open_ms"] for x in loads.values())
        procs = doc["processes"][state]
        assert set(procs) == {"none", "none-unverified", "build", "cache"} | ({"ort", "ort-prepacked"} if have_ort else set())
        assert all(xs[0]["spawn_to_exit_ms"] > 0 and xs[0]["peak_rss_mib"] > 0 for xs in procs.values())
    assert 0 < doc["zstd"]["ratio"] < 1.5 and doc["zstd"]["decode_gbps"] > 0
    assert sizes["cache_disk"] >= sizes["packed"] > 0
    _check_activity(doc["machine_activity"], p.stdout)


def test_plot_trace_draws_a_real_trace(tmp_path, tiny_llm_path):
    """A trace written by ``profile --trace`` is drawn: one PNG, every worker's track in it
    (the script prints the path; matplotlib is in the test extra)."""
    pytest.importorskip("matplotlib", reason="plot_trace.py draws with matplotlib (the plot extra)")
    from test_cli_exit_codes import ONNX_PREP

    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    p = subprocess.run([*ONNX_PREP, "profile", str(tiny_llm_path), "--repeat", "1", "--cache-policy", "disabled",
                        "--trace", str(trace)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and trace.exists(), p.stderr
    p = _run(["scripts/plot_trace.py", str(trace), str(png), "--title", "tiny"], tmp_path / "cache")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_startup_profile_smoke(tmp_path, small_llm_path):
    """scripts/startup_profile.py times every phase of real `onnx-prep run` processes from a
    prepared cache it builds (not timed here): the phases are in order and sum to the total."""
    out = tmp_path / "startup.json"
    p = _run(["scripts/startup_profile.py", "--model", str(small_llm_path), "--spawns", "2", "--json", str(out)],
             tmp_path / "cache")
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert doc["argv"][:2] == ["run", str(small_llm_path)] and "--prepared" in doc["argv"]
    assert len(doc["samples"]) == 2
    for s in doc["samples"]:
        phases = {k: v for k, v in s.items() if k != "total"}
        assert all(v is not None and v >= 0 for v in phases.values()), s
        assert abs(sum(phases.values()) - s["total"]) < 1e-6 * s["total"] + 1e-3
    assert doc["imports_ms"]["total"] > 0 and {"numpy", "onnx", "onnx_prep"} <= set(doc["imports_ms"]["by_package"])
    for line in ("interpreter", "first output", "close", "exit", "total", "bytecode: onnx_prep", "imports (one"):
        assert line in p.stdout
    _check_activity(doc["machine_activity"], p.stdout)


def test_gpu_check_script_parses():
    """scripts/gpu_check.sh installs cuda-python, so it is not run here (docs/cuda.md): its
    shell and its embedded Python at least parse."""
    script = ROOT / "scripts" / "gpu_check.sh"
    p = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    text = script.read_text()
    python = text.split("<<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]
    compile(python, "gpu_check.sh (python)", "exec")
    assert "tests/test_cuda_" in text and "results.json" in python
    # the device sweep runs a GroupQueryAttention preset (the device keeps its KV and captures
    # its decode steps; a standard-op fixture's sweep shows captures 0), and the preset exists
    import re

    from onnx_prep.fixtures import PRESETS

    swept = re.findall(r'FixtureConfig\.preset\("([^"]+)"\)', text)
    assert swept == ["medium-gqa"] and PRESETS[swept[0]].attention == "gqa", swept


def test_gemv_step_profile_compares_weight_streaming(tmp_path):
    out = tmp_path / "gemv.json"
    p = _run(["scripts/gemv_step_profile.py", "--preset", "tiny-llm", "--compare", "streaming", "--batch", "2",
              "--tokens", "4", "--rounds", "2", "--json", str(out)], tmp_path / "cache")
    assert p.returncode == 0, p.stderr  # includes: both sessions' greedy tokens identical
    doc = json.loads(out.read_text())
    assert set(doc["steps"]) == set(doc["replay_ms"]) == {"stream", "no-stream"}
    assert doc["tokens"]["stream"] == doc["tokens"]["no-stream"] and doc["batch"] == 2
    assert len(doc["tokens"]["stream"]) == 2  # one row of tokens per batch row
    assert all(len(v) == 2 * 2 for steps in doc["steps"].values() for v in steps.values())
    assert "[no-stream]" in p.stdout


def test_gemv_step_profile_compares_panel_pairs(tmp_path):
    out = tmp_path / "gemv.json"
    p = _run(["scripts/gemv_step_profile.py", "--preset", "tiny-llm", "--compare", "panels",
              "--tokens", "4", "--rounds", "1", "--json", str(out)], tmp_path / "cache")
    assert p.returncode == 0, p.stderr  # includes: both sessions' greedy tokens identical
    doc = json.loads(out.read_text())
    assert set(doc["steps"]) == {"one-panel", "panel-pairs"}
    assert doc["tokens"]["one-panel"] == doc["tokens"]["panel-pairs"]


def test_gemv_step_profile_compares_kept_helpers(tmp_path):
    """Helpers lent and taken back at every run block threads at every step (5-17 a
    step measured); kept, the steps block few (0-2 on a quiet machine, 1-3 beside a CI
    run: a helper sleeps only after 5 ms without a batch)."""
    import statistics

    out = tmp_path / "gemv.json"
    p = _run(["scripts/gemv_step_profile.py", "--preset", "tiny-llm", "--split-all", "--compare", "helpers",
              "--tokens", "8", "--rounds", "2", "--json", str(out)], tmp_path / "cache")
    assert p.returncode == 0, p.stderr  # includes: both sessions' greedy tokens identical
    doc = json.loads(out.read_text())
    assert set(doc["steps"]) == {"per-run", "kept"}
    if max(doc["steps"]["per-run"]["helper_chunks"]) == 0:
        pytest.skip("no helper ran a chunk (no idle worker to lend on this machine)")
    kept, per_run = doc["steps"]["kept"]["switches"], doc["steps"]["per-run"]["switches"]
    assert 2 * statistics.median(kept) < statistics.median(per_run), (kept, per_run)


def test_gemv_step_profile_compares_fused_and_unfused(tmp_path):
    out = tmp_path / "gemv.json"
    p = _run(["scripts/gemv_step_profile.py", "--preset", "tiny-llm", "--compare", "fusion",
              "--tokens", "4", "--rounds", "1", "--json", str(out)], tmp_path / "cache")
    assert p.returncode == 0, p.stderr  # includes: both sessions' greedy tokens identical
    doc = json.loads(out.read_text())
    assert set(doc["steps"]) == {"unfused", "fused"}
    assert doc["tokens"]["unfused"] == doc["tokens"]["fused"]


@pytest.mark.parametrize("toggle", ["streaming", "panels", "attention-split"])
def test_ab_decode_step_alternates_in_one_session(tmp_path, toggle):
    out = tmp_path / "ab.json"
    p = _run(["scripts/ab_decode_step.py", "--toggle", toggle, "--preset", "tiny-llm", "--tokens", "6",
              "--rounds", "2", "--json", str(out)], tmp_path / "cache")
    assert p.returncode == 0, p.stderr  # includes: every round's tokens identical
    doc = json.loads(out.read_text())
    _check_activity(doc["machine_activity"], p.stdout)
    # 6 tokens: 6 runs a round (the prefill gives the first), runs 0-1 left out; runs
    # 2-3 with the setting off, 4-5 on (alternating every two)
    assert len(doc["steps_ms"]["on"]) == len(doc["steps_ms"]["off"]) == 2 * 2 and doc["toggle"] == toggle
    assert "median off / on" in p.stdout


def test_gemv_step_profile_smoke(tmp_path):
    import importlib.util

    out = tmp_path / "gemv.json"
    with_ort = importlib.util.find_spec("onnxruntime") is not None  # --ort-per-op's part is skipped without it
    p = _run(["scripts/gemv_step_profile.py", "--preset", "tiny-llm", "--split-all", "--compare", "huge-pages",
              "--tokens", "5", "--rounds", "2", "--per-op", *(["--ort-per-op"] if with_ort else []),
              "--json", str(out)], tmp_path / "cache")
    assert p.returncode == 0, p.stderr  # includes: both sessions' greedy tokens identical
    doc = json.loads(out.read_text())
    _check_activity(doc["machine_activity"], p.stdout)
    assert set(doc["steps"]) == set(doc["open_s"]) == set(doc["replay_ms"]) == {"4k", "huge"}
    for mode, steps in doc["steps"].items():
        assert doc["replay_ms"][mode] > 0 and doc["replayed_gemvs"][mode] == 17
        assert all(len(v) == 2 * 3 for v in steps.values())  # 2 rounds of 3 decode steps kept
        # --split-all: all 17 INT4 matmuls of a step (4 per block + the LM head) go
        # through the mailbox; every batch is the caller's alone or a helper took a chunk
        assert steps["batches"] == [17] * 6
        assert all(s <= b for s, b in zip(steps["solo"], steps["batches"]))
        assert all(h >= b - s for h, b, s in zip(steps["helper_chunks"], steps["batches"], steps["solo"]))
        assert all(w <= f + 1e-6 for w, f in zip(steps["wait_ms"], steps["fj_ms"]))
        assert all(isinstance(v, int) and v >= 0 for v in steps["switches"])  # getrusage counts, or 0
    # --per-op: one more decode, every action timed: 17 INT4 matmuls a step, slowest op first
    per_op = doc["per_op"]
    ops = {o["op"]: o for o in per_op["ops"]}
    assert per_op["steps"] == 3 and ops["MatMulNBits"]["count"] == 17 and ops["MatMulNBits"]["ms"] > 0
    assert [o["ms"] for o in per_op["ops"]] == sorted((o["ms"] for o in per_op["ops"]), reverse=True)
    assert "us each" in p.stdout
    # --ort-per-op: ONNX Runtime's profiler over the same 3 decode steps; its 17 INT4 matmuls
    # are MatMulNBits kernels too (the tiny fixture's are MatMulNBits nodes)
    ort = doc["ort_per_op"]
    if not with_ort:
        assert ort is None
        return
    ort_ops = {o["op"]: o for o in ort["ops"]}
    assert ort["steps"] == 3 and ort["run_ms"] > 0 and ort_ops["MatMulNBits"]["count"] == 17
    assert "ONNX Runtime, per op type, 3 decode steps" in p.stdout


def test_bench_gemv_bandwidth_smoke(tmp_path):
    out = tmp_path / "bw.json"
    p = _run(["scripts/bench_gemv_bandwidth.py", "--weights", "3", "--K", "256", "--N", "512", "--repeats", "2",
              "--json", str(out)], tmp_path / "cache")
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    _check_activity(doc["machine_activity"], p.stdout)
    assert set(doc["gb_per_s"]) == {"one thread", "two threads, no sync", "two, split as a step",
                                    "numpy sum, two threads"}
    assert all(len(v) == 2 and min(v) > 0 for v in doc["gb_per_s"].values())
    from onnx_prep import native

    one = native.matmul_nbits_packed_size(K=256, N=512, block_size=32, zero_points="none", accuracy_level=4)
    assert doc["packed_bytes"] == 3 * one  # the rates are of the packed bytes the GEMVs read
