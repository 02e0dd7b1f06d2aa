"""Decoder I/O discovery on hand-built decoder-like models (tests/decoder_toys.py)."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from decoder_toys import KV_NAMES, build_toy_decoder
from onnx_prep.core.decode.decoder_io import DecoderIO, value_infos_from_model, value_infos_from_ort
from onnx_prep.core.decode.io_map import load_io_map
from onnx_prep.core.errors import ModelFormatError, ModelIOError, UsageError
from onnx_prep.core.model.resolved_model import ValueInfo


def _vi(name, elem, shape):
    return ValueInfo(name, elem, tuple(shape))


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("names", ["hf", "flat", "dot", "underscore"])
def test_discovers_common_exporter_conventions(tmp_path, names, layout):
    path = build_toy_decoder(tmp_path / "m.onnx", kv_names=names, layout=layout, layers=3,
                             heads=2, head_dim=4)
    io = DecoderIO.from_model(path)
    assert io.input_ids.name == "input_ids" and io.input_ids.dtype == np.int64
    assert io.attention_mask.name == "attention_mask"
    assert io.position_ids.name == "position_ids"
    assert io.logits == "logits" and io.vocab_size == 32
    assert io.kv_layout == layout and io.seq_axis == (2 if layout == "bhsd" else 1)
    assert [p.layer for p in io.kv] == [0, 1, 2]
    for p in io.kv:
        pk, pv, ok, ov = KV_NAMES[names](p.layer)
        assert (p.past_key.name, p.past_value.name, p.present_key, p.present_value) == (pk, pv, ok, ov)
        assert (p.kv_heads, p.key_head_dim, p.value_head_dim) == (2, 4, 4)
        assert p.past_key.dtype == np.float32
    assert io.source == "discovered" and not io.extras
    empty = io.empty_past(3)
    want = (3, 2, 0, 4) if layout == "bhsd" else (3, 0, 2, 4)
    assert len(empty) == 6 and all(a.shape == want for a in empty.values())


def test_ort_session_and_model_file_give_the_same_io(tmp_path):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime not installed")
    path = build_toy_decoder(tmp_path / "m.onnx", kv_names="flat", layout="bshd",
                             extras=("seqlens_k", "total_sequence_length"))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert DecoderIO.discover(*value_infos_from_ort(sess)) == DecoderIO.from_model(path)


def test_model_proto_and_path_agree_and_no_external_data_is_read(small_llm_path, tmp_path):
    # The fixture keeps its weights in external data: discovery works on the .onnx alone.
    alone = tmp_path / small_llm_path.name
    alone.write_bytes(small_llm_path.read_bytes())
    proto = onnx.load(str(small_llm_path), load_external_data=False)
    inputs, outputs = value_infos_from_model(proto)
    assert [vi.name for vi in inputs][:2] == ["input_ids", "position_ids"]
    io = DecoderIO.from_model(alone)
    assert io == DecoderIO.discover(inputs, outputs)
    assert io.kv_layout == "bhsd" and io.attention_mask is None and len(io.kv) == 2


def test_gqa_style_extras_are_placed(tmp_path):
    path = build_toy_decoder(tmp_path / "m.onnx", extras=("seqlens_k", "total_sequence_length", "cache_position"))
    io = DecoderIO.from_model(path)
    assert {r: s.name for r, s in io.extras.items()} == {
        "seqlens_k": "seqlens_k", "total_sequence_length": "total_sequence_length",
        "cache_position": "cache_position"}
    assert io.extras["seqlens_k"].dtype == np.int32 and io.extras["total_sequence_length"].rank == 0


def test_fp16_kv_dtype_follows_elem_type(tmp_path):
    path = build_toy_decoder(tmp_path / "m.onnx", kv_dtype=TensorProto.FLOAT16)
    io = DecoderIO.from_model(path)
    assert all(p.past_key.dtype == np.float16 for p in io.kv)
    assert all(a.dtype == np.float16 for a in io.empty_past(1).values())


def test_token_ids_fall_back_to_the_one_integer_input(tmp_path):
    path = build_toy_decoder(tmp_path / "m.onnx", ids_name="tok", logits_name="lm_out")
    io = DecoderIO.from_model(path)
    assert io.input_ids.name == "tok" and io.logits == "lm_out"  # the one non-KV output


def test_layout_from_symbol_names_when_heads_are_symbolic(tmp_path):
    # heads symbolic too: "past_sequence_length" names the sequence dim; heads come from the io-map
    for layout in ("bhsd", "bshd"):
        path = build_toy_decoder(tmp_path / f"{layout}.onnx", layout=layout, symbolic_heads=True)
        with pytest.raises(ModelIOError, match="no static heads/head_dim") as err:
            DecoderIO.from_model(path)
        assert "kv_heads" in str(err.value)  # the hint says what to give
        io = DecoderIO.from_model(path, {"kv_heads": 2})
        assert io.kv_layout == layout and io.kv[0].kv_heads == 2


def test_layout_from_past_present_symbol_change(tmp_path):
    # neither symbol names a sequence; the one that differs between past and present is it
    path = build_toy_decoder(tmp_path / "m.onnx", layout="bshd", symbolic_heads=True,
                             past_seq_dim="a", present_seq_dim="b")
    assert DecoderIO.from_model(path, {"kv_heads": 2}).kv_layout == "bshd"


def test_ambiguous_layout_needs_the_io_map(tmp_path):
    path = build_toy_decoder(tmp_path / "m.onnx", layout="bshd", symbolic_heads=True,
                             past_seq_dim="a", present_seq_dim="a")
    with pytest.raises(ModelIOError, match="cannot tell the KV layout"):
        DecoderIO.from_model(path, {"kv_heads": 2})
    assert DecoderIO.from_model(path, {"kv_heads": 2, "kv_layout": "bshd"}).kv_layout == "bshd"


def test_static_past_length_is_refused():
    inputs = [_vi("input_ids", 7, ["b", "s"]), _vi("past_key_values.0.key", 1, [1, 2, 128, 4]),
              _vi("past_key_values.0.value", 1, [1, 2, 128, 4])]
    outputs = [_vi("logits", 1, ["b", "s", 8]), _vi("present.0.key", 1, [1, 2, 128, 4]),
               _vi("present.0.value", 1, [1, 2, 128, 4])]
    with pytest.raises(ModelIOError, match="static shape"):
        DecoderIO.discover(inputs, outputs)


def test_unplaced_inputs_are_named_in_one_line(tmp_path):
    path = build_toy_decoder(tmp_path / "m.onnx", kv_names="opaque", layers=2)
    with pytest.raises(ModelIOError) as err:
        DecoderIO.from_model(path)
    msg = str(err.value)
    assert "\n" not in msg
    for name in ("kin0a", "kin0b", "kin1a", "kin1b"):
        assert repr(name) in msg
    assert "'input_ids'" not in msg and "--io-map" in msg and str(path) in msg


def test_missing_token_ids_is_reported(tmp_path):
    path = build_toy_decoder(tmp_path / "m.onnx", ids_name="tok")
    model = onnx.load(str(path))
    model.graph.input.append(helper.make_tensor_value_info("extra_ids", TensorProto.INT64, ["b", "s"]))
    with pytest.raises(ModelIOError, match="no token-ids input found.*'tok', 'extra_ids'"):
        DecoderIO.discover(*value_infos_from_model(model))


def test_past_without_present_is_reported():
    inputs = [_vi("input_ids", 7, ["b", "s"]), _vi("past_key_3", 1, ["b", 2, "p", 4]),
              _vi("past_value_3", 1, ["b", 2, "p", 4])]
    outputs = [_vi("logits", 1, ["b", "s", 8]), _vi("present_key_3", 1, ["b", 2, "t", 4])]
    with pytest.raises(ModelIOError, match="layer 3 has no present value"):
        DecoderIO.discover(inputs, outputs)


def test_io_map_places_opaque_names(tmp_path):
    path = build_toy_decoder(tmp_path / "m.onnx", kv_names="opaque", layers=2, ids_name="tok",
                             mask_name="m", pos_name=None, logits_name="out")
    kv = [dict(zip(("past_key", "past_value", "present_key", "present_value"), KV_NAMES["opaque"](l)))
          for l in range(2)]
    mapping = {"input_ids": "tok", "attention_mask": "m", "position_ids": None, "logits": "out", "kv": kv}
    map_file = tmp_path / "io.json"
    map_file.write_text(json.dumps(mapping))
    io = DecoderIO.from_model(path, load_io_map(map_file))
    assert io.source == "io-map" and io.input_ids.name == "tok" and io.attention_mask.name == "m"
    assert io.position_ids is None and io.logits == "out" and io.kv_layout == "bhsd"
    assert [(p.past_key.name, p.present_value) for p in io.kv] == [("kin0a", "kout0b"), ("kin1a", "kout1b")]


def test_io_map_overrides_discovery(tmp_path):
    path = build_toy_decoder(tmp_path / "m.onnx", layout="bhsd")
    # swap key and value of layer 0: the map wins over the names
    kv = [{"past_key": "past_key_values.0.value", "past_value": "past_key_values.0.key",
           "present_key": "present.0.value", "present_value": "present.0.key"},
          {"past_key": "past_key_values.1.key", "past_value": "past_key_values.1.value",
           "present_key": "present.1.key", "present_value": "present.1.value"}]
    io = DecoderIO.from_model(path, {"kv": kv})
    assert io.kv[0].past_key.name == "past_key_values.0.value"
    assert io.kv[0].present_key == "present.0.value"


@pytest.mark.parametrize("mapping, match", [
    ({"input_idz": "x"}, "unknown keys"),
    ({"kv_layout": "sbhd"}, "kv_layout"),
    ({"kv": [{"past_key": "a"}]}, r"kv\[0\]"),
    ({"kv_heads": 0}, "positive integer"),
    ({"logits": 3}, "tensor name"),
    ([1, 2], "JSON object"),
])
def test_io_map_validation(tmp_path, mapping, match):
    f = tmp_path / "io.json"
    f.write_text(json.dumps(mapping))
    with pytest.raises(UsageError, match=match) as err:
        load_io_map(f)
    assert str(f) in str(err.value)


def test_io_map_file_errors(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        load_io_map(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UsageError, match="not valid JSON"):
        load_io_map(bad)


def test_io_map_names_must_exist_in_the_model(tmp_path):
    path = build_toy_decoder(tmp_path / "m.onnx")
    with pytest.raises(ModelIOError, match="'ids', which is not a model input"):
        DecoderIO.from_model(path, {"input_ids": "ids"})
    with pytest.raises(ModelIOError, match="which is not a model output"):
        DecoderIO.from_model(path, {"logits": "nope"})
    with pytest.raises(ModelIOError, match="two roles"):
        DecoderIO.from_model(path, {"input_ids": "position_ids", "position_ids": "position_ids"})


def test_unreadable_or_missing_model_is_reported(tmp_path):
    for content in (b"\x00garbage\xff" * 10, b""):
        bad = tmp_path / "bad.onnx"
        bad.write_bytes(content)
        with pytest.raises(ModelFormatError, match="not an ONNX"):
            DecoderIO.from_model(bad)
    with pytest.raises(UsageError, match="not found"):
        DecoderIO.from_model(tmp_path / "absent.onnx")
    with pytest.raises(UsageError, match="not a file"):
        DecoderIO.from_model(tmp_path)
