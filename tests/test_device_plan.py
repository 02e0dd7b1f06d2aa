"""The plan built for a device (``--device cuda``), without one: its tasks per resource,
its dependencies (no step before the uploads of what it pins, no upload before the
prepack or the read of what it copies), each recipe (packed on the device, packed on a
CPU worker then uploaded, read packed from a prepared cache then uploaded, raw weights
uploaded as stored), the kernel spec's choice between the two prepack recipes, the
slots' granule rounding and the budget, on the tiny fixture and the medium-shaped
graph. Nothing here needs a GPU or imports the CUDA modules: planning is metadata."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import jsonschema
import pytest

from onnx_prep.core.errors import DeviceBudgetError
from onnx_prep.core.kernels import int4_matmul
from onnx_prep.core.kernels.prepack import device_recipes
from onnx_prep.core.kernels.spec import DEVICE_PREPACK, HOST_PREPACK, DevicePacking
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.plan.device_recipes import (
    READ_PACKED_PAYLOAD_UPLOAD,
    READ_SOURCE_PREPACK_UPLOAD,
    READ_SOURCE_UPLOAD,
    READ_SOURCE_UPLOAD_PREPACK,
)
from onnx_prep.core.plan.device_target import (
    DEFAULT_GRANULARITY,
    DeviceTarget,
    device_memory,
    require_budget,
    slot_placement,
)
from onnx_prep.core.plan.execution_plan import RAW_LAYOUT, build_prepared_execution_plan
from onnx_prep.core.plan.plan_report import plan_dump, plan_report, schema_path, task_from_json
from onnx_prep.core.plan.task import ResourceClass, TaskKind

from test_plan_cpu_unchanged import medium_graph_path  # noqa: F401 - a fixture
from test_plan_report import cache_path, opener  # noqa: F401 - cache_path is a fixture
from test_resolve_models import gemm_model

CUDA = DeviceTarget("cuda")
MiB = 1 << 20


@pytest.fixture(scope="module")
def tiny(tiny_llm_path):
    return resolve_model(tiny_llm_path)


@pytest.fixture(scope="module")
def plan(tiny):
    return build_prepared_execution_plan(tiny, device=CUDA)


def by_kind_and_resource(plan) -> dict[tuple[str, str], int]:
    return dict(Counter((t.kind.value, t.resource.value) for t in plan.tasks))


def check_device_plan(plan) -> None:
    placement = slot_placement(plan)
    place = {r.key: i for i, r in enumerate(plan.requirements)}
    """What every device plan holds, whatever its recipes: steps on the device queue
    after the tasks publishing what they pin, each of those an upload or a device
    prepack filling that key's slot; uploads after the prepack or read of their bytes."""
    index = {t.id: i for i, t in enumerate(plan.tasks)}
    for t in plan.tasks:
        assert all(index[d] < index[t.id] for d in t.dependencies), t.id
    for step in plan.invocation_tasks:
        assert step.resource is ResourceClass.DEVICE and step.kind is TaskKind.EXECUTE
        for key in step.prepared_requirements:
            assert key.endswith("|cuda"), key
            publisher = plan.by_id[plan.by_key[key].publisher]
            assert publisher.id in step.dependencies and publisher.publishes == key
            assert publisher.resource is ResourceClass.DEVICE
            assert publisher.kind in (TaskKind.UPLOAD, TaskKind.PREPACK)
            closure = plan.session_closure([key])
            assert any(t.kind is TaskKind.UPLOAD for t in closure)  # nothing reaches the device without one
    for t in plan.session_tasks:
        deps = [plan.by_id[d] for d in t.dependencies]
        if t.kind is TaskKind.UPLOAD:
            assert t.resource is ResourceClass.DEVICE and t.estimated_input_bytes > 0
            assert t.arena is None  # device memory: the device slot pool's, no host arena's
            if t.publishes is not None:  # fills the key's slot: what slot_placement commits for it
                i = place[t.publishes]
                if placement.granule[i] is None:  # a slot of its own: whole granules
                    assert t.estimated_output_bytes == placement.own[i] == plan.device.slot_bytes(t.estimated_input_bytes)
                else:  # a raw weight sharing a granule: its 256-byte share, not the granule (ba3452a)
                    assert plan.requirements[i].request.layout == RAW_LAYOUT
                    assert t.estimated_output_bytes == plan.device.share_bytes(t.estimated_input_bytes)
                assert [d.kind for d in deps] in ([TaskKind.PREPACK], [TaskKind.READ_SOURCE], [TaskKind.READ_PACKED])
                assert all(d.resource is not ResourceClass.DEVICE for d in deps)
            else:  # a source's bytes, for a device prepack: after its read (none for an inline source)
                assert t.id.startswith("S.upload_source:")
                assert [d.id for d in deps] in ([], [f"S.read_source:{t.id.split(':', 1)[1]}"])
        elif t.kind is TaskKind.PREPACK and t.resource is ResourceClass.DEVICE:
            assert deps and all(d.kind is TaskKind.UPLOAD and d.publishes is None for d in deps)
            assert t.publishes is not None and t.estimated_output_bytes % plan.device.granularity == 0
        elif t.kind in (TaskKind.PREPACK, TaskKind.READ_SOURCE, TaskKind.READ_PACKED):
            assert t.resource is not ResourceClass.DEVICE
            assert t.publishes is None  # host staging: the device object is what steps pin


