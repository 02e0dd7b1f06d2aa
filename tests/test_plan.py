"""PreparedExecutionPlan: one immutable scoped graph built from a frozen ResolvedModel."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from onnx_prep.core.errors import OnnxPrepError
from onnx_prep.core.plan.execution_plan import RAW_LAYOUT, build_prepared_execution_plan
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.runtime.session import Session
from onnx_prep.core.plan.task import TaskKind, TaskScope
from conftest import ort_or_skip
from test_resolve_models import gemm_model


@pytest.fixture(scope="module")
def tiny(tiny_llm_path):
    r = resolve_model(tiny_llm_path)
    return r, build_prepared_execution_plan(r)


def test_rejects_anything_but_a_frozen_resolved_model(tiny):
    r, _ = tiny
    with pytest.raises(OnnxPrepError, match="frozen ResolvedModel"):
        build_prepared_execution_plan({"nodes": r.nodes})  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.nodes = ()  # type: ignore[misc]
    _, plan = tiny
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.tasks = ()  # type: ignore[misc]


def test_reads_exactly_the_manifest(tiny):
    r, plan = tiny
    reads = {t.id.split(":", 1)[1] for t in plan.session_tasks if t.kind is TaskKind.READ_SOURCE}
    assert reads == {d.name for d in r.manifest}
    assert plan.bytes_to_read() == r.manifest.total_bytes


def test_tied_embedding_one_read_one_prepack(tiny):
    """The tied table: one read, one prepack (the LM head's int4mm object), which the
    embedding step (the first) and the LM head step (the last) both consume."""
    _, plan = tiny
    read = "S.read_source:embed_tokens.weight_q4"
    [prepack] = [t for t in plan.session_tasks if read in t.dependencies]
    assert prepack.kind is TaskKind.PREPACK
    req = plan.by_key[prepack.publishes]
    assert req.request.layout.split(".")[0] == "int4mm" and req.node == "lm_head"
    consumers = [s.label for s in plan.steps if prepack.publishes in plan.by_id[s.task_id].prepared_requirements]
    assert consumers == ["embed_tokens", "lm_head"]


def test_seed_step_granularity_and_dependencies(tiny):
    """Embedding, then per block qkv / attn_out / gate_up / down, then the LM head; each
    step depends only on the previous step and the publishers of what it consumes."""
    _, plan = tiny
    labels = [s.label for s in plan.steps]
    assert labels[0] == "embed_tokens" and labels[-1] == "lm_head"
    assert labels[1:5] == ["layers.0.attn.qkv_proj", "layers.0.attn.out_proj",
                           "layers.0.mlp.gate_up_proj", "layers.0.mlp.down_proj"]
    assert len(plan.steps) == 1 + 4 * 4 + 1
    prev = None
    for st in plan.steps:
        t = plan.by_id[st.task_id]
        assert t.scope is TaskScope.INVOCATION and t.action_range == st.action_range
        publishers = {plan.by_key[k].publisher for k in t.prepared_requirements}
        assert set(t.dependencies) == publishers | ({prev} if prev else set())
        bits = 0
        for k in t.prepared_requirements:
            bits |= 1 << plan.by_key[k].bit
        assert st.requirement_bits == bits
        prev = st.task_id
    # action ranges tile the action list
    assert plan.steps[0].action_range[0] == 0
    assert plan.steps[-1].action_range[1] == len(plan.resolved.nodes)
    for a, b in zip(plan.steps, plan.steps[1:]):
        assert a.action_range[1] == b.action_range[0]


def test_precomputed_positions(tiny):
    _, plan = tiny
    assert [r.bit for r in plan.requirements] == list(range(len(plan.requirements)))
    for r in plan.requirements:
        assert 0 <= r.first_step <= r.last_step < len(plan.steps)
        assert r.packed_bytes > 0 and r.read_bytes > 0
    lm = next(r for r in plan.requirements if r.node == "lm_head" and r.kernel == "int4_matmul")
    # prefetch distance: the first step, where the embedding reads the tied table from it
    assert (lm.first_step, lm.last_step) == (0, len(plan.steps) - 1)
    last = next(r for r in plan.requirements if r.node == "layers.3.mlp.down_proj")
    assert last.first_step == len(plan.steps) - 2
    norm = next(r for r in plan.requirements if r.request.layout == RAW_LAYOUT)
    assert plan.by_id[norm.publisher].kind is TaskKind.READ_SOURCE  # raw weight: the read publishes
    # input_ids: read by the embedding (action 0) and last by the mask's Shape; the graph
    # outputs outlive every action
    readers = [n.index for n in plan.resolved.nodes if "input_ids" in n.inputs]
    assert readers[0] == 0 and plan.resolved.nodes[readers[-1]].op_type == "Shape"
    assert plan.activation_last_use["input_ids"] == readers[-1] > 0
    n_actions = len(plan.resolved.nodes)
    assert {o.name: plan.activation_last_use[o.name] for o in plan.resolved.outputs} == \
        dict.fromkeys((o.name for o in plan.resolved.outputs), n_actions)


def test_identical_requests_share_one_task(tmp_path):
    r = resolve_model(gemm_model(tmp_path))
    plan = build_prepared_execution_plan(r)
    publishers = [t.publishes for t in plan.session_tasks if t.publishes]
    assert len(publishers) == len(set(publishers))
    gemm1 = next(n for n in r.nodes if n.name == "gemm1")
    gemm1b = next(n for n in r.nodes if n.name == "gemm1b")
    assert gemm1.requirements == gemm1b.requirements
    assert sum(1 for t in plan.session_tasks if t.publishes == gemm1.requirements[0].key) == 1


def test_gemm_model_runs_like_onnxruntime(tmp_path):
    ort = ort_or_skip()
    path = gemm_model(tmp_path)
    rng = np.random.default_rng(0)
    # NOTE: B3 is an initializer also listed as a graph input (overridable); the runtime
    # uses its initializer value and does not accept an override (known gap).
    feeds = {"A": rng.standard_normal((2, 16)).astype(np.float32),
             "C": rng.standard_normal((16, 8)).astype(np.float32)}
    ref = ort.InferenceSession(str(path)).run(None, feeds)
    with Session.open(path) as s:
        out = s.run(feeds)
    for name, want in zip(("Y1", "Y1b", "Y2", "Y3", "Y4"), ref):
        np.testing.assert_allclose(out[name], want, rtol=1e-5, atol=1e-5, err_msg=name)


def test_the_plan_is_what_the_runtime_executes(tiny_llm_path):
    """Every session task the runtime runs for prepare() is a plan task, and every plan
    session task runs exactly once."""
    with Session.open(tiny_llm_path) as s:
        s.prepare()
        names = [e.name for e in s.scheduler.events()]
    plan_ids = {t.id for t in s.plan.session_tasks}
    assert sorted(names) == sorted(plan_ids)
