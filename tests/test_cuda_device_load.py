"""A session that loads the device plan (``SessionOptions(device=CudaSessionDevice(...))``)
on the fake driver (tests/fake_cuda_driver.py), which queues stream work until a
synchronisation and refuses what the real driver refuses, packing on a CPU worker
(``device_prepack=False``: the host recipes; the device-side prepack in a session is
test_cuda_device_prepack_session.py's): the tiny fixture's every prepared object in its
device slot (the raw weights sharing one granule), its bytes read back equal to the CPU
prepack of the same key (raw weights to their source bytes); the counters (uploads,
host-to-device bytes, device time, committed and peak bytes); a load from a prepared
cache uploading its payloads and reading no packed object's sources; the refusals (a
budget below every slot, the device-side prepack on a device without its kernel, a run,
a cache that persists); the page-locked staging all given back, and everything released
by close. The same load on a real device, packing there: the ``gpu`` test at the end."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from fake_cuda_driver import MiB, ready

from onnx_prep.core.cuda.device_probe import probe_devices
from onnx_prep.core.cuda.session_device import CudaSessionDevice
from onnx_prep.core.errors import DeviceBudgetError, DeviceError, UsageError
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
from onnx_prep.core.plan.task import TaskKind
from onnx_prep.core.runtime.arenas import Arena
from onnx_prep.core.runtime.session import Session, SessionOptions, Workspace

G = 2 * MiB
NOTHING_LIVE = {"allocations": 0, "host_buffers": 0, "streams": 0, "events": 0, "modules": 0, "graphs": 0}


@pytest.fixture(scope="module")
def tiny(tiny_llm_path):
    return resolve_model(tiny_llm_path)


@pytest.fixture(scope="module")
def expected(tiny):
    """Each device key's bytes as the CPU makes them: the CPU prepack of the same
    request, or a raw weight's source bytes."""
    reader = ExternalDataReader.for_model(tiny)
    packed = prepack_all(tiny, source_loader(tiny, reader))
    plan = build_prepared_execution_plan(tiny, device=DeviceTarget("cuda", prepack="host"))
    out = {}
    for r in plan.requirements:
        if r.kernel == RAW_LAYOUT:
            out[r.key] = reader.read(tiny.weights[r.request.logical_value]).tobytes()
        else:
            cpu_key = dataclasses.replace(r.request, device="cpu").key
            out[r.key] = np.ascontiguousarray(packed[cpu_key]).view(np.uint8).tobytes()
    return out


def device_session(resolved, *, budget=None, memory=256 * MiB, device_prepack=False, **kw):
    driver = ready(memory=memory)
    device = CudaSessionDevice(driver, budget=budget, device_prepack=device_prepack)
    return driver, Session(resolved, SessionOptions(device=device, **kw))


