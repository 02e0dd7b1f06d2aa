"""Resolution refuses what ONNX Runtime refuses, before anything loads, and nothing it
accepts (core/model/conformance.py and the contrib-op rules in the kernel specs).

Each crafted case edits one field of the small fixture's metadata (its data file is
copied unchanged) and asserts both: ONNX Runtime refuses the model, and resolve_model
refuses it with one line naming the node, attribute or tensor and the rule. Every model
the suite generates is accepted by both.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import onnx
import pytest
from onnx import TensorProto, helper

from conftest import ort_or_skip
from onnx_prep.core.errors import EXIT_UNUSABLE, OnnxPrepError
from onnx_prep.core.model.resolution import resolve_model
from test_resolve import file_events, opened_paths
from test_resolve_models import (custom_op_model, gemm_model, matmul_nbits_model, qdq_matmul_model,
                                 single_weight_model, tied_int4_model)

MODEL = "tiny-llm.onnx"
NORM = "layers.0.input_norm.weight"
QKV_B, QKV_S = "layers.0.attn.qkv.weight_q4", "layers.0.attn.qkv.scales"


def _init(m: onnx.ModelProto, name: str) -> TensorProto:
    return next(t for t in m.graph.initializer if t.name == name)


def _ext(name: str, key: str, value: Callable[[str], str]) -> Callable[[onnx.ModelProto], None]:
    def edit(m):
        t = _init(m, name)
        old = {e.key: e.value for e in t.external_data}.get(key, "0")
        for e in t.external_data:
            if e.key == key:
                e.value = value(old)
                return
        t.external_data.add(key=key, value=value(old))
    return edit


def _attr(op: str, key: str, value) -> Callable[[onnx.ModelProto], None]:
    def edit(m):
        n = next(n for n in m.graph.node if n.op_type == op)
        for a in list(n.attribute):
            if a.name == key:
                n.attribute.remove(a)
        if value is not None:
            n.attribute.append(helper.make_attribute(key, value))
    return edit


def _set(name: str, field: str, value) -> Callable[[onnx.ModelProto], None]:
    return lambda m: setattr(_init(m, name), field, value)


def _opset(domain: str, version: int) -> Callable[[onnx.ModelProto], None]:
    def edit(m):
        next(o for o in m.opset_import if o.domain == domain).version = version
    return edit


def _second_producer(m: onnx.ModelProto) -> None:
    m.graph.node[5].output[0] = m.graph.node[4].output[0]


def _output_is_initializer(m: onnx.ModelProto) -> None:
    next(n for n in m.graph.node if n.op_type == "Mul").output[0] = "layers.1.input_norm.weight"


def _cast_input(op: str, position: int, to: int) -> Callable[[onnx.ModelProto], None]:
    def edit(m):
        n = next(n for n in m.graph.node if n.op_type == op)
        m.graph.node.insert(0 if position == 1 else list(m.graph.node).index(n),
                            helper.make_node("Cast", [n.input[position]], ["cast/out"], name="cast", to=to))
        n.input[position] = "cast/out"
    return edit


def _cast_to_2_40(m: onnx.ModelProto) -> None:
    """Found by the fuzzer (seed 5712): onnx's inference raised a ValueError."""
    n = next(n for n in m.graph.node if n.op_type == "Cast")
    next(a for a in n.attribute if a.name == "to").i = 2 ** 40


def _reshape_scales(m: onnx.ModelProto) -> None:
    dims = _init(m, QKV_S).dims  # [1536] -> [192, 4, 2]: same size, not ONNX Runtime's shape
    del dims[:]
    dims.extend([192, 4, 2])


