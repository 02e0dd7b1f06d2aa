"""The device tensor ops and the device graph runner on a real CUDA device, through
cuda-python: tensor_ops.cu compiled by NVRTC for the device, each op against numpy (the
arithmetic and the copies bit for bit; cosf / sinf within 4 ulp, CUDA's bound being 2;
Sigmoid within 2^-22 absolute, 4 ulp of its values in [0.5, 1): its 1 + tanh cancels), and the graph of test_cuda_device_graph.py run eagerly and under a StepGraph
against the CPU runtime. Each test skips, with discovery's one-line reason, where CUDA
is not usable (this CI)."""
from __future__ import annotations

import numpy as np
import pytest
from cuda_steps import GPU_MARKS
from cuda_steps import gpu_device as device  # noqa: F401 (a fixture)
from test_cuda_device_graph import EXACT, _on_device, build_model, feeds
from test_cuda_device_tensor_ops import Buffers

from onnx_prep.core.cuda.graph_capture import capture_decision
from onnx_prep.core.kernels.prepack import prepack_all
from onnx_prep.core.runtime.action_program import ActionProgram

pytestmark = GPU_MARKS


@pytest.fixture
def ops(device):
    from onnx_prep.core.cuda.device_tensor_ops import DeviceTensorOps

    d, _, stream = device
    bufs = Buffers(d)
    yield DeviceTensorOps(d), bufs, d, stream
    d.stream_synchronize(stream)
    bufs.close()


def test_the_tensor_ops_on_a_device_equal_numpy(ops):
    dev, bufs, d, stream = ops
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 3, 1, 40)).astype(np.float32)
    b = (rng.standard_normal((3, 7, 1)) + 3).astype(np.float32)
    out = np.broadcast_shapes(a.shape, b.shape)
    results = {}
    for op, fn in (("Add", np.add), ("Sub", np.subtract), ("Mul", np.multiply), ("Div", np.divide)):
        y = bufs.empty(out)
        dev.binary(stream, op, y, bufs.put(a), a.shape, bufs.put(b), b.shape)
        results[op] = (y, fn(a, b))
    x = (rng.standard_normal(5000) * 30).astype(np.float32)
    half = np.float32(0.5)
    unary = {"Sigmoid": (np.tanh(x * half) + np.float32(1)) * half, "Cos": np.cos(x), "Sin": np.sin(x)}
    ys = {}
    for op in unary:
        ys[op] = bufs.empty(x.shape)
        dev.unary(stream, op, ys[op], bufs.put(x), x.size)
    t = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    yt = bufs.empty((2, 4, 3, 5))
    dev.transpose(stream, yt, bufs.put(t), t.shape, (0, 2, 1, 3))
    ids = np.array([[5, 0, -1]], np.int64)
    table = rng.standard_normal((6, 9)).astype(np.float32)
    yg = bufs.empty((1, 3, 9))
    dev.gather(stream, yg, bufs.put(table), table.shape, bufs.put(ids), ids.shape)
    pos = np.array([0, 3, 2**24 + 1, -(2**40)], np.int64)
    yc = bufs.empty(pos.shape)
    dev.cast(stream, yc, bufs.put(pos), pos.size, "int64", "float32")
    d.stream_synchronize(stream)
    for op, (y, want) in results.items():
        assert np.array_equal(bufs.get(y, out), want), op
    for op, want in unary.items():
        if op == "Sigmoid":  # in ulps of tanh: 1 + tanh cancels (test_cuda_tensor_ops_emulated.py found it)
            assert np.max(np.abs(bufs.get(ys[op], x.shape).astype(np.float64) - want)) <= 2.0**-22, op
        else:
            np.testing.assert_array_max_ulp(bufs.get(ys[op], x.shape), want.astype(np.float32), maxulp=4)
    assert np.array_equal(bufs.get(yt, (2, 4, 3, 5)), t.transpose(0, 2, 1, 3))
    assert np.array_equal(bufs.get(yg, (1, 3, 9)), table[ids])
    assert np.array_equal(bufs.get(yc, pos.shape), pos.astype(np.float32))


def test_the_graph_runner_on_a_device_gives_the_cpu_runtimes_outputs_eager_and_replayed(device, tmp_path):
    from onnx_prep.core.cuda.device_graph import DeviceGraphRunner
    from onnx_prep.core.cuda.step_graph import StepGraph

    d, pool, _ = device
    resolved = build_model(tmp_path / "m.onnx")
    packed = prepack_all(resolved, lambda name: resolved.inline_values[name])
    cpu = ActionProgram.compile(resolved)
    decision = capture_decision(offload_enabled=False, stable_va=True, kv_capacity_fixed=True, host_ops=0)
    with DeviceGraphRunner(resolved, d, prepared=_on_device(pool, packed)) as runner, \
            StepGraph(d, runner.stream, decision) as graph:
        for seed, shape in enumerate([(1, 1), (1, 1), (2, 6), (2, 6), (1, 40)]):
            f = feeds(seed, *shape)
            want = cpu.run(f, packed)
            for got in (runner.run(f), runner.run(f, graph)):
                for name in want:
                    if name in EXACT and name != "rot_shifted":
                        assert np.array_equal(got[name], want[name]), name
                    else:  # the matmuls' accumulation order; cosf / sinf's ulps
                        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4, err_msg=name)
        c = graph.counters()
        assert (c.captures, c.replays, c.invalidations) == (3, 2, 2)
