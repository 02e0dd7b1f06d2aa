"""DeviceSlotPool's bookkeeping on the fake driver (tests/fake_cuda_driver.py), which
refuses what the real driver refuses: a key keeps its device address across evict →
page-in, sizes are whole granules of the granularity the driver reports, the budget is
enforced before any driver call, access is set after every map, eviction unmaps and
releases while the range stays reserved, close frees everything, and the counters say
what happened. The same pool on a real device: tests/test_cuda_gpu.py."""
from __future__ import annotations

import inspect
import threading

import pytest
from fake_cuda_driver import MiB, FakeDriver, ready

from onnx_prep.core.cuda.device_slot_pool import DeviceSlotPool, DeviceView
from onnx_prep.core.cuda.driver import DriverCallError
from onnx_prep.core.errors import BudgetError, DeviceBudgetError, DeviceError, OnnxPrepError
from onnx_prep.core.runtime.slot_pool import HostSlotPool, SlotBuffer, SlotPool

G = 2 * MiB


def test_a_key_keeps_its_device_address_across_evict_and_page_in():
    d = ready()
    pool = DeviceSlotPool(d)
    pool.reserve("w", 3 * G)
    address = pool.address("w")
    first = pool.page_in("w", b"\x11" * (G + 5))
    assert first == DeviceView(address, G + 5) and pool.view("w") is first
    assert pool.copy_to_host("w") == b"\x11" * (G + 5)
    buf = pool.buffer("w", G + 5, None)
    assert isinstance(buf, SlotBuffer) and buf.committed_bytes == 2 * G
    buf.release()  # what the store's eviction calls
    assert pool.committed_bytes("w") == 0 and d.mappings == {} and d.used == 0
    assert address in d.reservations  # the range stays reserved
    with pytest.raises(DeviceError, match="evicted slot"):
        pool.copy_to_host("w")
    again = pool.page_in("w", b"\x22" * (G + 5))  # different contents, same address
    assert again.address == address and pool.view("w").address == address
    assert pool.copy_to_host("w") == b"\x22" * (G + 5)
    assert set(d.mappings) == {address}
    pool.close()


def test_sizes_are_whole_granules_of_what_the_driver_reports():
    for granule in (64 << 10, 2 * MiB):
        d = ready(granularity=granule)
        pool = DeviceSlotPool(d)
        assert pool.granularity == granule and ("cuMemGetAllocationGranularity", 0) in d.calls
        pool.commit("one byte", 1)
        pool.commit("exact", 3 * granule)
        pool.commit("one over", 3 * granule + 1)
        assert [h.size for h in d.live_handles()] == [granule, 3 * granule, 4 * granule]
        assert pool.committed_bytes() == 8 * granule == pool.counters().committed_bytes
        assert pool.committed_bytes("one over") == 4 * granule
        assert pool.view("one over").nbytes == 3 * granule + 1  # the object's size, not the granules
        assert all(a % granule == 0 for a in d.reservations)
        pool.close()


def test_a_reserved_range_too_small_is_replaced_before_the_first_commit_only():
    d = ready()
    pool = DeviceSlotPool(d)
    pool.reserve("w", 1)  # one granule: the estimate was too low
    small = pool.address("w")
    pool.commit("w", 3 * G)
    assert pool.address("w") != small and small not in d.reservations  # freed, a range that fits taken
    assert d.reservations[pool.address("w")] == 3 * G
    with pytest.raises(OnnxPrepError, match="changed size"):
        pool.commit("w", 4 * G)
    assert pool.commit("w", 3 * G) is pool.view("w")  # resident: nothing to do
    assert pool.counters().page_ins == 1
    pool.close()


def test_the_budget_is_enforced_before_any_driver_call():
    d = ready(memory=64 * MiB)
    pool = DeviceSlotPool(d, budget=5 * G)
    pool.commit("a", 2 * G)
    pool.commit("b", G + 1)  # two granules
    calls = len(d.calls)
    with pytest.raises(DeviceBudgetError, match=r"would pass the device budget \(8,388,608 of 10,485,760"):
        pool.commit("c", G + 1)
    assert len(d.calls) == calls  # refused before cuMemAddressReserve or cuMemCreate
    assert pool.committed_bytes() == 4 * G and len(d.live_handles()) == 2
    assert pool.headroom() == G
    with pytest.raises(DeviceBudgetError, match="more than the device budget"):
        pool.commit("huge", 6 * G)  # can never fit
    assert issubclass(DeviceBudgetError, BudgetError)
    pool.decommit("a")  # what the session's eviction would do
    pool.commit("c", G + 1)
    c = pool.counters()
    assert c.committed_bytes == 4 * G and c.peak_committed_bytes == 4 * G <= pool.budget
    pool.close()


