"""What ONNX Runtime refuses at load, refused by resolution first, from the metadata only.

A model ONNX Runtime would not load must not run here with a different answer. These
checks read the protobuf parsed without external data (no payload byte is read; the
checker only ``stat``s the data files) and each refusal is one ``ModelFormatError``
line naming the node, attribute or tensor and the rule:

- IR version and opset ranges: at most what the installed ``onnx`` knows (ONNX
  Runtime 1.2x-1.3x accept exactly their bundled onnx's ``IR_VERSION`` and opset; a
  later one is refused with "Unsupported model IR version" / "opset ... is under
  development"); ``com.microsoft`` version 1;
- one producer per value: a node, an initializer or a graph input, each input declared
  once (ONNX Runtime: "Duplicate definition");
- external-data entries: keys ``location``, ``offset``, ``length``, ``checksum`` only,
  each once; offset and length ASCII decimal digits (ONNX Runtime parses them in the
  classic locale and refuses spaces, signs and other digits); a location that names
  a file (no trailing ``/``);
- the ONNX checker and strict type and shape inference (a declared shape that
  disagrees with the inferred one is not refused: ONNX Runtime merges those leniently;
  a type error is). Inference does not know the
  contrib ops, so the outputs of ``MatMulNBits`` and ``GatherBlockQuantized`` are given
  their schema's type first (the scales' type, T1/T2 in ONNX Runtime's contrib schema):
  a norm weight stored as INT32 then meets a float tensor in a ``Mul`` and is refused,
  as ONNX Runtime refuses it.

The contrib ops' attributes and tensors are checked by their kernel specs
(``core/kernels/int4_matmul.py``, ``int4_gather.py``).
"""
from __future__ import annotations

import re
from typing import Mapping, Sequence

import onnx
from onnx import TensorProto

from onnx_prep.core.errors import ExternalDataError, ModelFormatError, Where

MAX_IR_VERSION = onnx.IR_VERSION
MAX_OPSETS = {"": onnx.defs.onnx_opset_version(), "com.microsoft": 1}
EXTERNAL_DATA_KEYS = ("location", "offset", "length", "checksum")
_DECIMAL = re.compile(r"-?[0-9]+", re.ASCII)  # a negative number has its own message
# What onnx's C++ checker and inference also raise on a malformed model (a Cast to
# 2**40 is "ValueError: Invalid tensor data type 0."); the try blocks hold one call each.
_ONNX_ALSO_RAISES = (ValueError, TypeError, RuntimeError, IndexError)
# Contrib ops whose output type is their scales' type (input 2), per ONNX Runtime's schema.
_TYPED_BY_SCALES = {("com.microsoft", "MatMulNBits"), ("com.microsoft", "GatherBlockQuantized")}
# Ops ONNX Runtime registers in the default domain that ONNX does not define (the
# onnxruntime-genai builder emits them there): the checker would call them unknown, so
# its copy moves them to a domain of their own, whose ops it does not check.
_ORT_DEFAULT_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization"})
_CHECKER_ORT_DOMAIN = "onnx_prep.ort_default_domain"


def check_versions(proto: onnx.ModelProto, model: str) -> None:
    """IR version and opset versions within what ONNX Runtime loads."""
    if proto.ir_version > MAX_IR_VERSION:
        raise ModelFormatError(f"ir_version {proto.ir_version} is above the supported {MAX_IR_VERSION}",
                               Where(model=model))
    for o in proto.opset_import:
        domain = "" if o.domain in ("", "ai.onnx") else o.domain
        top = MAX_OPSETS.get(domain)
        if o.version < 1 or (top is not None and o.version > top):
            raise ModelFormatError(
                f"opset {o.version} of domain {domain or 'ai.onnx'!r} is outside the supported 1-{top}",
                Where(model=model))


def check_single_producers(graph: onnx.GraphProto, model: str) -> None:
    """Every value is defined once: as a graph input (an initializer may give it a
    default), an initializer, or by one node."""
    defined: set[str] = set()
    for v in graph.input:
        if v.name in defined:
            raise ModelFormatError(f"graph input {v.name!r} is declared more than once", Where(model=model))
        defined.add(v.name)
    defined |= {t.name for t in graph.initializer}
    for i, n in enumerate(graph.node):
        for name in n.output:
            if not name:
                continue
            if name in defined:
                raise ModelFormatError(f"value {name!r} has more than one producer",
                                       Where(model=model, node=n.name or f"{n.op_type}_{i}"))
            defined.add(name)


def external_entries(t: TensorProto, where: Where) -> dict[str, str]:
    """A tensor's external-data entries as a mapping, after the key set, number format
    and location syntax rules."""
    ext: dict[str, str] = {}
    for e in t.external_data:
        if e.key not in EXTERNAL_DATA_KEYS:
            raise ExternalDataError(f"unknown external data key {e.key!r} (allowed: "
                                    f"{', '.join(EXTERNAL_DATA_KEYS)})", where)
        if e.key in ext:
            raise ExternalDataError(f"external data key {e.key!r} given twice", where)
        ext[e.key] = e.value
    for key in ("offset", "length"):
        if key in ext and _DECIMAL.fullmatch(ext[key]) is None:
            raise ExternalDataError(f"external data {key} {ext[key][:40]!r} is not ASCII decimal digits", where)
    location = ext.get("location", "")
    if location.endswith(("/", "\\")):
        raise ExternalDataError(f"external data location {location[:200]!r} does not name a file", where)
    return ext


