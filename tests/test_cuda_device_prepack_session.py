"""The device-side prepack in a session, on the fake driver (tests/fake_cuda_driver.py,
which runs the prepack entries through this package's CPU prepack on its device bytes,
tests/fake_cuda_kernels.py): a ``CudaSessionDevice`` whose prepack kernels load plans
with the kernel's choice (``prepack="kernel"``), so the INT4 matmul's objects take the
``read_source_upload_prepack`` recipe: each source read into page-locked staging, copied
into device memory by its ``S.upload_source`` task, and packed on the device straight
into the key's slot by ``S.prepack:<device key>``.

Checked: every object's device bytes equal the CPU prepack's (the tiny fixture, its
zero-point config, fp16 scales with zero points), sequential or not; the counters say
which recipe ran (device prepacks, source uploads, uploads of raw weights; no CPU
prepack); every staging buffer and every source's device memory given back; an evicted
object packed on the device again at its address, a whole second pass under a budget of
exactly every slot; a plan mixing prepared-cache entries (read packed, uploaded) with
device-packed objects; a fused DequantizeLinear + MatMul weight, which the device
prepack does not pack, packed on a CPU worker in the same session; a failed source
upload and a failed prepack each named by their object, nothing left behind; a device
whose prepack kernels do not load plans with the host prepack and says why."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from fake_cuda_driver import MiB, fail, ready
from onnx import TensorProto, helper, numpy_helper

from onnx_prep.core.cuda.session_device import CudaSessionDevice
from onnx_prep.core.errors import DeviceError, TaskFailedError
from onnx_prep.core.io.external_data import ExternalDataReader
from onnx_prep.core.kernels.prepack import prepack_all, source_loader
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.plan.device_recipes import (
    READ_PACKED_PAYLOAD_UPLOAD,
    READ_SOURCE_PREPACK_UPLOAD,
    READ_SOURCE_UPLOAD,
    READ_SOURCE_UPLOAD_PREPACK,
)
from onnx_prep.core.plan.device_target import DeviceTarget, device_memory
from onnx_prep.core.plan.execution_plan import RAW_LAYOUT, build_prepared_execution_plan
from onnx_prep.core.plan.task import ResourceClass, TaskKind
from onnx_prep.core.runtime.arenas import Arena
from onnx_prep.core.runtime.session import Session, SessionOptions

G = 2 * MiB
TICK_NS = 2_000  # the fake's clock: the two events around one copy or one launch


def cpu_bytes(resolved) -> dict[str, bytes]:
    """Each device key's bytes as the CPU makes them: the CPU prepack of the same
    request, or a raw weight's source bytes."""
    reader = ExternalDataReader.for_model(resolved)
    packed = prepack_all(resolved, source_loader(resolved, reader))
    out = {}
    for key, req in resolved.requests.items():
        out[dataclasses.replace(req, device="cuda").key] = np.ascontiguousarray(packed[key]).view(np.uint8).tobytes()
    for name, wd in resolved.weights.items():
        if wd.external:
            out[f"raw:{name}"] = reader.read(wd).tobytes()
    return out


def expected_bytes(want: dict[str, bytes], r) -> bytes:
    return want[f"raw:{r.request.logical_value}"] if r.kernel == RAW_LAYOUT else want[r.key]


def device_session(resolved, *, memory=256 * MiB, budget=None, driver=None, **kw):
    driver = driver or ready(memory=memory)
    return driver, Session(resolved, SessionOptions(device=CudaSessionDevice(driver, budget=budget), **kw))


def check_slots(s, want) -> None:
    for r in s.plan.requirements:
        assert s.slots.copy_to_host(r.key) == expected_bytes(want, r), r.key


def check_given_back(driver, s) -> None:
    """Nothing of the load left on the host or the device but the slots: no staging, no
    source in device memory, no Preparation reservation."""
    assert s.device.live_staging() == 0 and s.device.live_sources() == 0
    assert driver.live()["host_buffers"] == 0 and driver.live()["allocations"] == 0
    assert s.budget.live(Arena.PREPARATION) == 0


@pytest.fixture(scope="module")
def fp16_zp_llm_path(tmp_path_factory):
    """A small tiny-llm with fp16 scales and stored zero points."""
    from onnx_prep.fixtures import FixtureConfig, generate

    cfg = FixtureConfig.preset("tiny-llm").replace(layers=2, hidden=128, intermediate=256, heads=4, vocab=512,
                                                   fp16_scales=True, zero_points=True)
    return generate(cfg, tmp_path_factory.mktemp("fp16-zp-llm"))