# case id -> (edit, fragments the one-line refusal holds)
REFUSED = {
    "norm-int32": (_set(NORM, "data_type", TensorProto.INT32), ["inference", "Mul", "int32"]),
    "opset-99": (_opset("", 99), ["opset 99", "ai.onnx"]),
    "ms-opset-2": (_opset("com.microsoft", 2), ["opset 2", "com.microsoft"]),
    "ir-99": (lambda m: setattr(m, "ir_version", 99), ["ir_version 99"]),
    "two-producers": (_second_producer, ["more than one producer"]),
    "output-is-initializer": (_output_is_initializer, ["'layers.1.input_norm.weight' has more than one producer"]),
    "input-twice": (lambda m: m.graph.input.append(m.graph.input[0]), ["'input_ids' is declared more than once"]),
    "cast-to-2^40": (_cast_to_2_40, ["type and shape inference", "Invalid tensor data type"]),
    "unknown-ext-key": (_ext(NORM, "basepath", lambda v: "x"), ["unknown external data key 'basepath'", NORM]),
    "offset-space": (_ext(NORM, "offset", lambda v: " " + v), ["offset", "ASCII decimal", NORM]),
    "offset-plus": (_ext(NORM, "offset", lambda v: "+" + v), ["offset", "ASCII decimal", NORM]),
    "offset-arabic-digit": (_ext(NORM, "offset", lambda v: "\u0660" + v), ["offset", "ASCII decimal", NORM]),
    "length-space": (_ext(NORM, "length", lambda v: v + " "), ["length", "ASCII decimal", NORM]),
    "location-slash": (_ext(NORM, "location", lambda v: v + "/"), ["does not name a file", NORM]),
    "mm-block-7": (_attr("MatMulNBits", "block_size", 7), ["block_size 7", "power of two", "qkv_proj"]),
    "mm-block-0": (_attr("MatMulNBits", "block_size", 0), ["block_size 0", "qkv_proj"]),
    "mm-block-64": (_attr("MatMulNBits", "block_size", 64), ["B shape", QKV_B]),
    "mm-N-0": (_attr("MatMulNBits", "N", 0), ["N 0", "positive"]),
    "mm-N-negative": (_attr("MatMulNBits", "N", -1), ["N -1", "positive"]),
    "mm-K-2^40": (_attr("MatMulNBits", "K", 2 ** 40), ["K 1099511627776", QKV_B]),
    "mm-K-missing": (_attr("MatMulNBits", "K", None), ["required attribute K"]),
    "mm-K-wrong": (_attr("MatMulNBits", "K", 256), ["K 256", QKV_B]),
    "mm-N-wrong": (_attr("MatMulNBits", "N", 256), ["N 256", QKV_B]),
    "mm-bits-3": (_attr("MatMulNBits", "bits", 3), ["bits 3"]),
    "mm-bits-8-on-4-bit-B": (_attr("MatMulNBits", "bits", 8), ["bits 8", QKV_B]),
    "mm-B-int8": (_set(QKV_B, "data_type", TensorProto.INT8), ["B is int8", "uint8", QKV_B]),
    "mm-scales-shape": (_reshape_scales, ["scales shape [192, 4, 2]", QKV_S]),
    "mm-A-float16": (_cast_input("MatMulNBits", 0, TensorProto.FLOAT16), ["input 'cast/out' is float16", "float"]),
    "gbq-indices-int16": (_cast_input("GatherBlockQuantized", 1, TensorProto.INT16), ["'cast/out' is int16", "int64"]),
    "mm-scales-int32": (_set(QKV_S, "data_type", TensorProto.INT32), ["scales are int32", QKV_S]),
    "gbq-block-7": (_attr("GatherBlockQuantized", "block_size", 7), ["GatherBlockQuantized", "block_size 7"]),
    "gbq-quantize-axis-5": (_attr("GatherBlockQuantized", "quantize_axis", 5), ["quantize_axis 5"]),
}


def _edited(src: Path, dst: Path, edit: Callable[[onnx.ModelProto], None]) -> Path:
    shutil.copytree(src.parent, dst)
    m = onnx.load(str(dst / MODEL), load_external_data=False)
    edit(m)
    onnx.save(m, str(dst / MODEL))
    return dst / MODEL


def _refusal(path: Path) -> OnnxPrepError:
    with pytest.raises(OnnxPrepError) as info:
        resolve_model(path)
    return info.value


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_onnxruntime_refuses_is_refused_in_one_line(small_llm_path, tmp_path, case):
    ort = ort_or_skip()
    edit, fragments = REFUSED[case]
    path = _edited(small_llm_path, tmp_path / case, edit)
    with pytest.raises(Exception):
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    err = _refusal(path)
    line = err.one_line()
    assert err.exit_code == EXIT_UNUSABLE and "\n" not in line
    for fragment in fragments:
        assert fragment in line, (fragment, line)


