"""com.microsoft GroupQueryAttention (the ``gqa`` kernel: native/attention.c through
core/ops/attention.py) against ONNX Runtime on one-node graphs: random shapes
(hypothesis) over batch 1-3, query / kv head ratios 1, 2, 4, head sizes 16-64, first
prompts (rows of different lengths: padding), decode steps on growing and on fixed-length
past buffers (rows of different lengths), continued prompts, rotary on / off,
interleaved or not, packed QKV. Then each ISA against the scalar twin, the numpy twin,
the shared (in-place) buffer, a model through resolve and a session, and every refusal.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper

from conftest import ort_or_skip
from ops_oracle import one_node_model, run_ort, run_ours
from test_resolve_models import from_array, write_model

from onnx_prep import native
from onnx_prep.core.errors import ModelFormatError
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.ops.attention import reference_gqa

MS = "com.microsoft"
# Output: fp32 dot products over <= 64 values, a softmax over <= ~20 positions and a
# weighted sum, summed in another order than ONNX Runtime's GEMMs, and its softmax's
# exp is MLAS's polynomial, not libm's: observed <= 4e-7 on values of order 1.
OUT_ATOL, OUT_RTOL = 1e-5, 1e-5
# Present keys: one rotation (two products and a sum per value) or a copy: <= 2.4e-7.
KEY_ATOL = 1e-6
# fp16 inputs: both compute in fp32 and round once to fp16; fp32 results ~1e-6 apart can
# round to neighbouring fp16 values: one ulp (2^-10 for |x| in [1, 2); outputs are < 2).
F16_ATOL = 2.0 ** -10
# ISA paths against the scalar twin: the same products summed in another order, and a
# vector exp within ~1 ulp of the twin's expf (tests/test_attention_simd.py).
ISA_ATOL, ISA_RTOL = 1e-5, 1e-5


def gqa_inputs(rng, *, B, S, N, KN, H, lens, total, past_len, rotary, packed=False, empty_past=False):
    """The op's nine inputs in order (None where absent; ``empty_past``: past buffers of
    length 0, as a decoder's first step feeds them)."""
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    if packed:
        q, k, v = f(B, S, (N + 2 * KN) * H), None, None
    else:
        q, k, v = f(B, S, N * H), f(B, S, KN * H), f(B, S, KN * H)
    pk, pv = (f(B, KN, past_len, H), f(B, KN, past_len, H)) if past_len or empty_past else (None, None)
    seqlens = np.asarray(lens, np.int32) - 1
    cos = sin = None
    if rotary:
        angles = rng.uniform(0, 2 * np.pi, (total + 4, H // 2)).astype(np.float32)
        cos, sin = np.cos(angles), np.sin(angles)
    return [q, k, v, pk, pv, seqlens, np.array([total], np.int32), cos, sin]


def attrs_of(N, KN, rotary, interleaved, **more):
    return dict(num_heads=N, kv_num_heads=KN, do_rotary=int(rotary), rotary_interleaved=int(interleaved), **more)


def ort_gqa(inputs, attrs):
    model = one_node_model("GroupQueryAttention", inputs, attrs, opset=17, n_out=3, domain=MS)
    return run_ort(model, inputs)


def ours(inputs, attrs):
    return run_ours("GroupQueryAttention", inputs, attrs, opset=17, n_out=3, domain=MS, kernel="gqa")


def assert_matches(got, want):
    assert [g.shape for g in got] == [w.shape for w in want]
    np.testing.assert_allclose(got[0], want[0], rtol=OUT_RTOL, atol=OUT_ATOL)
    np.testing.assert_allclose(got[1], want[1], rtol=0, atol=KEY_ATOL)
    np.testing.assert_array_equal(got[2], want[2])  # values are copied, never computed


@st.composite
def cases(draw):
    B = draw(st.integers(1, 3))
    KN = draw(st.integers(1, 2))
    N = KN * draw(st.sampled_from([1, 2, 4]))
    rotary = draw(st.booleans())
    H = draw(st.sampled_from([16, 32, 48, 64] if rotary else [16, 24, 40, 64]))  # rotary: H % 16 == 0
    mode = draw(st.sampled_from(["prompt", "decode-growing", "decode-fixed", "continued"]))
    if mode == "continued":
        B = 1
    if mode == "prompt":
        S = draw(st.integers(1, 6))
        lens = [draw(st.integers(1, S)) for _ in range(B)]
        lens[draw(st.integers(0, B - 1))] = S
        total, past_len = S, draw(st.sampled_from([0, S + 3]))  # no past, or a max-length buffer
    elif mode == "decode-growing":
        S, past_len = 1, draw(st.integers(1, 12))
        lens, total = [past_len + 1] * B, past_len + 1
    elif mode == "decode-fixed":  # rows of different lengths in one max-length buffer
        S, past_len = 1, draw(st.integers(2, 12))
        lens = [draw(st.integers(1, past_len)) for _ in range(B)]
        total = max(lens)
    else:
        S, past_len = draw(st.integers(2, 4)), draw(st.integers(1, 8))
        total = past_len + S
        lens = [total]
    return dict(B=B, S=S, N=N, KN=KN, H=H, lens=lens, total=total, past_len=past_len, rotary=rotary,
                packed=draw(st.booleans()), empty_past=past_len == 0 and draw(st.booleans())
                ), draw(st.booleans()), draw(st.integers(0, 2**31 - 1))


@given(cases())
def test_gqa_matches_onnx_runtime(case):
    ort_or_skip()
    shape, interleaved, seed = case
    inputs = gqa_inputs(np.random.default_rng(seed), **shape)
    attrs = attrs_of(shape["N"], shape["KN"], shape["rotary"], interleaved)
    assert_matches(ours(inputs, attrs), ort_gqa(inputs, attrs))


def test_gqa_scale_attribute_and_rows_of_different_lengths_match_onnx_runtime():
    ort_or_skip()
    shape = dict(B=3, S=1, N=8, KN=2, H=32, lens=[3, 9, 6], total=9, past_len=10, rotary=True)
    inputs = gqa_inputs(np.random.default_rng(1), **shape)
    attrs = attrs_of(8, 2, True, False, scale=0.3)
    want = ort_gqa(inputs, attrs)
    assert_matches(ours(inputs, attrs), want)
    # The rows really differ in length: row 0's present keeps the past's first 2 rows,
    # its new key at row 2, zeros after.
    assert np.all(want[2][0, :, 3:] == 0) and np.any(want[2][1, :, 8] != 0)


def test_fp16_inputs_compute_in_fp32_and_match_onnx_runtime_to_one_ulp():
    ort_or_skip()
    inputs = gqa_inputs(np.random.default_rng(2), B=2, S=1, N=4, KN=2, H=32, lens=[5, 8], total=8, past_len=8,
                        rotary=True)
    inputs = [x.astype(np.float16) if x is not None and x.dtype == np.float32 else x for x in inputs]
    attrs = attrs_of(4, 2, True, True)
    got, want = ours(inputs, attrs), ort_gqa(inputs, attrs)
    assert [g.dtype for g in got] == [np.float16] * 3
    assert np.abs(want[0]).max() < 2
    np.testing.assert_allclose(got[0].astype(np.float32), want[0].astype(np.float32), rtol=0, atol=F16_ATOL)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])


