"""StepGraph on the fake driver, whose graphs replay exactly the captured launches and
copies with their captured addresses, running the INT4 matmul for real: a step
captured once and replayed; replay after evict → page-in of a weight under its stable
address reads the NEW contents (the issue's test (1), on the fake); a changed address
is an invalidation and a re-capture; a declined capture runs eagerly with the
predicate's reason; a failed capture leaves no capture open, runs eagerly, names the
driver's error and is not retried for the same key; the counters say each of these."""
from __future__ import annotations

import numpy as np
import pytest
from cuda_steps import MatmulStep, matmul_case
from cuda_steps import fake_device as device  # noqa: F401 (a fixture)

from onnx_prep.core.cuda.graph_capture import capture_decision
from onnx_prep.core.cuda.step_graph import StepGraph

CAPTURABLE = capture_decision(offload_enabled=True, stable_va=True, kv_capacity_fixed=True, host_ops=0)


def counts(graph: StepGraph) -> tuple:
    c = graph.counters()
    return c.captures, c.replays, c.fallbacks, c.invalidations


def test_a_step_is_captured_once_then_replayed_with_new_inputs(device):
    d, pool, stream = device
    case = matmul_case(10, 1, 128, 70, 32, "u4", bias=True)
    step = MatmulStep(d, pool, "w", case)
    with StepGraph(d, stream, CAPTURABLE) as graph:
        assert graph.run(step, step.key) == "captured"
        launches = d.names().count("cuLaunchKernel")
        d.stream_synchronize(stream)
        assert np.array_equal(step.y(), case.cpu())
        rng = np.random.default_rng(1)
        for _ in range(3):
            A = rng.standard_normal(case.A.shape).astype(np.float32)
            step.set_a(A)  # the pinned buffer the graph copies from
            assert graph.run(step, step.key) == "replayed"
            d.stream_synchronize(stream)
            assert np.array_equal(step.y(), case.cpu(A))
        assert counts(graph) == (1, 3, 0, 0)
        assert d.names().count("cuLaunchKernel") == launches  # replays issue no launch of their own
        assert d.names().count("cuGraphLaunch") == 4 and d.launched == [step.plan.name] * 4
        assert graph.reason.startswith("captured (capturable (")
    assert d.live()["graphs"] == 0  # closing destroyed the graph and its executable
    step.close()


def test_replay_after_evict_and_page_in_reads_the_new_weight_under_the_same_address(device):
    d, pool, stream = device
    first, second = matmul_case(11, 4, 256, 90, 128, "float"), matmul_case(12, 4, 256, 90, 128, "float")
    step = MatmulStep(d, pool, "w", first)
    address = step.view.address
    graph = StepGraph(d, stream, CAPTURABLE)
    graph.run(step, step.key)
    d.stream_synchronize(stream)
    assert np.array_equal(step.y(), first.cpu())
    pool.decommit("w")  # evicted: physical memory released, the range kept
    assert pool.page_in("w", second.packed).address == address  # other bytes, same address
    assert graph.run(step, step.key) == "replayed"  # the key did not change: no re-capture
    d.stream_synchronize(stream)
    assert np.array_equal(step.y(), second.cpu(first.A)), "the replay read the old weight"
    assert counts(graph) == (1, 1, 0, 0) and pool.counters().evictions == 1
    graph.close()
    step.close()


def test_a_moved_buffer_invalidates_the_graph_and_is_captured_again(device):
    d, pool, stream = device
    case = matmul_case(13, 2, 64, 40, 16)
    step = MatmulStep(d, pool, "w", case)
    graph = StepGraph(d, stream, CAPTURABLE)
    graph.run(step, step.key)
    old_y = step.y_dev
    step.y_dev = d.mem_alloc(4 * 2 * 40)  # the output moved: the captured graph would write the old one
    assert graph.run(step, step.key) == "captured"
    d.stream_synchronize(stream)
    assert np.array_equal(step.y(), case.cpu())
    assert d.copy_to_host(step.y_dev, 4 * 2 * 40) == case.cpu().tobytes()
    assert counts(graph) == (2, 0, 0, 1)
    assert d.live()["graphs"] == 2  # the first graph and its executable were destroyed
    graph.close()
    d.mem_free(old_y)
    step.close()


def test_a_declined_capture_runs_eagerly_and_names_the_predicate_and_its_inputs(device):
    d, pool, stream = device
    case = matmul_case(14, 1, 64, 20, 32)
    step = MatmulStep(d, pool, "w", case)
    declined = capture_decision(offload_enabled=True, stable_va=False, kv_capacity_fixed=True, host_ops=0)
    graph = StepGraph(d, stream, declined)
    for _ in range(2):
        assert graph.run(step, step.key) == "eager"
        d.stream_synchronize(stream)
        assert np.array_equal(step.y(), case.cpu())
    assert counts(graph) == (0, 0, 2, 0)
    assert graph.reason == "capture declined: paged weights need stable addresses (offload_enabled=True stable_va=False)"
    assert "cuStreamBeginCapture" not in d.names()
    step.close()


def test_a_failed_capture_ends_it_runs_eagerly_and_is_not_retried_for_the_same_key(device):
    d, pool, stream = device
    case = matmul_case(15, 1, 64, 20, 32)
    step = MatmulStep(d, pool, "w", case)
    pageable = np.zeros(4 * 64, np.uint8)  # not host_alloc's: a captured copy from it is refused
    pageable[:] = step.a_host

    def with_a_pageable_copy(stream):
        d.copy_to_device_async(step.a_dev, pageable, stream)
        step(stream)

    graph = StepGraph(d, stream, CAPTURABLE)
    assert graph.run(with_a_pageable_copy, step.key) == "eager"
    assert stream.capture is None  # the capture was ended
    d.stream_synchronize(stream)
    assert np.array_equal(step.y(), case.cpu())  # the eager run computed the step
    assert graph.reason.startswith("capture failed: cuMemcpyHtoDAsync failed: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
    assert graph.run(with_a_pageable_copy, step.key) == "eager"
    assert d.names().count("cuStreamBeginCapture") == 1  # the same key is not captured again
    assert graph.run(step, ("another key",)) == "captured"  # a new key is
    assert counts(graph) == (1, 0, 2, 0)
    graph.close()
    step.close()


def test_a_step_that_raises_leaves_no_capture_open(device):
    d, pool, stream = device

    def broken(stream):
        raise RuntimeError("a bug in the step")

    graph = StepGraph(d, stream, CAPTURABLE)
    with pytest.raises(RuntimeError, match="a bug in the step"):
        graph.run(broken, ("k",))
    assert stream.capture is None and counts(graph) == (0, 0, 0, 0)
    d.begin_capture(stream)  # the stream can capture again
    d.graph_destroy(d.end_capture(stream))
