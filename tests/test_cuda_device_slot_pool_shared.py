"""DeviceSlotPool's shared ranges on the fake driver (tests/fake_cuda_driver.py, which
refuses what the real driver refuses: a map over a mapping, an unmap of what is not
mapped, a copy outside one mapping or without access, freeing a range with a mapping in
it): small objects reserved ``shared=True`` placed first fit, 256-byte aligned, in
granules they share, each granule mapped once while any of its objects is resident and
counted once in the committed bytes and the budget; addresses stable across evict →
re-commit; an object larger than a granule in a range of its own; close frees it all.
The session's use of them (the raw weights): test_cuda_device_load.py."""
from __future__ import annotations

import threading

import pytest
from fake_cuda_driver import MiB, ready

from onnx_prep.core.cuda.device_slot_pool import DeviceSlotPool
from onnx_prep.core.errors import DeviceBudgetError, DeviceError, OnnxPrepError
from onnx_prep.core.plan.device_target import SHARED_ALIGNMENT

G = 2 * MiB
K = 1 << 10


VMM = {"cuMemAddressReserve", "cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease",
       "cuMemAddressFree"}


def mem_calls(d) -> list[str]:
    return [n for n in d.names() if n in VMM]


def test_small_objects_share_one_granule_mapped_once():
    d = ready()
    pool = DeviceSlotPool(d)
    sizes = {"rotary": 128, "norm.0": 2 * K, "norm.1": 2 * K, "odd": 1000}
    for key, n in sizes.items():
        pool.reserve(key, n, shared=True)
    assert list(d.reservations.values()) == [G]  # one shared range of one granule
    base = next(iter(d.reservations))
    addresses = [pool.address(k) for k in sizes]
    # first fit in reservation order, each share a multiple of 256 bytes
    assert addresses == [base, base + 256, base + 256 + 2 * K, base + 256 + 4 * K]
    assert SHARED_ALIGNMENT == 256 and all(pool.is_shared(k) for k in sizes)
    for i, (key, n) in enumerate(sizes.items()):
        view = pool.page_in(key, bytes([i + 1]) * n)
        assert view.address == addresses[i] and view.nbytes == n
    assert d.names().count("cuMemCreate") == 1 and list(d.mappings) == [base] and d.used == G
    c = pool.counters()
    assert (c.committed_bytes, c.peak_committed_bytes, c.page_ins) == (G, G, 1)
    assert c.host_to_device_bytes == sum(sizes.values())
    for i, (key, n) in enumerate(sizes.items()):  # each object's bytes, none overwritten by the next
        assert pool.copy_to_host(key) == bytes([i + 1]) * n
    # an object's figure is its share: they add up to no more than the pool's
    assert [pool.committed_bytes(k) for k in sizes] == [256, 2 * K, 2 * K, 1024]
    assert pool.committed_bytes() == G
    pool.close()
    assert d.reservations == {} and d.mappings == {} and d.used == 0 and not d.live_handles()


def test_an_upload_on_a_stream_lands_at_the_object_not_the_granule_start():
    d = ready()
    pool = DeviceSlotPool(d)
    pool.reserve("a", 300, shared=True)
    pool.reserve("b", 300, shared=True)
    pool.commit("a", 300)
    view = pool.commit("b", 300)
    assert view.address == pool.address("a") + 512
    stream = d.stream_create()
    pinned = d.host_alloc(300)
    pinned[:] = 0x5A
    pool.upload("b", pinned, stream)
    d.stream_synchronize(stream)
    assert pool.copy_to_host("b") == b"\x5a" * 300 and pool.copy_to_host("a") == bytes(300)
    d.host_free(pinned)
    d.stream_destroy(stream)
    pool.close()