@pytest.fixture(scope="module")
def tiny(tiny_llm_path):
    return resolve_model(tiny_llm_path)


@pytest.fixture(scope="module")
def tiny_want(tiny):
    return cpu_bytes(tiny)


@pytest.mark.parametrize("sequential", [False, True], ids=["workers", "sequential"])
@pytest.mark.parametrize("model", ["tiny_llm_path", "tiny_zp_llm_path", "fp16_zp_llm_path"])
def test_every_object_is_packed_on_the_device_as_the_cpu_packs_it(request, model, sequential):
    resolved = resolve_model(request.getfixturevalue(model))
    want = cpu_bytes(resolved)
    driver, s = device_session(resolved, sequential=sequential)
    with s:
        plan = s.plan
        assert s.device.packs_on_device and plan.device.prepack == "kernel"
        on_device = [r for r in plan.requirements if r.selected.kind == READ_SOURCE_UPLOAD_PREPACK]
        raw = [r for r in plan.requirements if r.kernel == RAW_LAYOUT]
        # the INT4 gather's own object (an untied embedding: zero points one a byte)
        # has no device prepack: packed on a CPU worker, its packed bytes uploaded
        on_host = [r for r in plan.requirements if r.selected.kind == READ_SOURCE_PREPACK_UPLOAD]
        assert on_device and len(on_device) + len(raw) + len(on_host) == len(plan.requirements)
        assert {r.kernel for r in on_device} == {"int4_matmul"} and {r.kernel for r in on_host} <= {"int4_gather"}
        assert {r.selected.kind for r in raw} == {READ_SOURCE_UPLOAD}
        source_uploads = [t for t in plan.session_tasks if t.id.startswith("S.upload_source:")]
        assert all(t.resource is ResourceClass.DEVICE for t in source_uploads)
        s.prepare()
        assert s.is_prepared()
        check_slots(s, want)
        # the raw weights in a shared granule, as the plan placed them
        from test_cuda_device_load import committed

        assert s.slots.committed_bytes() == committed(plan) == device_memory(plan)["committed_bytes"]
        assert all(s.slots.is_shared(r.key) for r in raw)
        st = s.stats()
        # which recipe ran: each INT4 matmul object packed on the device, the rest uploaded
        assert (st.device_prepacks, st.prepacks) == (len(on_device), len(on_host))
        assert (st.uploads, st.source_uploads) == (len(raw) + len(on_host), len(source_uploads))
        assert st.host_to_device_bytes == (sum(r.packed_bytes for r in raw + on_host)
                                           + sum(t.estimated_input_bytes for t in source_uploads))
        assert st.upload_ns == (st.uploads + st.source_uploads) * TICK_NS
        assert st.device_prepack_ns == st.device_prepacks * TICK_NS
        assert driver.launched == ["int4_matmul_prepack"] * len(on_device)
        assert st.queues["device"].ran == st.uploads + st.source_uploads + st.device_prepacks
        assert st.tasks["prepack"].ran == len(on_device) + len(on_host)
        # every copy from page-locked staging on the one stream; a device prepack's sources
        # read into it, not mapped (a CPU prepack's are mapped, as on the CPU)
        assert driver.names().count("cuMemcpyHtoDAsync") == st.uploads + st.source_uploads
        assert "cuMemcpyHtoD" not in driver.names()
        staged = {d for t in plan.session_tasks if t.kind is TaskKind.UPLOAD for d in t.dependencies}
        assert st.source_bytes_mapped == sum(t.estimated_output_bytes for t in plan.session_tasks
                                             if t.kind is TaskKind.READ_SOURCE and t.id not in staged)
        assert st.to_json()["device"]["device_prepacks"] == len(on_device)
        check_given_back(driver, s)
    assert driver.live() == {"allocations": 0, "host_buffers": 0, "streams": 0, "events": 0, "modules": 1,
                             "graphs": 0}  # the prepack kernels stay loaded for the process
    assert driver.reservations == {} and driver.mappings == {} and driver.used == 0


def test_an_evicted_object_is_packed_on_the_device_again_at_its_address(tiny, tiny_want):
    driver, s = device_session(tiny)
    with s:
        s.prepare()
        r = next(r for r in s.plan.requirements if r.selected.kind == READ_SOURCE_UPLOAD_PREPACK)
        address = s.prepared_view(r.key).address
        before = s.stats()
        assert s.evict(r.key) and s.slots.committed_bytes(r.key) == 0
        s.prepare()
        assert s.prepared_view(r.key).address == address
        check_slots(s, tiny_want)
        st = s.stats()
        assert st.page_ins == 1 and st.device_prepacks == before.device_prepacks + 1
        # its sources read and uploaded again (their device memory went back after the first pack)
        assert st.source_uploads == before.source_uploads + len(r.request.source_lineage)
        assert st.source_reads == before.source_reads + len(r.request.source_lineage)
        assert (st.uploads, st.prepacks) == (before.uploads, 0)
        check_given_back(driver, s)


