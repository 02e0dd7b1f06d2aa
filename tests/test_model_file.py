"""The model file and its value infos (core/model/model_file.py, ValueInfo.from_proto):
resolution and decoder I/O discovery read both the same way, so they report the same
inputs and the same one-line error for the same bad file."""
from __future__ import annotations

import os

import pytest
from onnx import TensorProto, helper

from onnx_prep.core.decode.decoder_io import DecoderIO, value_infos_from_model
from onnx_prep.core.errors import OnnxPrepError
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.model.resolved_model import ValueInfo

from test_resolve_models import from_array, write_model


def test_value_infos_cover_symbols_unknown_dims_and_non_tensors(tmp_path):
    import numpy as np

    seq = helper.make_tensor_sequence_value_info("seq_in", TensorProto.FLOAT, None)
    shapeless = helper.make_tensor_value_info("shapeless", TensorProto.INT64, None)
    mixed = helper.make_tensor_value_info("mixed", TensorProto.FLOAT16, [2, "batch", 3])
    mixed.type.tensor_type.shape.dim[2].Clear()  # neither a value nor a symbol
    overridable = helper.make_tensor_value_info("W", TensorProto.FLOAT, [4])  # also an initializer
    nodes = [helper.make_node("Identity", ["mixed"], ["out"])]
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT16, [2, "batch", None])
    path = write_model(tmp_path, nodes, [from_array("W", np.zeros(4, np.float32))],
                       [seq, shapeless, mixed, overridable], [out])
    want_inputs = (ValueInfo("seq_in", 0, None), ValueInfo("shapeless", TensorProto.INT64, None),
                   ValueInfo("mixed", TensorProto.FLOAT16, (2, "batch", None)))
    want_outputs = (ValueInfo("out", TensorProto.FLOAT16, (2, "batch", None)),)
    assert value_infos_from_model(path) == (want_inputs, want_outputs)
    r = resolve_model(path)
    assert (r.inputs, r.outputs) == (want_inputs, want_outputs)


def test_both_readers_give_the_same_one_line_error(tmp_path):
    cases = {"garbage": b"\x00garbage\xff" * 10, "text": b"this is not a model\n" * 10, "empty": b"",
             "absent": None, "fifo": "fifo"}
    for label, content in cases.items():
        path = tmp_path / f"{label}.onnx"
        if content == "fifo":
            os.mkfifo(path)  # exists, not a file (a folder is one model's folder to resolve)
        elif content is not None:
            path.write_bytes(content)
        with pytest.raises(OnnxPrepError) as by_resolve:
            resolve_model(path)
        with pytest.raises(OnnxPrepError) as by_decoder_io:
            DecoderIO.from_model(path)
        a, b = by_resolve.value, by_decoder_io.value
        assert (type(a), a.one_line()) == (type(b), b.one_line()), label
        assert "\n" not in a.one_line() and f"model {path}" in a.one_line(), label