# ------------------------------------------------------------------------- structure

def test_the_tiny_plan_for_cuda(plan, tiny):
    """17 packed objects packed on the device and 10 raw ones uploaded: every source
    read (44) on the I/O queue, one upload per source read (34 sources of packed objects,
    10 raw weights), 17 prepacks and the 18 steps on the device queue, no CPU task."""
    assert by_kind_and_resource(plan) == {("read_source", "io"): 44, ("upload", "device"): 44,
                                          ("prepack", "device"): 17, ("execute", "device"): 18}
    cpu = build_prepared_execution_plan(tiny)  # the same objects and steps
    assert [r.request.key for r in plan.requirements] == [r.request.key.replace("|cpu", "|cuda")
                                                          for r in cpu.requirements]
    assert [s.action_range for s in plan.steps] == [s.action_range for s in cpu.steps]
    assert Counter(r.selected.kind for r in plan.requirements) == {READ_SOURCE_UPLOAD_PREPACK: 17,
                                                                   READ_SOURCE_UPLOAD: 10}
    check_device_plan(plan)


def test_block0_gate_up_read_uploaded_packed_on_the_device_then_pinned(plan):
    key = next(r.key for r in plan.requirements if r.request.logical_value == "layers.0.mlp.gate_up.weight_q4")
    pack = plan.by_id[plan.by_key[key].publisher]
    assert pack.id == f"S.prepack:{key}" and pack.resource is ResourceClass.DEVICE
    assert pack.dependencies == ("S.upload_source:layers.0.mlp.gate_up.weight_q4",
                                 "S.upload_source:layers.0.mlp.gate_up.scales")
    assert [plan.by_id[d].dependencies for d in pack.dependencies] == [
        ("S.read_source:layers.0.mlp.gate_up.weight_q4",), ("S.read_source:layers.0.mlp.gate_up.scales",)]
    assert pack.estimated_input_bytes == 1_048_576 + 262_144  # the sources it packs
    assert pack.estimated_output_bytes == 2 * MiB  # 1,310,784 packed bytes: one 2 MiB granule
    step = next(t for t in plan.invocation_tasks if t.label == "layers.0.mlp.gate_up_proj")
    assert step.prepared_requirements == (key,) and pack.id in step.dependencies


def test_the_medium_shaped_plan_for_cuda(medium_graph_path):  # noqa: F811 - the fixture
    """16 blocks: 65 packed objects (4 a block and the tied table), 34 raw weights."""
    p = build_prepared_execution_plan(resolve_model(medium_graph_path), device=CUDA)
    assert by_kind_and_resource(p) == {("read_source", "io"): 164, ("upload", "device"): 164,
                                       ("prepack", "device"): 65, ("execute", "device"): 66}
    assert Counter(r.selected.kind for r in p.requirements) == {READ_SOURCE_UPLOAD_PREPACK: 65,
                                                                READ_SOURCE_UPLOAD: 34}
    check_device_plan(p)