def test_a_second_pass_under_a_budget_of_every_slot_packs_on_the_device_again(tiny, tiny_want):
    """A device session pages nothing by itself (a budget below every slot is refused:
    test_cuda_device_load.py): at exactly every slot, each object evicted and brought
    back is packed on the device again, the slots within the budget throughout (the
    sources' device memory is not the slots')."""
    from test_cuda_device_load import committed

    plan_bytes = committed(build_prepared_execution_plan(tiny, device=DeviceTarget("cuda", granularity=G)))
    driver, s = device_session(tiny, budget=plan_bytes)
    with s:
        s.prepare()
        first = s.stats()
        for r in s.plan.requirements:
            assert s.evict(r.key)
        assert s.slots.counters().committed_bytes == 0
        s.prepare()
        check_slots(s, tiny_want)
        st = s.stats()
        assert st.device_prepacks == 2 * first.device_prepacks and st.uploads == 2 * first.uploads
        assert st.page_ins == len(s.plan.requirements) and st.prepacks == 0
        assert st.device_memory["peak_committed_bytes"] == plan_bytes == s.slots.budget
        check_given_back(driver, s)


class SomeEntries:
    """A prepared cache through which the plan finds only some keys' entries (the plan
    sees a cache only through its ``PackedPayloadIndex`` protocol)."""

    def __init__(self, cache, keep) -> None:
        self._cache, self._keep = cache, keep

    def lookup(self, req):
        return self._cache.lookup(req) if self._keep(req) else None

    def __getattr__(self, name):
        return getattr(self._cache, name)


def test_a_mixed_plan_reads_some_objects_from_the_cache_and_packs_the_rest_on_the_device(
        tiny_llm_path, tmp_path, tiny, tiny_want):
    from onnx_prep.core.cache.cache_build import build_prepared_cache
    from onnx_prep.core.cache.prepared_cache import PreparedCache

    path = tmp_path / "tiny-llm.prepared.onnx"
    build_prepared_cache(tiny_llm_path, output=path)
    resolved = resolve_model(tiny_llm_path)
    cached = {req.key for i, req in enumerate(sorted(resolved.requests.values(), key=lambda q: q.key)) if i % 2}
    cache = SomeEntries(PreparedCache(resolved, path), lambda req: req.key in cached)
    driver, s = device_session(resolved, cache=cache)
    with s:
        kinds = [r.selected.kind for r in s.plan.requirements]
        n_cached, n_device = kinds.count(READ_PACKED_PAYLOAD_UPLOAD), kinds.count(READ_SOURCE_UPLOAD_PREPACK)
        assert n_cached == len(cached) and n_device == len(resolved.requests) - len(cached) > 0
        s.prepare()
        check_slots(s, tiny_want)
        st = s.stats()
        assert (st.packed_reads, st.device_prepacks, st.prepacks) == (n_cached, n_device, 0)
        assert st.uploads == n_cached + kinds.count(READ_SOURCE_UPLOAD)
        assert driver.launched.count("int4_matmul_prepack") == n_device
        check_given_back(driver, s)


