"""RuntimeStats (core/runtime/stats.py): the record of a real session over the tiny
fixture (real external data, the real scheduler and C kernels), exact where the figure
is deterministic; per submission, the difference over it; and no count shared between
two sessions of one process."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.decode.generation import greedy_decode, step_feeds
from onnx_prep.core.errors import UsageError
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.plan.task import TaskKind
from onnx_prep.core.runtime.execution_handle import ExecutionHandle
from onnx_prep.core.runtime.session import RuntimeContext, Session, Workspace
from onnx_prep.core.runtime.stats import SCHEMA, RuntimeStats

HOOK_TIMEOUT_S = 30  # a blocked test hook gives up after this (a failing test, not a hang)
LAYERS = 4  # the tiny fixture's blocks: a K and a V Concat each


@pytest.fixture(scope="module")
def tiny(tiny_llm_path):
    r = resolve_model(tiny_llm_path)
    return r, DecoderIO.discover(r.inputs, r.outputs)


def _prefill(io, ids=(3, 1, 4)):
    return step_feeds(io, np.array([list(ids)]), io.empty_past(1), 0)


def _decode_feeds(io, out, past_len, token=7):
    past = {kv.past_key.name: out[kv.present_key] for kv in io.kv}
    past.update({kv.past_value.name: out[kv.present_value] for kv in io.kv})
    return step_feeds(io, np.array([[token]]), past, past_len)


def _run(s: Session, feeds) -> tuple[RuntimeContext, RuntimeStats]:
    ctx = RuntimeContext(feeds)
    with s.run_async(ctx) as h:
        pass
    return ctx, h.stats()


def _plan_tasks(s: Session, kind: TaskKind) -> int:
    return sum(1 for t in s.plan.session_tasks if t.kind is kind)


def test_cold_prepare_reads_the_payload_once_and_a_hot_run_reads_nothing(tiny):
    r, io = tiny
    with Session(r, source_pages="keep") as s:
        h = s.prepare_async()
        h.wait()
        prep = h.stats()
        assert prep.source_bytes == r.manifest.total_bytes  # every payload byte, once
        # the map path maps each prepack's source; a weight used raw is read into its slot
        raw = sum(r.weights[t.id.split(":", 1)[1]].length for t in s.plan.session_tasks
                  if t.kind is TaskKind.READ_SOURCE and t.publishes is not None)
        assert prep.source_bytes_read == raw and prep.source_bytes_mapped == r.manifest.total_bytes - raw
        assert prep.source_reads == _plan_tasks(s, TaskKind.READ_SOURCE)
        assert prep.packed_bytes_read == 0 and prep.packed_reads == 0  # no prepared cache yet
        assert prep.materializations == len(s.plan.requirements)
        assert prep.prepacks == _plan_tasks(s, TaskKind.PREPACK) and prep.prepack_ns > 0
        assert prep.page_ins == 0 and prep.evictions == 0 and prep.runs == 0
        assert prep.tasks["read_source"].tasks == _plan_tasks(s, TaskKind.READ_SOURCE)
        assert prep.tasks["prepack"].ran == _plan_tasks(s, TaskKind.PREPACK)
        assert "execute" not in prep.tasks
        assert prep.queues["io"].ran == _plan_tasks(s, TaskKind.READ_SOURCE)
        # every prepared byte is held in the PREPARED arena now, and nothing more was
        assert prep.arena_peaks["prepared"] == sum(q.packed_bytes for q in s.plan.requirements)
        assert prep.arena_peaks["preparation"] > 0

        _, hot = _run(s, _prefill(io))
        assert (hot.hot_runs, hot.cold_runs) == (1, 0)
        assert hot.source_bytes == 0 and hot.source_reads == 0  # a hot run reads 0 bytes
        assert hot.materializations == 0 and hot.prepacks == 0 and hot.prepack_ns == 0
        assert hot.tasks == {} and hot.queues == {}  # zero scheduler tasks
        assert hot.kv_copied == 2 * LAYERS and hot.kv_appended_in_place == 0  # the prefill's buffers
        assert hot.arena_peaks["prepared"] == prep.arena_peaks["prepared"]  # what stayed resident
        assert hot.arena_peaks["execution"] > 0 and hot.arena_peaks["io"] > 0

        total = s.stats()
        assert total.source_bytes == r.manifest.total_bytes
        assert (total.hot_runs, total.cold_runs, total.kv_copied) == (1, 0, 2 * LAYERS)
        assert total.materializations == len(s.plan.requirements)


def test_per_run_records_isolate_runs_on_one_session(tiny):
    """A cold first run, then a hot decode step: each record has its own run and its own
    Concats; the session's record is their sum."""
    r, io = tiny
    with Session(r) as s:
        ctx1, cold = _run(s, _prefill(io))
        assert (cold.cold_runs, cold.hot_runs) == (1, 0) and cold.yields >= 1
        assert cold.source_bytes == r.manifest.total_bytes  # the run pulled every weight in
        assert cold.materializations == len(s.plan.requirements)
        assert cold.tasks["execute"].ran >= cold.yields + 1  # one continuation per yield, plus the first
        assert (cold.kv_copied, cold.kv_appended_in_place) == (2 * LAYERS, 0)

        _, hot = _run(s, _decode_feeds(io, ctx1.outputs, 3))
        assert (hot.hot_runs, hot.cold_runs, hot.yields) == (1, 0, 0)
        assert (hot.kv_copied, hot.kv_appended_in_place) == (0, 2 * LAYERS)  # appended in place
        assert hot.source_bytes == 0 and hot.materializations == 0

        total = s.stats()
        for f in ("cold_runs", "hot_runs", "kv_copied", "kv_appended_in_place", "source_bytes",
                  "materializations", "yields"):
            assert getattr(total, f) == getattr(cold, f) + getattr(hot, f), f