def test_a_kernel_without_device_packing_packs_on_a_cpu_worker_then_uploads(tmp_path):
    """gemm_packed declares no device recipe: its object is read, packed on a CPU worker
    and the packed bytes uploaded (the second Gemm on B1 shares it, as on the CPU); B3,
    an initializer the caller may override, is read and uploaded as stored."""
    p = build_prepared_execution_plan(resolve_model(gemm_model(tmp_path)), device=CUDA)
    packed = [r for r in p.requirements if r.kernel == "gemm_packed"]
    assert len(packed) == 2 and all(r.selected.kind == READ_SOURCE_PREPACK_UPLOAD for r in packed)
    assert all([x.kind for x in r.recipes] == [READ_SOURCE_PREPACK_UPLOAD] for r in packed)
    for r in packed:
        upload = p.by_id[r.publisher]
        host_key = r.request.key.replace("|cuda", "|cpu")
        assert upload.id == f"S.upload:{r.key}" and upload.dependencies == (f"S.prepack:{host_key}",)
        prepack = p.by_id[f"S.prepack:{host_key}"]
        assert prepack.resource is ResourceClass.CPU and prepack.publishes is None
        assert upload.estimated_input_bytes == prepack.estimated_output_bytes == r.packed_bytes
    assert by_kind_and_resource(p) == {("read_source", "io"): 3, ("prepack", "cpu"): 2, ("upload", "device"): 3,
                                       ("execute", "device"): 3}
    check_device_plan(p)


def test_with_a_complete_cache_each_object_is_read_packed_then_uploaded(tiny, cache_path):  # noqa: F811
    cache = opener(cache_path)(tiny)
    try:
        p = build_prepared_execution_plan(tiny, cache=cache, device=CUDA)
    finally:
        cache.close()
    assert by_kind_and_resource(p) == {("read_source", "io"): 10, ("read_packed", "mapped"): 17,
                                       ("upload", "device"): 27, ("execute", "device"): 18}
    for r in p.requirements:
        if r.kernel == RAW_LAYOUT:
            continue
        assert [x.kind for x in r.recipes] == [READ_PACKED_PAYLOAD_UPLOAD, READ_SOURCE_UPLOAD_PREPACK,
                                               READ_SOURCE_PREPACK_UPLOAD]
        upload = p.by_id[r.publisher]
        read = p.by_id[upload.dependencies[0]]
        assert read.id == "S.read_packed:" + r.request.key.replace("|cuda", "|cpu")  # the host bytes' entry
        assert upload.estimated_input_bytes == read.estimated_output_bytes == r.packed_bytes == r.read_bytes
    check_device_plan(p)


def test_zero_points_are_a_third_source_uploaded(tiny_zp_llm_path):
    p = build_prepared_execution_plan(resolve_model(tiny_zp_llm_path), device=CUDA)
    pack = next(t for t in p.session_tasks if t.kind is TaskKind.PREPACK and "layers.0.attn.qkv" in t.id)
    assert len(pack.dependencies) == 3 and all(d.startswith("S.upload_source:") for d in pack.dependencies)
    check_device_plan(p)


# ------------------------------------------------------------------------- the kernel's choice

@pytest.mark.parametrize("source,packed,first", [(100, 164, DEVICE_PREPACK), (164, 164, DEVICE_PREPACK),
                                                 (165, 164, HOST_PREPACK)])
def test_int4_matmul_packs_on_the_device_unless_the_source_is_larger(source, packed, first):
    assert int4_matmul.device_recipe(source, packed) == first
    offered = device_recipes("int4_matmul", "cuda", source, packed)
    assert offered[0] == first and set(offered) == {DEVICE_PREPACK, HOST_PREPACK}


def test_a_fused_dq_weight_is_not_offered_the_device_prepack():
    """The device prepack reads MatMulNBits' B; a fused DequantizeLinear + MatMul weight
    (int4 [K, N], converted by the CPU prepack) is packed on a CPU worker whatever the sizes
    (a session on a device with the prepack kernel plans it so:
    test_cuda_device_prepack_session.py)."""
    kn = {"K": 64, "N": 64, "block_size": 32, "weight_layout": "KN"}
    assert device_recipes("int4_matmul", "cuda", 100, 164, kn) == (HOST_PREPACK,)
    assert device_recipes("int4_matmul", "cuda", 100, 164, {**kn, "weight_layout": "NKb"}) == (DEVICE_PREPACK,
                                                                                                 HOST_PREPACK)
    assert device_recipes("int4_matmul", "cuda", 100, 164, {"K": 64, "N": 64})[0] == DEVICE_PREPACK


def test_a_device_a_kernel_declares_nothing_for_gets_host_packing_only():
    assert device_recipes("int4_matmul", "rocm", 1, 2) == (HOST_PREPACK,)
    assert device_recipes("gemm_packed", "cuda", 1, 2) == (HOST_PREPACK,)