def committed(plan) -> int:
    """Every slot resident: each packed object in whole granules of its own, the raw
    weights packed together into shared granules, 256-byte shares (the tiny fixture's ten,
    18,560 bytes, in one: 38 MiB in all, where a granule each took 56 MiB)."""
    own = sum(-(-r.packed_bytes // G) * G for r in plan.requirements if r.kernel != RAW_LAYOUT)
    shared = sum(-(-r.packed_bytes // 256) * 256 for r in plan.requirements if r.kernel == RAW_LAYOUT)
    return own + -(-shared // G) * G


def check_slots(s, expected) -> None:
    pool = s.slots
    for r in s.plan.requirements:
        assert pool.copy_to_host(r.key) == expected[r.key], r.key
        assert s.prepared_view(r.key).address == pool.address(r.key)


def test_the_tiny_fixture_loads_into_device_slots_as_the_cpu_packs_it(tiny, expected):
    driver, s = device_session(tiny)
    with s:
        plan = s.plan
        kinds = {r.selected.kind for r in plan.requirements}
        assert kinds == {READ_SOURCE_PREPACK_UPLOAD, READ_SOURCE_UPLOAD}  # packed on a CPU worker: no device prepack
        s.prepare()
        assert s.is_prepared()
        check_slots(s, expected)
        st = s.stats()
        n = len(plan.requirements)
        packed = sum(r.packed_bytes for r in plan.requirements)
        assert (st.uploads, st.host_to_device_bytes) == (n, packed)
        assert st.host_to_device_bytes == sum(len(b) for b in expected.values())
        assert st.materializations == n and st.prepacks == n - sum(r.kernel == RAW_LAYOUT for r in plan.requirements)
        # device time: the events around each copy ran on the fake's clock (1 us an op)
        assert st.upload_ns == n * 2_000
        assert st.device_memory == {"committed_bytes": committed(plan), "peak_committed_bytes": committed(plan)}
        c = s.slots.counters()
        raw = sum(r.kernel == RAW_LAYOUT for r in plan.requirements)
        # a map per packed object, one for the granule the raw weights share
        assert (c.page_ins, c.host_to_device_bytes) == (n - raw + 1, packed)
        doc = st.to_json()["device"]
        assert doc == {"uploads": n, "source_uploads": 0, "host_to_device_bytes": packed, "upload_ns": n * 2_000,
                       "device_prepacks": 0, "device_prepack_ns": 0,
                       "committed_bytes": committed(plan), "peak_committed_bytes": committed(plan)}
        # every upload a task on the device queue, copied from pinned memory on one stream
        assert st.tasks["upload"].ran == n and st.queues["device"].ran == n
        copies = [c for c in driver.calls if c[0] == "cuMemcpyHtoDAsync"]
        assert len(copies) == n and "cuMemcpyHtoD" not in driver.names()
        assert driver.names().count("cuStreamCreate") == 1


def test_staging_is_page_locked_accounted_and_all_given_back(tiny):
    driver, s = device_session(tiny)
    device = s.device
    with s:
        s.prepare()
        n = len(s.plan.requirements)
        assert driver.names().count("cuMemAllocHost") == n  # one staging buffer per upload, nothing else
        assert device.live_staging() == 0 and driver.live()["host_buffers"] == 0
        assert s.budget.live(Arena.PREPARATION) == 0  # every staging reservation returned
        st = s.stats()
        assert st.arena_peaks["preparation"] > 0  # the staging was paid for from the Preparation arena
        assert st.arena_peaks["prepared"] == 0  # device bytes are the device pool's, not a host arena's
        with pytest.raises(DeviceError, match="not page-locked staging"):
            device.upload(s.plan.requirements[0].key, np.zeros(8, np.uint8))
    assert driver.live() == NOTHING_LIVE  # stream, events, staging
    assert driver.reservations == {} and driver.mappings == {} and driver.used == 0
    with pytest.raises(UsageError, match="closed"):
        s.prepare()


def test_an_evicted_object_comes_back_at_its_address(tiny, expected):
    driver, s = device_session(tiny)
    with s:
        s.prepare()
        key = next(r.key for r in s.plan.requirements if r.kernel != RAW_LAYOUT)
        address = s.prepared_view(key).address
        assert s.evict(key) and s.slots.committed_bytes(key) == 0
        s.prepare()
        assert s.prepared_view(key).address == address
        check_slots(s, expected)
        st = s.stats()
        assert (st.page_ins, st.uploads) == (1, len(s.plan.requirements) + 1)
        assert s.device.live_staging() == 0


def test_the_raw_weights_share_one_granule_at_stable_addresses(tiny, expected):
    """The session reserves raw weights' device keys as shared (DeviceSlotPool shared
    ranges): the tiny fixture's ten in one granule, mapped once, the bytes the same; the
    granule stays while any of them is resident and they come back at their addresses."""
    driver, s = device_session(tiny)
    with s:
        s.prepare()
        check_slots(s, expected)
        pool, plan = s.slots, s.plan
        raw = [r.key for r in plan.requirements if r.kernel == RAW_LAYOUT]
        packed = [r.key for r in plan.requirements if r.kernel != RAW_LAYOUT]
        assert len(raw) == 10 and all(pool.is_shared(k) for k in raw) and not any(pool.is_shared(k) for k in packed)
        addresses = [pool.address(k) for k in raw]
        base = min(addresses) // G * G
        assert len(set(addresses)) == 10 and all(base <= a < base + G and a % 256 == 0 for a in addresses)
        assert all(pool.address(k) % G == 0 for k in packed)
        # 18 mappings: 17 packed objects of their own, one shared granule
        assert len(driver.mappings) == len(packed) + 1 and driver.mappings[base].size == G
        assert pool.committed_bytes() == committed(plan) == 19 * G == device_memory(plan)["committed_bytes"]
        for k in raw[:-1]:
            assert s.evict(k) and pool.committed_bytes(k) == 0
        assert base in driver.mappings and pool.committed_bytes() == 19 * G  # the last one still holds it
        assert pool.copy_to_host(raw[-1]) == expected[raw[-1]]
        assert s.evict(raw[-1]) and base not in driver.mappings and pool.committed_bytes() == 18 * G
        s.prepare()
        assert [pool.address(k) for k in raw] == addresses and pool.committed_bytes() == 19 * G
        check_slots(s, expected)


def test_from_a_prepared_cache_the_payloads_are_uploaded_and_no_packed_source_read(tiny_llm_path, tmp_path,
                                                                                      expected):
    from onnx_prep.core.cache.cache_build import build_prepared_cache
    from onnx_prep.core.cache.prepared_cache import PreparedCache

    path = tmp_path / "tiny-llm.prepared.onnx"
    built = build_prepared_cache(tiny_llm_path, output=path)
    resolved = resolve_model(tiny_llm_path)
    driver, s = device_session(resolved, cache=PreparedCache(resolved, path))
    with s:
        plan = s.plan
        packed = [r for r in plan.requirements if r.kernel != RAW_LAYOUT]
        raw = [r for r in plan.requirements if r.kernel == RAW_LAYOUT]
        assert len(packed) == built["objects"]
        assert {r.selected.kind for r in packed} == {READ_PACKED_PAYLOAD_UPLOAD}
        s.prepare()
        check_slots(s, expected)
        st = s.stats()
        assert (st.packed_reads, st.prepacks) == (len(packed), 0)
        assert st.packed_bytes_read == sum(r.packed_bytes for r in packed)  # stored uncompressed
        # sources read: the raw weights' only (the cache holds packed objects)
        assert st.source_bytes == sum(r.packed_bytes for r in raw)
        assert st.uploads == len(plan.requirements)
        assert st.host_to_device_bytes == sum(r.packed_bytes for r in plan.requirements)
        assert s.device.live_staging() == 0


def test_a_budget_below_every_slot_is_refused_before_any_work(tiny):
    plan = build_prepared_execution_plan(tiny, device=DeviceTarget("cuda", prepack="host"))
    need = committed(plan)
    driver = ready(memory=256 * MiB)
    with pytest.raises(DeviceBudgetError, match=rf"below the {need:,} B that all {len(plan.requirements)} "
                                                r"device slots commit .*unless its caller pages them"):
        Session(tiny, SessionOptions(device=CudaSessionDevice(driver, budget=need - G, device_prepack=False)))
    assert driver.live() == NOTHING_LIVE and driver.reservations == {}  # the session closed its device
    _, s = device_session(tiny, budget=need)  # exactly every slot: loads
    with s:
        s.prepare()
        assert s.stats().device_memory["committed_bytes"] == need == s.slots.budget


class KernelChoiceDevice(CudaSessionDevice):
    """A device without the device prepack kernel that plans with the kernel's choice
    anyway (device-side prepack for the tiny fixture's INT4 weights): what the session
    must refuse."""

    def target(self) -> DeviceTarget:
        return dataclasses.replace(super().target(), prepack="kernel")


def test_the_device_prepack_recipe_is_refused_by_name(tiny):
    kernel = build_prepared_execution_plan(tiny, device=DeviceTarget("cuda"))
    host = build_prepared_execution_plan(tiny, device=DeviceTarget("cuda", prepack="host"))
    on_device = [r for r in kernel.requirements if r.selected.kind == READ_SOURCE_UPLOAD_PREPACK]
    assert on_device  # the kernel's preference for these sizes
    assert not any(r.selected.kind == READ_SOURCE_UPLOAD_PREPACK for r in host.requirements)
    for r in host.requirements:  # the same offers; host first
        if r.kernel != RAW_LAYOUT:
            assert [x.kind for x in r.recipes] == [READ_SOURCE_PREPACK_UPLOAD, READ_SOURCE_UPLOAD_PREPACK]
    assert not any(t.kind is TaskKind.PREPACK and t.publishes for t in host.session_tasks)  # none on the device
    with pytest.raises(ValueError, match="prepack must be one of"):
        DeviceTarget("cuda", prepack="gpu")
    driver = ready(memory=256 * MiB)
    device = KernelChoiceDevice(driver, device_prepack=False)
    assert not device.packs_on_device and CudaSessionDevice(ready(), device_prepack=False).target().prepack == "host"
    with pytest.raises(DeviceError) as e:
        Session(tiny, SessionOptions(device=device))
    line = str(e.value)
    assert "\n" not in line and READ_SOURCE_UPLOAD_PREPACK in line
    assert "this cuda device has no device-side prepack kernel: not asked for (device_prepack=False)" in line
    assert f"{len(on_device)} object(s)" in line and 'prepack="host"' in e.value.hint
    assert driver.live() == NOTHING_LIVE


def test_a_device_session_refuses_to_run_a_cache_that_persists_and_a_host_prepared_limit(tiny, tiny_llm_path, tmp_path):
    _, s = device_session(tiny)
    with s:
        with pytest.raises(DeviceError, match="the device step is not built"):
            s.run({})
    from onnx_prep.core.cache.prepared_cache import PreparedCache

    driver = ready(memory=256 * MiB)
    cache = PreparedCache(tiny, tmp_path / "x.prepared.onnx", policy="build-if-missing")
    with pytest.raises(UsageError, match="does not write the prepared cache"):
        Session(tiny, SessionOptions(device=CudaSessionDevice(driver), cache=cache))
    with Workspace() as ws, pytest.raises(UsageError, match="no device queue"):
        Session(tiny, SessionOptions(device=CudaSessionDevice(ready(memory=256 * MiB)), workspace=ws))
    # a host PREPARED limit would bound nothing of a device's objects: refused, and the device closed
    from onnx_prep.core.runtime.arenas import Arena, MemoryBudget

    driver = ready(memory=256 * MiB)
    with pytest.raises(UsageError, match=r"a PREPARED limit \(1,048,576 B\) means nothing to a session on cuda"):
        Session(tiny, SessionOptions(device=CudaSessionDevice(driver, device_prepack=False),
                                     budget=MemoryBudget(limits={Arena.PREPARED: MiB})))
    assert driver.live() == NOTHING_LIVE


def test_a_sequential_device_session_loads_the_same_bytes(tiny, expected):
    _, s = device_session(tiny, sequential=True)
    with s:
        s.prepare()
        check_slots(s, expected)
        assert s.device.live_staging() == 0


def test_a_cpu_session_imports_nothing_of_cuda(tiny_llm_path):
    code = (f"from onnx_prep.core.runtime.session import Session\n"
            f"with Session.open({str(tiny_llm_path)!r}) as s:\n"
            "    s.prepare()\n"
            "    assert s.stats().to_json().get('device') is None\n"
            "import sys\n"
            "print(sorted(m for m in sys.modules if m == 'cuda' or m.startswith(('cuda.', 'onnx_prep.core.cuda'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


PROBE = probe_devices()


@pytest.mark.skipif(PROBE.usable, reason="CUDA is usable here: the real driver loads")
def test_without_a_usable_cuda_the_device_says_why_in_one_line():
    with pytest.raises(DeviceError) as e:
        CudaSessionDevice()
    assert str(e.value).startswith(f"CUDA is not usable: {PROBE.reason}") and "\n" not in str(e.value)


@pytest.mark.gpu
@pytest.mark.skipif(not PROBE.usable, reason=f"needs a CUDA device: {PROBE.one_line()}")
def test_the_tiny_load_on_a_device(tiny, expected):
    device = CudaSessionDevice()  # cuda-python's driver
    with Session(tiny, SessionOptions(device=device)) as s:
        s.prepare()
        check_slots(s, expected)
        st = s.stats()
        assert device.packs_on_device, device.device_prepack_reason
        assert st.uploads + st.device_prepacks == len(s.plan.requirements) and st.upload_ns > 0
        assert st.device_prepacks > 0 and st.device_prepack_ns > 0 and st.prepacks == 0
        assert device.live_staging() == 0 and device.live_sources() == 0
