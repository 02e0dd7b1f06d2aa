"""Weight views: a constant-foldable view of an initializer, folded at resolve time.

An exporter may feed a kernel's weight input not with an initializer but with a view
of one: the onnxruntime-genai builder's tied Qwen2 gives GatherBlockQuantized (the
embedding) ``Reshape(lm_head.MatMul.weight_Q4 [V, K/bs, bs/2] -> [V, K/2])``, the
LM head's own MatMulNBits weight. A Reshape (Flatten, Squeeze, Unsqueeze, Identity)
of a row-major tensor keeps every byte where it is, so the view is the same source
bytes with other dims: ``fold_weight_views`` rewrites the reading node to take the
initializer itself and records the dims it reads it as (``DATA_VIEW``). The tied weight
then stays one source descriptor, read once, fanning out to both prepared layouts.

Metadata only: the view's dims come from the source's dims and the view nodes'
attributes and shape constants (a Constant node, or an inline initializer); no payload
byte is read. A weight input computed any other way (a Transpose, a Cast, arithmetic, a
shape computed at run time, a shape stored as external data) cannot be folded without
reading bytes: the model is refused, naming the node and why. A weight input that is a
graph input (no producer) is left alone: no kernel takes it, and resolve lists the op.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from onnx_prep.core.errors import ModelFormatError, Where
from onnx_prep.core.model.weights import WeightDescriptor

# Reserved node attribute (a leading '_' never collides with an ONNX name): the dims a
# folded weight input is read as; the node's input names the initializer itself.
DATA_VIEW = "_data_view"
# The weight inputs a kernel needs constant, by (domain, op_type): input index.
WEIGHT_INPUTS = {("com.microsoft", "GatherBlockQuantized"): 0}
VIEW_OPS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity")


@dataclass(frozen=True)
class FoldedView:
    """One folded view: node ``node`` reads initializer ``source`` (dims
    ``source_dims``) as ``dims``, through the view nodes ``through`` (source side first,
    each ``(op_type, name)``)."""

    node: str
    source: str
    source_dims: tuple[int, ...]
    dims: tuple[int, ...]
    through: tuple[tuple[str, str], ...]

    def to_json(self) -> dict:
        return {"node": self.node, "source": self.source, "source_dims": list(self.source_dims),
                "dims": list(self.dims),
                "through": [{"op_type": op, "node": name} for op, name in self.through]}


class _Refused(Exception):
    def __init__(self, view: str, why: str) -> None:
        super().__init__(why)
        self.view, self.why = view, why


def fold_weight_views(nodes: list, constants: Mapping[str, WeightDescriptor],
                      inline_value: Callable[[str], "np.ndarray | None"]) -> list[FoldedView]:
    """Fold every view feeding a weight input (``WEIGHT_INPUTS``), in place: the node
    reads the initializer and carries ``DATA_VIEW`` (the view nodes, now unread, are
    pruned later if nothing else reads them). ``inline_value(name)`` is an inline
    initializer's value, None for one stored as external data. Raises
    ModelFormatError naming the node when a producer cannot be folded."""
    producers = {o: n for n in nodes for o in n.outputs if o}
    folded: list[FoldedView] = []
    for node in nodes:
        index = WEIGHT_INPUTS.get((node.domain, node.op_type))
        if index is None or len(node.inputs) <= index:
            continue
        name = node.inputs[index]
        if not name or name in constants or name not in producers:
            continue
        try:
            view = _trace(name, producers, constants, inline_value)
        except _Refused as exc:
            raise ModelFormatError(
                f"{node.op_type}: input {index} {name!r} is computed by {exc.view}, which cannot be "
                f"folded without reading the weight's bytes ({exc.why}); only {', '.join(VIEW_OPS)} "
                f"of an initializer fold", Where(node=node.name, tensor=name)) from None
        source, dims, through = view
        node.inputs[index] = source
        node.attributes[DATA_VIEW] = dims
        folded.append(FoldedView(node.name, source, constants[source].dims, dims, through))
    return folded


def _trace(name: str, producers: Mapping, constants: Mapping[str, WeightDescriptor],
           inline_value: Callable) -> tuple[str, tuple[int, ...], tuple[tuple[str, str], ...]]:
    """(initializer, dims of ``name``, view nodes source side first) or _Refused."""
    chain = []
    while name not in constants:
        node = producers.get(name)
        if node is None:
            raise _Refused(f"graph input {name!r}", "not a constant")
        label = f"{node.op_type} {node.name!r}"
        if node.domain != "" or node.op_type not in VIEW_OPS:
            raise _Refused(label, "not a view")
        chain.append(node)
        name = node.inputs[0] if node.inputs else ""
        if not name:
            raise _Refused(label, "no data input")
    source = name
    dims = constants[source].dims
    for node in reversed(chain):
        dims = _view_dims(node, dims, producers, constants, inline_value)
    return source, dims, tuple((n.op_type, n.name) for n in reversed(chain))


def _constant_ints(node, i: int, producers: Mapping, constants: Mapping[str, WeightDescriptor],
                   inline_value: Callable) -> tuple[int, ...] | None:
    """Input ``i`` of ``node`` as ints from a Constant node or an inline initializer;
    None when absent. _Refused when it is neither (computed, external, a graph input)."""
    name = node.inputs[i] if len(node.inputs) > i else ""
    if not name:
        return None
    label = f"{node.op_type} {node.name!r}"
    value = None
    if name in constants:
        value = inline_value(name)
        if value is None:
            raise _Refused(label, f"its input {name!r} is stored as external data")
    elif name in producers and producers[name].op_type == "Constant" and producers[name].domain == "":
        attrs = producers[name].attributes
        value = attrs.get("value", attrs.get("value_ints", attrs.get("value_int")))
    if value is None:
        raise _Refused(label, f"its input {name!r} is not a constant")
    return tuple(int(v) for v in np.asarray(value).reshape(-1))


def _view_dims(node, dims: tuple[int, ...], producers: Mapping, constants: Mapping[str, WeightDescriptor],
               inline_value: Callable) -> tuple[int, ...]:
    """The dims ``node`` (a view op) gives a tensor of ``dims``, by ONNX's rules."""
    label = f"{node.op_type} {node.name!r}"
    op, attrs, rank = node.op_type, node.attributes, len(dims)
    numel = int(np.prod(dims, dtype=np.int64))
    if op == "Identity":
        return dims
    if op == "Flatten":
        axis = int(attrs.get("axis", 1))
        axis = axis + rank if axis < 0 else axis
        if not 0 <= axis <= rank:
            raise _Refused(label, f"axis {attrs.get('axis')} is outside rank {rank}")
        return (int(np.prod(dims[:axis], dtype=np.int64)), int(np.prod(dims[axis:], dtype=np.int64)))
    if op == "Reshape":
        shape = _constant_ints(node, 1, producers, constants, inline_value)
        if shape is None:
            raise _Refused(label, "no shape input")
        out = [dims[i] if s == 0 and not int(attrs.get("allowzero", 0)) and i < rank else s
               for i, s in enumerate(shape)]
        if out.count(-1) > 1 or any(s < -1 for s in out):
            raise _Refused(label, f"shape {list(shape)} is not a valid reshape")
        known = int(np.prod([s for s in out if s != -1], dtype=np.int64))
        if -1 in out:
            if known == 0 or numel % known:
                raise _Refused(label, f"shape {list(shape)} does not fit {list(dims)}")
            out[out.index(-1)] = numel // known
        if int(np.prod(out, dtype=np.int64)) != numel:
            raise _Refused(label, f"shape {list(shape)} does not fit {list(dims)}")
        return tuple(out)
    axes = _constant_ints(node, 1, producers, constants, inline_value)
    if axes is None and "axes" in attrs:
        axes = tuple(int(a) for a in attrs["axes"])
    if op == "Squeeze":
        if axes is None:
            return tuple(d for d in dims if d != 1)
        picked = {a + rank if a < 0 else a for a in axes}
        if any(not 0 <= a < rank or dims[a] != 1 for a in picked):
            raise _Refused(label, f"axes {list(axes)} do not name dims of 1 in {list(dims)}")
        return tuple(d for i, d in enumerate(dims) if i not in picked)
    if axes is None:  # Unsqueeze
        raise _Refused(label, "no axes")
    out_rank = rank + len(axes)
    picked = {a + out_rank if a < 0 else a for a in axes}
    if len(picked) != len(axes) or any(not 0 <= a < out_rank for a in picked):
        raise _Refused(label, f"axes {list(axes)} are not valid for rank {out_rank}")
    rest = iter(dims)
    return tuple(1 if i in picked else next(rest) for i in range(out_rank))
