"""The device decoder ops (decoder_ops.cu) on a real CUDA device, through cuda-python
(core/cuda/cuda_python_driver.py): the kernels compiled by NVRTC for the device, each
op's outputs against the CPU op's on the cases the fake-driver tests run
(decoder_op_cases.py: decode steps and prompts of 9, 33 and 300 rows), plus a long
past, a 2048-row prompt at the tiny fixture's shape and a wide norm, and the fused forms the
resolver makes of standard ops (onnx_prep.fused::RotaryEmbedding, ::Attention). Each test skips, with
discovery's one-line reason, where CUDA is not usable (this CI).

Tolerances, by name:

- EXACT (bit for bit): rotary (the fused one too), the gather, the present KV rows (copies and rotations)
  and the Skip norms' sum output: the kernels round each product and sum as the CPU
  kernels do (__fmul_rn / __fadd_rn; the CPU build contracts nothing: -std=c11);
- ``norm_bound``: the row norm's sums are reassociated (a thread's strided terms, then
  a tree of NORM_THREADS): per element, FP32_U x (2 (n / NORM_THREADS + log2
  NORM_THREADS) + 16) x (|v| + |mean|) x inv x |gamma| (+ FP32_U |beta|), twice that
  against the CPU's own fp32 result;
- ``gqa_bound`` (``attention_bound``; also the fused Attention's): the scores' dot products (lanes of 32, then a shuffle tree), libdevice's
  expf and the weighted sums (one FMA chain per output over the span) differ from the
  CPU's order: 2 FP32_U x ((span + 8) + 2 (H / 32 + 8) x scale ||q|| ||k||) x max |v|.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from decoder_op_cases import (FUSED_PROMPT_CASES, GQA_CASES, Buffers, fused_attention_case, gather_case, gqa_case,
                              norm_case, rotary_case, tables_rotary_case)

from onnx_prep.core.cuda.device_decoder_ops import NORM_THREADS, DeviceDecoderOps, check_status
from onnx_prep.core.cuda.device_probe import probe_devices

PROBE = probe_devices()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not PROBE.usable, reason=f"needs a CUDA device: {PROBE.one_line()}")]
FP32_U = 2.0 ** -24


@pytest.fixture(scope="module")
def device():
    from onnx_prep.core.cuda.cuda_python_driver import load_driver

    d = load_driver()
    d.init()
    d.use_device(0)
    ops = DeviceDecoderOps(d)
    stream = d.stream_create()
    bufs = Buffers(d)
    yield ops, bufs, stream
    bufs.close()
    d.stream_destroy(stream)


def _run(device, case, **kwargs):
    ops, bufs, stream = device
    return case.device(ops, bufs, stream, **kwargs)


# The checks this file and the host emulation (test_cuda_decoder_ops_emulated.py) both
# run, each on its own ``device`` fixture: (ops, buffers, stream).
def check_row_norm(device, rows, n, form):
    case = norm_case(rows * n, rows, n, simplified="rms" in form, skip=form.startswith("skip"), beta="layer" in form,
                     bias="bias" in form)
    want, got = case.cpu(), _run(device, case)
    assert_within(got["y"], want["y"], norm_bound(case), f"{form} y")
    if "sum" in want:
        assert_exact(got["sum"], want["sum"], f"{form} input_skip_bias_sum")


def check_rotary(device, B, S, heads, H, rot, transposed, interleaved, per_token):
    case = rotary_case(B + S + H, B, S, heads, H, rot, transposed=transposed, interleaved=interleaved,
                       per_token=per_token, max_pos=4096)
    want = case.cpu()["y"]
    assert_exact(_run(device, case)["y"], want, "rotary")
    assert_exact(_run(device, case, in_place=True)["y"], want, "rotary in place")


def check_gqa(device, B, S, N, KN, H, P, options):
    case = gqa_case(B * 1000 + S * 100 + P, B, S, N, KN, H, P, **options)
    want, got = case.cpu(), _run(device, case)
    assert_exact(got["present_key"], want["present_key"], "present key")
    assert_exact(got["present_value"], want["present_value"], "present value")
    assert_within(got["out"], want["out"], gqa_bound(case, want["out"]), "output")


def check_fused_attention(device, B, N, KN, S, H, P):
    case = fused_attention_case(B * 100 + S + P, B, N, KN, S, H, P)
    want, got = case.cpu(), _run(device, case)
    assert_exact(got["present_key"], want["present_key"], "present key")
    assert_exact(got["present_value"], want["present_value"], "present value")
    bound = attention_bound(case.q, want["present_key"], want["present_value"], P + S, H, case.scale)
    assert_within(got["out"], want["out"], np.full(want["out"].shape, bound), "output")


def check_fused_rotary(device, B, heads, S, D, per_row):
    case = tables_rotary_case(B + S + D, B, heads, S, D, per_row=per_row)
    assert_exact(_run(device, case)["y"], case.cpu()["y"], "fused rotary")


def check_int4_gather(device, V, K, bs, zp, tied):
    case = gather_case(V + K, V, K, bs, zp, 8, tied=tied)
    assert_exact(_run(device, case)["rows"], case.cpu()["rows"], "gathered rows")


def check_status_bits(device):
    """A bad position id, gather index and seqlens_k come back as NaN rows and the
    status word's bits (7), which check_status turns into one error."""
    ops, bufs, stream = device
    status = bufs.put(np.zeros(1, np.uint32))
    rot = rotary_case(1, 1, 2, 2, 16, 16, transposed=False, interleaved=False, per_token=True, max_pos=10)
    rot.pos[0, 1] = -1
    y = _run(device, rot, status=status)["y"].reshape(2, 32)
    assert np.isnan(y[1]).all() and not np.isnan(y[0]).any()
    gather = gather_case(2, 20, 64, 32, "u4", 2, tied=False)
    gather.indices[:] = [1, 99]
    rows = _run(device, gather, status=status)["rows"]
    assert np.isnan(rows[1]).all() and not np.isnan(rows[0]).any()
    gqa = gqa_case(3, 2, 1, 4, 2, 16, 6, shared=True)
    gqa.seqlens[0] = -5
    out = _run(device, gqa, status=status)["out"]
    assert np.isnan(out[0]).all() and not np.isnan(out[1]).any()
    word = int(bufs.get(status, (1,), np.uint32)[0])
    assert word == 7
    with pytest.raises(Exception, match="device decoder ops flagged"):
        check_status(word)