def test_two_sessions_in_one_process_do_not_see_each_others_counts(tiny):
    """The bug of process-wide counters: a session's record moved with another's work.
    Also on one workspace (one scheduler, one budget): each has its own tasks."""
    r, io = tiny
    with Workspace() as ws:
        a = Session(r, workspace=ws)
        b = Session(r, workspace=ws)
        try:
            greedy_decode(a, io, np.array([[3, 1, 4]]), 4)
            idle = b.stats()
            assert idle.counts() == RuntimeStats().counts()  # nothing of a's
            assert idle.tasks == {} and b.timeline() == []
            a_before = a.stats()
            got = greedy_decode(b, io, np.array([[3, 1, 4]]), 4)
            assert got.stats.kv_copied == 2 * LAYERS and got.stats.kv_appended_in_place == 3 * 2 * LAYERS
            assert a.stats().counts() == a_before.counts() and a.stats().tasks == a_before.tasks
            assert b.stats().source_bytes == r.manifest.total_bytes  # its own reader's bytes
            assert {e.task_id for e in a.timeline()}.isdisjoint(e.task_id for e in b.timeline())
            assert len(b.timeline()) == sum(t.tasks for t in b.stats().tasks.values())
        finally:
            a.close()
            b.close()


def test_the_timeline_can_draw_a_trace(tiny):
    """Each event of the session's timeline says which task (id, plan name), what kind,
    which resource and worker, and when it was submitted, ready, started and ended."""
    r, io = tiny
    with Session(r) as s:
        s.run(_prefill(io))
        events = s.timeline()
        assert events
        for e in events:
            assert e.kind is not None and e.worker is not None
            assert e.submit_ns <= e.ready_ns <= e.start_ns <= e.end_ns
            if e.kind is TaskKind.EXECUTE:
                assert e.name.startswith("run-1:step")
            else:
                assert s.plan.by_id[e.name].kind is e.kind
                assert s.plan.by_id[e.name].resource is e.resource
            doc = e.to_json()
            assert doc["kind"] == e.kind.value and doc["resource"] == e.resource.value
        kinds = {e.kind for e in events}
        assert {TaskKind.READ_SOURCE, TaskKind.PREPACK, TaskKind.EXECUTE} <= kinds
        # the record's task totals are the timeline's, summed
        totals = s.stats().tasks
        for kind in kinds:
            mine = [e for e in events if e.kind is kind]
            t = totals[kind.value]
            assert t.tasks == t.ran == len(mine)
            assert t.queue_wait_ns == sum(e.start_ns - e.ready_ns for e in mine)
            assert t.run_ns == sum(e.end_ns - e.start_ns for e in mine)


def test_to_json_has_the_documented_shape(tiny):
    r, io = tiny
    with Session(r) as s:
        s.prepare()
        s.run(_prefill(io))
        rec = s.stats()
    doc = json.loads(json.dumps(rec.to_json()))
    assert doc["schema"] == SCHEMA
    assert set(doc) == {"schema", "io", "prepare", "runs", "memory", "tasks", "queues", "kv", "intra_op"}
    assert set(doc["io"]) == {"source_bytes", "source_bytes_read", "source_bytes_mapped", "source_reads",
                              "source_bytes_dropped", "packed_bytes_read", "packed_bytes_mapped", "packed_bytes_pmd_mapped",
                              "packed_reads"}
    assert set(doc["prepare"]) == {"prepacks", "prepack_ns", "materializations", "page_ins", "page_in_bytes", "evictions",
                                   "shed", "slot_bytes_warmed"}
    assert doc["runs"] == {"hot": 1, "cold": 0, "yields": 0, "reads_first": 0}
    assert set(doc["memory"]["arena_peaks"]) == {"preparation", "prepared", "execution", "io"}
    assert doc["memory"]["global_peak"] >= max(doc["memory"]["arena_peaks"].values())
    assert set(doc["tasks"]) == {"read_source", "prepack"}
    assert set(doc["queues"]) >= {"io", "cpu"}
    for t in (*doc["tasks"].values(), *doc["queues"].values()):
        assert set(t) == {"tasks", "ran", "queue_wait_ns", "run_ns", "cpu_ns"}
    assert doc["kv"] == {"appended_in_place": 0, "copied": 2 * LAYERS}
    assert set(doc["intra_op"]) == {"matmul_splits", "split_parts", "attention_splits", "runs_lending",
                                    "chunks_by_helpers", "helper_sleeps", "helper_wakes"}
    assert doc["io"]["source_bytes"] == r.manifest.total_bytes


def test_a_handle_has_its_record_once_done_and_not_before(tiny):
    r, io = tiny
    gate = threading.Event()
    with Session(r) as s:
        s.reader.hooks.before_read = lambda desc: gate.wait(HOOK_TIMEOUT_S)
        h = s.prepare_async()
        try:
            with pytest.raises(UsageError, match="still running"):
                h.stats()
        finally:
            gate.set()
        h.wait()
        assert h.stats().source_bytes == r.manifest.total_bytes  # there as soon as wait() returns
        again = s.prepare_async()  # everything resident: done at once, with an empty record
        assert again.is_ready() and again.stats().source_bytes == 0 and again.stats().tasks == {}
    assert ExecutionHandle.completed(name="x").stats() is None  # a handle that records none