def test_decommit_keeps_the_others_and_the_last_one_unmaps_the_granule():
    d = ready()
    pool = DeviceSlotPool(d)
    for key in "abc":
        pool.reserve(key, 4 * K, shared=True)
        pool.page_in(key, key.encode() * (4 * K))
    base = pool.address("a")
    pool.decommit("a")
    assert pool.committed_bytes("a") == 0 and pool.committed_bytes() == G and base in d.mappings
    with pytest.raises(DeviceError, match="read of an evicted slot"):
        pool.copy_to_host("a")
    with pytest.raises(DeviceError, match="upload to an evicted slot"):
        pool.upload("a", b"x")
    assert pool.copy_to_host("b") == b"b" * (4 * K) and pool.copy_to_host("c") == b"c" * (4 * K)
    pool.decommit("a")  # evicted already: nothing to do
    pool.decommit("b")
    assert base in d.mappings and pool.counters().evictions == 0  # nothing unmapped yet
    pool.decommit("c")
    assert d.mappings == {} and d.used == 0 and pool.committed_bytes() == 0
    assert base in d.reservations  # the shared range stays reserved
    c = pool.counters()
    assert (c.page_ins, c.evictions, c.peak_committed_bytes) == (1, 1, G)
    assert mem_calls(d) == ["cuMemAddressReserve", "cuMemCreate", "cuMemMap", "cuMemSetAccess",
                            "cuMemUnmap", "cuMemRelease"]
    pool.close()


def test_an_object_comes_back_at_its_address_after_evict():
    d = ready()
    pool = DeviceSlotPool(d)
    pool.reserve("x", 700, shared=True)
    pool.reserve("y", 700, shared=True)
    y = pool.address("y")
    pool.page_in("x", b"\x01" * 700)
    pool.page_in("y", b"\x02" * 700)
    pool.decommit("y")  # x holds the granule
    again = pool.page_in("y", b"\x03" * 700)
    assert again.address == y == pool.view("y").address and pool.counters().page_ins == 1
    assert pool.copy_to_host("x") == b"\x01" * 700 and pool.copy_to_host("y") == b"\x03" * 700
    pool.decommit("x")
    pool.decommit("y")  # the granule goes: the next commit maps a fresh one at the same address
    assert pool.commit("y", 700).address == y and pool.counters().page_ins == 2
    assert pool.copy_to_host("y") == bytes(700)  # fresh memory: the caller uploads
    with pytest.raises(OnnxPrepError, match="changed size"):
        pool.commit("y", 701)
    pool.close()


def test_first_fit_fills_an_earlier_granule_before_the_newest():
    d = ready(granularity=64 * K)
    pool = DeviceSlotPool(d)
    pool.reserve("a", 40 * K, shared=True)
    pool.reserve("b", 30 * K, shared=True)  # 24 KiB left in the first: a second granule
    pool.reserve("c", 20 * K, shared=True)  # fits the first's 24 KiB
    pool.reserve("d", 64 * K, shared=True)  # exactly a granule: a third, all its own share
    first, second = pool.address("a"), pool.address("b")
    assert second // (64 * K) != first // (64 * K) and pool.address("c") == first + 40 * K
    assert pool.address("d") not in (first, second) and pool.is_shared("d")
    assert sorted(d.reservations.values()) == [64 * K] * 3
    for key in "abcd":
        pool.commit(key, {"a": 40, "b": 30, "c": 20, "d": 64}[key] * K)
    assert pool.committed_bytes() == 3 * 64 * K and len(d.mappings) == 3
    pool.close()
    assert d.reservations == {} and d.used == 0


def test_an_object_larger_than_a_granule_is_not_shared():
    d = ready()
    pool = DeviceSlotPool(d)
    pool.reserve("small", 100, shared=True)
    pool.reserve("big", G + 1, shared=True)
    assert not pool.is_shared("big") and pool.is_shared("small")
    assert pool.address("big") % G == 0 and d.reservations[pool.address("big")] == 2 * G
    pool.page_in("big", b"\x07" * (G + 1))
    pool.page_in("small", b"\x08" * 100)
    assert pool.committed_bytes("big") == 2 * G and pool.committed_bytes() == 3 * G
    assert pool.copy_to_host("big") == b"\x07" * (G + 1)
    pool.close()


