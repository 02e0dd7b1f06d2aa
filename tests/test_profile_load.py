"""``onnx-prep profile`` (the load): the trace is the session's own timeline (one slice
per executed task, tracks that never overlap), the record validates against its schema
with one sample per repeat and configuration, a cached load reads no source byte of a
packed weight, a first build never touches the model's cache, --cold says whether its
drop took, and bad options are one line with exit 2. Real models, real processes."""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from types import SimpleNamespace

import pytest

from tests.conftest import ort_or_skip

# a private copy of the small model (a cache may be built beside it), the CLI as users run it
from tests.test_cli_build_cache import cli, model, schema  # noqa: E402,F401 - model is a fixture


def _slices(doc: dict, cat: str) -> list[dict]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and e.get("cat") == cat]


@pytest.mark.parametrize("mode", ["parallel", "sequential"])
def test_the_trace_draws_the_sessions_timeline(small_llm_path, tmp_path, mode):
    from onnx_prep.core.profile.chrome_trace import RESOURCE_PIDS, trace_document
    from onnx_prep.core.profile.load_sample import LoadSpec, measure_load

    out = tmp_path / "trace.json"
    m = measure_load(LoadSpec(model=str(small_llm_path), mode=mode, trace=str(out)))
    doc = json.loads(out.read_text())  # the file written is valid JSON, and is the document
    assert doc == json.loads(json.dumps(trace_document(m, label=f"{mode}/disabled")))
    ran = [e for e in m.events if e.start_ns is not None]
    tasks = _slices(doc, "task")
    # one X slice per executed task, named by its id, on its resource's process and its worker's track
    assert Counter(s["name"] for s in tasks) == Counter(e.name for e in ran)
    assert len(tasks) == m.sample["executed_tasks"] == len(ran)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    placed = {(s["name"], round(s["ts"], 3)): s for s in tasks}
    for e in ran:
        s = placed[(e.name, round((e.start_ns - m.base_ns) / 1e3, 3))]
        assert s["dur"] == pytest.approx((e.end_ns - e.start_ns) / 1e3, abs=1e-3)
        assert s["pid"] == RESOURCE_PIDS[e.resource.value] and threads[(s["pid"], s["tid"])] == e.worker
        assert s["args"]["kind"] == e.kind.value
        desc = m.plan.by_id.get(e.name)
        if desc is not None:  # a session task: its plan descriptor's scope, key and bytes
            assert (s["args"]["scope"], s["args"]["key"], s["args"]["bytes"]) == \
                (desc.scope.value, desc.publishes, desc.estimated_output_bytes)
    # every invocation step of the first forward, once
    steps = _slices(doc, "step")
    assert sorted(s["args"]["step"] for s in steps) == list(range(len(m.plan.steps)))
    # slices on one track never overlap
    tracks = defaultdict(list)
    for s in tasks + steps:
        tracks[(s["pid"], s["tid"])].append((s["ts"], s["ts"] + s["dur"]))
    for spans in tracks.values():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start >= end - 1e-3
    if mode == "sequential":  # one worker ran everything
        assert len({threads[k] for k in tracks}) == 1 and m.sample["overlap"] == 0.0
    # every flow starts and finishes once; names of processes; a counter per arena
    flows = Counter((e["ph"], e["id"]) for e in doc["traceEvents"] if e["ph"] in ("s", "f"))
    assert flows and all(n == 1 for n in flows.values())
    assert {i for ph, i in flows if ph == "s"} == {i for ph, i in flows if ph == "f"}
    procs = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert {"load", "run steps", "io", "cpu"} <= procs
    counters = {e["name"] for e in doc["traceEvents"] if e["ph"] == "C"}
    assert counters == {f"{a} arena bytes" for a in ("preparation", "prepared", "execution", "io")}
    peak = max(e["args"]["bytes"] for e in doc["traceEvents"] if e["ph"] == "C" and e["name"] == "prepared arena bytes")
    assert peak == m.sample["peak_prepared_bytes"]
    marks = {e["name"] for e in doc["traceEvents"] if e["ph"] == "i"}
    assert marks == {"first step", "first output", "all ready"}


