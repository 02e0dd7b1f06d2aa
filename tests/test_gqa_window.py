"""GroupQueryAttention's sliding window (``local_window_size``), its window-sized KV
buffers (``sliding_window_cache``) and ``softcap``, as the onnxruntime-genai builder
writes them for Gemma 2: the ``gqa`` kernel against ONNX Runtime 1.32 on one-node
graphs, then each ISA against the scalar twin, and what must hold bit for bit.

ONNX Runtime's semantics, as its CPU kernel computes them (docs/ops.md says where they
were read and checked): the query at position p sees keys p + 1 - W .. p (W keys, not
W + 1; W = 0 sees none: zeros); softcap c > 0 makes each scaled score x into c tanh(x /
c) before the softmax; a sliding-window cache of capacity C >= W keeps each row's most
recent L(T) positions from row 0, dropping G = C - W + 1 at once.

Tolerances: test_native_gqa's (OUT_ATOL: other summation orders, MLAS's exp; softcap
adds tanh's last bit times the cap over scores of order 1). Present rows past L(T) are
unspecified in ONNX Runtime's contract and not compared.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import ort_or_skip
from test_native_gqa import (ISA_ATOL, ISA_RTOL, KEY_ATOL, MS, OUT_ATOL, OUT_RTOL, assert_matches, attrs_of, cases,
                             gqa_inputs, gqa_model, ort_gqa, ours, session_step)

from onnx_prep import native
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.ops.attention import _window_rows, reference_gqa

ISAS = [pytest.param(i, marks=pytest.mark.skip(reason=f"{i}: {native.unavailable_reason(i)}"))
        if native.unavailable_reason(i) else i for i in ("avx2", "avx512")]


@st.composite
def windowed_cases(draw):
    """test_native_gqa's shapes (prompts with padding rows, decode steps on growing and
    fixed buffers, continued prompts) with a window from 0 (no key) to past the longest
    row (cuts nothing), and a softcap or none."""
    case = draw(cases())
    longest = max(case[0]["lens"])
    window = draw(st.one_of(st.integers(0, longest), st.just(longest + 5), st.just(-1)))
    softcap = draw(st.sampled_from([0.0, 0.0, 0.7, 5.0, 50.0]))
    return case, window, softcap


@given(windowed_cases())
def test_windows_and_softcap_match_onnx_runtime(case):
    ort_or_skip()
    (shape, interleaved, seed), window, softcap = case
    inputs = gqa_inputs(np.random.default_rng(seed), **shape)
    if softcap == 0.7:  # scores well past the cap: tanh's flat part
        inputs[0] = inputs[0] * 4
    attrs = attrs_of(shape["N"], shape["KN"], shape["rotary"], interleaved, local_window_size=window,
                     softcap=softcap)
    assert_matches(ours(inputs, attrs), ort_gqa(inputs, attrs))


@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("window", [0, 1, 3, 6, 20])
def test_windows_that_cut_and_that_do_not_match_onnx_runtime_and_the_numpy_twin(window, softcap):
    """Prefill with padding rows (a padding row's window: native/attention.c), decode
    steps over a growing past and over a max-length buffer with rows of different
    lengths, a continued prompt; windows from none seen to longer than every row."""
    ort_or_skip()
    rng = np.random.default_rng(window)
    for shape in (dict(B=2, S=8, N=4, KN=2, H=16, lens=[8, 5], total=8, past_len=0, rotary=True),
                  dict(B=3, S=1, N=8, KN=2, H=32, lens=[12, 5, 9], total=12, past_len=14, rotary=True),
                  dict(B=2, S=1, N=4, KN=4, H=24, lens=[10, 10], total=10, past_len=9, rotary=False),
                  dict(B=1, S=4, N=4, KN=1, H=16, lens=[11], total=11, past_len=7, rotary=True, packed=True)):
        inputs = gqa_inputs(rng, **shape)
        attrs = attrs_of(shape["N"], shape["KN"], shape["rotary"], False, local_window_size=window, softcap=softcap)
        want = ort_gqa(inputs, attrs)
        assert_matches(ours(inputs, attrs), want)
        twin = reference_gqa(*inputs, num_heads=shape["N"], kv_num_heads=shape["KN"], local_window_size=window,
                             softcap=softcap)
        assert_matches(list(twin), want)
    if window == 0:  # no key in any window: every output row is zeros, there and here
        assert not want[0].any()


def _window_cache_steps(rng, *, W, C, plan, B=1, softcap=0.0, rotary=True, N=4, KN=2, H=16):
    """Steps on window-sized buffers of capacity C, each step's present fed back as the
    next one's past (ours to ours, ONNX Runtime's to ONNX Runtime, the numpy twin's to the
    twin), from a random past that stands for earlier tokens. ``plan``: (S, lengths per
    row after the step). Compares each step's output and present rows [0, L(T))."""
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    past = (f(B, KN, C, H), f(B, KN, C, H))
    mine, theirs, twins = past, past, past
    angles = rng.uniform(0, 6, (64, H // 2)).astype(np.float32)
    cos, sin = (np.cos(angles), np.sin(angles)) if rotary else (None, None)
    attrs = attrs_of(N, KN, rotary, False, local_window_size=W, softcap=softcap, sliding_window_cache=1)
    for S, lens in plan:
        lens = np.asarray(lens)
        q, k, v = f(B, S, N * H), f(B, S, KN * H), f(B, S, KN * H)
        lengths = ((lens - 1).astype(np.int32), np.array([lens.max()], np.int32))
        want = ort_gqa([q, k, v, *theirs, *lengths, cos, sin], attrs)
        got = ours([q, k, v, *mine, *lengths, cos, sin], attrs)
        twin = reference_gqa(q, k, v, *twins, *lengths, cos, sin, num_heads=N, kv_num_heads=KN,
                             local_window_size=W, softcap=softcap, sliding_window_cache=True)
        for name, result in (("ours", got), ("twin", twin)):
            where = f"{name}, step of {S} to lengths {lens.tolist()}"
            np.testing.assert_allclose(result[0], want[0], rtol=OUT_RTOL, atol=OUT_ATOL, err_msg=where)
            assert result[1].shape == result[2].shape == want[1].shape == (B, KN, C, H), where
            for b in range(B):
                kept = _window_rows(int(lens[b]), C, W)
                np.testing.assert_allclose(result[1][b, :, :kept], want[1][b, :, :kept], rtol=0, atol=KEY_ATOL,
                                           err_msg=where)
                np.testing.assert_array_equal(result[2][b, :, :kept], want[2][b, :, :kept], err_msg=where)
        mine, theirs, twins = got[1:], want[1:], twin[1:]


@pytest.mark.parametrize("W,C,plan,B,softcap", [
    # capacity = window: from T > C every step evicts one position (read through the staging copy)
    (3, 3, [(2, [2]), (1, [3]), (1, [4]), (1, [5]), (3, [8]), (1, [9])], 1, 0.0),
    # slack above the window: eviction drops G = 3 at once, every third step
    (3, 5, [(4, [4]), *[(1, [t]) for t in range(5, 12)], (5, [16]), (2, [18])], 1, 0.0),
    # a first prompt longer than the capacity, then decode, with softcap
    (3, 5, [(8, [8]), (1, [9]), (1, [10]), (1, [11])], 1, 2.0),
    # rows of different lengths in one decode batch, each with its own resident range
    (4, 6, [(1, [5, 3]), (1, [6, 4]), (1, [7, 5]), (1, [8, 6]), (1, [9, 7]), (1, [10, 8])], 2, 0.0),
    (4, 6, [(9, [9, 9]), (1, [10, 10]), (1, [11, 11]), (1, [12, 12])], 2, 1.0),
    # the builder's shape: the window never cut, the cache far from full
    (64, 64, [(8, [8, 8]), (1, [9, 9]), (1, [10, 10])], 2, 50.0),
])
def test_sliding_window_cache_steps_match_onnx_runtime(W, C, plan, B, softcap):
    ort_or_skip()
    _window_cache_steps(np.random.default_rng(W * 100 + C), W=W, C=C, plan=plan, B=B, softcap=softcap)


def test_a_sliding_window_cache_without_rotary_over_many_evictions_matches_onnx_runtime():
    ort_or_skip()
    _window_cache_steps(np.random.default_rng(1), W=2, C=7, plan=[(3, [3])] + [(1, [t]) for t in range(4, 30)],
                        rotary=False)


@pytest.mark.parametrize("change,needle", [
    (dict(past_len=3), "sliding_window_cache: KV cache capacity (3, past_key's dimension 2) must be at least "
                       "local_window_size (4)"),
    (dict(lens=[6, 4]), "seqlens_k[1] = 3 is too small for sequence_length 6"),
])
def test_what_onnx_runtime_refuses_of_a_sliding_window_cache_is_refused_in_one_line(change, needle):
    """ONNX Runtime refuses both (a capacity below the window; a first prompt with padding
    rows on window-sized buffers): so do we, one line each."""
    ort = ort_or_skip()
    shape = dict(B=2, S=6, N=4, KN=2, H=16, lens=[6, 6], total=6, past_len=8, rotary=True)
    shape.update(change)
    inputs = gqa_inputs(np.random.default_rng(2), **shape)
    attrs = attrs_of(4, 2, True, False, local_window_size=4, sliding_window_cache=1)
    with pytest.raises(ValueError, match=re.escape(needle)) as e:
        ours(inputs, attrs)
    assert "\n" not in str(e.value)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument):
        ort_gqa(inputs, attrs)


def test_a_sliding_window_cache_without_a_past_is_refused_at_resolve(tmp_path):
    from onnx import helper

    from onnx_prep.core.errors import ModelFormatError
    from test_resolve_models import write_model

    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "", "", "seqlens_k", "total"],
                            ["y", "present_key", "present_value"], name="attn0", domain=MS,
                            **attrs_of(4, 2, False, False, local_window_size=4, sliding_window_cache=1))
    vi = helper.make_tensor_value_info
    f, i32 = 1, 6
    inputs = [vi("q", f, ["b", "s", 64]), vi("k", f, ["b", "s", 32]), vi("v", f, ["b", "s", 32]),
              vi("seqlens_k", i32, ["b"]), vi("total", i32, [])]
    path = write_model(tmp_path, [node], [], inputs, [vi(n, f, None) for n in ("y", "present_key", "present_value")],
                       opsets={"": 17, MS: 1})
    with pytest.raises(ModelFormatError, match=re.escape("sliding_window_cache = 1 requires past_key and past_value")
                       ) as e:
        resolve_model(path)
    assert "attn0" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("H", [64, 80, 24])