def test_refusals_read_no_payload_byte(small_llm_path, tmp_path):
    """By audit hook (as test_resolve's test_resolution_reads_no_payload_byte): the
    checks run on metadata; no data file is opened or mapped, whichever rule refuses."""
    paths = [_edited(small_llm_path, tmp_path / c, REFUSED[c][0])
             for c in ("norm-int32", "mm-scales-shape", "gbq-block-7", "two-producers")]
    _, seen = file_events(lambda: [_refusal(path) for path in paths])
    opened = opened_paths(seen)
    assert any(o.endswith(MODEL) for o in opened)  # the hook works
    assert not any(o.endswith(".data") for o in opened)
    assert not any(e == "mmap.__new__" for e, _ in seen)


@pytest.mark.parametrize("level", [9, -1])
def test_accuracy_level_outside_0_4_computes_as_0(small_llm_path, tmp_path, level):
    """ONNX Runtime loads accuracy_level 9 or -1 and computes in fp32 (int8 at 4 only):
    resolution takes the model and gives it level 0's layout and attributes."""
    ort = ort_or_skip()
    path = _edited(small_llm_path, tmp_path / "acc", _attr("MatMulNBits", "accuracy_level", level))
    ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    node = next(n for n in resolve_model(path).nodes if n.name == "layers.0.attn.qkv_proj")
    assert node.attributes["accuracy_level"] == 0
    assert node.requirements[0].layout.endswith(".acc0")


@pytest.mark.parametrize("edit", [
    pytest.param(lambda m: None, id="as-generated"),
    pytest.param(lambda m: setattr(m, "ir_version", 14), id="ir-14"),
    pytest.param(_attr("MatMulNBits", "accuracy_level", 4), id="accuracy-level-4"),
    pytest.param(_attr("GatherBlockQuantized", "block_size", 64), id="gbq-one-block-per-row"),
    pytest.param(lambda m: m.graph.node.reverse(), id="nodes-out-of-order"),
])
def test_what_onnxruntime_loads_is_resolved(small_llm_path, tmp_path, edit):
    ort = ort_or_skip()
    path = _edited(small_llm_path, tmp_path / "m", edit)
    ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert resolve_model(path).nodes


BUILDERS = {
    "tied": tied_int4_model, "single-weight": single_weight_model, "gemm": gemm_model,
    "matmul-nbits": matmul_nbits_model,
    "matmul-nbits-zp": lambda d: matmul_nbits_model(d, zero_points=True),
    "qdq": qdq_matmul_model, "qdq-uint4-zp": lambda d: qdq_matmul_model(d, signed=False, zero_points=True),
    "qdq-fp16": lambda d: qdq_matmul_model(d, scale_dtype="float16"),
}


@pytest.mark.parametrize("builder", list(BUILDERS))
def test_every_built_model_onnxruntime_loads_is_resolved(tmp_path, builder):
    ort = ort_or_skip()
    path = BUILDERS[builder](tmp_path / builder)
    ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    resolve_model(path)


def test_a_model_with_an_op_nobody_knows_is_still_resolved(tmp_path):
    """ONNX Runtime refuses custom.ops::Frobnicate (no kernel); resolution lists it as
    unsupported, as before: the checker does not judge unknown domains."""
    resolved = resolve_model(custom_op_model(tmp_path / "custom"))
    assert [u.op_type for u in resolved.unsupported] == ["Frobnicate"]


@pytest.mark.parametrize("fixture", ["tiny_llm_path", "small_llm_path", "tiny_zp_llm_path"])
def test_every_fixture_onnxruntime_loads_is_resolved(request, fixture):
    ort = ort_or_skip()
    path = request.getfixturevalue(fixture)
    ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    resolve_model(path)


@pytest.mark.parametrize("command", ["resolve", "run"])
@pytest.mark.parametrize("case", ["norm-int32", "mm-B-int8", "gbq-block-7", "offset-arabic-digit"])
def test_commands_that_load_refuse_with_exit_2_and_one_line(small_llm_path, tmp_path, command, case):
    """`run` used to exit 0 with other tokens on the INT32 norm, and to exit 3 inside a
    prepack task on an int8 B; both commands now stop at resolution."""
    from test_resolve_cli import assert_one_line_error, run

    path = _edited(small_llm_path, tmp_path / case, REFUSED[case][0])
    args = [command, str(path)] + (["--tokens", "2"] if command == "run" else [])
    assert_one_line_error(run(*args), *REFUSED[case][1])
