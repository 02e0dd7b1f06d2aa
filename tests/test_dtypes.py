"""The one table of ONNX element types (core/model/dtypes.py) against ONNX's own
codes, numpy's sizes and ONNX Runtime's type strings, and its users: resolution's
payload sizes, the reader's packed and typed views, decoder I/O's feed dtypes."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnx_prep.core.decode.decoder_io import DecoderIO, value_infos_from_ort
from onnx_prep.core.errors import ModelIOError
from onnx_prep.core.io.external_data import ExternalDataReader
from onnx_prep.core.model.dtypes import DTYPES, dtype_of_type_string
from onnx_prep.core.model.resolution import resolve_model

from conftest import ort_or_skip
from test_resolve_models import Tensor, from_array, write_model

PACKED = {"int4": 4, "uint4": 4, "float4e2m1": 4, "int2": 2, "uint2": 2}


def test_codes_and_names_are_onnx_own():
    for code, d in DTYPES.items():
        assert d.code == code
        assert TensorProto.DataType.Value(d.onnx_name.upper()) == code, d


def test_sizes_agree_with_numpy_and_sub_byte_types_pack():
    for d in DTYPES.values():
        if d.name == "string":
            assert d.bits == 0 and d.nbytes(5) == 0 and not d.packed
        elif d.name in PACKED:
            assert d.packed and d.bits == PACKED[d.name]
            assert d.nbytes(3) == (3 * d.bits + 7) // 8  # rounds up to a whole byte
        else:
            assert not d.packed and d.bits == 8 * d.numpy.itemsize, d
            assert d.nbytes(3) == 3 * d.numpy.itemsize
    assert {d.name for d in DTYPES.values() if d.packed} == set(PACKED)
    assert DTYPES[TensorProto.FLOAT].numpy == np.float32 and DTYPES[TensorProto.BFLOAT16].numpy.itemsize == 2


def test_type_strings_are_the_ones_onnxruntime_reports():
    ort = ort_or_skip()
    # Identity takes the byte-sized types ORT runs; int4 / uint4 reach it through DequantizeLinear.
    codes = [c for c, d in DTYPES.items()
             if not d.packed and d.name not in ("complex64", "complex128", "float8e8m0")]
    nodes = [helper.make_node("Identity", [f"x{c}"], [f"y{c}"]) for c in codes]
    inputs = [helper.make_tensor_value_info(f"x{c}", c, [2]) for c in codes]
    outputs = [helper.make_tensor_value_info(f"y{c}", c, [2]) for c in codes]
    for c in (TensorProto.INT4, TensorProto.UINT4):
        nodes.append(helper.make_node("DequantizeLinear", [f"x{c}", "scale"], [f"y{c}"]))
        inputs.append(helper.make_tensor_value_info(f"x{c}", c, [2]))
        outputs.append(helper.make_tensor_value_info(f"y{c}", TensorProto.FLOAT, [2]))
    graph = helper.make_graph(nodes, "types", inputs, outputs,
                              [helper.make_tensor("scale", TensorProto.FLOAT, [], [1.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ours, _ = value_infos_from_ort(sess)
    assert len(ours) == len(codes) + 2
    for vi in ours:
        assert vi.elem_type == int(vi.name[1:]), vi
    assert dtype_of_type_string("seq(tensor(float))") is None
    assert dtype_of_type_string("tensor(float6e2m3)") is None  # a type the project does not handle


def _packed_and_typed_model(tmp_path):
    """An int4 weight with an odd count (its payload rounds up to a byte), a uint4 one
    in whole-byte rows, and a float16 one, all external, feeding the outputs."""
    int4 = Tensor("q_odd", TensorProto.INT4, (3,), np.array([0x21, 0x03], np.uint8).tobytes())
    uint4 = Tensor("q_rows", TensorProto.UINT4, (2, 4), bytes([0x10, 0x32, 0x54, 0x76]))
    half = Tensor("h", TensorProto.FLOAT16, (3,), np.array([1, -2, 0.5], np.float16).tobytes())
    nodes = [helper.make_node("Identity", [t.name], [f"{t.name}_out"]) for t in (int4, uint4, half)]
    outputs = [helper.make_tensor_value_info(f"{t.name}_out", t.onnx_type, list(t.dims))
               for t in (int4, uint4, half)]
    return write_model(tmp_path, nodes, [int4, uint4, half], [], outputs)


def test_resolution_sizes_and_reader_views_follow_the_table(tmp_path):
    path = _packed_and_typed_model(tmp_path)
    r = resolve_model(path)
    w = r.weights
    assert (w["q_odd"].dtype, w["q_odd"].length) == ("int4", 2)
    assert (w["q_rows"].dtype, w["q_rows"].length) == ("uint4", 4)
    assert (w["h"].dtype, w["h"].length) == ("float16", 6)
    reader = ExternalDataReader.for_model(r)
    odd, rows, half = (reader.read_array(w[n]) for n in ("q_odd", "q_rows", "h"))
    assert odd.dtype == np.uint8 and odd.shape == (2,)  # 3 nibbles: flat packed bytes
    assert rows.dtype == np.uint8 and rows.shape == (2, 2) and rows.tolist() == [[0x10, 0x32], [0x54, 0x76]]
    assert half.dtype == np.float16 and half.tolist() == [1, -2, 0.5]


def test_decoder_feed_dtypes_follow_the_table():
    def vi(name, elem, shape):
        return helper.make_tensor_value_info(name, elem, shape)

    graph = helper.make_graph(
        [], "d", [vi("input_ids", TensorProto.INT32, ["b", "s"]),
                  vi("past_key_values.0.key", TensorProto.BFLOAT16, ["b", 2, "p", 4]),
                  vi("past_key_values.0.value", TensorProto.BFLOAT16, ["b", 2, "p", 4])],
        [vi("logits", TensorProto.FLOAT, ["b", "s", 8]),
         vi("present.0.key", TensorProto.BFLOAT16, ["b", 2, "t", 4]),
         vi("present.0.value", TensorProto.BFLOAT16, ["b", 2, "t", 4])])
    io = DecoderIO.from_model(helper.make_model(graph))
    assert io.input_ids.dtype == np.int32
    assert io.kv[0].past_key.dtype == DTYPES[TensorProto.BFLOAT16].numpy
    assert io.empty_past(1)["past_key_values.0.key"].dtype.itemsize == 2
    graph.input[0].type.tensor_type.elem_type = 27  # float6e2m3: not in the table
    with pytest.raises(ModelIOError, match="unsupported element type 27"):
        DecoderIO.from_model(helper.make_model(graph))


def test_run_reserves_its_outputs_at_their_element_size(tmp_path):
    from onnx_prep import MemoryBudget, Session
    from onnx_prep.core.plan.task import Arena

    nodes = [helper.make_node("Add", ["X", "W"], ["Y"]), helper.make_node("Equal", ["X", "W"], ["E"]),
             helper.make_node("Cast", ["X"], ["F"], to=TensorProto.FLOAT8E4M3FN)]
    outputs = [helper.make_tensor_value_info(n, t, ["b", 8]) for n, t in
               (("Y", TensorProto.FLOAT16), ("E", TensorProto.BOOL), ("F", TensorProto.FLOAT8E4M3FN))]
    path = write_model(tmp_path, nodes, [from_array("W", np.arange(8, dtype=np.float16))],
                       [helper.make_tensor_value_info("X", TensorProto.FLOAT16, ["b", 8])], outputs)
    budget = MemoryBudget()
    with Session.open(path, budget=budget) as s:
        out = s.run({"X": np.ones((3, 8), np.float16)})
    assert [out[n].dtype.itemsize for n in ("Y", "E", "F")] == [2, 1, 1]
    # the IO arena holds what the declared outputs take: 2, 1 and 1 bytes an element
    assert budget.peak(Arena.IO) == sum(a.nbytes for a in out.values()) == 3 * 8 * 4
