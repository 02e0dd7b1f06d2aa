"""The device INT4 matmul and step graphs on a real CUDA device, through cuda-python
(core/cuda/cuda_python_driver.py): the kernels compiled by NVRTC for the device, their
results against the float64 reference and the CPU kernel on random shapes (M = 1, 2,
4, 8, 32; K and N not multiples of the 64-column panel; block sizes 32 and 128; every
zero-point kind), and a captured graph replayed after the physical memory under a
weight's stable address was swapped for other contents (the issue's test (1)). Each
test skips, with discovery's one-line reason, where CUDA is not usable (this CI).

Tolerance: the bound the CPU's FMA mode is held to (test_native_reference.level_bounds,
one fp32 rounding per term of the longest chain, times the fold magnitude |A| x
(|code| + |zero|) |scale|) plus GEMV_WARPS roundings for the GEMV's warp sums, against
float64; and twice that against the CPU kernel's own fp32 result."""
from __future__ import annotations

import numpy as np
import pytest
from cuda_steps import GPU_MARKS, MatmulStep, matmul_case
from cuda_steps import gpu_device as device  # noqa: F401 (a fixture)
from test_native_reference import FP32_UNIT_ROUNDOFF, assert_close_rel, dequantize_matmul_nbits, fold_weights, \
    level_bounds, matmul_reference

from onnx_prep import native
from onnx_prep.core.cuda.device_int4_matmul import GEMV_WARPS
from onnx_prep.core.cuda.graph_capture import capture_decision

pytestmark = GPU_MARKS


def assert_matches(got: np.ndarray, case, what: str) -> None:
    B, s, z = case.sources
    K, N = case.A.shape[1], got.shape[1]
    bs = native.packed_header(case.packed).block_size
    W = dequantize_matmul_nbits(B, s, z, K=K, N=N, block_size=bs)
    want, _ = matmul_reference(case.A, W, case.bias)
    mag = np.abs(case.A.astype(np.float64)) @ fold_weights(B, s, z, K=K, N=N, block_size=bs)
    if case.bias is not None:
        mag = mag + np.abs(case.bias)
    rel = level_bounds(case.A, W, mag, K=K, block_size=bs, level="fma")[0] + GEMV_WARPS * FP32_UNIT_ROUNDOFF
    assert_close_rel(got, want, mag, rel, f"{what} vs float64")
    assert_close_rel(got, case.cpu(), mag, 2 * rel, f"{what} vs the CPU kernel")


@pytest.mark.parametrize("M", [1, 2, 4, 8, 32])
@pytest.mark.parametrize("bs,K,N", [(32, 1001, 129), (128, 700, 333)])  # A rows unaligned / aligned
@pytest.mark.parametrize("zp", ["none", "u4", "float"])
def test_the_device_kernels_match_the_cpu_kernels(device, M, bs, K, N, zp):
    d, pool, stream = device
    case = matmul_case(M * 7919 + K + N, M, K, N, bs, zp, bias=(M == 2))
    key = f"w-{M}-{bs}-{zp}"
    step = MatmulStep(d, pool, key, case)
    try:
        step(stream)
        d.stream_synchronize(stream)
        assert_matches(step.y(), case, step.plan.name)
    finally:
        step.close()
        pool.decommit(key)


def test_a_decode_sized_gemv_matches_and_is_timed_by_events(device):
    d, pool, stream = device
    case = matmul_case(99, 1, 4096, 4096, 32, "u4")
    step = MatmulStep(d, pool, "big", case)
    start, end = d.event_create(), d.event_create()
    try:
        step(stream)  # the first launch loads the module's code on the device
        d.event_record(start, stream)
        step(stream)
        d.event_record(end, stream)
        d.event_synchronize(end)
        assert d.event_elapsed_ms(start, end) > 0
        assert_matches(step.y(), case, step.plan.name)
    finally:
        d.event_destroy(start)
        d.event_destroy(end)
        step.close()
        pool.decommit("big")


def test_a_replayed_graph_reads_the_new_weight_after_its_memory_was_swapped(device):
    from onnx_prep.core.cuda.step_graph import StepGraph

    d, pool, stream = device
    first, second = matmul_case(21, 1, 512, 200, 32, "u4"), matmul_case(22, 1, 512, 200, 32, "u4")
    step = MatmulStep(d, pool, "swapped", first)
    address = step.view.address
    decision = capture_decision(offload_enabled=True, stable_va=True, kv_capacity_fixed=True, host_ops=0)
    graph = StepGraph(d, stream, decision)
    try:
        assert graph.run(step, step.key) == "captured"
        d.stream_synchronize(stream)
        assert_matches(step.y(), first, "captured")
        pool.decommit("swapped")  # unmapped and released: the range stays reserved
        assert pool.page_in("swapped", second.packed).address == address  # new physical memory, same address
        assert graph.run(step, step.key) == "replayed"
        d.stream_synchronize(stream)
        second.A = first.A  # the step's input is still first.A
        assert_matches(step.y(), second, "replayed after the swap")
        c = graph.counters()
        assert (c.captures, c.replays, c.fallbacks, c.invalidations) == (1, 1, 0, 0)
    finally:
        graph.close()
        step.close()
        pool.decommit("swapped")