def test_concurrent_page_ins_never_pass_the_budget():
    d = ready(memory=1 << 30)
    pool = DeviceSlotPool(d, budget=7 * G)
    barrier = threading.Barrier(12)
    refused = []

    def page_in(i):
        barrier.wait()
        try:
            pool.commit(f"k{i}", G)
        except DeviceBudgetError:
            refused.append(i)

    threads = [threading.Thread(target=page_in, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(refused) == 5 and pool.counters().peak_committed_bytes == 7 * G == d.used
    pool.close()


def test_the_fake_device_running_out_leaves_the_pool_unchanged():
    d = ready(memory=4 * G)  # no budget: the device's own memory is the limit
    pool = DeviceSlotPool(d)
    pool.commit("a", 3 * G)
    with pytest.raises(DriverCallError, match=r"cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY \(2\)"):
        pool.commit("b", 2 * G)
    c = pool.counters()
    assert (c.committed_bytes, c.page_ins) == (3 * G, 1) and pool.committed_bytes("b") == 0
    assert len(d.live_handles()) == 1 and d.mappings.keys() == {pool.address("a")}
    pool.close()


def test_access_is_set_after_every_map_and_eviction_unmaps_then_releases():
    d = ready()
    pool = DeviceSlotPool(d)
    pool.reserve("w", G)
    for _ in range(3):
        pool.commit("w", G)
        pool.decommit("w")
    pool.decommit("w")  # evicted already: nothing to do, not counted
    mem = [c[0] for c in d.calls if c[0].startswith("cuMem") and c[0] != "cuMemGetAllocationGranularity"]
    assert mem == ["cuMemAddressReserve"] + ["cuMemCreate", "cuMemMap", "cuMemSetAccess",
                                             "cuMemUnmap", "cuMemRelease"] * 3
    address = pool.address("w")
    maps = [c for c in d.calls if c[0] in ("cuMemMap", "cuMemSetAccess")]
    assert all(c[1:3] == (address, G) for c in maps)  # the same range every time
    c = pool.counters()
    assert (c.page_ins, c.evictions, c.committed_bytes, c.peak_committed_bytes) == (3, 3, 0, G)
    assert d.used == 0 and not d.live_handles() and d.reservations == {address: G}
    pool.close()


def test_counters_count_page_ins_evictions_and_host_to_device_bytes():
    d = ready()
    pool = DeviceSlotPool(d)
    pool.page_in("a", bytearray(1000))
    pool.page_in("b", memoryview(bytes(3 * G)))
    pool.upload("a", b"\x01" * 10)  # a partial re-upload counts its bytes
    pool.decommit("b")
    pool.page_in("b", bytes(3 * G))
    c = pool.counters()
    assert c.to_json() == {"committed_bytes": 4 * G, "peak_committed_bytes": 4 * G, "page_ins": 3,
                           "evictions": 1, "host_to_device_bytes": 1000 + 3 * G + 10 + 3 * G}
    assert pool.copy_to_host("a")[:12] == b"\x01" * 10 + b"\0\0"
    with pytest.raises(DeviceError, match="upload of 1,001 bytes into an object of 1,000"):
        pool.upload("a", bytes(1001))
    pool.decommit("a")
    with pytest.raises(DeviceError, match="upload to an evicted slot"):
        pool.upload("a", b"x")
    assert pool.counters().host_to_device_bytes == c.host_to_device_bytes  # refused copies count nothing
    pool.close()


def test_close_frees_everything_and_the_pool_refuses_work_after():
    d = ready()
    pool = DeviceSlotPool(d)
    pool.reserve("never committed", G)
    pool.page_in("resident", bytes(100))
    pool.commit("evicted", G)
    pool.decommit("evicted")
    pool.close()
    assert d.reservations == {} and d.mappings == {} and d.used == 0 and not d.live_handles()
    assert pool.counters().evictions == 1  # close is not an eviction
    pool.close()  # idempotent
    with pytest.raises(DeviceError, match="closed"):
        pool.commit("resident", 100)


def test_a_device_without_vmm_or_a_budget_below_a_granule_is_refused():
    with pytest.raises(DeviceError, match=r"device 0 \(Fake GPU\) does not support virtual memory management"):
        DeviceSlotPool(ready(vmm=False))
    with pytest.raises(DeviceBudgetError, match="below one allocation granule"):
        DeviceSlotPool(ready(), budget=G - 1)


@pytest.mark.parametrize("misuse, error", [
    (lambda d, a: d.map(a + 64 * MiB, G, d.create(G, 0)), "is not reserved"),
    (lambda d, a: d.set_access(a, G, 0), "is not mapped"),
    (lambda d, a: (d.release(h := d.create(G, 0)), d.release(h)), "already released"),
    (lambda d, a: d.create(65 * MiB // G * G + G, 0), "OUT_OF_MEMORY"),
    (lambda d, a: (d.map(a, G, d.create(G, 0)), d.copy_to_device(a, b"x")), "no access was set"),
    (lambda d, a: (d.map(a, G, d.create(G, 0)), d.address_free(a, 2 * G)), "still has a mapping"),
    (lambda d, a: d.unmap(a, G), "is not a mapping"),
    (lambda d, a: d.create(G + 1, 0), "not a whole number of granules"),
], ids=["map unreserved", "access before map", "double release", "past device memory", "copy without access",
        "free while mapped", "unmap unmapped", "partial granule"])
def test_the_fake_driver_refuses_what_the_real_one_does(misuse, error):
    """The fake's rules fail (so the pool tests above could)."""
    d = ready(memory=64 * MiB)
    d.use_device(0)
    address = d.address_reserve(2 * G, G)
    with pytest.raises(DriverCallError, match=error):
        misuse(d, address)


def test_the_fake_driver_needs_init_and_a_current_device():
    d = FakeDriver()
    with pytest.raises(DriverCallError, match=r"cuDeviceGetCount failed: CUDA_ERROR_NOT_INITIALIZED \(3\)"):
        d.device_count()
    d.init()
    with pytest.raises(DriverCallError, match="CUDA_ERROR_INVALID_CONTEXT"):
        d.address_reserve(G, G)
    d.use_device(0)
    d.address_reserve(G, G)
    errors = []  # a context is current per thread: another thread has none yet
    t = threading.Thread(target=lambda: errors.append(pytest.raises(DriverCallError, d.host_alloc, 8)))
    t.start()
    t.join()
    assert "CUDA_ERROR_INVALID_CONTEXT" in str(errors[0].value)


def test_the_pool_makes_its_context_current_on_each_thread_that_uses_it():
    d = ready()
    pool = DeviceSlotPool(d)
    assert d.names().count("cuCtxSetCurrent") == 1
    pool.commit("a", G)  # the same thread: nothing more
    t = threading.Thread(target=lambda: (pool.commit("b", G), pool.decommit("a")))
    t.start()
    t.join()
    assert d.names().count("cuCtxSetCurrent") == 2 and pool.committed_bytes() == G
    pool.close()


def test_the_device_pool_has_the_slot_pool_interface():
    """Every method of the interface, with the host pool's parameter names."""
    for name in [n for n in vars(SlotPool) if not n.startswith("_")]:
        host = list(inspect.signature(getattr(HostSlotPool, name)).parameters)
        device = list(inspect.signature(getattr(DeviceSlotPool, name)).parameters)
        assert device == host, name


def test_an_upload_on_a_stream_is_queued_until_its_synchronisation_and_counted():
    d = ready()
    pool = DeviceSlotPool(d)
    stream = d.stream_create()
    pinned = d.host_alloc(G + 5)
    pinned[:] = 0x33
    view = pool.commit("w", G + 5)
    pool.upload("w", pinned, stream)
    assert d.copy_to_host(view.address, 8) == bytes(8)  # queued, not copied yet
    d.stream_synchronize(stream)
    assert pool.copy_to_host("w") == b"\x33" * (G + 5)
    assert pool.counters().host_to_device_bytes == G + 5
    assert "cuMemcpyHtoDAsync" in d.names() and "cuMemcpyHtoD" not in d.names()
    pool.close()
