"""The device decoder ops' CUDA code run on the host, where no GPU is: every entry of
``decoder_ops.cu`` (row_norm, rotary, the GQA append and attend, int4_gather),
unchanged, built by tests/cuda_host.py and launched by ``DeviceDecoderOps`` itself
through ``cuda_host.HostDriver`` (so with exactly the entries, grids, blocks and
arguments its ``plan_*`` functions decide), on the cases the fake-driver and GPU tests
run (decoder_op_cases.py), against the CPU ops.

Held to what device_decoder_ops.py and test_cuda_gpu_decoder_ops.py claim, with that
file's bounds by name: rotary (the fused one too), the gather, the present KV rows and
the Skip norms' sum bit for bit; the row norm within ``norm_bound``; the attention
output within ``gqa_bound`` / ``attention_bound`` (here the host's expf stands in for
libdevice's); what only the device sees (a bad position, index or seqlens_k) as NaN and
a status bit. The GPU test's shapes (decode steps, and prompts of 9, 33 and 300 rows:
GQA_CASES, FUSED_PROMPT_CASES), but for its past of 4000 keys (5 s here; the 2000-key
case of GQA_CASES already stages two chunks) and its 2048-row prompt (the blocks run
one after another here: ~1 minute; the 300-row ones take ~4 s); a prompt of more rows
than the grid holds (capped at 3 blocks) looped over in the blocks, the uncapped
launch's bits; and a misdescribed launch caught.

The fake driver's twins of these entries are the CPU kernels themselves
(fake_cuda_decoder_ops.py): this is where the kernels' own reductions, shuffles,
shared-memory staging and index arithmetic are checked without a GPU. Skipped, saying
so, without a C++20 compiler."""
from __future__ import annotations

import pytest
from cuda_host import host_driver
from decoder_op_cases import FUSED_PROMPT_CASES, GQA_CASES, Buffers, gqa_case, rotary_case
from test_cuda_gpu_decoder_ops import (assert_exact, assert_within, check_fused_attention, check_fused_rotary,
                                      check_gqa, check_int4_gather, check_row_norm, check_rotary, check_status_bits,
                                      gqa_bound)

from onnx_prep.core.cuda import device_decoder_ops
from onnx_prep.core.cuda.device_decoder_ops import DeviceDecoderOps


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    d = host_driver(tmp_path_factory)
    ops = DeviceDecoderOps(d)
    stream = d.stream_create()
    bufs = Buffers(d)
    yield ops, bufs, stream
    bufs.close()


def _run(device, case, **kwargs):
    ops, bufs, stream = device
    return case.device(ops, bufs, stream, **kwargs)


@pytest.mark.parametrize("rows,n", [(1, 512), (4, 4096), (8, 3000), (2, 17)])
@pytest.mark.parametrize("form", ["rms", "layer", "skip_rms", "skip_layer_bias"])
def test_row_norm_matches_the_cpu_op(device, rows, n, form):
    check_row_norm(device, rows, n, form)


@pytest.mark.parametrize("B,S,heads,H,rot,transposed,interleaved,per_token", [
    (1, 1, 32, 128, 128, False, False, True), (2, 3, 3, 32, 16, False, True, True),
    (1, 5, 8, 64, 64, True, False, False), (4, 1, 8, 128, 64, True, True, True),
])
def test_rotary_is_the_cpu_ops_bits(device, B, S, heads, H, rot, transposed, interleaved, per_token):
    check_rotary(device, B, S, heads, H, rot, transposed, interleaved, per_token)


@pytest.mark.parametrize("B,S,N,KN,H,P,options", GQA_CASES + [(4, 1, 16, 4, 64, 700, dict(shared=True,
                                                                                         seqlens_i32=True))])
def test_gqa_matches_the_cpu_kernel(device, B, S, N, KN, H, P, options):
    check_gqa(device, B, S, N, KN, H, P, options)


def test_a_prompt_over_the_grids_rows_loops_in_the_blocks(device, monkeypatch):
    """Rows past a grid's y (attend) and tiles past its z (append) are looped over by the
    blocks there are: with the grid capped at 3 blocks (65535 on a device), a 33-row
    prompt over a past gives the uncapped launch's bits, and the CPU kernel's within the
    bound."""
    case = gqa_case(7, 1, 33, 4, 2, 32, 5, shared=True, rotary=True)
    want, whole = case.cpu(), _run(device, case)
    monkeypatch.setattr(device_decoder_ops, "GRID_YZ_MAX", 3)
    append, attend = _gqa_plans(case)
    assert (append.grid, attend.grid) == ((2, 1, 3), (4, 3, 1))
    looped = _run(device, case)
    for name in ("out", "present_key", "present_value"):
        assert_exact(looped[name], whole[name], f"{name}, looped over the rows")
    assert_exact(looped["present_key"], want["present_key"], "present key")
    assert_within(looped["out"], want["out"], gqa_bound(case, want["out"]), "output")


def _gqa_plans(case):
    B, S, H = case.shape
    return device_decoder_ops.plan_gqa(0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x4000, 0x5000, 0x6000, 0x7000,
                                       batch=B, seq=S, num_heads=case.num_heads, kv_num_heads=case.kv_num_heads,
                                       head_size=H, past_len=case.past_len, total_sequence_length=case.total,
                                       past_stride=case.present[0].shape[2], present_stride=case.present[0].shape[2])


@pytest.mark.parametrize("B,N,KN,S,H,P", [(1, 32, 32, 1, 128, 500), (2, 8, 1, 4, 64, 37), (1, 4, 4, 8, 32, 0)]
                         + FUSED_PROMPT_CASES)
def test_the_fused_attention_matches_the_cpu_op(device, B, N, KN, S, H, P):
    check_fused_attention(device, B, N, KN, S, H, P)


@pytest.mark.parametrize("B,heads,S,D,per_row", [(1, 32, 1, 128, False), (2, 8, 6, 64, True)])
def test_the_fused_rotary_is_the_cpu_ops_bits(device, B, heads, S, D, per_row):
    check_fused_rotary(device, B, heads, S, D, per_row)


@pytest.mark.parametrize("V,K,bs,zp,tied", [
    (8192, 512, 32, "none", False), (300, 256, 128, "u4", False), (33, 96, 16, "float", False),
    (8192, 512, 32, "u4", True), (65, 200, 64, "float", True),
])
def test_int4_gather_is_the_cpu_kernels_bits(device, V, K, bs, zp, tied):
    check_int4_gather(device, V, K, bs, zp, tied)


def test_a_bad_position_index_and_seqlens_come_back_as_status_bits(device):
    check_status_bits(device)



def test_a_misdescribed_launch_is_caught(device):
    """The comparisons can fail: rotary launched with the other pairing (interleaved
    where the CPU op rotates halves) gives other bits."""
    case = rotary_case(5, 1, 2, 4, 32, 32, transposed=False, interleaved=False, per_token=True)
    want = case.cpu()["y"]
    case.attrs["interleaved"] = 1
    with pytest.raises(AssertionError, match="elements differ"):
        assert_exact(_run(device, case)["y"], want, "misdescribed rotary")