def test_overlap_is_the_read_time_under_cpu_work():
    from onnx_prep.core.plan.task import ResourceClass, TaskKind
    from onnx_prep.core.profile.load_sample import overlap

    def ev(kind, resource, start, end):
        return SimpleNamespace(kind=kind, resource=resource, start_ns=start, end_ns=end)

    read, pack = (TaskKind.READ_SOURCE, ResourceClass.IO), (TaskKind.PREPACK, ResourceClass.CPU)
    # reads [0,10) and [5,20) -> union [0,20); CPU [8,12) and [15,30) -> covers 4 + 5 of it
    events = [ev(*read, 0, 10), ev(*read, 5, 20), ev(*pack, 8, 12), ev(*pack, 15, 30)]
    assert overlap(events) == pytest.approx(9 / 20)
    assert overlap([ev(*pack, 0, 5)]) is None  # no reads: nothing to hide
    assert overlap([ev(*read, 0, 5), ev(*pack, 5, 9)]) == 0.0  # back to back: none hidden


def test_both_modes_two_repeats_validate_and_trace(model, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    trace = tmp_path / "load.json"
    doc = json.loads(cli("profile", model, "--mode", "both", "--repeat", "2", "--cache-policy", "disabled",
                         "--json", "--trace", trace).stdout)
    jsonschema.validate(doc, schema("profile-load"))
    assert [c["name"] for c in doc["configurations"]] == ["parallel/disabled", "sequential/disabled"]
    for c in doc["configurations"]:
        assert len(c["samples"]) == 2  # two samples per figure, each from a fresh process
        assert all(set(s) == set(c["summary"]) for s in c["samples"])
        assert c["summary"]["first_output_ms"]["min"] <= c["summary"]["first_output_ms"]["max"]
    par, seq = (c["samples"] for c in doc["configurations"])
    # the same task set both ways
    assert {s["session_tasks"] for s in par} == {s["session_tasks"] for s in seq}
    assert {s["source_bytes"] for s in par} == {s["source_bytes"] for s in seq}
    assert all(s["overlap"] == 0.0 for s in seq)
    assert {r["figure"] for r in doc["ratios"]} >= {"first_output_ms", "all_ready_ms"}
    assert doc["trace"] == {"path": str(trace), "configuration": "parallel/disabled"}
    events = json.loads(trace.read_text())["traceEvents"]
    assert len([e for e in events if e["ph"] == "X" and e["cat"] == "task"]) >= par[0]["session_tasks"]
    # the table names every figure, every configuration, and the ratio
    text = cli("profile", model, "--mode", "both", "--repeat", "1", "--cache-policy", "disabled")
    for word in ("first_output_ms", "overlap", "parallel/disabled", "sequential/disabled", "sequential / parallel"):
        assert word in text.stdout


def test_a_cached_load_reads_no_source_byte_of_a_packed_weight(model):
    from onnx_prep.core.cache.cache_build import build_prepared_cache
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.core.plan.execution_plan import RAW_LAYOUT, build_prepared_execution_plan
    from onnx_prep.core.profile.load_profile import LoadProfileOptions, profile_load

    build_prepared_cache(model)
    manifest = model.parent / f"{model.stem}.prepared.onnx"
    before = sorted((p.name, p.stat().st_mtime_ns) for p in model.parent.iterdir())
    doc = profile_load(model, LoadProfileOptions(cache_policies=("disabled", "read-only", "build-if-missing"),
                                                 repeat=1))
    by = {c["cache_policy"]: c["samples"][0] for c in doc["configurations"]}
    resolved = resolve_model(model)
    # the weights the runtime uses as they are (norms, rotary): no cache entry, read from source
    raw = {r.request.logical_value for r in build_prepared_execution_plan(resolved).requirements
           if r.request.layout == RAW_LAYOUT}
    raw_bytes = sum(w.length for n, w in resolved.weights.items() if w.external and n in raw)
    assert 0 < raw_bytes
    cached, none, first = by["read-only"], by["disabled"], by["build-if-missing"]
    assert cached["prepacks"] == 0 and cached["packed_reads"] > 0 and cached["packed_bytes"] > 0
    assert cached["source_bytes"] == raw_bytes < none["source_bytes"]  # only weights used as they are
    assert none["packed_bytes"] == 0 and none["prepacks"] > 0
    # a first build packs everything from sources, into a cache folder of its own
    assert first["prepacks"] == none["prepacks"] and first["source_bytes"] == none["source_bytes"]
    assert first["cache_commit_ms"] > 0 and cached["cache_commit_ms"] is None is none["cache_commit_ms"]
    assert sorted((p.name, p.stat().st_mtime_ns) for p in model.parent.iterdir()) == before
    assert doc["configurations"][1]["cache"]["path"] == str(manifest)


def test_cold_says_whether_the_drop_took(model):
    from onnx_prep.core.profile.load_profile import LoadProfileOptions, profile_load
    from onnx_prep.core.profile.page_cache import drop_files, resident_bytes

    data = model.with_name(model.name + ".data")
    data.read_bytes()
    assert resident_bytes(data) == data.stat().st_size  # just read: all of it resident
    got = drop_files([data])
    assert got["files"] == 1 and got["bytes"] == data.stat().st_size
    assert got["resident_after"] == resident_bytes(data) and got["dropped"] == (got["resident_after"] == 0)
    doc = profile_load(model, LoadProfileOptions(cache_policies=("disabled",), repeat=1, cold=True))
    pc = doc["configurations"][0]["page_cache"]
    assert pc["cold"] is True and pc["drops"] == 1 and pc["all_dropped"] is not None


def test_compare_ort_side_by_side(model):
    ort_or_skip()
    from onnx_prep.core.profile.load_profile import LoadProfileOptions, profile_load

    jsonschema = pytest.importorskip("jsonschema")
    doc = profile_load(model, LoadProfileOptions(cache_policies=("disabled",), repeat=1, compare="ort"))
    jsonschema.validate(doc, schema("profile-load"))
    cmp = doc["compare"]
    assert len(cmp["samples"]) == 1
    s = cmp["samples"][0]
    assert s["first_output_ms"] == pytest.approx(s["create_ms"] + s["first_run_ms"])
    assert s["decode_ms_per_token"] > 0
    ours = doc["configurations"][0]["summary"]["open_to_first_output_ms"]["median"]
    assert cmp["open_to_first_output_over_ort"]["parallel/disabled"] == \
        pytest.approx(ours / cmp["summary"]["first_output_ms"]["median"])


@pytest.mark.parametrize("args, needle", [
    (["--mode", "fast"], "--mode"),
    (["--repeat", "0"], "--repeat"),
    (["--cache-policy", "sometimes"], "--cache-policy"),
    (["--cache-policy", "disabled,disabled"], "twice"),
    (["--compare", "tvm"], "--compare"),
    (["--trace", "/no/such/folder/t.json"], "--trace"),
    (["--trace", "/proc/version"], "cannot write the trace"),
    (["--cache-policy", "require-complete"], "no prepared cache there"),
    (["--cache-policy", "build-if-missing", "--no-verify-digests"], "verified"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_bad_options_exit_2_in_one_line(model, args, needle):
    p = cli("profile", model, *args, ok=False)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], p.stderr
    assert p.stdout == ""


# ------------------------------------------------------------- profile of any model
@pytest.fixture(scope="module")
def mlp_model(tmp_path_factory):
    from tests.test_run_any_model import build_mlp

    return build_mlp(tmp_path_factory.mktemp("profile-mlp"))


def test_a_model_that_is_no_decoder_loads_to_one_forward(mlp_model):
    """Not a decoder: the load runs to one forward of the graph on run's generated inputs
    (the symbolic batch bound by --shape), and ONNX Runtime gets the same feeds, once,
    with no decode tokens. A decoder's record says it decodes its fixed prompt."""
    ort_or_skip()
    jsonschema = pytest.importorskip("jsonschema")
    doc = json.loads(cli("profile", mlp_model, "--repeat", "1", "--shape", "batch=3", "--compare", "ort",
                         "--cache-policy", "disabled", "--json").stdout)
    jsonschema.validate(doc, schema("profile-load"))
    assert doc["kind"]["kind"] == "graph" and "not a decoder" in doc["kind"]["reason"]
    assert doc["prompt_ids"] is None
    assert [(i["name"], i["shape"], i["source"]) for i in doc["inputs"]] == \
        [("input", [3, 16], "generated"), ("gain", [1], "generated")]
    s = doc["configurations"][0]["samples"][0]
    assert s["prepacks"] >= 1 and s["first_output_ms"] > 0  # the INT4 weight was packed, the forward ran
    cmp = doc["compare"]
    assert cmp["decode_tokens"] == 0 and cmp["samples"][0]["decode_ms_per_token"] is None
    assert cmp["samples"][0]["first_run_ms"] > 0
    text = cli("profile", mlp_model, "--repeat", "1", "--shape", "batch=3", "--cache-policy", "disabled").stdout
    assert "one forward (not a decoder" in text and "input float32 [3, 16] generated" in text


def test_inputs_from_a_file_feed_the_forward(mlp_model, tmp_path):
    import numpy as np

    jsonschema = pytest.importorskip("jsonschema")
    feeds = tmp_path / "feeds.npz"
    np.savez(feeds, input=np.ones((2, 16), np.float32), gain=np.full(1, 2.0, np.float32))
    doc = json.loads(cli("profile", mlp_model, "--repeat", "1", "--inputs", feeds, "--cache-policy", "disabled",
                         "--json").stdout)
    jsonschema.validate(doc, schema("profile-load"))
    assert [(i["name"], i["shape"], i["source"]) for i in doc["inputs"]] == \
        [("input", [2, 16], str(feeds)), ("gain", [1], str(feeds))]


def test_a_decoders_record_names_its_prompt(model):
    doc = json.loads(cli("profile", model, "--repeat", "1", "--cache-policy", "disabled", "--json").stdout)
    assert doc["kind"]["kind"] == "decoder" and doc["prompt_ids"] == list(range(1, 9)) and doc["inputs"] is None


@pytest.mark.parametrize("args, needle", [
    ([], "dim 0 is the symbolic 'batch', which --shape does not bind"),
    (["--shape", "seq=4"], "--shape binds 'seq', which is no symbolic dim"),
    (["--batch-sweep", "1,2"], "--batch-sweep decodes a decoder LLM; this model is not a decoder"),
    (["--batch-sweep", "1,2", "--shape", "batch=1"], "--inputs and --shape feed one forward of the load"),
], ids=["unbound dim", "unknown dim", "sweep", "sweep with shape"])
def test_what_one_forward_cannot_run_exits_2_in_one_line(mlp_model, args, needle):
    p = cli("profile", mlp_model, "--repeat", "1", *args, ok=False)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], p.stderr
    assert p.stdout == ""


def test_no_fuse_loads_the_graph_as_written(model):
    """--no-fuse reaches the load: the unfused graph keeps the RMSNorm / rotary chains, so
    the plan it executes has the same weights (same session tasks and source bytes) and
    the record says fuse false; plan-dump --no-fuse plans more actions (graph nodes) into
    the same invocation steps."""
    jsonschema = pytest.importorskip("jsonschema")
    docs = {f: json.loads(cli("profile", model, "--repeat", "1", "--cache-policy", "disabled", "--json",
                              *([] if f else ["--no-fuse"])).stdout) for f in (True, False)}
    for f, doc in docs.items():
        jsonschema.validate(doc, schema("profile-load"))
        assert doc["fuse"] is f
    fused, unfused = (docs[f]["configurations"][0]["samples"][0] for f in (True, False))
    assert fused["source_bytes"] == unfused["source_bytes"] and fused["prepacks"] == unfused["prepacks"]
    plans = {f: json.loads(cli("plan-dump", model, "--json", "--cache-policy", "disabled",
                               *([] if f else ["--no-fuse"])).stdout) for f in (True, False)}
    actions = {f: plans[f]["steps"][-1]["actions"][1] for f in plans}  # the last step's end: all actions
    assert [s["task"] for s in plans[True]["steps"]] == [s["task"] for s in plans[False]["steps"]]
    assert actions[True] < actions[False]