def check_onnx_rules(proto: onnx.ModelProto, order: Sequence[int], model: str) -> None:
    """The ONNX checker and strict type and shape inference on a copy of the
    metadata: nodes in ``order`` (resolution's topological order: ONNX Runtime sorts a
    graph that is merely out of order, the checker would refuse it), external
    initializers as typed graph inputs (the checker would look for their files from
    the working directory; resolution has checked them beside the model), contrib
    outputs typed from their scales."""
    where = Where(model=model)
    typed = _checkable_copy(proto, order)
    # NOTE: the checker requires a shape on every graph input and output; ONNX Runtime
    # does not (a tensor of unknown rank). Such a value gets an empty shape for the
    # checker only, taken off again before inference, where it would mean a scalar.
    shapeless = [v.type.tensor_type for v in (*typed.graph.input, *typed.graph.output)
                 if v.type.HasField("tensor_type") and not v.type.tensor_type.HasField("shape")]
    for t in shapeless:
        t.shape.SetInParent()
    try:
        onnx.checker.check_model(typed)
    except (onnx.checker.ValidationError, *_ONNX_ALSO_RAISES) as exc:
        raise ModelFormatError(f"ONNX checker: {_first_line(exc)}", where) from None
    for t in shapeless:
        t.ClearField("shape")
    try:
        inferred = _infer(typed)
    except onnx.shape_inference.InferenceError as exc:
        if _SHAPE_MERGE not in str(exc):
            raise ModelFormatError(f"type and shape inference: {_first_line(exc)}", where) from None
        # NOTE: an inferred shape that disagrees with a declared one is not an error to
        # ONNX Runtime: it logs a warning and merges leniently (the onnxruntime-genai
        # builder declares a rank-0 shape for a Constant of shape [1], and ONNX Runtime
        # loads the model). Type errors stay fatal there, and here: inference runs again
        # with every declared shape dropped and every declared type kept.
        inferred = _infer(_without_declared_shapes(typed), where)
    except (onnx.checker.ValidationError, *_ONNX_ALSO_RAISES) as exc:
        raise ModelFormatError(f"type and shape inference: {_first_line(exc)}", where) from None
    _check_contrib_input_types(inferred, model)


_SHAPE_MERGE = "Inferred shape and existing shape differ"


def _infer(model: onnx.ModelProto, where: Where | None = None) -> onnx.ModelProto:
    """Strict type and shape inference; with ``where``, its failure is the refusal."""
    if where is None:
        return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, *_ONNX_ALSO_RAISES) as exc:
        raise ModelFormatError(f"type and shape inference: {_first_line(exc)}", where) from None


def _without_declared_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose value_info and graph outputs keep their types but not their shapes."""
    relaxed = onnx.ModelProto()
    relaxed.CopyFrom(model)
    for v in (*relaxed.graph.value_info, *relaxed.graph.output):
        if v.type.HasField("tensor_type"):
            v.type.tensor_type.ClearField("shape")
    return relaxed


def _check_contrib_input_types(inferred: onnx.ModelProto, model: str) -> None:
    """The contrib ops' inputs against their schema's type constraints, once inference
    has typed them: MatMulNBits' A (and bias) the scales' type (T1), and
    GatherBlockQuantized's indices int32 or int64."""
    g = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*g.input, *g.value_info, *g.output)}
    types.update({t.name: t.data_type for t in g.initializer})
    for n in g.node:
        if (n.domain, n.op_type) not in _TYPED_BY_SCALES or len(n.input) < 3:
            continue
        scales = types.get(n.input[2], 0)
        if n.op_type == "MatMulNBits":
            checked = [(n.input[i], (scales,)) for i in (0, 5) if i < len(n.input) and n.input[i]]
        else:
            checked = [(n.input[1], (TensorProto.INT32, TensorProto.INT64))]
        for name, allowed in checked:
            got = types.get(name, 0)
            if got and all(allowed) and got not in allowed:
                raise ModelFormatError(
                    f"{n.op_type}: input {name!r} is {_type_name(got)}, expected "
                    f"{' or '.join(map(_type_name, allowed))}",
                    Where(model=model, node=n.name or None))


def _checkable_copy(proto: onnx.ModelProto, order: Sequence[int]) -> onnx.ModelProto:
    """The copy ``check_onnx_rules`` checks (see there)."""
    graph = proto.graph
    types: Mapping[str, int] = {t.name: t.data_type for t in graph.initializer}
    known = {v.name for v in (*graph.value_info, *graph.output)}
    typed = onnx.ModelProto()
    typed.CopyFrom(proto)
    g = typed.graph
    del g.node[:]
    g.node.extend(graph.node[i] for i in order)
    inputs = {v.name for v in graph.input}
    external = [t for t in graph.initializer if t.data_location == TensorProto.EXTERNAL]
    del g.initializer[:]
    g.initializer.extend(t for t in graph.initializer if t.data_location != TensorProto.EXTERNAL)
    g.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                   for t in external if t.name not in inputs)
    moved = [n for n in g.node if n.domain in ("", "ai.onnx") and n.op_type in _ORT_DEFAULT_DOMAIN_OPS]
    for n in moved:
        n.domain = _CHECKER_ORT_DOMAIN
    if moved:
        typed.opset_import.append(onnx.helper.make_opsetid(_CHECKER_ORT_DOMAIN, 1))
    for n in graph.node:
        domain = n.domain or ""
        if (domain, n.op_type) not in _TYPED_BY_SCALES or len(n.input) < 3 or not n.output:
            continue
        elem = types.get(n.input[2])
        if elem is not None and n.output[0] not in known:
            typed.graph.value_info.append(onnx.helper.make_tensor_value_info(n.output[0], elem, None))
    return typed


def _type_name(elem_type: int) -> str:
    try:
        return TensorProto.DataType.Name(elem_type).lower()
    except ValueError:  # not a TensorProto.DataType
        return f"type {elem_type}"


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return " ".join(text.split("\n")[:1])[:300]
