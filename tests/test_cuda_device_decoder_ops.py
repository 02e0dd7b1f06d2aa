"""The device decoder ops (core/cuda/device_decoder_ops.py) through their whole call
sequence on the fake driver, which runs each entry of decoder_ops.cu through this
package's CPU kernel on its device bytes (tests/fake_cuda_decoder_ops.py): inputs
copied in, the launch(es), outputs copied back after the synchronisation, equal bit
for bit to the CPU op the runtime runs (core/ops, native): row_norm (every form and
output), rotary (both layouts, interleaved, per-token and start ids, in place), gqa
(decode and first prompts, shared and separate past, packed QKV, rotary inside, int32
seqlens), int4_gather (both packed kinds, every zero-point kind, negative indices).
What only the device sees (a bad position, index or seqlens_k) comes back as NaN and
a status bit; what the host can see is refused before any launch; the module is
compiled once per process and device. The real kernels: test_cuda_nvrtc.py (compiled)
and test_cuda_gpu_decoder_ops.py (run on a GPU)."""
from __future__ import annotations

import numpy as np
import pytest
from decoder_op_cases import (FUSED_PROMPT_CASES, GQA_CASES, Buffers, fused_attention_case, gather_case, gqa_case,
                              norm_case, rotary_case, tables_rotary_case)
from fake_cuda_driver import ready
from hypothesis import given
from hypothesis import strategies as st

from onnx_prep import native
from onnx_prep.core.cuda import device_decoder_ops
from onnx_prep.core.cuda.device_decoder_ops import (ENTRIES, DeviceDecoderOps, check_gqa_attributes, check_status,
                                                     kernel_source, plan_gqa, plan_int4_gather, plan_row_norm,
                                                     plan_rotary, status_problems)
from onnx_prep.core.cuda.device_slot_pool import DeviceView
from onnx_prep.core.cuda.driver import DriverCallError
from onnx_prep.core.errors import DeviceError


class Device:
    """A fake device with the ops loaded, a stream, and buffers freed at the end."""

    def __init__(self) -> None:
        self.d = ready(memory=256 << 20)
        self.d.use_device(0)
        self.ops = DeviceDecoderOps(self.d)
        self.stream = self.d.stream_create()
        self.bufs = Buffers(self.d)

    def run(self, case, **kwargs) -> dict:
        return case.device(self.ops, self.bufs, self.stream, **kwargs)

    def close(self) -> None:
        self.bufs.close()
        assert self.d.live()["allocations"] == 0


@pytest.fixture
def dev():
    device = Device()
    yield device
    device.close()


def assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        assert np.array_equal(got[name], want[name], equal_nan=True), f"{name}: not the CPU op's bits"


