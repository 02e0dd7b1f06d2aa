"""A decode step captured once and replayed (issue #20): the KV cache kept on the device
at a fixed capacity (core/cuda/device_kv_cache.py) by DeviceDecoder, on the fake driver.

The model, built here, is the builder's form in small: an fp32 embedding, per layer an
INT4 MatMulNBits to packed QKV and GroupQueryAttention (rotary inside) over its past,
the sequence lengths from the attention mask on the host, an INT4 LM head. Decoded by
the decode loop (greedy_decode) through DeviceDecoder:

- the CPU runtime's tokens over TOKENS steps, with capture on and off, all resident and
  streamed under a budget of one granule (a segment per weight);
- the counters: each segment captured once for the prefill and once for the decode step,
  replayed on every later step, no fallback, no invalidation; the KV buffers allocated
  once; a second generation at the same batch replays the decode graphs;
- what is declined, with the reason: the tiny fixture's fused Attention (its KV through
  the host, capture declined, its tokens as before), a step whose past the decoder did
  not return (run through the host), a prompt with no capacity known.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from fake_cuda_driver import MiB, ready
from onnx import TensorProto, helper, numpy_helper

from onnx_prep.core.cuda.device_decoder import DeviceDecoder
from onnx_prep.core.cuda.device_kv_cache import kv_pairs
from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.decode.generation import greedy_decode, next_past, step_feeds
from onnx_prep.core.errors import DeviceError
from onnx_prep.core.kernels.prepack import prepack_all
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.runtime.action_program import ActionProgram
from onnx_prep.fixtures.int4_weights import block_scales, int4_codes, tensor_rng

G = 2 * MiB  # the fake's granularity
TOKENS = 9
LAYERS, N, KN, H, V, BLOCK, MAX_POS = 2, 4, 2, 16, 96, 16, 64
D = N * H
QKV = (N + 2 * KN) * H
PROMPTS = {1: [[3, 1, 4, 1, 5]], 2: [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]]}
MS = "com.microsoft"


def _nbits(rng, name: str, k: int, n: int, inits: list) -> None:
    inits += [numpy_helper.from_array(int4_codes(rng, n, k, BLOCK, symmetric=True), f"{name}_q"),
              numpy_helper.from_array(block_scales(rng, n, k, BLOCK, gain=2.0).reshape(-1), f"{name}_scales")]


def build_gqa_decoder(path):
    rng = tensor_rng(5, "device-kv")
    angles = rng.uniform(-np.pi, np.pi, (MAX_POS, H // 2))
    inits = [numpy_helper.from_array(rng.standard_normal((V, D)).astype(np.float32), "embed"),
             numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
             numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin"),
             numpy_helper.from_array(np.array([1], np.int64), "one_axis"),
             numpy_helper.from_array(np.array(1, np.int64), "one"),
             numpy_helper.from_array(np.array(1, np.int64), "index_1")]
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Gather", ["embed", "input_ids"], ["x0"], "embed", axis=0),
             helper.make_node("ReduceSum", ["attention_mask", "one_axis"], ["mask_sum"], "mask_sum", keepdims=0),
             helper.make_node("Sub", ["mask_sum", "one"], ["seqlens64"], "seqlens64"),
             helper.make_node("Cast", ["seqlens64"], ["seqlens_k"], "seqlens", to=TensorProto.INT32),
             helper.make_node("Shape", ["attention_mask"], ["mask_shape"], "mask_shape"),
             helper.make_node("Gather", ["mask_shape", "index_1"], ["total64"], "total64", axis=0),
             helper.make_node("Cast", ["total64"], ["total"], "total", to=TensorProto.INT32)]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"])]
    outputs = [helper.make_tensor_value_info("logits", f, ["batch", "seq", V])]
    x = "x0"
    for i in range(LAYERS):
        _nbits(rng, f"qkv{i}", D, QKV, inits)
        past, present = f"past_key_values.{i}", f"present.{i}"
        nodes += [helper.make_node("MatMulNBits", [x, f"qkv{i}_q", f"qkv{i}_scales"], [f"qkv{i}"], f"qkv{i}",
                                   domain=MS, K=D, N=QKV, bits=4, block_size=BLOCK),
                  helper.make_node("GroupQueryAttention", [f"qkv{i}", "", "", f"{past}.key", f"{past}.value",
                                                           "seqlens_k", "total", "cos", "sin"],
                                   [f"attn{i}", f"{present}.key", f"{present}.value"], f"gqa{i}", domain=MS,
                                   num_heads=N, kv_num_heads=KN, do_rotary=1),
                  helper.make_node("Add", [f"attn{i}", x], [f"x{i + 1}"], f"residual{i}")]
        x = f"x{i + 1}"
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"{past}.{kind}", f, ["batch", KN, "past", H]))
            outputs.append(helper.make_tensor_value_info(f"{present}.{kind}", f, ["batch", KN, "total", H]))
    _nbits(rng, "lm", D, V, inits)
    nodes.append(helper.make_node("MatMulNBits", [x, "lm_q", "lm_scales"], ["logits"], "lm_head", domain=MS,
                                  K=D, N=V, bits=4, block_size=BLOCK))
    graph = helper.make_graph(nodes, "gqa-decoder", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    onnx.save_model(model, str(path))
    return resolve_model(path)


class CpuRunner:
    """The CPU runtime's program over the same packed objects: the reference."""

    def __init__(self, resolved, packed):
        self.program, self.packed = ActionProgram.compile(resolved), packed

    def run(self, feeds):
        return self.program.run(feeds, self.packed)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    resolved = build_gqa_decoder(tmp_path_factory.mktemp("kv") / "gqa.onnx")
    packed = prepack_all(resolved, lambda name: resolved.inline_values[name])
    io = DecoderIO.discover(resolved.inputs, resolved.outputs, None)
    return resolved, packed, io