def test_windows_and_softcap_on_every_isa_match_the_scalar_twin(isa, H):
    """Decode steps over long pasts and prompts, windows shorter than the keys (not on a
    vector block's boundary), softcap on and off; the ISA paths differ from the scalar
    twin by their summation order and vector exp (test_attention_simd.py), no more."""
    rng = np.random.default_rng(H)
    for keys, window, softcap in ((257, 37, 0.0), (257, 100, 30.0), (1030, 513, 50.0), (40, 0, 5.0)):
        inputs = gqa_inputs(rng, B=2, S=1, N=8, KN=2, H=H, lens=[keys, keys - 3], total=keys, past_len=keys - 1,
                            rotary=H % 16 == 0)
        kw = dict(num_heads=8, kv_num_heads=2, local_window_size=window, softcap=softcap)
        scalar = native.group_query_attention(*inputs, isa="scalar", **kw)
        assert native.last_kernel() == "scalar"
        got = native.group_query_attention(*inputs, isa=isa, **kw)
        assert native.last_kernel() == isa
        np.testing.assert_allclose(got[0], scalar[0], rtol=ISA_RTOL, atol=ISA_ATOL, err_msg=f"{keys} keys")
        np.testing.assert_array_equal(got[1], scalar[1])
        np.testing.assert_array_equal(got[2], scalar[2])
    prompt = gqa_inputs(rng, B=1, S=19, N=4, KN=1, H=H, lens=[19], total=19, past_len=0, rotary=False)
    kw = dict(num_heads=4, kv_num_heads=1, local_window_size=5, softcap=3.0)
    scalar, got = (native.group_query_attention(*prompt, isa=i, **kw)[0] for i in ("scalar", isa))
    np.testing.assert_allclose(got, scalar, rtol=ISA_RTOL, atol=ISA_ATOL)