@pytest.mark.parametrize("rotary,interleaved", [(False, False), (True, False), (True, True)])
def test_numpy_twin_matches_onnx_runtime(rotary, interleaved):
    ort_or_skip()
    rng = np.random.default_rng(7)
    for shape in (dict(B=2, S=4, N=4, KN=2, H=32, lens=[2, 4], total=4, past_len=0, rotary=rotary),
                  dict(B=3, S=1, N=4, KN=1, H=16, lens=[5, 2, 7], total=7, past_len=8, rotary=rotary)):
        inputs = gqa_inputs(rng, **shape)
        attrs = attrs_of(shape["N"], shape["KN"], rotary, interleaved)
        cos, sin = (inputs[7], inputs[8]) if rotary else (None, None)
        got = reference_gqa(*inputs[:7], cos, sin, num_heads=shape["N"], kv_num_heads=shape["KN"],
                            interleaved=interleaved)
        assert_matches(list(got), ort_gqa(inputs, attrs))


@pytest.mark.parametrize("isa", [i for i in ("avx2", "avx512") if native.unavailable_reason(i) is None] or
                         [pytest.param("avx2", marks=pytest.mark.skip(reason="no SIMD ISA on this CPU/build"))])
def test_isa_paths_match_the_scalar_twin(isa):
    rng = np.random.default_rng(3)
    # Head sizes that leave tails after the 8- / 16-wide vectors, and past the 4-way unroll.
    for H, lens, past in ((24, [5, 3], 6), (64, [9, 9], 8), (136, [4, 1], 4)):
        inputs = gqa_inputs(rng, B=2, S=1, N=4, KN=2, H=H, lens=lens, total=max(lens), past_len=past,
                            rotary=False)
        kw = dict(num_heads=4, kv_num_heads=2)
        scalar = native.group_query_attention(*inputs[:7], isa="scalar", **kw)
        assert native.last_kernel() == "scalar"
        got = native.group_query_attention(*inputs[:7], isa=isa, **kw)
        assert native.last_kernel() == isa
        np.testing.assert_allclose(got[0], scalar[0], rtol=ISA_RTOL, atol=ISA_ATOL)
        np.testing.assert_array_equal(got[1], scalar[1])
        np.testing.assert_array_equal(got[2], scalar[2])