@given(rows=st.integers(1, 8), n=st.integers(1, 700), simplified=st.booleans(), skip=st.booleans(),
       beta=st.booleans(), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_row_norm_equals_the_cpu_op(rows, n, simplified, skip, beta, bias, seed):
    device = Device()
    try:
        case = norm_case(seed, rows, n, simplified=simplified, skip=skip, beta=beta, bias=bias)
        want = case.cpu()
        assert_same(device.run(case), want)
        assert device.d.launched == ["decoder_row_norm"]
    finally:
        device.close()


@pytest.mark.parametrize("B,S,heads,H,rot,transposed,interleaved,per_token", [
    (1, 1, 4, 64, 64, False, False, True), (2, 3, 3, 32, 16, False, True, True), (1, 5, 2, 16, 16, True, False, False),
    (3, 1, 8, 128, 64, True, True, True), (2, 8, 1, 8, 8, False, False, False), (1, 2, 5, 96, 32, True, False, True),
])
def test_rotary_equals_the_cpu_op(dev, B, S, heads, H, rot, transposed, interleaved, per_token):
    case = rotary_case(B * 100 + S * 10 + H, B, S, heads, H, rot, transposed=transposed, interleaved=interleaved,
                       per_token=per_token)
    want = case.cpu()
    assert_same(dev.run(case), want)
    assert_same(dev.run(case, in_place=True), want)  # y may be x
    assert dev.d.launched == ["decoder_rotary", "decoder_rotary"]




@pytest.mark.parametrize("B,heads,S,D,per_row", [(1, 4, 1, 64, False), (2, 3, 5, 32, True), (3, 2, 8, 16, False)])
def test_the_fused_rotary_reads_its_tables_in_place_and_equals_the_cpu_op(dev, B, heads, S, D, per_row):
    case = tables_rotary_case(B + S + D, B, heads, S, D, per_row=per_row)
    assert_same(dev.run(case), case.cpu())


@pytest.mark.parametrize("B,N,KN,S,H,P", [(1, 4, 4, 1, 32, 7), (2, 4, 1, 3, 16, 5), (1, 2, 2, 8, 64, 0)]
                         + FUSED_PROMPT_CASES)
def test_the_fused_attention_is_the_gqa_launches_over_bnsh_strides(dev, B, N, KN, S, H, P):
    case = fused_attention_case(B * 100 + S + P, B, N, KN, S, H, P)
    assert_same(dev.run(case), case.cpu())


@pytest.mark.parametrize("B,S,N,KN,H,P,options", GQA_CASES)
def test_gqa_equals_the_cpu_kernel(dev, B, S, N, KN, H, P, options):
    case = gqa_case(B * 1000 + S * 100 + P, B, S, N, KN, H, P, **options)
    want = case.cpu()
    got = dev.run(case)
    assert_same(got, want)
    assert dev.d.launched == ["decoder_gqa_append", "decoder_gqa_attend"]
    capacity = case.present[0].shape[2]
    assert (got["present_key"][:, :, case.present_len():] == 7.0).all()  # the room after the rows is not written
    assert capacity > case.present_len()


@pytest.mark.parametrize("V,K,bs,zp,tied", [
    (50, 64, 32, "none", False), (17, 256, 128, "u4", False), (9, 96, 16, "float", False),
    (130, 100, 32, "u4", True), (70, 64, 16, "none", True), (65, 200, 64, "float", True),
])
def test_int4_gather_equals_the_cpu_kernel(dev, V, K, bs, zp, tied):
    case = gather_case(V + K, V, K, bs, zp, 7, tied=tied)
    assert (case.indices < 0).any()
    want = case.cpu()
    assert_same(dev.run(case), want)
    assert_same(dev.run(case, ld_out=case.K + 5), want)  # rows written at their stride


def _status(dev) -> tuple[int, callable]:
    address = dev.bufs.put(np.zeros(1, np.uint32))
    return address, lambda: int(dev.bufs.get(address, (1,), np.uint32)[0])


def test_what_only_the_device_sees_is_nan_and_a_status_bit(dev):
    status, word = _status(dev)
    rot = rotary_case(1, 2, 3, 2, 16, 16, transposed=False, interleaved=False, per_token=True, max_pos=10)
    want = rot.cpu()["y"].reshape(2, 3, 32)
    rot.pos[1, 2] = 10  # one past the caches
    got = dev.run(rot, status=status)["y"].reshape(2, 3, 32)
    assert np.isnan(got[1, 2]).all() and not np.isnan(np.delete(got.reshape(6, 32), 5, 0)).any()
    assert np.array_equal(np.delete(got.reshape(6, 32), 5, 0), np.delete(want.reshape(6, 32), 5, 0))
    assert word() == 2

    gather = gather_case(2, 20, 64, 32, "u4", 4, tied=False)
    gather.indices[:] = [3, 20, -21, -1]
    rows = dev.run(gather, status=status)["rows"]
    assert np.isnan(rows[1:3]).all()
    assert np.array_equal(rows[[0, 3]], native.gather_block_quantized(gather.indices[[0, 3]], gather.packed))
    assert word() == 3

    gqa = gqa_case(3, 2, 1, 4, 2, 16, 6, shared=True)
    want = gqa.cpu()
    gqa.seqlens[1] = 40  # past the present buffers
    got = dev.run(gqa, status=status)
    assert np.isnan(got["out"][1]).all() and np.array_equal(got["out"][0], want["out"][0])
    assert np.array_equal(got["present_key"][1], gqa.present[0][1])  # row 1's present untouched
    assert np.array_equal(got["present_key"][0], want["present_key"][0])
    assert word() == 7
    assert len(status_problems(word())) == 3
    with pytest.raises(DeviceError, match=r"^device decoder ops flagged: int4_gather: an index .*; rotary: .*; "
                                          r"gqa: a row's seqlens_k does not fit"):
        check_status(word())
    check_status(0)
    assert status_problems(8) == ["unknown status bits 0x8"]


@pytest.mark.parametrize("call,error", [
    (lambda: plan_row_norm(0x100, 0x200, 0x300, 0, 8, epsilon=1e-5, simplified=True), "rows=0 must be"),
    (lambda: plan_row_norm(0x102, 0x200, 0x300, 1, 8, epsilon=1e-5, simplified=True), "x 0x102 is not 4-byte"),
    (lambda: plan_row_norm(0, 0x200, 0x300, 1, 8, epsilon=1e-5, simplified=True), "x is required"),
    (lambda: plan_row_norm(0x100, 0x200, 0x300, 3, 8, epsilon=1e-5, simplified=True, skip=0x400, skip_rows=2),
     "skip of 2 rows does not repeat over 3 rows"),
    (lambda: plan_row_norm(0x100, 0x200, 0x300, 1, 8, epsilon=-1.0, simplified=False), "epsilon -1 is negative"),
    (lambda: plan_row_norm(0x100, 0x200, 0x300, 1, 8, epsilon=1e-5, simplified=True, beta=0x400),
     "takes no beta"),
    (lambda: plan_row_norm(0x100, 0x200, 0x300, 1, 8, epsilon=1e-5, simplified=True, skip=0x400, skip_rows=1,
                           sum_out=0x100), "must not be the input"),
    (lambda: plan_rotary(0x100, 0x100, 0x200, 0x300, 0x400, batch=1, seq=1, heads=2, head_size=16, rotary_dim=18,
                         max_pos=8, transposed=False, interleaved=False, pos_per_token=True),
     "rotary dim 18 must be even, 2 .. head size 16"),
    (lambda: plan_rotary(0x100, 0x100, 0x204, 0x300, 0x400, batch=1, seq=1, heads=2, head_size=16, rotary_dim=16,
                         max_pos=8, transposed=False, interleaved=False, pos_per_token=True),
     "position_ids 0x204 is not 8-byte aligned"),
    (lambda: plan_rotary(0x100, 0x100, 0x200, 0x300, 0x400, batch=1, seq=70000, heads=2, head_size=16,
                         rotary_dim=16, max_pos=8, transposed=False, interleaved=False, pos_per_token=True),
     "seq=70000 must be 1 .. 65535"),
], ids=["no rows", "misaligned x", "null x", "skip rows", "negative epsilon", "rms beta", "sum aliases x",
        "rotary dim", "misaligned positions", "grid z"])
def test_norm_and_rotary_misuse_is_refused_before_a_launch(call, error):
    with pytest.raises(DeviceError, match=error):
        call()


def _gqa(**change):
    args = dict(q=0x1000, k=0x2000, v=0x3000, past_key=0x4000, past_value=0x5000, present_key=0x4000,
                present_value=0x5000, seqlens_k=0x6000, out=0x7000)
    shape = dict(batch=1, seq=1, num_heads=4, kv_num_heads=2, head_size=64, past_len=10, total_sequence_length=11,
                 past_stride=16, present_stride=16)
    for key, value in change.items():
        (args if key in args else shape)[key] = value
    return plan_gqa(*args.values(), **shape)


@pytest.mark.parametrize("change,error", [
    (dict(num_heads=5), "num_heads 5 is not a multiple of kv_num_heads 2"),
    (dict(head_size=60), "head size 60 is not a multiple of 8"),
    (dict(head_size=264), "head size 264 is over 256"),
    (dict(batch=2, seq=2, total_sequence_length=12), r"a continued prompt \(sequence 2, total 12\) needs batch 1"),
    (dict(past_value=0), "past_key and past_value must be both present or both absent"),
    (dict(present_stride=10), "row strides past 16 / present 10 are below"),
    (dict(past_stride=12), "past_key is present_key's buffer: one row stride, got 12 and 16"),
    (dict(cos_cache=0x8000), "cos_cache and sin_cache must be both present"),
    (dict(cos_cache=0x8000, sin_cache=0x9000, cache_rows=8, cache_width=16), r"cos/sin caches \[8, 16\] are not"),
    (dict(seqlens_dtype="float32"), "seqlens_k is float32"),
    (dict(seqlens_k=0x6004), "seqlens_k 0x6004 is not 8-byte aligned"),
    (dict(q_strides=(256, 64, 60)), r"strides of q \(256, 64, 60\) must each be at least the head size 64"),
    (dict(ld_out=100), "output row stride 100 is below 256"),
    (dict(batch=70000), "batch=70000 must be 1 .. 65535"),
], ids=lambda x: str(x)[:30])
def test_gqa_misuse_is_refused_before_a_launch(change, error):
    _gqa()  # the unchanged arguments plan
    with pytest.raises(DeviceError, match=error):
        _gqa(**change)


@pytest.mark.parametrize("attrs,error", [
    (dict(num_heads=4, kv_num_heads=3), "num_heads 4 is not a multiple of kv_num_heads 3"),
    (dict(num_heads=4, kv_num_heads=2, local_window_size=128), "local_window_size = 128: a sliding window"),
    (dict(num_heads=4, kv_num_heads=2, softcap=30.0), "softcap = 30.0"),
    (dict(num_heads=4, kv_num_heads=2, smooth_softmax=1), "smooth_softmax = 1"),
    (dict(num_heads=4), "must both be set and positive"),
])
def test_gqa_attributes_the_cpu_kernel_refuses_are_refused_by_name(attrs, error):
    with pytest.raises(DeviceError, match=error):
        check_gqa_attributes(attrs)
    check_gqa_attributes(dict(num_heads=4, kv_num_heads=2, local_window_size=-1, do_rotary=1))


def test_gather_misuse_is_refused_before_a_launch(dev):
    case = gather_case(4, 10, 64, 32, "none", 2, tied=False)
    header = native.packed_header(case.packed)
    view = DeviceView(0x10000, case.packed.nbytes)
    plan = plan_int4_gather(header, 0x1000, 2, view, 0x2000)
    assert (plan.name, plan.grid, plan.block) == ("decoder_int4_gather", (2, 1, 1), (256, 1, 1))
    assert [plan.arg(n) for n in ("kind", "V", "K", "block_size", "n_blocks", "zp_kind", "stride")] == [
        2, 10, 64, 32, 2, 0, header.panel_stride]
    for call, error in [
        (lambda: plan_int4_gather(header, 0x1000, 2, DeviceView(0x10000, 64), 0x2000), "the device view holds 64"),
        (lambda: plan_int4_gather(header, 0x1004, 2, view, 0x2000), "indices 0x1004 is not 8-byte aligned"),
        (lambda: plan_int4_gather(header, 0x1000, 0, view, 0x2000), "indices=0 must be"),
        (lambda: plan_int4_gather(header, 0x1000, 2, view, 0x2000, ld_out=63), "row stride 63 is below K=64"),
    ]:
        with pytest.raises(DeviceError, match=error):
            call()
    gemm = native.prepack_gemm_b(np.ones((8, 8), np.float32), trans_b=False)
    with pytest.raises(DeviceError, match="reads int4_gather or int4_matmul packed buffers, got a gemm"):
        plan_int4_gather(native.packed_header(gemm), 0x1000, 2, DeviceView(0x10000, gemm.nbytes), 0x2000)
    with pytest.raises(DeviceError, match="needs the packed header"):
        dev.ops.int4_gather(dev.stream, 0x1000, 2, view, 0x2000)
    assert "cuLaunchKernel" not in dev.d.names()


def test_each_launch_has_its_geometry_and_the_fake_checks_it(dev):
    plans = _gqa(batch=1, seq=3, total_sequence_length=13)
    assert [(p.name, p.grid, p.block) for p in plans] == [
        ("decoder_gqa_append", (2, 1, 1), (128, 1, 1)), ("decoder_gqa_attend", (4, 3, 1), (128, 1, 1))]
    assert plans[0].arg("present_len") == 13 and plans[0].arg("first_prompt") == 0
    # a prompt: an append block per 8 new rows, an attend block per row (a decode step's shape up to 8 rows)
    assert [p.grid for p in _gqa(seq=8, total_sequence_length=18, past_stride=18, present_stride=18)] == [
        (2, 1, 1), (4, 8, 1)]
    prompt = dict(past_len=0, past_key=0, past_value=0, past_stride=0)
    assert [p.grid for p in _gqa(seq=9, total_sequence_length=9, **prompt)] == [(2, 1, 2), (4, 9, 1)]
    assert [p.grid for p in _gqa(seq=2048, total_sequence_length=2048, present_stride=2048, **prompt)] == [
        (2, 1, 256), (4, 2048, 1)]
    # past a grid's y and z (65535 blocks) the kernels loop: the grid stops there
    assert [p.grid for p in _gqa(seq=600000, total_sequence_length=600000, present_stride=600000, **prompt)] == [
        (2, 1, 65535), (4, 65535, 1)]
    assert plans[0].arg("scale") == pytest.approx(1 / 8)
    norm = plan_row_norm(0x100, 0x200, 0x300, 5, 8, epsilon=1e-5, simplified=True)
    assert (norm.grid, norm.block) == ((5, 1, 1), (256, 1, 1))
    # a launch whose geometry is not the source's is refused by the fake (a device would run it wrong)
    with pytest.raises(DriverCallError, match=r"\(fake-only check\) decoder_row_norm runs as grid \(5, 1, 1\)"):
        dev.d.launch(dev.ops._functions[norm.name], (4, 1, 1), norm.block, 0, dev.stream, norm.args)
    with pytest.raises(DriverCallError, match="decoder_row_norm takes"):
        dev.d.launch(dev.ops._functions[norm.name], norm.grid, norm.block, 0, dev.stream, norm.args[:-1])


def test_a_captured_step_of_every_op_replays_with_new_device_inputs(dev):
    """The point of issue #20: the ops' launches captured once, replayed reading what is at
    their addresses now (a new position for rotary, a longer past for gqa)."""
    from onnx_prep.core.cuda.graph_capture import capture_decision
    from onnx_prep.core.cuda.step_graph import StepGraph

    d, ops, stream, bufs = dev.d, dev.ops, dev.stream, dev.bufs
    rot = rotary_case(5, 1, 1, 2, 16, 16, transposed=False, interleaved=False, per_token=True)
    x, y, pos = bufs.put(rot.x), bufs.put(np.zeros_like(rot.x)), bufs.put(rot.pos)
    cos, sin = bufs.put(rot.cos), bufs.put(rot.sin)

    def step(s):
        ops.rotary(s, x, y, pos, cos, sin, batch=1, seq=1, heads=2, head_size=16, rotary_dim=16, max_pos=64,
                   transposed=False, interleaved=False, pos_per_token=True)

    graph = StepGraph(d, stream, capture_decision(offload_enabled=True, stable_va=True, kv_capacity_fixed=True,
                                                  host_ops=0))
    try:
        assert graph.run(step, ("rotary", x, y, pos)) == "captured"
        d.stream_synchronize(stream)
        assert np.array_equal(bufs.get(y, rot.x.shape), rot.cpu()["y"])
        rot.pos[:] = 41
        d.copy_to_device(pos, rot.pos)
        assert graph.run(step, ("rotary", x, y, pos)) == "replayed"
        d.stream_synchronize(stream)
        assert np.array_equal(bufs.get(y, rot.x.shape), rot.cpu()["y"])
    finally:
        graph.close()


def test_the_kernels_are_compiled_once_per_process_and_device(monkeypatch):
    monkeypatch.setattr(device_decoder_ops._KERNELS, "loaded", {})
    d = ready(devices=2)
    DeviceDecoderOps(d, 0)
    DeviceDecoderOps(d, 0)
    DeviceDecoderOps(d, 1)
    loads = [c for c in d.calls if c[0] == "cuModuleLoadData"]
    assert loads == [("cuModuleLoadData", "decoder_ops.cu", 0), ("cuModuleLoadData", "decoder_ops.cu", 1)]


def test_the_fake_finds_every_entry_the_launches_name_in_the_source():
    d = ready()
    d.use_device(0)
    module = d.module_from_source(kernel_source(), "decoder_ops.cu", 0)
    assert module.entries == set(ENTRIES)