@pytest.mark.parametrize("isa", ["scalar", *ISAS])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_a_window_is_bit_for_bit_the_same_attention_as_a_cache_cut_to_it(isa, softcap):
    """On each ISA, the scalar twin too: a decode step with a window of W over a past of
    P rows gives the bits of the same step without a window over the past's last W - 1
    rows (the tables get the same keys from the window's first: no other arithmetic),
    each query head of a row group as alone; and a sliding-window cache step (its rows
    moved, or read through the staging copy when it evicts) gives the bits of the
    windowed step over the whole history."""
    rng = np.random.default_rng(7)
    N, KN, H, P, W = 8, 2, 48, 300, 70
    q, k, v, pk, pv, seqlens, total, _, _ = gqa_inputs(rng, B=1, S=1, N=N, KN=KN, H=H, lens=[P + 1], total=P + 1,
                                                       past_len=P, rotary=False)
    kw = dict(num_heads=N, kv_num_heads=KN, softcap=softcap, isa=isa)
    windowed = native.group_query_attention(q, k, v, pk, pv, seqlens, total, local_window_size=W, **kw)[0]
    assert native.last_kernel() == isa
    cut = native.group_query_attention(q, k, v, pk[:, :, P + 1 - W:], pv[:, :, P + 1 - W:],
                                       np.array([W - 1], np.int32), np.array([W], np.int32), **kw)[0]
    np.testing.assert_array_equal(windowed, cut)
    for h in range(N):  # one query head per kv head: the single-row entries
        alone = native.group_query_attention(q[..., h * H:(h + 1) * H], k[..., h // 4 * H:(h // 4 + 1) * H],
                                             v[..., h // 4 * H:(h // 4 + 1) * H], pk[:, h // 4:h // 4 + 1],
                                             pv[:, h // 4:h // 4 + 1], seqlens, total, local_window_size=W,
                                             num_heads=1, kv_num_heads=1, softcap=softcap, isa=isa)[0]
        np.testing.assert_array_equal(windowed[..., h * H:(h + 1) * H], alone, err_msg=f"head {h}")
    for C in (W, W + 40):  # C = W: this step evicts (staging); C = W + 40: rows moved in place
        kept = _window_rows(P, C, W)
        past = tuple(np.ascontiguousarray(np.pad(x[:, :, P - kept:], ((0, 0), (0, 0), (0, C - kept, ), (0, 0))))
                     for x in (pk, pv))
        cached = native.group_query_attention(q, k, v, *past, seqlens, total, local_window_size=W,
                                              sliding_window_cache=True, **kw)
        np.testing.assert_array_equal(cached[0], windowed, err_msg=f"capacity {C}")


def test_a_session_decodes_on_a_sliding_window_cache_as_onnx_runtime(tmp_path):
    """A builder-style layer with a window, window-sized buffers and softcap through
    resolve and a Session: a prompt, then decode steps past the capacity (evictions),
    each step's present fed back; every step as ONNX Runtime fed its own presents."""
    from onnx_prep.core.runtime.session import Session

    ort = ort_or_skip()
    W, C = 3, 4
    path = gqa_model(tmp_path, attrs_of(4, 2, True, False, local_window_size=W, softcap=20.0,
                                        sliding_window_cache=1))
    resolved = resolve_model(path)
    assert [n.kernel for n in resolved.nodes] == ["gqa"] and not resolved.unsupported
    oracle = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(9)
    B, KN, H = 2, 2, 16
    empty = np.zeros((B, KN, C, H), np.float32)
    mine, theirs, total = (empty, empty), (empty, empty), 0
    with Session(resolved) as session:
        for S in (3, 1, 1, 1, 1, 1):
            total += S
            step = session_step(rng, B=B, S=S, KN=KN, H=H, total=total)
            got = session.run({**step, "past_key": mine[0], "past_value": mine[1]})
            want = oracle.run(None, {**step, "past_key": theirs[0], "past_value": theirs[1]})
            kept = _window_rows(total, C, W)
            np.testing.assert_allclose(got["y"], want[0], rtol=OUT_RTOL, atol=OUT_ATOL, err_msg=f"total {total}")
            np.testing.assert_allclose(got["present_key"][:, :, :kept], want[1][:, :, :kept], rtol=0, atol=KEY_ATOL)
            np.testing.assert_array_equal(got["present_value"][:, :, :kept], want[2][:, :, :kept])
            mine, theirs = (got["present_key"], got["present_value"]), (want[1], want[2])
    assert total > C  # the steps went past the capacity


@pytest.mark.parametrize("window,softcap", [(5, 0.0), (0, 0.0), (-1, 3.0), (4, 3.0)])
def test_the_decode_steps_lean_call_takes_the_window_and_softcap_with_the_general_calls_bits(window, softcap,
                                                                                              monkeypatch):
    """native.gqa_decode (a session's decode step on append buffers, the Gemma 2 export's
    growing cache) windows and caps as group_query_attention does, without taking the
    general path."""
    import onnx_prep.native.attention as attention_module

    rng = np.random.default_rng(window + 10)
    N, KN, H, P = 8, 2, 32, 9
    q, k, v, pk, pv, seqlens, total, cos, sin = gqa_inputs(rng, B=1, S=1, N=N, KN=KN, H=H, lens=[P + 1],
                                                           total=P + 1, past_len=P, rotary=True)
    q = q * 3  # scores past a cap of 3
    kw = dict(num_heads=N, kv_num_heads=KN, scale=0.0, interleaved=False, local_window_size=window, softcap=softcap)
    want = native.group_query_attention(q, k, v, pk, pv, seqlens, total, cos, sin, **kw)
    present = tuple(np.empty((1, KN, P + 1, H), np.float32) for _ in range(2))

    def general(*a, **k):
        raise AssertionError("the lean call took the general path")

    monkeypatch.setattr(attention_module, "group_query_attention", general)
    got = native.gqa_decode(q, k, v, pk, pv, seqlens, total, cos, sin, present=present, **kw)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    monkeypatch.undo()  # and the window or softcap changed the output, not only its path
    kw.update(local_window_size=-1, softcap=0.0)
    assert not np.array_equal(native.group_query_attention(q, k, v, pk, pv, seqlens, total, cos, sin, **kw)[0],
                              want[0])