def test_a_shared_reservation_too_small_is_placed_again_before_its_first_commit_only():
    d = ready()
    pool = DeviceSlotPool(d)
    pool.reserve("w", 100, shared=True)  # the estimate was too low
    pool.reserve("next", 100, shared=True)
    low = pool.address("w")
    view = pool.commit("w", 300)  # 512 bytes: a new share after "next", the old 256 unused
    assert view.address == low + 512 and pool.address("w") == view.address and pool.is_shared("w")
    pool.reserve("v", 100, shared=True)
    pool.commit("v", 3 * G)  # larger than a granule now: a range of its own
    assert not pool.is_shared("v") and pool.address("v") % G == 0
    assert d.reservations[pool.address("v")] == 3 * G
    assert pool.committed_bytes() == G + 3 * G
    pool.close()
    assert d.reservations == {} and d.mappings == {} and d.used == 0


def test_the_budget_counts_a_shared_granule_once():
    d = ready(memory=64 * MiB)
    pool = DeviceSlotPool(d, budget=2 * G)
    pool.commit("own", G)
    for key in ("n0", "n1", "n2"):
        pool.reserve(key, G // 4, shared=True)  # three in the first shared granule
    pool.reserve("n3", G // 2, shared=True)  # does not fit its last quarter: a second granule
    pool.commit("n0", G // 4)
    assert pool.committed_bytes() == 2 * G == pool.budget
    pool.commit("n1", G // 4)  # its granule is mapped: nothing more to admit
    pool.commit("n2", G // 4)
    assert pool.headroom() == 0 and pool.counters().page_ins == 2
    calls = len(d.calls)
    with pytest.raises(DeviceBudgetError, match=r"paging in 2,097,152 device bytes would pass the device budget "
                                                r"\(4,194,304 of 4,194,304 committed\)"):
        pool.commit("n3", G // 2)
    assert len(d.calls) == calls  # refused before cuMemCreate
    assert pool.committed_bytes("n3") == 0 and len(d.live_handles()) == 2
    pool.decommit("own")
    pool.commit("n3", G // 2)
    c = pool.counters()
    assert c.committed_bytes == 2 * G and c.peak_committed_bytes == 2 * G == d.used
    # a shared commit that needs a new shared range is refused before it is reserved
    pool.decommit("n3")
    pool.commit("own", G)
    reserved = dict(d.reservations)
    with pytest.raises(DeviceBudgetError, match="would pass the device budget"):
        pool.commit("unreserved", 100)  # never reserved: a range of its own, one granule
    assert d.reservations == reserved
    pool.close()
    assert d.reservations == {} and d.mappings == {} and d.used == 0 and not d.live_handles()


def test_concurrent_commits_and_decommits_map_a_shared_granule_once():
    d = ready()
    pool = DeviceSlotPool(d)
    keys = [f"k{i}" for i in range(8)]
    for k in keys:
        pool.reserve(k, 4 * K, shared=True)
    barrier = threading.Barrier(len(keys))
    errors = []

    def churn(key):
        barrier.wait()
        try:
            for _ in range(50):
                pool.commit(key, 4 * K)
                pool.upload(key, key.encode().ljust(4 * K, b"."))
                assert pool.copy_to_host(key) == key.encode().ljust(4 * K, b".")
                pool.decommit(key)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=churn, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    c = pool.counters()
    assert c.committed_bytes == 0 and d.mappings == {} and c.page_ins == c.evictions >= 1
    assert c.peak_committed_bytes == G  # one granule, however the threads interleaved
    pool.close()


def test_close_frees_shared_and_own_ranges_whatever_is_resident():
    d = ready()
    pool = DeviceSlotPool(d)
    for key in ("resident", "evicted", "never"):
        pool.reserve(key, 100, shared=True)
    pool.reserve("other granule", G, shared=True)
    pool.reserve("own", 3 * G)
    pool.page_in("resident", b"r" * 100)
    pool.commit("evicted", 100)
    pool.decommit("evicted")
    pool.commit("other granule", G)
    pool.commit("own", 3 * G)
    assert len(d.reservations) == 3 and len(d.mappings) == 3
    pool.close()  # the fake refuses freeing a range with a mapping in it
    assert d.reservations == {} and d.mappings == {} and d.used == 0 and not d.live_handles()
    assert pool.counters().evictions == 0  # close is not an eviction
    with pytest.raises(DeviceError, match="closed"):
        pool.reserve("late", 100, shared=True)