def fused_dq_model(tmp_path):
    """A DequantizeLinear (int4 [K, N], blocked along K) feeding a MatMul, its weights
    in an external data file: resolution fuses it into one INT4 matmul node
    (``weight_layout`` "KN")."""
    rng = np.random.default_rng(3)
    K, N, bs = 128, 64, 32
    codes = rng.integers(-8, 8, size=(K, N))
    scales = (rng.random((K // bs, N)) * 0.1 + 0.01).astype(np.float32)
    nodes = [helper.make_node("DequantizeLinear", ["w", "s"], ["wf"], axis=0, block_size=bs),
             helper.make_node("MatMul", ["a", "wf"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])],
        initializer=[helper.make_tensor("w", TensorProto.INT4, codes.shape, codes.reshape(-1).tolist()),
                     numpy_helper.from_array(scales, "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    path = tmp_path / "dq.onnx"
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location="dq.bin",
              size_threshold=0)
    return path


def test_a_fused_dq_weight_is_packed_on_a_cpu_worker_in_a_device_prepack_session(tmp_path):
    resolved = resolve_model(fused_dq_model(tmp_path))
    (node,) = resolved.nodes
    assert node.kernel == "int4_matmul" and node.attributes["weight_layout"] == "KN"
    want = cpu_bytes(resolved)
    driver, s = device_session(resolved)
    with s:
        (r,) = s.plan.requirements
        assert s.device.packs_on_device and [x.kind for x in r.recipes] == [READ_SOURCE_PREPACK_UPLOAD]
        s.prepare()
        check_slots(s, want)
        st = s.stats()
        assert (st.prepacks, st.device_prepacks, st.uploads) == (1, 0, 1)
        check_given_back(driver, s)


def test_a_failed_source_upload_names_its_source_and_leaves_nothing_behind(tiny, monkeypatch):
    driver = ready(memory=256 * MiB)
    _, s = device_session(tiny, driver=driver, sequential=True)
    r = next(r for r in s.plan.requirements if r.selected.kind == READ_SOURCE_UPLOAD_PREPACK)
    scales = r.request.source_lineage[1]
    nbytes = tiny.weights[scales].length
    real = driver.mem_alloc

    def mem_alloc(n):
        if n == nbytes:
            raise fail("cuMemAlloc", "CUDA_ERROR_OUT_OF_MEMORY", "injected")
        return real(n)

    monkeypatch.setattr(driver, "mem_alloc", mem_alloc)
    with s:
        with pytest.raises(TaskFailedError) as e:
            s.prepare()
        line, cause = str(e.value), e.value.__cause__
        assert "\n" not in line and "cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY" in line
        assert isinstance(cause, DeviceError)
        assert cause.message.startswith(f"upload of a source to the device ({nbytes:,} bytes)")
        named = cause.where.tensor
        assert line.startswith(cause.message) and f"(tensor '{named}')" in line  # the device's words, and where
        assert e.value.task == f"S.upload_source:{named}"
        assert named in tiny.weights and tiny.weights[named].length == nbytes  # a scales tensor of that size
        assert not s.store.is_resident(r.key)
    check_given_back(driver, s)
    assert driver.live()["streams"] == 0


def test_a_failed_device_prepack_names_its_object_and_the_next_prepare_packs_it(tiny, tiny_want, monkeypatch):
    driver = ready(memory=256 * MiB)
    _, s = device_session(tiny, driver=driver, sequential=True)

    def launch(function, *args):
        raise fail("cuLaunchKernel", "CUDA_ERROR_ILLEGAL_ADDRESS", "injected")

    monkeypatch.setattr(driver, "launch", launch)
    with s:
        with pytest.raises(TaskFailedError) as e:
            s.prepare()
        line, cause = str(e.value), e.value.__cause__
        assert "\n" not in line and isinstance(cause, DeviceError)
        assert cause.message.startswith("device prepack: cuLaunchKernel failed: CUDA_ERROR_ILLEGAL_ADDRESS")
        key = cause.where.tensor
        assert line.startswith(cause.message) and f"(tensor '{key}')" in line
        assert e.value.task == f"S.prepack:{key}"
        assert key in s.plan.by_key and s.plan.by_key[key].selected.kind == READ_SOURCE_UPLOAD_PREPACK
        assert not s.store.is_resident(key)
        monkeypatch.undo()  # the launch works again: the next prepare packs it (and the rest)
        s.prepare()
        check_slots(s, tiny_want)
        assert s.stats().device_prepacks == sum(r.selected.kind == READ_SOURCE_UPLOAD_PREPACK
                                                for r in s.plan.requirements)
    check_given_back(driver, s)


def test_a_device_whose_prepack_kernels_do_not_load_plans_the_host_prepack_and_says_why(tiny, monkeypatch):
    def refuse(source, name, ordinal):
        raise fail("cuModuleLoadData", "CUDA_ERROR_NOT_SUPPORTED", "injected")

    driver = ready(memory=256 * MiB)
    monkeypatch.setattr(driver, "module_from_source", refuse)
    device = CudaSessionDevice(driver)
    assert not device.packs_on_device and device.target().prepack == "host"
    assert device.device_prepack_reason.startswith("cuModuleLoadData failed: CUDA_ERROR_NOT_SUPPORTED")
    with Session(tiny, SessionOptions(device=device)) as s:
        assert {r.selected.kind for r in s.plan.requirements} == {READ_SOURCE_PREPACK_UPLOAD, READ_SOURCE_UPLOAD}
        s.prepare()
        assert s.stats().device_prepacks == 0 and s.stats().prepacks > 0
    with pytest.raises(DeviceError, match="cuModuleLoadData failed"):
        CudaSessionDevice(driver, device_prepack=True)  # required: the compile error raised
    assert driver.live()["streams"] == 0 and driver.reservations == {}
