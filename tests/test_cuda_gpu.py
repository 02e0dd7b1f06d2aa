"""The stable-VA device slots on a real CUDA device, through cuda-python's driver
(core/cuda/cuda_python_driver.py): discovery reports the device, a key keeps its device
address across evict → page-in with the new bytes under it, sizes are whole granules of
what the driver reports, the budget holds, close frees the ranges. Each test skips,
with discovery's one-line reason, where CUDA is not usable (this CI has no GPU)."""
from __future__ import annotations

import pytest

from onnx_prep.core.cuda.device_probe import probe_devices

PROBE = probe_devices()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not PROBE.usable, reason=f"needs a CUDA device: {PROBE.one_line()}")]


@pytest.fixture
def driver():
    from onnx_prep.core.cuda.cuda_python_driver import load_driver

    d = load_driver()
    d.init()
    if not d.vmm_supported(0):
        pytest.skip(f"device 0 ({d.device_name(0)}) has no virtual memory management")
    return d


def test_discovery_reports_the_device_and_its_granularity():
    d = PROBE.devices[0]
    assert d.name and d.total_memory > 0 and d.compute_capability[0] >= 3
    if d.vmm_supported:
        assert d.granularity > 0 and d.granularity & (d.granularity - 1) == 0


def test_address_identity_across_evict_and_page_in_on_the_device(driver):
    from onnx_prep.core.cuda.device_slot_pool import DeviceSlotPool

    with DeviceSlotPool(driver) as pool:
        g = pool.granularity
        pool.reserve("w", 2 * g)
        address = pool.address("w")
        first = bytes(range(256)) * (g // 256) + b"\x07" * 5
        assert pool.page_in("w", first).address == address
        assert pool.copy_to_host("w") == first
        pool.decommit("w")
        second = bytes(reversed(range(256))) * (g // 256) + b"\x09" * 5
        assert pool.page_in("w", second).address == address  # new physical memory, same address
        assert pool.copy_to_host("w") == second
        c = pool.counters()
        assert (c.page_ins, c.evictions, c.committed_bytes) == (2, 1, 2 * g)
        assert c.host_to_device_bytes == 2 * len(first)


def test_the_budget_holds_on_the_device(driver):
    from onnx_prep.core.cuda.device_slot_pool import DeviceSlotPool
    from onnx_prep.core.errors import DeviceBudgetError

    g = driver.allocation_granularity(0)
    with DeviceSlotPool(driver, budget=3 * g) as pool:
        pool.commit("a", 2 * g)
        with pytest.raises(DeviceBudgetError):
            pool.commit("b", g + 1)
        pool.decommit("a")
        pool.commit("b", g + 1)
        assert pool.counters().peak_committed_bytes == 2 * g