def test_shared_buffer_is_updated_in_place_and_gives_the_same_output():
    rng = np.random.default_rng(4)
    inputs = gqa_inputs(rng, B=2, S=1, N=4, KN=2, H=32, lens=[4, 7], total=7, past_len=10, rotary=True)
    kw = dict(num_heads=4, kv_num_heads=2)
    fresh = native.group_query_attention(*inputs, **kw)
    pk, pv = inputs[3].copy(), inputs[4].copy()
    out, k, v = native.group_query_attention(*inputs[:3], pk, pv, *inputs[5:], present=(pk, pv), **kw)
    assert k is pk and v is pv
    np.testing.assert_array_equal(out, fresh[0])
    for b, n in enumerate([4, 7]):  # the rows the step wrote and read; the rest is the past's
        np.testing.assert_array_equal(pk[b, :, :n], fresh[1][b, :, :n])
        np.testing.assert_array_equal(pv[b, :, n:], inputs[4][b, :, n:])


@pytest.mark.parametrize("B,KN", [(1, 1), (2, 1), (1, 2)])
def test_a_kv_cache_appended_in_place_in_a_larger_buffer_gives_the_copys_output(B, KN):
    """The fused attention's past as rows of a buffer with room after them and its
    present the same buffer one row longer (a decode's KV cache appended in place):
    the output and the new rows equal those of a call on copies. With one kv head at
    batch 1 numpy calls the past's rows C-contiguous; their head stride is still the
    buffer's (it was refused as a bad argument)."""
    rng = np.random.default_rng(5)
    N, S, H, P, room = 4, 1, 16, 5, 12
    q = rng.standard_normal((B, N, S, H), dtype=np.float32)
    k, v = (rng.standard_normal((B, KN, S, H), dtype=np.float32) for _ in range(2))
    bk, bv = (np.zeros((B, KN, room, H), np.float32) for _ in range(2))
    bk[:, :, :P], bv[:, :, :P] = (rng.standard_normal((B, KN, P, H), dtype=np.float32) for _ in range(2))
    want = native.attention_with_past(q, k, v, bk[:, :, :P].copy(), bv[:, :, :P].copy(), scale=0.25)
    got = native.attention_with_past(q, k, v, bk[:, :, :P], bv[:, :, :P], scale=0.25,
                                     present=(bk[:, :, :P + 1], bv[:, :, :P + 1]))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(bk[:, :, :P + 1], want[1])
    np.testing.assert_array_equal(bv[:, :, :P + 1], want[2])


def test_a_seqlens_value_outside_the_buffers_is_one_line_naming_the_row():
    inputs = gqa_inputs(np.random.default_rng(5), B=2, S=1, N=2, KN=2, H=16, lens=[3, 4], total=4, past_len=4,
                        rotary=False)
    inputs[5] = np.array([2, 9], np.int32)
    with pytest.raises(ValueError, match=r"seqlens_k\[1\] = 9 does not fit") as e:
        native.group_query_attention(*inputs[:7], num_heads=2, kv_num_heads=2)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("change,needle", [
    (lambda x: x.__setitem__(0, x[0][..., :60]), "query's last dimension 60 is not 4 heads (num_heads)"),
    (lambda x: x.__setitem__(1, x[1][:, :, :16]), "key shape [2, 1, 16] is not [2, 1, 32]"),
    (lambda x: x.__setitem__(3, x[3][:, :1]), "past_key shape [2, 1, 6, 16] is not [2, 2, past length, 16]"),
    (lambda x: x.__setitem__(4, None), "past_key and past_value must be both present or both absent"),
    (lambda x: x.__setitem__(7, x[7][:4]), "cos/sin caches [4, 8] / [11, 8] are not [>= total_sequence_length 7"),
    (lambda x: x.__setitem__(5, x[5][:1]), "seqlens_k has 1 values for batch 2"),
])
def test_inputs_the_kernel_cannot_take_are_one_line_naming_the_input(change, needle):
    inputs = gqa_inputs(np.random.default_rng(8), B=2, S=1, N=4, KN=2, H=16, lens=[7, 7], total=7, past_len=6,
                        rotary=True)
    change(inputs)
    with pytest.raises(ValueError, match=re.escape(needle)) as e:
        native.group_query_attention(*inputs, num_heads=4, kv_num_heads=2)
    assert "\n" not in str(e.value)