def test_device_packing_refuses_what_it_does_not_offer():
    with pytest.raises(ValueError, match="among"):
        DevicePacking(offers=("pack_somewhere",))
    with pytest.raises(ValueError, match="not offered"):
        DevicePacking(offers=(HOST_PREPACK,), prefers=lambda s, p: DEVICE_PREPACK).recipes(1, 1)


# ------------------------------------------------------------------------- slots and budget

def test_slots_are_whole_granules_of_the_assumed_or_given_size(tiny, plan):
    memory = device_memory(plan)
    assert memory["queried"] is False and memory["granularity"] == DEFAULT_GRANULARITY == 2 * MiB
    assert memory["granularity_source"] == "assumed"
    packed = [r.packed_bytes for r in plan.requirements if r.kernel != RAW_LAYOUT]
    raw = [r.packed_bytes for r in plan.requirements if r.kernel == RAW_LAYOUT]
    assert memory["slots"] == 27 and memory["packed_bytes"] == sum(packed) + sum(raw) == 13_126_848
    # the 17 packed objects in whole granules of their own (18), the ten raw weights (nine
    # 2 KiB norm weights, the 128-byte rotary table) together in one shared granule
    # (before shared granules: a granule each, 28 in all)
    assert sorted(raw) == [128] + [2048] * 9
    assert memory["committed_bytes"] == sum(-(-b // (2 * MiB)) * 2 * MiB for b in packed) + 2 * MiB == 19 * 2 * MiB
    assert memory["host_to_device_bytes"] == 13_125_760  # the sources: every object packed on the device
    small = build_prepared_execution_plan(tiny, device=DeviceTarget("cuda", 64 << 10, True))
    m = device_memory(small)
    assert m["granularity_source"] == "given"
    assert m["committed_bytes"] == sum(-(-b // (64 << 10)) * (64 << 10) for b in packed) + (64 << 10)
    assert m["committed_bytes"] < memory["committed_bytes"]
    assert memory["fits"] is None and memory["min_page_in_bytes_per_pass"] is None


def test_raw_weights_share_granules_first_fit_in_plan_order(tiny, plan):
    """``slot_placement`` places them as the device slot pool does (the session reserves
    them in plan order): first fit, each share 256-byte multiples, none straddling two
    granules, one larger than a granule in whole granules of its own."""
    placement = slot_placement(plan)
    raw = [i for i, r in enumerate(plan.requirements) if r.kernel == RAW_LAYOUT]
    assert placement.shared_granules == 1 and {placement.granule[i] for i in raw} == {0}
    assert all(placement.own[i] == 0 for i in raw)
    assert all(placement.granule[i] is None and placement.own[i] % (2 * MiB) == 0
               for i in range(len(plan.requirements)) if i not in raw)
    # 2 KiB granules: the rotary table's 128 bytes take 256 of the first, whose 1,792 left
    # no norm weight fits; each norm weight fills one of its own: ten in all
    fine = build_prepared_execution_plan(tiny, device=DeviceTarget("cuda", 2048, True))
    p = slot_placement(fine)
    sizes = [fine.requirements[i].packed_bytes for i in raw]
    assert sizes[0] == 128 and sizes[1:] == [2048] * 9  # the rotary table first in plan order
    assert [p.granule[i] for i in raw] == list(range(10)) and p.shared_granules == 10
    # 4 KiB: the table's 256 bytes and one norm weight, then two norm weights a granule
    coarse = build_prepared_execution_plan(tiny, device=DeviceTarget("cuda", 4096, True))
    p = slot_placement(coarse)
    assert [p.granule[i] for i in raw] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert p.shared_granules == 5
    assert DeviceTarget("cuda", 2048, True).share_bytes(2049) is None  # a slot of its own
    assert [CUDA.share_bytes(n) for n in (0, 1, 256, 257, 2 * MiB)] == [256, 256, 256, 512, 2 * MiB]


def test_a_budget_says_whether_the_slots_fit_and_what_a_pass_pages_in(tiny, plan):
    committed = device_memory(plan)["committed_bytes"]
    largest = device_memory(plan)["largest_step"]
    # the embedding (4 MiB of its own) and the shared granule holding the rotary table and
    # the first norm weight (before shared granules: a granule each, 8 MiB)
    assert largest == {"step": 0, "label": "embed_tokens", "committed_bytes": 6 * MiB}
    fits = build_prepared_execution_plan(tiny, device=DeviceTarget("cuda", budget=committed))
    assert device_memory(fits)["fits"] is True and device_memory(fits)["min_page_in_bytes_per_pass"] == 0
    tight = build_prepared_execution_plan(tiny, device=DeviceTarget("cuda", budget=6 * MiB))
    require_budget(tight)  # the largest step fits alone
    assert device_memory(tight)["fits"] is False
    assert device_memory(tight)["min_page_in_bytes_per_pass"] == committed - 6 * MiB
    short = build_prepared_execution_plan(tiny, device=DeviceTarget("cuda", budget=6 * MiB - 1))
    with pytest.raises(DeviceBudgetError, match=r"step 0 \(embed_tokens\) pins 6,291,456 B of device slots"
                                                r".*every slot at once takes 39,845,888 B"):
        require_budget(short)


@pytest.mark.parametrize("kwargs,needle", [({"name": "cpu"}, "one of"), ({"name": "tpu"}, "one of"),
                                           ({"name": "cuda", "granularity": 3 * MiB}, "power of two"),
                                           ({"name": "cuda", "budget": 0}, "positive")])
def test_a_device_target_refuses_nonsense(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        DeviceTarget(**kwargs)


# ------------------------------------------------------------------------- the record

@pytest.fixture(scope="module")
def doc(tiny_llm_path):
    return json.loads(json.dumps(plan_dump(tiny_llm_path, device="cuda", budget=32 * MiB)))


def test_the_record_validates_with_its_device_section(doc):
    schema = json.loads(schema_path().read_text())
    jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)
    d = doc["summary"]["device"]
    assert (d["name"], d["queried"], d["granularity_source"], d["budget"], d["fits"]) == (
        "cuda", False, "assumed", 32 * MiB, False)
    assert doc["summary"]["recipes"] == {READ_PACKED_PAYLOAD_UPLOAD: 0, READ_SOURCE_UPLOAD_PREPACK: 17,
                                         READ_SOURCE_PREPACK_UPLOAD: 0, READ_SOURCE_UPLOAD: 10}
    assert doc["summary"]["by_resource"] == {"io": 44, "device": 79}
    assert doc["cost_model"]["upload_bytes_per_s"] == 25e9
    broken = json.loads(json.dumps(doc))
    del broken["summary"]["device"]["queried"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema, cls=jsonschema.Draft202012Validator)


def test_each_task_says_the_recipes_it_serves(doc):
    rows = {t["id"]: t for t in doc["tasks"]}
    assert rows["S.read_source:layers.0.input_norm.weight"]["recipes"] == [READ_SOURCE_UPLOAD]
    assert rows["S.upload:P:layers.0.input_norm.weight|raw|cuda"]["recipes"] == [READ_SOURCE_UPLOAD]
    assert rows["S.upload_source:layers.0.attn.qkv.scales"]["recipes"] == [READ_SOURCE_UPLOAD_PREPACK]
    assert all(t["recipes"] == [] for t in doc["tasks"] if t["kind"] == "execute")
    assert all(t["recipes"] for t in doc["tasks"] if t["scope"] == "session")


def test_the_critical_path_counts_uploads_not_device_packing(doc):
    cp = doc["summary"]["critical_path"]
    # the tied table: read 2 MiB of codes (2 GB/s), upload them (25 GB/s), pack on the device (0 ms)
    assert cp["tasks"][:3] == ["S.read_source:embed_tokens.weight_q4", "S.upload_source:embed_tokens.weight_q4",
                               "S.prepack:P:embed_tokens.weight_q4+lm_head.scales|int4mm.v1.bs32.zp-none.sc-float32"
                               ".acc0|cuda"]
    assert cp["upload_bytes"] == 2_097_152
    assert cp["estimated_ms"] == pytest.approx((2_097_152 / 2e9 + 2_097_152 / 25e9) * 1e3, abs=1e-3)


def test_json_tasks_rebuild_the_device_plan_exactly(tiny_llm_path, plan):
    rows = plan_report(plan)["tasks"]
    assert tuple(task_from_json(json.loads(json.dumps(r))) for r in rows) == plan.tasks


def test_planning_for_cuda_imports_nothing_of_cuda(tiny_llm_path):
    code = (f"from onnx_prep.core.plan.plan_report import plan_dump\n"
            f"plan_dump({str(tiny_llm_path)!r}, device='cuda')\n"
            "import sys\n"
            "print(sorted(m for m in sys.modules if m == 'cuda' or m.startswith(('cuda.', 'onnx_prep.core.cuda'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
