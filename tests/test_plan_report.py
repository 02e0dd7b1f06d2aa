"""The plan report (``core/plan/plan_report.py``) of the tiny INT4 LLM: its tasks and
scopes, the tied embedding / LM head's one prepack, the cost model and critical path, the
filters, the JSON schema, the round trip against what a real Session executes, and the
Graphviz rendering parsed back."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import jsonschema
import numpy as np
import pytest

from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.decode.generation import step_feeds
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.plan.execution_plan import build_prepared_execution_plan
from onnx_prep.core.plan.plan_report import (
    RESOURCE_COLOURS,
    CostModel,
    plan_dot,
    plan_dump,
    plan_report,
    schema_path,
    task_from_json,
)
from onnx_prep.core.runtime.session import RuntimeContext, Session

TIED = "S.read_source:embed_tokens.weight_q4"
BLOCK0_PROJECTIONS = ("attn.qkv", "attn.out", "mlp.gate_up", "mlp.down")


@pytest.fixture(scope="module")
def plan(tiny_llm_path):
    return build_prepared_execution_plan(resolve_model(tiny_llm_path))


@pytest.fixture(scope="module")
def doc(tiny_llm_path):
    """The record as ``--format json`` prints it (through JSON and back)."""
    return json.loads(json.dumps(plan_dump(tiny_llm_path)))


def validate(record: dict) -> None:
    schema = json.loads(schema_path().read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(record, schema, cls=jsonschema.Draft202012Validator)


# ------------------------------------------------------------------------- content

def test_summary_counts_the_tiny_llm(doc, plan):
    s = doc["summary"]
    # 44 external weights, each read once (the embedding's own scales are not: the tied
    # table is read through the LM head's object); 17 INT4 prepared objects (4 blocks x
    # 4 projections, the LM head's, which the embedding gather reads too); one step per
    # consuming node
    assert s["tasks"] == 79 == len(doc["tasks"])
    assert s["by_scope"] == {"session": 61, "invocation": 18}
    assert s["by_kind"] == {"read_source": 44, "prepack": 17, "execute": 18}
    assert s["by_resource"] == {"io": 44, "cpu": 35}
    assert s["requirements"] == 27 and s["invocation_steps"] == 18
    manifest = plan.resolved.manifest
    assert s["bytes_to_read"] == {"source": manifest.total_bytes, "packed": 0}
    assert s["prepared_bytes"] == sum(r.packed_bytes for r in plan.requirements)
    assert s["lookahead"] == {"steps": plan.lookahead.steps, "bytes": plan.lookahead.bytes}
    assert s["filter"] == {"scope": None, "text": None, "shown": 79, "filtered_out": 0}
    assert s["recipes"] == {"read_packed_payload": 0, "read_source_and_prepack": 17, "read_source": 10}


def test_block0_reads_then_prepacks_each_weight(doc):
    """Block 0 reads like the design's table: per projection, two source reads (INT4
    codes and scales) on the I/O queue feeding one CPU prepack that publishes its key;
    the norm weights are raw reads that publish themselves; each step waits for the
    previous step and for the publishers of what it pins."""
    rows = {t["id"]: t for t in doc["tasks"]}
    for proj in BLOCK0_PROJECTIONS:
        codes, scales = (f"S.read_source:layers.0.{proj}.{n}" for n in ("weight_q4", "scales"))
        (prepack,) = [t for t in doc["tasks"] if t["kind"] == "prepack" and t["dependencies"] == [codes, scales]]
        assert prepack["scope"] == "session" and prepack["resource"] == "cpu"
        assert prepack["publishes"].startswith(f"P:layers.0.{proj}.weight_q4+layers.0.{proj}.scales|int4mm.")
        assert prepack["id"] == f"S.prepack:{prepack['publishes']}"
        assert prepack["estimated_bytes"] == rows[codes]["estimated_bytes"] + rows[scales]["estimated_bytes"]
        for read in (rows[codes], rows[scales]):
            assert (read["scope"], read["kind"], read["resource"], read["publishes"]) == (
                "session", "read_source", "io", None)
            assert read["index"] < prepack["index"]
    norm = rows["S.read_source:layers.0.input_norm.weight"]
    assert norm["publishes"] == "P:layers.0.input_norm.weight|raw|cpu" and norm["dependencies"] == []
    step = rows["I.1:layers.0.attn.qkv_proj"]
    assert step["scope"] == "invocation" and step["kind"] == "execute"
    assert step["dependencies"][0] == "I.0:embed_tokens"
    assert set(step["dependencies"][1:]) == {
        doc["requirements"][[r["key"] for r in doc["requirements"]].index(k)]["publisher"]
        for k in step["prepared_requirements"]}


def test_the_tied_source_is_read_once_for_one_prepack(doc):
    """The tied embedding / LM head: one read of the INT4 codes, a dependency of one
    prepack (the LM head's matmul layout, which the embedding reads too): no fan-out."""
    reads = [t for t in doc["tasks"] if t["id"] == TIED]
    assert len(reads) == 1
    [prepack] = [t for t in doc["tasks"] if TIED in t["dependencies"]]
    assert prepack["kind"] == "prepack"
    assert prepack["publishes"].split("|")[1].split(".")[0] == "int4mm"
    consumers = [t["label"] for t in doc["tasks"] if prepack["publishes"] in t["prepared_requirements"]]
    assert consumers == ["embed_tokens", "lm_head"]
    assert doc["summary"]["fan_out"] == []


# ------------------------------------------------------------- cost model, critical path

def test_critical_path_under_the_default_cost_model(doc, plan):
    """By hand: the longest chain reads the 2 MiB tied codes and packs embedding or LM
    head (2.5 MiB of source each), then runs through every step (execute costs 0)."""
    cp = doc["summary"]["critical_path"]
    cm = CostModel()
    assert cp["read_bytes"] == 2_097_152 and cp["prepack_bytes"] == 2_621_440
    assert cp["bytes"] == 2_097_152 + 2_621_440
    assert cp["estimated_ms"] == pytest.approx((2_097_152 / cm.io_bytes_per_s + 2_621_440 / cm.prepack_bytes_per_s) * 1e3,
                                               abs=1e-3)
    assert cp["tasks"][0] == TIED and cp["tasks"][-1] == plan.steps[-1].task_id
    rows = {t["id"]: t for t in doc["tasks"]}
    for before, after in zip(cp["tasks"], cp["tasks"][1:]):
        assert before in rows[after]["dependencies"]
    assert max(t["finish_ms"] for t in doc["tasks"]) == pytest.approx(cp["estimated_ms"], abs=1e-3)
    assert {t["id"] for t in doc["tasks"] if t["critical"]} == set(cp["tasks"])
    serial = doc["summary"]["serial_by_resource"]
    assert serial["io"]["bytes"] == doc["summary"]["bytes_to_read"]["source"]
    assert serial["io"]["serial_ms"] == pytest.approx(serial["io"]["bytes"] / cm.io_bytes_per_s * 1e3, abs=1e-3)


def test_a_slow_disk_moves_the_critical_path_to_the_largest_read(plan):
    """At 1 MB/s of reads and a near-free prepack, the path is the longest read chain:
    the tied 2 MiB codes (the largest read) and nothing slower than it."""
    cost = CostModel(io_bytes_per_s=1e6, prepack_bytes_per_s=1e15)
    cp = plan_report(plan, cost=cost)["summary"]["critical_path"]
    assert cp["tasks"][0] == TIED and cp["read_bytes"] == 2_097_152
    assert cp["estimated_ms"] == pytest.approx(2_097_152 / 1e6 * 1e3, rel=1e-6)
    with pytest.raises(ValueError):
        CostModel(io_bytes_per_s=0)


# ------------------------------------------------------------------------- filters

@pytest.mark.parametrize("scope,count", [("session", 61), ("invocation", 18)])
def test_scope_keeps_one_scope_and_says_how_many_left(plan, scope, count):
    rec = plan_report(plan, scope=scope)
    assert len(rec["tasks"]) == count and {t["scope"] for t in rec["tasks"]} == {scope}
    assert rec["summary"]["filter"] == {"scope": scope, "text": None, "shown": count, "filtered_out": 79 - count}
    assert rec["summary"]["tasks"] == 79  # the summary is of the whole plan
    validate(rec)


def test_text_filter_matches_ids_and_labels(plan):
    rec = plan_report(plan, text="layers.0.")
    ids = [t["id"] for t in rec["tasks"]]
    # 8 reads + 4 prepacks + 2 raw reads of block 0, and its 4 steps
    assert len(ids) == 18 and all("layers.0." in i for i in ids)
    assert rec["summary"]["filter"]["filtered_out"] == 61
    by_label = plan_report(plan, text="prepack embed_tokens")  # a label, not in any id
    assert [t["kind"] for t in by_label["tasks"]] == ["prepack"]
    assert plan_report(plan, text="no such task")["tasks"] == []
    with pytest.raises(ValueError):
        plan_report(plan, scope="bogus")


# ------------------------------------------------------------------- JSON and round trip

def test_record_validates_and_the_schema_is_closed(doc):
    validate(doc)
    bad = json.loads(json.dumps(doc))
    bad["tasks"][0]["surprise"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def test_json_tasks_rebuild_the_plan_exactly(doc, plan):
    assert tuple(task_from_json(t) for t in doc["tasks"]) == plan.tasks
    assert doc["requirements"] == [r.to_json() for r in plan.requirements]
    assert doc["steps"] == [s.to_json() for s in plan.steps]


@pytest.fixture(scope="module")
def cache_path(tiny_llm_path, tmp_path_factory):
    """A complete prepared cache of the tiny LLM, built by build-cache's core call into
    a folder of its own (the shared model's folder stays without one)."""
    from onnx_prep.core.cache.cache_build import build_prepared_cache

    path = tmp_path_factory.mktemp("prepared") / "tiny-llm.prepared.onnx"
    built = build_prepared_cache(tiny_llm_path, output=path)
    assert built["written"] == built["objects"] == 17
    return path


def opener(path):
    from onnx_prep.core.cache.prepared_cache import PreparedCache

    return lambda resolved: PreparedCache(resolved, path)


@pytest.fixture(scope="module")
def cached_doc(tiny_llm_path, cache_path):
    return json.loads(json.dumps(plan_dump(tiny_llm_path, open_cache=opener(cache_path))))


def test_with_a_complete_cache_one_read_packed_per_weight_publishing_the_same_key(doc, cached_doc):
    """Every prepack of the plain plan becomes one read of its packed payload, on the
    mapped queue (the cache maps it into its slot), with no dependencies, publishing the
    same key; the raw reads stay on the I/O queue; each step waits for the same keys,
    now from their packed reads."""
    validate(cached_doc)
    prepacks = [t for t in doc["tasks"] if t["kind"] == "prepack"]
    packed = [t for t in cached_doc["tasks"] if t["kind"] == "read_packed"]
    assert len(packed) == len(prepacks) == 17
    assert sorted(t["publishes"] for t in packed) == sorted(t["publishes"] for t in prepacks)
    for t in packed:
        assert t["id"] == f"S.read_packed:{t['publishes']}"
        assert (t["scope"], t["resource"], t["dependencies"]) == ("session", "mapped", [])
    raw = [t["id"] for t in doc["tasks"] if t["kind"] == "read_source" and t["publishes"]]
    assert [t["id"] for t in cached_doc["tasks"] if t["kind"] == "read_source"] == raw  # 10 raw reads
    assert {t["resource"] for t in cached_doc["tasks"] if t["kind"] == "read_source"} == {"io"}
    assert cached_doc["summary"]["by_resource"] == {"io": 10, "mapped": 17, "cpu": 18}
    assert not [t for t in cached_doc["tasks"] if t["kind"] == "prepack"]
    rename = {t["id"]: f"S.read_packed:{t['publishes']}" for t in prepacks}
    plain_steps = [t for t in doc["tasks"] if t["scope"] == "invocation"]
    cached_steps = [t for t in cached_doc["tasks"] if t["scope"] == "invocation"]
    assert [t["dependencies"] for t in cached_steps] == [[rename.get(d, d) for d in t["dependencies"]]
                                                          for t in plain_steps]
    s = cached_doc["summary"]
    assert s["recipes"] == {"read_packed_payload": 17, "read_source_and_prepack": 0, "read_source": 10}
    assert doc["summary"]["recipes"] == {"read_packed_payload": 0, "read_source_and_prepack": 17, "read_source": 10}
    assert s["bytes_to_read"]["packed"] == sum(t["estimated_bytes"] for t in packed)
    assert s["bytes_to_read"]["source"] == sum(t["estimated_bytes"] for t in cached_doc["tasks"]
                                               if t["kind"] == "read_source")
    assert s["by_kind"] == {"read_source": 10, "read_packed": 17, "execute": 18}
    for q in cached_doc["requirements"]:
        if q["selected"] != "read_source":
            assert q["selected"] == "read_packed_payload"
            assert [r["kind"] for r in q["recipes"]] == ["read_packed_payload", "read_source_and_prepack"]
            assert q["recipes"][0]["payload"]["mapped"] is True


@pytest.mark.parametrize("how", ["map-off", "zstd"])
def test_a_payload_read_into_fresh_pages_stays_on_the_io_queue(tiny_llm_path, cache_path, tmp_path,
                                                               monkeypatch, how):
    """Only a payload the cache maps runs on the mapped queue: with mapping switched off
    (ONNX_PREP_MAP_CACHE=0), or stored compressed, it is read (a storage read) on IO."""
    from onnx_prep.core.cache.cache_build import build_prepared_cache

    path = cache_path
    if how == "map-off":
        monkeypatch.setenv("ONNX_PREP_MAP_CACHE", "0")
    else:
        path = tmp_path / "tiny-llm.prepared.onnx"
        assert build_prepared_cache(tiny_llm_path, output=path, compress="zstd")["written"] == 17
    record = json.loads(json.dumps(plan_dump(tiny_llm_path, open_cache=opener(path))))
    validate(record)
    packed = [t for t in record["tasks"] if t["kind"] == "read_packed"]
    assert len(packed) == 17 and {t["resource"] for t in packed} == {"io"}
    assert record["summary"]["by_resource"] == {"io": 27, "cpu": 18}
    assert not [q for q in record["requirements"] if q["recipes"][0].get("payload", {}).get("mapped")]


@pytest.mark.parametrize("cached", [False, True], ids=["sources", "prepared-cache"])
def test_the_json_is_the_plan_a_session_executes(tiny_llm_path, doc, cached, request):
    """Run a real Session (a cold run, then prepare for whatever the run did not need)
    and read back what it executed: every session task once, by its plan id, kind and
    resource, on the dependencies the JSON lists (from the scheduler's handles); every
    step in plan order, pinning exactly the keys the JSON lists for it, whose publishers
    are its other dependencies. With the prepared cache, the same against the JSON
    planned with it."""
    r = resolve_model(tiny_llm_path)
    cache = opener(request.getfixturevalue("cache_path"))(r) if cached else None
    record = request.getfixturevalue("cached_doc") if cached else doc
    io = DecoderIO.discover(r.inputs, r.outputs)
    ids = np.array([[1, 2, 3]])
    pinned: dict[int, set] = {}
    try:
        with Session(r, cache=cache) as s:
            keys = [q.key for q in s.plan.requirements]

            def before_step(si: int) -> None:  # on the worker, the step's objects pinned
                pinned[si] = {k for k in keys if s.store.pins(k) > 0}

            ctx = RuntimeContext(step_feeds(io, ids, io.empty_past(1), 0), before_step=before_step)
            s.run_async(ctx).wait()
            s.prepare()
            assert s.scheduler.wait_idle(timeout=60)
            events = [e for e in s.timeline() if not e.name.startswith("run-")]
            deps: dict[str, list[str]] = {}
            for h in list(s.tasks.handles.values()):
                deps[h.name] = [d.name for d in h.deps]
                for d in h.deps:  # shared reads leave the table once consumed
                    deps.setdefault(d.name, [x.name for x in d.deps])
    finally:
        if cache is not None:
            assert cache.counters["packed_reads"] == 17 and cache.counters["fallbacks"] == 0
            cache.close()

    session_rows = [t for t in record["tasks"] if t["scope"] == "session"]
    names = [e.name for e in events]
    assert sorted(names) == sorted(t["id"] for t in session_rows)  # each exactly once
    assert all(e.state.value == "done" for e in events)
    ran = {e.name: (e.kind.value, e.resource.value) for e in events}
    assert ran == {t["id"]: (t["kind"], t["resource"]) for t in session_rows}
    assert deps == {t["id"]: t["dependencies"] for t in session_rows}

    steps = [t for t in record["tasks"] if t["scope"] == "invocation"]
    assert [si for si, *_ in ctx.step_log] == list(range(len(steps)))  # in plan order, each once
    publisher = {q["key"]: q["publisher"] for q in record["requirements"]}
    for si, t in enumerate(steps):
        assert pinned[si] == set(t["prepared_requirements"]), t["id"]
        previous = [steps[si - 1]["id"]] if si else []
        assert t["dependencies"] == previous + list(dict.fromkeys(publisher[k] for k in t["prepared_requirements"]))


# --------------------------------------------------------------------------- Graphviz

NODE = re.compile(r'^\s+"([^"]+)" \[label="[^"]*", fillcolor="(#[0-9a-f]{6})", tooltip="(\w+)"(, penwidth=[\d.]+)?\];$')
EDGE = re.compile(r'^\s+"([^"]+)" -> "([^"]+)";$')
CLUSTER = re.compile(r"^\s+subgraph cluster_(\w+) \{$")


def parse_dot(text: str):
    """Nodes (id -> (cluster, colour, resource)) and edges of ``plan_dot``'s output;
    any other line but the few fixed ones fails the parse."""
    nodes, edges, cluster = {}, [], None
    lines = text.strip().split("\n")
    assert lines[0] == "digraph plan {" and lines[-1] == "}"
    for line in lines[1:-1]:
        if m := CLUSTER.match(line):
            cluster = m.group(1)
        elif line.strip() == "}":
            cluster = None
        elif m := NODE.match(line):
            assert cluster is not None, line
            nodes[m.group(1)] = (cluster, m.group(2), m.group(3))
        elif m := EDGE.match(line):
            edges.append((m.group(1), m.group(2)))
        else:
            assert line.strip().startswith(("rankdir=", "node [", "label=")), line
    return nodes, edges


def test_dot_has_every_task_and_every_dependency(doc):
    text = plan_dot(doc)
    nodes, edges = parse_dot(text)
    assert set(nodes) == {t["id"] for t in doc["tasks"]}
    for t in doc["tasks"]:
        assert nodes[t["id"]] == (t["scope"], RESOURCE_COLOURS[t["resource"]], t["resource"])
    assert sorted(edges) == sorted((d, t["id"]) for t in doc["tasks"] for d in t["dependencies"])
    assert sum(1 for a, _ in edges if a == TIED) == 1  # one prepack of the tied codes
    if shutil.which("dot") is None:
        pytest.skip("Graphviz `dot` not installed: structure checked, rendering skipped")
    out = subprocess.run(["dot", "-Tsvg"], input=text, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "<svg" in out.stdout


def test_dot_of_a_filtered_record_has_edges_only_between_listed_tasks(plan):
    rec = plan_report(plan, text="layers.0.mlp.down")
    nodes, edges = parse_dot(plan_dot(rec))
    assert len(nodes) == 4  # two reads, the prepack, the step
    assert all(a in nodes and b in nodes for a, b in edges) and len(edges) == 3