@pytest.fixture(scope="module")
def cpu_tokens(model):
    resolved, packed, io = model
    return {b: greedy_decode(CpuRunner(resolved, packed), io, np.array(p), TOKENS) for b, p in PROMPTS.items()}


def _decode(model, batch, *, generations=1, driver=None, **kwargs):
    """``generations`` decodes of PROMPTS[batch] by one DeviceDecoder (on the fake unless
    ``driver``): the results, its counters, and how often it allocated KV buffers."""
    resolved, packed, io = model
    d = ready(memory=256 << 20) if driver is None else driver
    with DeviceDecoder(resolved, d, packed, **kwargs) as dec:
        results = [greedy_decode(dec, io, np.array(PROMPTS[batch]), TOKENS, keep_logits=True)
                   for _ in range(generations)]
        counters, allocations = dec.counters(), dec.kv.allocations if dec.kv else None
        counters["kv_on_device"] = dec.kv_reason == "kept on the device at a fixed capacity"
    if driver is None:
        live = d.live()
        assert all(n == 0 for k, n in live.items() if k != "modules"), live  # the KV buffers given back too
    return results, counters, allocations


def test_the_builders_form_keeps_its_kv_on_the_device(model):
    resolved, _, _ = model
    pairs, ids, why = kv_pairs(resolved)
    assert why == "" and ids == "input_ids"
    assert pairs == tuple((f"past_key_values.{i}.{k}", f"present.{i}.{k}") for i in range(LAYERS)
                          for k in ("key", "value"))


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("capture", [True, False])
def test_a_decode_step_is_captured_once_and_replayed_with_the_cpu_runtimes_tokens(model, cpu_tokens, batch,
                                                                                    capture):
    (got,), c, allocations = _decode(model, batch, capture=capture)
    want = cpu_tokens[batch]
    assert got.tokens.tolist() == want.tokens.tolist()
    np.testing.assert_allclose(got.first_logits, want.first_logits, rtol=0, atol=2e-4)
    segments = c["segments_per_step"]
    assert c["kv_on_device"] and allocations == 1 and c["steps"] == TOKENS
    if capture:  # the prefill's graph and the decode step's, per segment; every later step replays
        assert (c["captures"], c["replays"], c["fallbacks"], c["invalidations"]) == (
            2 * segments, segments * (TOKENS - 2), 0, 0), c
        assert c["capture"] and c["capture_reason"].startswith("capturable (host_ops=0 kv_capacity_fixed=True")
    else:
        assert (c["captures"], c["replays"], c["fallbacks"]) == (0, 0, 0)