def assert_exact(got, want, what):
    assert got.shape == want.shape, what
    bad = np.argwhere(got.view(np.uint32) != want.view(np.uint32))
    assert not bad.size, f"{what}: {len(bad)} elements differ, first at {tuple(bad[0])}: {got[tuple(bad[0])]!r} " \
                         f"vs {want[tuple(bad[0])]!r}"


def assert_within(got, want, bound, what):
    err = np.abs(got.astype(np.float64) - want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound + 1e-30).all(), f"{what}: |error| {err[worst]:.3g} over the bound {bound[worst]:.3g} at " \
                                         f"{worst}"


def norm_bound(case) -> np.ndarray:
    rows, n = case.x.shape
    v = case.x.astype(np.float64) + (0 if case.skip is None else case.skip) + (0 if case.bias is None else case.bias)
    mean = 0 if case.simplified else v.mean(axis=1, keepdims=True)
    var = (v - mean) ** 2 if not case.simplified else v ** 2
    inv = 1 / np.sqrt(var.mean(axis=1, keepdims=True) + case.epsilon)
    rel = FP32_U * (2 * (n / NORM_THREADS + math.log2(NORM_THREADS)) + 16)
    bound = rel * (np.abs(v) + np.abs(mean)) * inv * np.abs(case.gamma)
    return 2 * (bound + (0 if case.beta is None else FP32_U * np.abs(case.beta)))


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


def attention_bound(q_heads: np.ndarray, keys: np.ndarray, values: np.ndarray, span: int, H: int,
                    scale: float) -> float:
    """gqa_bound from the query heads' and the keys' L2 norms and the values' magnitude."""
    q_norm = np.sqrt((q_heads.astype(np.float64) ** 2).sum(-1)).max()
    k_norm = np.sqrt((keys.astype(np.float64) ** 2).sum(-1)).max()
    v_max = np.abs(values).max()
    return 2 * FP32_U * ((span + 8) + 2 * (H / 32 + 8) * scale * q_norm * k_norm) * v_max


def gqa_bound(case, want_out) -> np.ndarray:
    B, S, H = case.shape
    N = case.num_heads
    q = case.q[..., :N * H].reshape(B, S, N, H)
    L = case.present_len()
    values = [want_out, case.present[1]] + ([] if case.past is None else [case.past[1]])
    bound = attention_bound(q, np.concatenate([k[:, :, :L].reshape(-1, H) for k in (case.present[0],)]),
                            np.concatenate([np.abs(x).reshape(-1) for x in values]), L, H,
                            case.scale or 1 / math.sqrt(H))
    return np.full(want_out.shape, bound)


@pytest.mark.parametrize("B,S,N,KN,H,P,options", GQA_CASES + [
    (1, 1, 32, 8, 128, 4000, dict(shared=True, rotary=True)),  # a long past: four chunks of staged keys
    (4, 1, 16, 4, 64, 700, dict(shared=True, seqlens_i32=True)),
    (1, 2048, 8, 8, 64, 0, dict(shared=True, first_prompt=True)),  # a 2048-token prompt at the tiny fixture's shape
])
def test_gqa_matches_the_cpu_kernel(device, B, S, N, KN, H, P, options):
    check_gqa(device, B, S, N, KN, H, P, options)


@pytest.mark.parametrize("B,N,KN,S,H,P", [(1, 32, 32, 1, 128, 500), (2, 8, 1, 4, 64, 37), (1, 4, 4, 8, 32, 0)]
                         + FUSED_PROMPT_CASES + [(1, 8, 8, 2048, 64, 0)])  # the tiny fixture's 2048-token prefill
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