def session_step(rng, *, B: int, S: int, KN: int, H: int, total: int, N: int = 4) -> dict:
    """One step's non-KV feeds of ``gqa_model``'s graph: S new positions of B rows, the
    total sequence ``total`` (past + S)."""
    return {"q": rng.standard_normal((B, S, N * H)).astype(np.float32),
            "k": rng.standard_normal((B, S, KN * H)).astype(np.float32),
            "v": rng.standard_normal((B, S, KN * H)).astype(np.float32),
            "seqlens_k": np.full(B, total - 1, np.int32),
            "total_sequence_length": np.array(total, np.int32)}


def gqa_model(out_dir: Path, attrs: dict, *, extra_inputs: tuple[str, ...] = (), n_out: int = 3) -> Path:
    """A decoder layer's attention as the builder writes it: growing BNSH KV, rotary
    caches as external initializers."""
    N, KN, H = attrs["num_heads"], attrs["kv_num_heads"], 16
    names = ["q", "k", "v", "past_key", "past_value", "seqlens_k", "total_sequence_length", "cos", "sin"]
    node = helper.make_node("GroupQueryAttention", names + list(extra_inputs),
                            ["y", "present_key", "present_value", "qk"][:n_out], name="attn0", domain=MS, **attrs)
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    vi = helper.make_tensor_value_info
    inputs = [vi("q", f, ["b", "s", N * H]), vi("k", f, ["b", "s", KN * H]), vi("v", f, ["b", "s", KN * H]),
              vi("past_key", f, ["b", KN, "p", H]), vi("past_value", f, ["b", KN, "p", H]),
              vi("seqlens_k", i32, ["b"]), vi("total_sequence_length", i32, [])]
    inputs += [vi(n, f, None) for n in extra_inputs]
    angles = np.random.default_rng(0).uniform(0, 6, (32, H // 2)).astype(np.float32)
    outputs = [vi(n, f, None) for n in ["y", "present_key", "present_value", "qk"][:n_out]]
    return write_model(out_dir, [node], [from_array("cos", np.cos(angles)), from_array("sin", np.sin(angles))],
                       inputs, outputs, opsets={"": 17, MS: 1})


def test_a_builder_style_model_resolves_to_gqa_and_runs_in_a_session(tmp_path):
    from onnx_prep.core.runtime.session import Session

    ort = ort_or_skip()
    path = gqa_model(tmp_path, attrs_of(4, 2, True, False))
    resolved = resolve_model(path)
    assert [n.kernel for n in resolved.nodes] == ["gqa"] and not resolved.unsupported
    rng = np.random.default_rng(6)
    inputs = gqa_inputs(rng, B=2, S=1, N=4, KN=2, H=16, lens=[6, 6], total=6, past_len=5, rotary=False)
    feeds = dict(zip(["q", "k", "v", "past_key", "past_value", "seqlens_k", "total_sequence_length"], inputs))
    with Session(resolved) as session:
        got = session.run(feeds)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert_matches([got["y"], got["present_key"], got["present_value"]], want)


def test_a_session_decode_appends_present_in_place_and_matches_onnx_runtime(tmp_path):
    """A prompt then decode steps, each step's present fed back as its past (as the
    decode loop does): the runtime's presents are prefix views of one append buffer per
    tensor (rows handed out are never written again) and every step matches ONNX Runtime
    fed its own presents."""
    from onnx_prep.core.runtime.session import Session

    ort = ort_or_skip()
    path = gqa_model(tmp_path, attrs_of(4, 2, True, True))
    oracle = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(9)
    B, KN, H = 2, 2, 16
    empty = np.zeros((B, KN, 0, H), np.float32)
    ours_kv, theirs_kv, total, seen = (empty, empty), (empty, empty), 0, []
    with Session(resolve_model(path)) as session:
        for S in (3, 1, 1, 1):
            total += S
            step = session_step(rng, B=B, S=S, KN=KN, H=H, total=total)
            got = session.run({**step, "past_key": ours_kv[0], "past_value": ours_kv[1]})
            want = oracle.run(None, {**step, "past_key": theirs_kv[0], "past_value": theirs_kv[1]})
            assert_matches([got["y"], got["present_key"], got["present_value"]], want)
            seen.append((got["present_key"], got["present_key"].copy()))
            ours_kv, theirs_kv = (got["present_key"], got["present_value"]), (want[1], want[2])
    first = seen[0][0]
    assert all(np.shares_memory(k, first) for k, _ in seen[1:])  # appended, not copied
    for k, snapshot in seen:  # no step wrote rows an earlier step handed out
        np.testing.assert_array_equal(k, snapshot)


def test_a_marked_node_with_rows_of_different_lengths_does_not_append():
    """Present is past + S rows only when every row is at the past's length; rows of
    different lengths (new rows inside the past's span) take a fresh buffer, and the
    past's rows are left as they were."""
    from onnx_prep.core.kernels.binding import get_op
    from onnx_prep.core.ops import append_buffer
    from onnx_prep.core.ops.attributes import APPEND_IN_PLACE

    ort_or_skip()
    inputs = gqa_inputs(np.random.default_rng(10), B=2, S=1, N=4, KN=2, H=16, lens=[6, 4], total=6, past_len=5,
                        rotary=True)
    pasts = []
    for x in inputs[3:5]:  # the past as the claimed prefix of an append buffer with room
        view, _ = append_buffer.extend(np.zeros((2, 2, 0, 16), np.float32), 2, 5)
        view[...] = x
        pasts.append(view)
    inputs[3:5] = pasts
    before = [p.copy() for p in pasts]
    attrs = attrs_of(4, 2, True, False)
    want = ort_gqa([*inputs[:3], *before, *inputs[5:]], attrs)
    op = get_op("GroupQueryAttention", MS, "gqa")
    got = op(inputs, {**attrs, APPEND_IN_PLACE: (0, 1)}, {})
    assert_matches(got, want)
    assert not np.shares_memory(got[1], pasts[0])
    for p, b in zip(pasts, before):
        np.testing.assert_array_equal(p, b)
    # The same past with equal rows appends in place.
    inputs[5] = np.array([5, 5], np.int32)
    got = op(inputs, {**attrs, APPEND_IN_PLACE: (0, 1)}, {})
    assert np.shares_memory(got[1], pasts[0]) and np.shares_memory(got[2], pasts[1])
    assert_matches(got, ort_gqa([*inputs[:3], *before, *inputs[5:]], attrs))


@pytest.mark.parametrize("attrs,extra,n_out,needle", [
    (dict(smooth_softmax=1), (), 3, "smooth_softmax = 1: smooth softmax"),
    (dict(qk_output=1), (), 3, "qk_output = 1: the QK output"),
    (dict(sliding_window_cache=1), (), 3, "sliding_window_cache = 1 requires local_window_size > 0, got -1"),
    (dict(sliding_window_cache=1, local_window_size=0), (), 3, "requires local_window_size > 0, got 0"),
    (dict(sliding_window_cache=1, local_window_size=4), (), 2,
     "sliding_window_cache = 1 requires the present_key and present_value outputs"),
    (dict(kv_num_heads=3), (), 3, "num_heads 4 is not a multiple of kv_num_heads 3"),
    (dict(), ("position_ids",), 3, "input 9 (position_ids) is not implemented"),
    (dict(), ("position_ids", "attention_bias"), 3, "input 10 (attention_bias) is not implemented"),
    (dict(), (), 4, "output 3 (output_qk) is not implemented"),
])
def test_what_the_kernel_does_not_implement_is_refused_at_resolve(tmp_path, attrs, extra, n_out, needle):
    base = attrs_of(4, 2, True, False)
    base.update(attrs)
    if extra == ("position_ids", "attention_bias"):  # position_ids absent, attention_bias given
        extra = ("", "attention_bias")
    path = gqa_model(tmp_path, base, extra_inputs=tuple(x for x in extra), n_out=n_out)
    with pytest.raises(ModelFormatError, match=re.escape(needle)) as e:
        resolve_model(path)
    assert "attn0" in str(e.value) and "\n" not in str(e.value)


def test_a_refusal_is_exit_2_in_one_line_through_the_cli(tmp_path):
    from typer.testing import CliRunner

    from onnx_prep.cli.app import app

    path = gqa_model(tmp_path, attrs_of(4, 2, True, False, smooth_softmax=1))
    result = CliRunner().invoke(app, ["resolve", str(path)])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert any("smooth_softmax = 1" in line and "attn0" in line for line in lines)
    assert "Traceback" not in result.output


def _room(x: np.ndarray, extra: int) -> np.ndarray:
    """``x`` [B, KN, P, H] as the prefix view of a longer buffer (the runtime's append
    buffers), the room after its rows filled with a marker."""
    B, KN, P, H = x.shape
    base = np.full((B, KN, P + extra, H), 7.0, np.float32)
    base[:, :, :P] = x
    return base[:, :, :P]


@pytest.mark.parametrize("B,rotary,interleaved,seq_dtype,packed", [
    (1, True, False, np.int32, False), (1, False, False, np.int64, False), (2, True, True, np.int32, False),
    (3, False, False, np.int32, False), (1, True, False, np.int32, True), (2, True, False, np.int64, True)])
def test_the_decode_steps_lean_call_gives_the_general_calls_bits(B, rotary, interleaved, seq_dtype, packed,
                                                                  monkeypatch):
    """native.gqa_decode (what a session's decode step calls, past and present in append
    buffers) gives group_query_attention's output and present rows bit for bit, without
    taking the general path, and leaves the buffers' other rows as they were."""
    import onnx_prep.native.attention as attention_module

    rng = np.random.default_rng(11)
    N, KN, H, P = 8, 2, 32, 9
    q, k, v, pk, pv, seqlens, total, cos, sin = gqa_inputs(
        rng, B=B, S=1, N=N, KN=KN, H=H, lens=[P + 1] * B, total=P + 1, past_len=P, rotary=rotary, packed=packed)
    seqlens = seqlens.astype(seq_dtype)
    kw = dict(num_heads=N, kv_num_heads=KN, scale=0.0, interleaved=interleaved)
    want = native.group_query_attention(q, k, v, pk, pv, seqlens, total, cos, sin, **kw)
    past_k, past_v = _room(pk, 4), _room(pv, 4)
    present = tuple(x.base[:, :, :P + 1] for x in (past_k, past_v))

    def general(*a, **k):
        raise AssertionError("the lean call took the general path")

    monkeypatch.setattr(attention_module, "group_query_attention", general)
    got = native.gqa_decode(q, k, v, past_k, past_v, seqlens, total, cos, sin, present=present, **kw)
    np.testing.assert_array_equal(got[0], want[0])
    for g, w, base in ((got[1], want[1], past_k.base), (got[2], want[2], past_v.base)):
        assert g.base is base  # written in place, into the buffer given
        np.testing.assert_array_equal(g, w)
        assert (base[:, :, P + 1:] == 7.0).all()  # the room after the new row untouched


@pytest.mark.parametrize("change", ["f16", "strided", "packed", "first_prompt", "bad_key", "bad_seqlens"])
def test_the_lean_call_takes_the_general_path_for_any_other_form(change):
    """Arguments not in the lean call's form go the general way: the same results, or
    its one-line ValueError naming the input."""
    rng = np.random.default_rng(12)
    B, N, KN, H, P = 2, 4, 2, 16, 6
    q, k, v, pk, pv, seqlens, total, cos, sin = gqa_inputs(
        rng, B=B, S=1, N=N, KN=KN, H=H, lens=[P + 1] * B, total=P + 1, past_len=P, rotary=True)
    kw = dict(num_heads=N, kv_num_heads=KN, scale=0.0, interleaved=False)
    if change == "f16":
        q = q.astype(np.float16)
    elif change == "strided":
        q = np.repeat(q, 2, axis=2)[..., ::2]
    elif change == "first_prompt":
        total = np.array([1], np.int32)
    elif change == "bad_key":
        k = k[..., :16]
    elif change == "bad_seqlens":
        seqlens = seqlens[:1]
    present = (np.empty((B, KN, P + 1, H), np.float32), np.empty((B, KN, P + 1, H), np.float32))
    if change == "packed":
        k = None
    try:
        want = native.group_query_attention(q, k, v, pk, pv, seqlens, total, cos, sin, present=present, **kw)
    except ValueError as e:
        with pytest.raises(ValueError, match=re.escape(str(e))):
            native.gqa_decode(q, k, v, pk, pv, seqlens, total, cos, sin, present=present, **kw)
        return
    present2 = tuple(np.empty_like(x) for x in present)
    got = native.gqa_decode(q, k, v, pk, pv, seqlens, total, cos, sin, present=present2, **kw)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


# ------------------------------------- the bound decode step (core/ops/attention.py bind)

def _claimed_past(x: np.ndarray) -> np.ndarray:
    """``x`` [B, KN, P, H] copied into a fresh append buffer (with room), as the view a
    decode step's present was handed out: the next step's past."""
    from onnx_prep.core.ops import append_buffer

    view, in_place = append_buffer.extend(x[:, :, :0], 2, x.shape[2])
    assert not in_place
    view[...] = x
    return view


@pytest.mark.parametrize("B,rotary,interleaved,seq_dtype,total_form", [
    (1, True, False, np.int32, "scalar"), (1, False, False, np.int64, "array"), (2, True, True, np.int32, "array"),
    (3, True, False, np.int64, "scalar"), (2, False, False, np.int32, "scalar")])
def test_the_bound_decode_step_gives_the_general_calls_bits(B, rotary, interleaved, seq_dtype, total_form,
                                                              monkeypatch):
    """A marked GroupQueryAttention node's bound call (native.GqaStep over append
    buffers) gives the general op's output and present bit for bit, writes the new row
    into the past's own buffer, and never takes the general path for that form."""
    from onnx_prep.core.ops import attention as ops_attention
    from onnx_prep.core.ops.attributes import APPEND_IN_PLACE

    rng = np.random.default_rng(21 + B)
    N, KN, H, P = 8, 2, 32, 9
    q, _, _, pk, pv, seqlens, total, cos, sin = gqa_inputs(
        rng, B=B, S=1, N=N, KN=KN, H=H, lens=[P + 1] * B, total=P + 1, past_len=P, rotary=rotary, packed=True)
    seqlens = seqlens.astype(seq_dtype)
    total = np.int32(P + 1) if total_form == "scalar" else total
    attrs = dict(attrs_of(N, KN, rotary, interleaved), scale=0.0)
    want = ops_attention.group_query_attention([q, None, None, pk, pv, seqlens, total, cos, sin], attrs, None)
    bound = ops_attention.bind_group_query_attention({**attrs, APPEND_IN_PLACE: (0, 1)})
    assert bound.unbound is ops_attention.group_query_attention
    past_k, past_v = _claimed_past(pk), _claimed_past(pv)

    def general(*a, **k):
        raise AssertionError("the bound step took the general path")

    monkeypatch.setattr(native, "gqa_decode", general)
    monkeypatch.setattr(ops_attention, "group_query_attention", general)
    got = bound([q, None, None, past_k, past_v, seqlens, total, cos, sin, None, None, None], attrs, None)
    np.testing.assert_array_equal(got[0], want[0])
    for g, w, past in ((got[1], want[1], past_k), (got[2], want[2], past_v)):
        assert g.base is past.base and g.shape == (B, KN, P + 1, H)  # the new row written in place
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("B,N,KN", [(1, 8, 2), (3, 8, 4), (2, 4, 4)])
def test_the_bound_step_shares_its_units_with_the_runs_helpers_and_gives_the_same_bits(B, N, KN, monkeypatch):
    """In a hot run with a served mailbox, the bound decode step cuts its units (batch row
    x kv head) into chunks the helpers take (native op_mailbox_gqa): output and present
    bit for bit the general op's, until a helper has run chunks of it; a single unit, a
    run without helpers or a cache under MIN_ATTENTION_SPLIT_BYTES stays on the caller."""
    import threading

    from onnx_prep.core.ops import attention as ops_attention
    from onnx_prep.core.ops import intra_op
    from onnx_prep.core.ops.attributes import APPEND_IN_PLACE

    H, P = 32, 11
    rng = np.random.default_rng(40 + B)
    attrs = dict(attrs_of(N, KN, True, False), scale=0.0)
    bound = ops_attention.bind_group_query_attention({**attrs, APPEND_IN_PLACE: (0, 1)})
    units = B * KN
    assert intra_op.attention_split(units, 1 << 30) == (None, 1)  # no run: no split
    box = native.Mailbox()
    helper = threading.Thread(target=box.serve)
    helper.start()
    try:
        with intra_op.using(lambda *a, **k: 0, parts=2, mailbox=intra_op.LazyMailbox(lambda: box)):
            assert intra_op.attention_split(units, intra_op.MIN_ATTENTION_SPLIT_BYTES - 1) == (None, 1)
            assert intra_op.attention_split(1, 1 << 30) == (None, 1)
            assert intra_op.attention_split(units, 1 << 30) == (box, min(units, 4))
            monkeypatch.setattr(intra_op, "MIN_ATTENTION_SPLIT_BYTES", 0)
            for i in range(2000):  # until a helper has run a chunk (it spins in C, so soon)
                q, _, _, pk, pv, seqlens, total, cos, sin = gqa_inputs(
                    rng, B=B, S=1, N=N, KN=KN, H=H, lens=[P + 1] * B, total=P + 1, past_len=P, rotary=True,
                    packed=True)
                want = ops_attention.group_query_attention([q, None, None, pk, pv, seqlens, total, cos, sin],
                                                           attrs, None)
                batches = box.batches
                got = bound([q, None, None, _claimed_past(pk), _claimed_past(pv), seqlens, total, cos, sin,
                             None, None, None], attrs, None)
                assert box.batches == batches + 1  # the step went through the mailbox
                for g, w in zip(got, want):
                    np.testing.assert_array_equal(g, w)
                if box.chunks_by_helpers and i >= 5:
                    break
    finally:
        box.stop()
        helper.join()
    assert box.chunks_by_helpers > 0


def test_a_run_with_more_threads_than_the_kernel_takes_chunks_shares_64(monkeypatch):
    """A machine with many threads asks for more chunks than op_mailbox_gqa holds (64):
    it takes 64, not an error, and gives the same bits."""
    import threading

    from onnx_prep.core.ops import attention as ops_attention
    from onnx_prep.core.ops import intra_op
    from onnx_prep.core.ops.attributes import APPEND_IN_PLACE

    rng = np.random.default_rng(50)
    B, N, KN, H, P = 3, 32, 32, 16, 7  # 96 units
    attrs = dict(attrs_of(N, KN, True, False), scale=0.0)
    bound = ops_attention.bind_group_query_attention({**attrs, APPEND_IN_PLACE: (0, 1)})
    monkeypatch.setattr(intra_op, "MIN_ATTENTION_SPLIT_BYTES", 0)
    box = native.Mailbox()
    helper = threading.Thread(target=box.serve)
    helper.start()
    try:
        with intra_op.using(lambda *a, **k: 0, parts=100, mailbox=intra_op.LazyMailbox(lambda: box)):
            assert intra_op.attention_split(B * KN, 1) == (box, 96)
            q, _, _, pk, pv, seqlens, total, cos, sin = gqa_inputs(
                rng, B=B, S=1, N=N, KN=KN, H=H, lens=[P + 1] * B, total=P + 1, past_len=P, rotary=True, packed=True)
            want = ops_attention.group_query_attention([q, None, None, pk, pv, seqlens, total, cos, sin], attrs, None)
            got = bound([q, None, None, _claimed_past(pk), _claimed_past(pv), seqlens, total, cos, sin, None, None,
                         None], attrs, None)
            assert box.batches == 1
    finally:
        box.stop()
        helper.join()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("change", ["plain_past", "ragged_rows", "separate_kv", "first_prompt", "f16"])
def test_the_bound_decode_step_takes_the_general_path_for_any_other_form(change):
    """A past that is no append buffer (copied into one), rows of different lengths,
    separate key and value, a first prompt or float16: the general op's results."""
    from onnx_prep.core.ops import attention as ops_attention
    from onnx_prep.core.ops.attributes import APPEND_IN_PLACE

    rng = np.random.default_rng(31)
    B, N, KN, H, P = 2, 4, 2, 16, 6
    lens = [P + 1, P] if change == "ragged_rows" else [P + 1] * B
    inputs = gqa_inputs(rng, B=B, S=1, N=N, KN=KN, H=H, lens=lens, total=P + 1, past_len=P, rotary=True,
                        packed=change != "separate_kv")
    if change == "first_prompt":
        inputs = gqa_inputs(rng, B=B, S=3, N=N, KN=KN, H=H, lens=[3] * B, total=3, past_len=0, rotary=True,
                            packed=True, empty_past=True)
    if change == "f16":
        inputs[0] = inputs[0].astype(np.float16)
    attrs = dict(attrs_of(N, KN, True, False), scale=0.0)
    want = ops_attention.group_query_attention(list(inputs), attrs, None)
    bound = ops_attention.bind_group_query_attention({**attrs, APPEND_IN_PLACE: (0, 1)})
    if change != "plain_past" and inputs[3] is not None and inputs[3].shape[2]:
        inputs[3], inputs[4] = _claimed_past(inputs[3]), _claimed_past(inputs[4])
    got = bound(list(inputs), attrs, None)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_an_unmarked_or_window_cache_node_is_not_bound():
    """Only a node the action program marked (its KV appended in place) gets the bound
    step; a window-sized cache never appends."""
    from onnx_prep.core.ops import attention as ops_attention
    from onnx_prep.core.ops.attributes import APPEND_IN_PLACE

    attrs = attrs_of(4, 2, True, False)
    assert ops_attention.bind_group_query_attention(attrs) is ops_attention.group_query_attention
    windowed = {**attrs, "local_window_size": 4, "sliding_window_cache": 1, APPEND_IN_PLACE: (0, 1)}
    assert ops_attention.bind_group_query_attention(windowed) is ops_attention.group_query_attention
    assert ops_attention.bind_group_query_attention({**attrs, APPEND_IN_PLACE: (0, 1)}) is not \
        ops_attention.group_query_attention