def test_streamed_under_a_budget_each_segment_is_captured_once_the_same_tokens(model, cpu_tokens):
    (resident,), _, _ = _decode(model, 2)
    (got,), c, _ = _decode(model, 2, budget=G)  # one granule: the three weights take turns in it
    assert got.tokens.tolist() == cpu_tokens[2].tokens.tolist()
    assert all(np.array_equal(a, b) for a, b in zip(got.logits, resident.logits))
    segments = c["segments_per_step"]
    assert segments == LAYERS + 1 and c["evictions"] > 0
    assert (c["captures"], c["replays"], c["fallbacks"], c["invalidations"]) == (
        2 * segments, segments * (TOKENS - 2), 0, 0), c


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 2])
def test_on_a_device_the_decode_step_is_captured_once_and_replayed_with_the_cpu_runtimes_tokens(
        model, cpu_tokens, batch):
    """On a real device (skipped here, with discovery's reason): the CPU runtime's tokens
    with capture on and off, and streamed under one of the device's granules; every
    segment captured for the prefill and the decode step, replayed after, no fallback."""
    from test_cuda_weight_residency import _real_driver

    drv = _real_driver()
    want = cpu_tokens[batch].tokens.tolist()
    for kwargs in ({"capture": False}, {}, {"budget": drv.allocation_granularity(0)}):
        (got,), c, _ = _decode(model, batch, driver=drv, **kwargs)
        assert got.tokens.tolist() == want, kwargs
        if kwargs.get("capture", True):
            segments = c["segments_per_step"]
            assert (c["captures"], c["replays"], c["fallbacks"]) == (
                2 * segments, segments * (TOKENS - 2), 0), (kwargs, c)


def test_a_second_generation_at_the_same_batch_replays_the_decode_graphs(model, cpu_tokens):
    (first, second), c, allocations = _decode(model, 1, generations=2)
    assert first.tokens.tolist() == second.tokens.tolist() == cpu_tokens[1].tokens.tolist()
    segments = c["segments_per_step"]
    assert allocations == 1  # the same buffers: the same keys
    assert (c["captures"], c["replays"], c["fallbacks"], c["invalidations"]) == (
        2 * segments, segments * (2 * TOKENS - 2), 0, 0), c


def test_prompts_longer_than_a_decode_step_prefill_on_the_device_with_the_cpu_runtimes_tokens(model):
    """Prompts of 40 then 12 tokens (GroupQueryAttention's prefill on the device, its KV
    in the device buffers, captured) by one DeviceDecoder, then the 40 again: each the
    CPU runtime's tokens; a prompt of another length is captured again, not replayed
    (a captured prefill holds its row count in its launches' grids)."""
    resolved, packed, io = model
    rng = np.random.default_rng(40)
    prompts = [rng.integers(0, V, (1, n)) for n in (40, 12)]
    prompts.append(prompts[0])
    d = ready(memory=256 << 20)
    with DeviceDecoder(resolved, d, packed) as dec:
        for prompt in prompts:
            want = greedy_decode(CpuRunner(resolved, packed), io, prompt, TOKENS)
            got = greedy_decode(dec, io, prompt, TOKENS)
            assert got.tokens.tolist() == want.tokens.tolist(), prompt.shape
            np.testing.assert_allclose(got.first_logits, want.first_logits, rtol=0, atol=2e-4)
        c = dec.counters()
        assert dec.kv_reason == "kept on the device at a fixed capacity" and c["fallbacks"] == 0, c
        # each generation's prefill and decode step captured (the capacity, prompt + tokens, changes), replayed after
        assert (c["captures"], c["replays"]) == (2 * 3, 3 * (TOKENS - 2)), c
    attends = [call[2] for call in d.calls if call[:2] == ("cuLaunchKernel", "decoder_gqa_attend")]
    assert (N, 40, 1) in attends and (N, 12, 1) in attends


