"""com.microsoft RotaryEmbedding (native/rotary.c, core/ops/rotary.py, the rotary kernel)
against ONNX Runtime on random shapes and values (hypothesis), the numpy form, position
checks, and what resolve refuses or leaves unsupported."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from conftest import ort_or_skip
from ops_oracle import one_node_model, run_ort, run_ours
from onnx_prep import native
from onnx_prep.core.errors import ModelFormatError
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.ops import rotary

MS = "com.microsoft"

# Each output is x_a cos + (-x_b) sin: we round both products and the sum; ONNX Runtime
# (1.32's vectorized path) fuses one product into a multiply-add, one rounding fewer.
# With |cos|, |sin| <= 1 the two differ by at most ~1.5 ulp of max|x|; the bound is
# 4 ulp of it [measured: 2.4e-7 with max|x| ~4, i.e. ~1 ulp; 6 of 300 cases bit-equal].
ROTARY_ATOL_ULPS = 4


def _bound(x: np.ndarray) -> float:
    return ROTARY_ATOL_ULPS * float(np.spacing(np.float32(np.abs(x).max())))


@st.composite
def cases(draw):
    b, s, heads = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 4))
    head = 2 * draw(st.integers(1, 24))
    partial = draw(st.booleans())
    rot = 2 * draw(st.integers(1, head // 2)) if partial else 0
    four_d = draw(st.booleans())
    max_pos = s + draw(st.integers(0, 12))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, heads, s, head) if four_d else (b, s, heads * head)).astype(np.float32)
    angles = rng.random((max_pos, (rot or head) // 2)) * 2 * np.pi
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    if draw(st.booleans()):
        pos = rng.integers(0, max_pos, (b, s)).astype(np.int64)
    else:
        pos = np.array([draw(st.integers(0, max_pos - s))], np.int64)
    attrs = {"interleaved": int(draw(st.booleans()))}
    if partial:
        attrs.update(rotary_embedding_dim=rot, num_heads=heads)
    elif draw(st.booleans()) and not four_d:
        attrs["num_heads"] = heads
    return x, pos, cos, sin, attrs


def _ours(inputs, attrs):
    return run_ours("RotaryEmbedding", inputs, attrs, opset=21, domain=MS, kernel="rotary")[0]


@given(case=cases())
def test_rotary_embedding_matches_onnxruntime(case):
    ort_or_skip()
    x, pos, cos, sin, attrs = case
    inputs = [x, pos, cos, sin]
    theirs = run_ort(one_node_model("RotaryEmbedding", inputs, attrs, opset=21, domain=MS), inputs)[0]
    ours = _ours(inputs, attrs)
    assert ours.shape == theirs.shape and ours.dtype == np.float32
    assert np.max(np.abs(ours - theirs)) <= _bound(x)
    assert native.last_kernel() == "scalar"  # one portable implementation


@given(case=cases())
def test_the_numpy_form_gives_the_native_bits(case):
    x, pos, cos, sin, attrs = case
    heads, head, rot, transposed = rotary.rotary_geometry(x.shape, cos.shape[1], attrs.get("num_heads", 0),
                                                          attrs.get("rotary_embedding_dim", 0))
    interleaved = attrs["interleaved"] == 1
    want = native.rotary_embedding(x, pos, cos, sin, heads=heads, head_size=head, rotary_dim=rot,
                                   transposed=transposed, interleaved=interleaved)
    got = rotary._rotary_numpy(x, pos, cos, sin, heads, head, rot, transposed, interleaved)
    np.testing.assert_array_equal(got, want)
    # the part of each head past the rotary dim is copied unchanged
    tail_want = x.reshape(*x.shape[:-1], -1, head)[..., rot:] if not transposed else x[..., rot:]
    tail_got = want.reshape(*x.shape[:-1], -1, head)[..., rot:] if not transposed else want[..., rot:]
    np.testing.assert_array_equal(tail_got, tail_want)


def test_wrong_pairing_fails_the_tolerance():
    """Negative control: interleaved pairs where the model says halves (and the reverse)
    are far outside the bound."""
    ort_or_skip()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 3, 2 * 16)).astype(np.float32)
    ang = rng.random((8, 8)) * 6
    inputs = [x, np.array([[0, 3, 5]], np.int64), np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)]
    for inter in (0, 1):
        theirs = run_ort(one_node_model("RotaryEmbedding", inputs, {"interleaved": inter}, opset=21, domain=MS),
                         inputs)[0]
        wrong = _ours(inputs, {"interleaved": 1 - inter})
        assert np.max(np.abs(wrong - theirs)) > 100 * _bound(x)


def test_float16_is_computed_in_float32():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 2, 8)).astype(np.float16)
    ang = rng.random((4, 4)) * 6
    cos, sin = np.cos(ang).astype(np.float16), np.sin(ang).astype(np.float16)
    pos = np.array([1], np.int64)
    y = _ours([x, pos, cos, sin], {})
    want = _ours([x.astype(np.float32), pos, cos.astype(np.float32), sin.astype(np.float32)], {}).astype(np.float16)
    assert y.dtype == np.float16
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("pos,message", [
    (np.array([[0, 9]], np.int64), r"position_ids\[0, 1\] = 9 is outside the caches' 8 positions"),
    (np.array([[-1, 2]], np.int64), r"position_ids\[0, 0\] = -1 is outside"),
    (np.array([7], np.int64), r"positions 7..8 is outside the caches' 8 positions"),
])
def test_a_position_outside_the_caches_is_an_index_error_naming_it(pos, message):
    x = np.ones((1, 2, 8), np.float32)
    cos = sin = np.ones((8, 4), np.float32)
    with pytest.raises(IndexError, match=message):
        _ours([x, pos, cos, sin], {})


def test_shapes_that_do_not_fit_are_value_errors():
    x = np.ones((1, 2, 12), np.float32)
    cos = sin = np.ones((8, 4), np.float32)  # heads of 8 do not tile 12
    with pytest.raises(ValueError, match="do not fit"):
        _ours([x, np.array([0], np.int64), cos, sin], {})
    with pytest.raises(ValueError, match="rank 2"):
        _ours([x[0], np.array([0], np.int64), cos, sin], {})


# ------------------------------------------------------------------ resolve: kernel, refusals

def _model(tmp_path, attrs, inputs=("x", "pos", "cos", "sin"), cos_shape=(16, 4), sin_shape=(16, 4)):
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.random(cos_shape).astype(np.float32), "cos"),
             numpy_helper.from_array(rng.random(sin_shape).astype(np.float32), "sin")]
    node = helper.make_node("RotaryEmbedding", list(inputs), ["y"], name="rope", domain=MS, **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "S", 16]),
                                        helper.make_tensor_value_info("pos", TensorProto.INT64, [1, "S"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)])
    m.ir_version = 10
    path = tmp_path / "rope.onnx"
    onnx.save(m, str(path), save_as_external_data=True, location="rope.data", size_threshold=0)
    return path


def test_resolve_runs_rotary_embedding_on_the_rotary_kernel(tmp_path):
    resolved = resolve_model(_model(tmp_path, {"interleaved": 1, "num_heads": 2}))
    assert not resolved.unsupported
    assert [n.kernel for n in resolved.nodes] == ["rotary"]


@pytest.mark.parametrize("attrs,kw,message", [
    ({"rotary_embedding_dim": 4}, {}, "rotary_embedding_dim 4 needs num_heads > 0 (num_heads is 0)"),
    ({}, {"inputs": ("x", "pos", "cos")}, "input, position_ids, cos_cache and sin_cache are required"),
    ({}, {"cos_shape": (16, 4, 1)}, "cache has shape [16, 4, 1], expected 2-D"),
    ({}, {"sin_shape": (8, 4)}, "cos_cache [16, 4] and sin_cache [8, 4] differ"),
])
def test_resolve_refuses_what_onnxruntime_refuses_in_one_line(tmp_path, attrs, kw, message):
    with pytest.raises(ModelFormatError) as e:
        resolve_model(_model(tmp_path, attrs, **kw))
    text = str(e.value)
    assert f"RotaryEmbedding: {message}" in text and "node 'rope'" in text and "\n" not in text


@pytest.mark.parametrize("attrs", [{"is_packed_batching": 1}, {"rotary_embedding_dim": 3, "num_heads": 2}])
def test_what_the_kernel_does_not_implement_is_listed_unsupported(tmp_path, attrs):
    resolved = resolve_model(_model(tmp_path, attrs))
    assert [(u.op_type, u.nodes) for u in resolved.unsupported] == [("RotaryEmbedding", ("rope",))]
