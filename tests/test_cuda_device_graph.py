"""DeviceGraphRunner (core/cuda/device_graph.py) on the fake driver, which runs every
kernel through its CPU twin on the device bytes: a real ONNX graph built here (two
INT4 MatMulNBits packed by this package and paged into a DeviceSlotPool, a SiLU gate
(fused into QuickGelu at resolve) over a Split, a bias Add, a Reshape to heads from host-computed shape values, a
Transpose, a Div; beside it, int64 positions cast, unsqueezed, scaled, through Cos and
Sin and concatenated) gives the CPU runtime's outputs; under a StepGraph the step is
captured once and replayed with new feeds, and new shapes capture it again; a node the
device cannot run is refused, named, before anything touches the device."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from fake_cuda_driver import ready
from onnx import TensorProto, helper, numpy_helper

from onnx_prep import native
from onnx_prep.core.cuda.arena_layout import ArenaLayout
from onnx_prep.core.cuda.device_graph import DeviceGraphRunner, DeviceObject
from onnx_prep.core.cuda.device_slot_pool import DeviceSlotPool
from onnx_prep.core.cuda.graph_capture import capture_decision
from onnx_prep.core.cuda.step_graph import StepGraph
from onnx_prep.core.errors import DeviceError
from onnx_prep.core.kernels.prepack import prepack_all
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.runtime.action_program import ActionProgram
from onnx_prep.fixtures.int4_weights import block_scales, int4_codes, tensor_rng

HIDDEN, WIDTH, HEADS, BLOCK, FREQS = 32, 32, 4, 16, 4
# The device INT4 matmul computes the CPU kernel's FMA mode; the CPU runtime's kernel
# may accumulate in another order (within fp32 reassociation), so what the matmuls feed
# ("out", of magnitude ~5) agrees to a few ulp of their sums, not bit for bit. The rest
# (the positions' table: a cast, a Mul, cos / sin, a Concat, a Sub) is the same fp32
# arithmetic on both sides and equal exactly on the fake (a GPU's cosf / sinf are
# within 2 ulp of it).
RTOL, ATOL = 1e-5, 1e-5
EXACT = ("rot_shifted", "heads_shape")


def _matmul_nbits(rng, name: str, k: int, n: int, inits: list) -> None:
    inits += [numpy_helper.from_array(int4_codes(rng, n, k, BLOCK, symmetric=True), f"{name}_q"),
              numpy_helper.from_array(block_scales(rng, n, k, BLOCK, gain=2.0).reshape(-1), f"{name}_scales")]


def build_model(path, *, extra: list | None = None, extra_outputs: list | None = None):
    rng = tensor_rng(7, "device-graph")
    inits: list = []
    _matmul_nbits(rng, "w1", HIDDEN, 2 * WIDTH, inits)
    _matmul_nbits(rng, "w2", WIDTH, HIDDEN, inits)
    inits += [numpy_helper.from_array(rng.standard_normal(HIDDEN).astype(np.float32), "bias"),
              numpy_helper.from_array(np.array([WIDTH, WIDTH], np.int64), "split_sizes"),
              numpy_helper.from_array(np.array([HEADS, HIDDEN // HEADS], np.int64), "head_dims"),
              numpy_helper.from_array(np.array([0, 1], np.int64), "lead_axes"),
              numpy_helper.from_array(np.array(2.0, np.float32), "two"),
              numpy_helper.from_array(np.array([-1], np.int64), "last_axis"),
              numpy_helper.from_array((1.0 / 10000 ** (np.arange(FREQS) / FREQS)).astype(np.float32), "inv_freq")]
    ms = "com.microsoft"
    nodes = [
        helper.make_node("MatMulNBits", ["x", "w1_q", "w1_scales"], ["h"], "up", domain=ms,
                         K=HIDDEN, N=2 * WIDTH, bits=4, block_size=BLOCK),
        helper.make_node("Split", ["h", "split_sizes"], ["gate", "up_out"], "split", axis=-1),
        helper.make_node("Sigmoid", ["gate"], ["gate_sig"], "sigmoid"),
        helper.make_node("Mul", ["gate", "gate_sig"], ["silu"], "silu"),
        helper.make_node("Mul", ["silu", "up_out"], ["gated"], "gated"),
        helper.make_node("MatMulNBits", ["gated", "w2_q", "w2_scales"], ["down"], "down", domain=ms,
                         K=WIDTH, N=HIDDEN, bits=4, block_size=BLOCK),
        helper.make_node("Add", ["down", "bias"], ["biased"], "add_bias"),
        # the heads' shape from x's own: int64 values computed on the host
        helper.make_node("Shape", ["x"], ["x_shape"], "shape"),
        helper.make_node("Gather", ["x_shape", "lead_axes"], ["lead"], "lead", axis=0),
        helper.make_node("Concat", ["lead", "head_dims"], ["heads_shape"], "heads_shape", axis=0),
        helper.make_node("Reshape", ["biased", "heads_shape"], ["heads"], "to_heads"),
        helper.make_node("Transpose", ["heads"], ["heads_t"], "transpose", perm=[0, 2, 1, 3]),
        helper.make_node("Div", ["heads_t", "two"], ["out"], "halve"),
        # positions -> cos | sin, as a rotary table is made
        helper.make_node("Cast", ["positions"], ["pos_f"], "cast", to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["pos_f", "last_axis"], ["pos_u"], "unsqueeze"),
        helper.make_node("Mul", ["pos_u", "inv_freq"], ["angles"], "angles"),
        helper.make_node("Cos", ["angles"], ["cos"], "cos"),
        helper.make_node("Sin", ["angles"], ["sin"], "sin"),
        helper.make_node("Concat", ["cos", "sin"], ["rot"], "rot", axis=-1),
        helper.make_node("Sub", ["rot", "two"], ["rot_shifted"], "shift"),
        *(extra or []),
    ]
    graph = helper.make_graph(
        nodes, "device-graph",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", HIDDEN]),
         helper.make_tensor_value_info("positions", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", HEADS, "seq", HIDDEN // HEADS]),
         helper.make_tensor_value_info("rot_shifted", TensorProto.FLOAT, ["batch", "seq", 2 * FREQS]),
         helper.make_tensor_value_info("heads_shape", TensorProto.INT64, [4]), *(extra_outputs or [])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ms, 1)])
    model.ir_version = 8
    onnx.save_model(model, str(path))
    return resolve_model(path)


def feeds(seed: int, batch: int = 1, seq: int = 3) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, seq, HIDDEN)).astype(np.float32),
            "positions": rng.integers(0, 4096, (batch, seq)).astype(np.int64)}


@pytest.fixture
def model(tmp_path):
    resolved = build_model(tmp_path / "m.onnx")
    packed = prepack_all(resolved, lambda name: resolved.inline_values[name])
    return resolved, packed


@pytest.fixture
def device():
    d = ready(memory=256 << 20)
    pool = DeviceSlotPool(d)
    yield d, pool
    pool.close()


def _on_device(pool, packed) -> dict:
    return {key: DeviceObject(pool.page_in(key, array), native.packed_header(array)) for key, array in packed.items()}


def _assert_cpu(got: dict, resolved, packed, f) -> None:
    want = ActionProgram.compile(resolved).run(f, packed)
    assert set(got) == set(want)
    for name in want:
        assert got[name].shape == want[name].shape and got[name].dtype == want[name].dtype, name
        if name in EXACT:
            assert np.array_equal(got[name], want[name]), name
        else:
            np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)


def test_the_model_resolves_to_the_kernels_the_runner_dispatches(model):
    resolved, packed = model
    kernels = {n.name: n.kernel for n in resolved.nodes}
    assert kernels["up"] == kernels["down"] == "int4_matmul" and len(packed) == 2
    assert {kernels[n] for n in ("split", "to_heads", "transpose", "cos", "rot", "cast")} == {"numpy"}
    # the SiLU gate, fused at resolve into QuickGelu: on the device its two kernels again
    assert kernels["silu"] == "activation" and "sigmoid" not in kernels


def test_the_device_run_gives_the_cpu_runtimes_outputs(model, device):
    resolved, packed = model
    d, pool = device
    with DeviceGraphRunner(resolved, d, prepared=_on_device(pool, packed)) as runner:
        # the shape values run on the host; Reshape and Unsqueeze are views: no launch
        assert set(runner.host_nodes) == {"shape", "lead", "heads_shape"}
        for seed, (batch, seq) in enumerate([(1, 3), (2, 5), (1, 1), (3, 9)]):
            f = feeds(seed, batch, seq)
            step = runner.prepare(f)
            # up, split (2 copies), QuickGelu (sigmoid, mul), the gate's mul, down, add, transpose, div, cast, mul, cos, sin,
            # concat (2 copies), sub: 17 launches; the views and the host nodes launch nothing
            assert [op[2].name for op in step.ops if op[0] == "launch"] == [
                "int4_matmul_gemv_m" + str(next(r for r in (1, 2, 4, 8) if r >= batch * seq))
                if batch * seq <= 8 else "int4_matmul_tiled", "copy_strided_b32", "copy_strided_b32",
                "sigmoid_f32", "mul_f32", "mul_f32", "int4_matmul_gemv_m" + str(next(
                    r for r in (1, 2, 4, 8) if r >= batch * seq)) if batch * seq <= 8 else "int4_matmul_tiled",
                "add_f32", "copy_strided_b32", "div_f32", "cast_i64_f32", "mul_f32", "cos_f32", "sin_f32",
                "copy_strided_b32", "copy_strided_b32", "sub_f32"]
            got = runner.run(f)
            _assert_cpu(got, resolved, packed, f)
            assert got["heads_shape"].tolist() == [batch, seq, HEADS, HIDDEN // HEADS]  # a host output
        assert runner.last_mode == "eager"
    assert d.live()["allocations"] == 0 and d.live()["host_buffers"] == 0 and d.live()["streams"] == 0


def test_values_give_their_place_back_after_their_last_reader(model, device):
    resolved, packed = model
    d, pool = device
    with DeviceGraphRunner(resolved, d, prepared=_on_device(pool, packed)) as runner:
        f = feeds(0, 4, 16)
        runner.run(f)
        rows = 4 * 16
        # every device value of the step, 256-byte rounded, if none gave its place back
        values = [HIDDEN, 2 * WIDTH, WIDTH, WIDTH, WIDTH, WIDTH, WIDTH, HIDDEN, HIDDEN, HIDDEN, HIDDEN]
        everything = sum(-(-rows * w * 4 // 256) * 256 for w in values)
        assert runner._arena_size < everything / 2


def test_a_step_graph_captures_once_and_replays_with_new_feeds(model, device):
    resolved, packed = model
    d, pool = device
    with DeviceGraphRunner(resolved, d, prepared=_on_device(pool, packed)) as runner:
        decision = capture_decision(offload_enabled=False, stable_va=True, kv_capacity_fixed=True, host_ops=0)
        with StepGraph(d, runner.stream, decision) as graph:
            f = feeds(1, 2, 4)
            _assert_cpu(runner.run(f, graph), resolved, packed, f)
            assert runner.last_mode == "captured"
            launches = d.names().count("cuLaunchKernel")
            for seed in (2, 3, 4):  # same shapes, new values: the graph replays them
                f = feeds(seed, 2, 4)
                _assert_cpu(runner.run(f, graph), resolved, packed, f)
                assert runner.last_mode == "replayed"
            assert d.names().count("cuLaunchKernel") == launches  # replays launch no kernel one by one
            c = graph.counters()
            assert (c.captures, c.replays, c.fallbacks, c.invalidations) == (1, 3, 0, 0)

            f = feeds(5, 3, 7)  # new shapes: another key, captured again
            _assert_cpu(runner.run(f, graph), resolved, packed, f)
            assert runner.last_mode == "captured" and graph.counters().invalidations == 1
            eager = runner.run(f)  # the same step issued eagerly agrees with the replay
            replayed = runner.run(f, graph)
            assert runner.last_mode == "replayed"
            for name in eager:
                assert np.array_equal(eager[name], replayed[name])
    assert d.live()["graphs"] == 0


def test_a_node_without_a_device_launcher_is_refused_before_anything_runs(tmp_path, device):
    d, pool = device
    resolved = build_model(tmp_path / "m.onnx", extra=[helper.make_node("Relu", ["out"], ["relu"], "the_relu"),
                                                       helper.make_node("Cast", ["rot"], ["rot16"], "to_half",
                                                                        to=TensorProto.FLOAT16),
                                                       helper.make_node("QuickGelu", ["out"], ["gelu"], "gelu",
                                                                        domain="com.microsoft", alpha=1.702)],
                           extra_outputs=[helper.make_tensor_value_info("relu", TensorProto.FLOAT, None),
                                          helper.make_tensor_value_info("rot16", TensorProto.FLOAT16, None),
                                          helper.make_tensor_value_info("gelu", TensorProto.FLOAT, None)])
    packed = prepack_all(resolved, lambda name: resolved.inline_values[name])
    prepared = _on_device(pool, packed)
    del prepared[next(iter(prepared))]  # one prepared object not on the device
    calls = len(d.calls)
    with pytest.raises(DeviceError) as info:
        DeviceGraphRunner(resolved, d, prepared=prepared)
    message = str(info.value)
    assert "4 node(s) cannot run on the device" in message
    assert "Relu node the_relu: no device launcher for Relu (kernel numpy)" in message
    # (the fourth, past the three a message names in full)
    assert "its device kernels compute x * sigmoid(x) (alpha 1), alpha is 1.702" in dict(info.value.refused)["gelu"]
    assert "Cast node to_half: no device Cast from float32 to float16" in message
    assert "MatMulNBits node up: its prepared object" in message and "is not on the device" in message
    assert info.value.where.node == "up"  # the first, in node order
    assert d.calls[calls:] == []  # nothing was compiled, allocated or launched


def test_a_refusal_of_many_nodes_names_the_first_three_and_counts_the_rest_by_op(tmp_path, device):
    d, pool = device
    relus = [helper.make_node("Relu", ["out" if i == 0 else f"r{i - 1}"], [f"r{i}"], f"relu_{i}") for i in range(5)]
    resolved = build_model(tmp_path / "m.onnx", extra=relus,
                           extra_outputs=[helper.make_tensor_value_info("r4", TensorProto.FLOAT, None)])
    packed = prepack_all(resolved, lambda name: resolved.inline_values[name])
    with pytest.raises(DeviceError) as info:
        DeviceGraphRunner(resolved, d, prepared=_on_device(pool, packed))
    message = info.value.one_line()
    assert "5 node(s) cannot run on the device: Relu node relu_0: no device launcher for Relu (kernel numpy); " \
        "Relu node relu_1: " in message and "; and 2 more (2 Relu)" in message and "relu_3" not in message
    assert [name for name, _ in info.value.refused] == [f"relu_{i}" for i in range(5)]  # all of them, for callers


def test_a_builder_exports_ops_all_have_a_place_on_the_host_or_the_device(device):
    """onnxruntime-genai's builder graph (fp32 embedding Gather, SiLU, the sequence lengths
    from the attention mask, the fused decoder ops): every op runs on the host or has a
    launcher, so the runner is built; only the shape values and the mask's sums stay on
    the host (test_cuda_device_decode.py decodes it)."""
    from conftest import real_export
    from onnx_prep.core.cuda.device_slot_pool import DeviceView

    d, _ = device
    resolved = resolve_model(real_export("builder-llama-acc1-b32-zp"))
    # the check reads which objects and weights are given, not their bytes
    given = {key: DeviceObject(DeviceView(0, 0), None) for key in resolved.requests}
    weights = {name: np.zeros(0, np.float32) for name in ActionProgram.compile(resolved).weight_names}
    with DeviceGraphRunner(resolved, d, prepared=given, weights=weights) as runner:
        op_of = {n.name: n.op_type for n in resolved.nodes}
        # ReduceSum / Sub / Cast of the mask have no device kernel: on the host
        assert {op_of[n] for n in runner.host_nodes} <= {"Shape", "Constant", "ReduceSum", "Sub", "Cast", "Gather",
                                                         "Concat", "Unsqueeze", "Squeeze", "Reshape", "Slice"}
        assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"} <= {
            op_of[n.name] for n, h in zip(resolved.nodes, runner._host) if not h}
    assert "model.embed_tokens.weight" in weights

    del weights["model.embed_tokens.weight"]  # the embedding's raw weight not given: named
    with pytest.raises(DeviceError, match=r"Gather node /model/embed_tokens/Gather: its raw weight "
                                          r"model.embed_tokens.weight was not given \(weights=\)"):
        DeviceGraphRunner(resolved, d, prepared=given, weights=weights)


def test_a_step_that_cannot_be_made_is_refused_naming_its_node_before_anything_is_issued(model, device):
    resolved, packed = model
    d, pool = device
    with DeviceGraphRunner(resolved, d, prepared=_on_device(pool, packed)) as runner:
        launches = d.names().count("cuLaunchKernel")
        f = feeds(0)
        f["x"] = np.zeros((1, 3, HIDDEN + 1), np.float32)
        with pytest.raises(DeviceError, match=r"MatMulNBits input A of shape \[1, 3, 33\] does not end in K=32") as info:
            runner.run(f)
        assert info.value.where.node == "up"
        assert d.names().count("cuLaunchKernel") == launches and d.names().count("cuMemcpyHtoDAsync") == 0
        _assert_cpu(runner.run(feeds(1)), resolved, packed, feeds(1))  # the runner is still usable


def test_the_arena_layout_reuses_given_back_places_first_fit_and_merged():
    layout = ArenaLayout()
    a, b, c = layout.alloc(100), layout.alloc(300), layout.alloc(10)
    assert (a, b, c) == (0, 256, 768) and layout.end == 1024  # 256-byte places
    layout.release(b, 300)
    assert layout.alloc(200) == 256  # first fit, in the hole
    layout.release(a, 100)
    layout.release(256, 200)
    assert layout.alloc(700) == 0 and layout.end == 1024  # [0, 768) merged from three places
    assert layout.alloc(1) == 1024