def test_a_past_the_decoder_did_not_return_runs_through_the_host(model):
    resolved, packed, io = model
    prompt = np.array(PROMPTS[1])
    cpu = CpuRunner(resolved, packed)
    with DeviceDecoder(resolved, ready(memory=256 << 20), packed, kv_capacity=16) as dec:
        out = cpu.run(step_feeds(io, prompt, io.empty_past(1), 0))  # the CPU's own past, fed to the device
        past = next_past(io, out, prompt.shape[1])
        feeds = step_feeds(io, np.array([[7]]), past, prompt.shape[1])
        got, want = dec.run(feeds), cpu.run(feeds)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
        c = dec.counters()
    assert c["fallbacks"] == c["segments_per_step"] and c["captures"] == 0
    assert c["capture_reason"] == "eager: the step's KV came through the host " \
                                  "(a past this decoder did not return was fed (run through the host))"


def test_without_a_capacity_the_prompt_runs_through_the_host_and_a_full_cache_is_refused(model):
    resolved, packed, io = model
    prompt = np.array(PROMPTS[1])
    with DeviceDecoder(resolved, ready(memory=256 << 20), packed) as dec:  # no room_for, no kv_capacity
        out = dec.run(step_feeds(io, prompt, io.empty_past(1), 0))
        assert out["present.0.key"].shape == (1, KN, 5, H) and np.isfinite(out["present.0.key"]).all()
        assert "no KV capacity for the prompt's 5 rows (capacity 0" in dec.reason
    with DeviceDecoder(resolved, ready(memory=256 << 20), packed, kv_capacity=6) as dec:
        out = dec.run(step_feeds(io, prompt, io.empty_past(1), 0))
        out = dec.run(step_feeds(io, np.array([[7]]), next_past(io, out, 5), 5))
        with pytest.raises(DeviceError, match=r"the device KV cache holds 6 rows: 6 held and 1 new do not fit"):
            dec.run(step_feeds(io, np.array([[8]]), next_past(io, out, 6), 6))


def test_the_tiny_fixtures_fused_attention_keeps_its_kv_on_the_host_and_says_why():
    from onnx_prep.core.cuda.device_decoder import open_device_decoder
    from onnx_prep.fixtures import default_model_path

    resolved = resolve_model(default_model_path())
    pairs, _, why = kv_pairs(resolved)
    assert pairs == () and why.startswith("only GroupQueryAttention's past is kept on the device; its attention "
                                          "is Attention node")
    with open_device_decoder(resolved, ready(memory=256 << 20)) as dec:
        c = dec.counters()
        assert dec.kv is None and dec.kv_reason == f"fed from the host: {why}"
    assert not c["capture"]
    assert c["capture_reason"] == ("capture declined: the KV cache must not move between steps "
                                   f"(kv_capacity_fixed=False) (the KV cache is fed from the host: {why})")


def test_a_decode_step_copies_in_the_ids_and_lengths_and_out_the_logits_only(model):
    """The past stays where the last step left it: no KV row crosses to or from the host."""
    from onnx_prep.core.ops import append_buffer

    resolved, packed, io = model
    prompt = np.array(PROMPTS[2])
    with DeviceDecoder(resolved, ready(memory=256 << 20), packed) as dec, append_buffer.room_for(12):
        out = dec.run(step_feeds(io, prompt, io.empty_past(2), 0))
        assert out["present.1.value"].shape == (2, KN, 5, H) and np.isnan(out["present.1.value"]).all()
        feeds = step_feeds(io, np.array([[1], [2]]), next_past(io, out, 5), 5)
        resident, phase = dec.kv.take(feeds)
        assert phase == "decode" and {t.shape for t in resident.values()} == {(2, KN, 12, H)}
        step = dec.runner.prepare(feeds, resident=resident, keep=dec.kv.presents)
        copies = [(op[0], op[2].nbytes if op[0] == "htod" else op[1].nbytes) for op in step.ops
                  if op[0] != "launch"]
    # the status word zeroed, the ids (int64), seqlens_k (int32); the logits and the status word back
    assert copies == [("htod", 4), ("htod", 2 * 8), ("htod", 2 * 4), ("dtoh", 2 * V * 4), ("dtoh", 4)]
