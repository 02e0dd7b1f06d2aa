"""Shape and data-movement ONNX ops in numpy: Reshape, Transpose, Concat, Slice, Gather,
Unsqueeze, Squeeze, Shape, Expand, Range, ConstantOfShape, Constant, Split, Trilu, Tile.

Where an argument moved from an attribute to an input across opsets (Squeeze,
Unsqueeze, Split, Slice), both forms are read: a valid node carries exactly one.
Outputs may be views of inputs (Reshape, Transpose, Slice, Expand): callers never write
into op outputs, so aliasing is safe and saves a copy per node.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from onnx_prep.core.ops import append_buffer
from onnx_prep.core.ops.attributes import APPEND_IN_PLACE, N_OUTPUTS, axes_from, axis_index


def _ints(a) -> list[int]:
    # NOTE: tolist() first: an integer array's values come out as Python ints at once,
    # where int() of each numpy scalar costs ~1 us an element (every Reshape and Split of
    # a decode step reads its shape or sizes here)
    a = np.asarray(a).reshape(-1)
    return a.tolist() if a.dtype.kind in "iu" else [int(v) for v in a.tolist()]


def reshape(inputs, attrs, prepared):
    x = inputs[0]
    shape = _ints(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else list(attrs["shape"])
    if not attrs.get("allowzero", 0):
        # 0 copies the input's dimension at the same position (unless allowzero=1).
        shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return [x.reshape(shape)]


def transpose(inputs, attrs, prepared):
    perm = attrs.get("perm")
    # the method, not np.transpose: the same view without the wrapper's ~0.9 us (80 a
    # medium decode step); perm as normalize_attributes left it (a list of ints)
    x = np.asarray(inputs[0])
    return [x.transpose() if perm is None else x.transpose(perm)]


def concat(inputs, attrs, prepared):
    it = [x for x in inputs if x is not None]
    axis = axis_index(attrs["axis"], it[0].ndim)
    mark = attrs.get(APPEND_IN_PLACE)
    if mark and inputs[0] is not None:
        position, count = mark
        return [append_buffer.concat(it, axis, spread=(position + 0.5) / count)]
    return [np.concatenate(it, axis=axis)]


def slice_(inputs, attrs, prepared):
    x = inputs[0]
    if len(inputs) > 1:  # opset >= 10: starts, ends, axes?, steps? as inputs
        starts, ends = _ints(inputs[1]), _ints(inputs[2])
        axes = _ints(inputs[3]) if len(inputs) > 3 and inputs[3] is not None else None
        steps = _ints(inputs[4]) if len(inputs) > 4 and inputs[4] is not None else None
    else:  # opset 1: attributes
        starts, ends = list(attrs["starts"]), list(attrs["ends"])
        axes = list(attrs["axes"]) if attrs.get("axes") is not None else None
        steps = None
    if axes is None:
        axes = list(range(len(starts)))
    if steps is None:
        steps = [1] * len(starts)
    index = [slice(None)] * x.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = axis_index(a, x.ndim)
        dim = x.shape[a]
        if st == 0:
            raise ValueError("Slice step cannot be 0")
        s = s + dim if s < 0 else s
        e = e + dim if e < 0 else e
        if st > 0:
            s = min(max(s, 0), dim)
            e = min(max(e, 0), dim)
            index[a] = slice(s, e, st)
        else:
            # Negative steps clamp start to [0, dim-1] and end to [-1, dim-1]; an end
            # of -1 means "through index 0", which Python spells as None.
            s = min(max(s, 0), dim - 1)
            e = min(max(e, -1), dim - 1)
            index[a] = slice(s, None if e < 0 else e, st)
    return [x[tuple(index)]]


def gather(inputs, attrs, prepared):
    x, idx = inputs[0], inputs[1]
    axis = axis_index(attrs.get("axis", 0), x.ndim)
    # np.take accepts negative indices the way ONNX defines them (count from the end)
    # and raises on out-of-range ones.
    return [np.take(x, idx, axis=axis)]


def unsqueeze(inputs, attrs, prepared):
    x = inputs[0]
    axes = axes_from(inputs, 1, attrs)
    rank = x.ndim + len(axes)
    return [x.reshape(_unsqueezed_shape(x.shape, [axis_index(a, rank) for a in axes]))]


def _unsqueezed_shape(shape, axes):
    out = list(shape)
    for a in sorted(axes):
        out.insert(a, 1)
    return out


def squeeze(inputs, attrs, prepared):
    x = inputs[0]
    axes = axes_from(inputs, 1, attrs)
    if axes is None:
        return [x.reshape([d for d in x.shape if d != 1])]
    drop = {axis_index(a, x.ndim) for a in axes}
    for a in drop:
        if x.shape[a] != 1:
            raise ValueError(f"Squeeze axis {a} has size {x.shape[a]}, not 1")
    return [x.reshape([d for i, d in enumerate(x.shape) if i not in drop])]


def shape(inputs, attrs, prepared):
    dims = inputs[0].shape
    rank = len(dims)
    start = attrs.get("start", 0)
    end = attrs.get("end", None)
    # Opset 15 start/end clamp to [0, rank] after adding rank to negatives.
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = rank if end is None else min(max(end + rank if end < 0 else end, 0), rank)
    return [np.array(dims[start:end], dtype=np.int64)]


def size(inputs, attrs, prepared):
    return [np.array(inputs[0].size, dtype=np.int64)]


def expand(inputs, attrs, prepared):
    x = inputs[0]
    target = np.broadcast_shapes(x.shape, tuple(_ints(inputs[1])))  # bidirectional
    return [np.broadcast_to(x, target)]


def tile(inputs, attrs, prepared):
    return [np.tile(inputs[0], _ints(inputs[1]))]


def range_(inputs, attrs, prepared):
    start, limit, delta = (np.asarray(v).reshape(()) for v in inputs[:3])
    dtype = start.dtype
    # ONNX: n = max(ceil((limit - start) / delta), 0), element i = start + i * delta.
    n = int(max(np.ceil((float(limit) - float(start)) / float(delta)), 0))
    return [(start + np.arange(n, dtype=dtype) * delta).astype(dtype)]


def constant_of_shape(inputs, attrs, prepared):
    value = attrs.get("value")
    v = np.zeros(1, dtype=np.float32) if value is None else np.asarray(value).reshape(-1)
    return [np.full(tuple(_ints(inputs[0])), v[0], dtype=v.dtype)]


def constant(inputs, attrs, prepared):
    return [constant_value(attrs)]


def constant_value(attrs: Mapping[str, Any]) -> np.ndarray:
    """The value of a Constant node from whichever attribute carries it."""
    if "value" in attrs:
        return np.asarray(attrs["value"])
    if "value_float" in attrs:
        return np.array(attrs["value_float"], dtype=np.float32)
    if "value_floats" in attrs:
        return np.array(attrs["value_floats"], dtype=np.float32)
    if "value_int" in attrs:
        return np.array(attrs["value_int"], dtype=np.int64)
    if "value_ints" in attrs:
        return np.array(attrs["value_ints"], dtype=np.int64)
    if "value_string" in attrs:
        return np.array(attrs["value_string"], dtype=object)
    if "value_strings" in attrs:
        return np.array(attrs["value_strings"], dtype=object)
    raise ValueError(f"Constant node without a supported value attribute: {sorted(attrs)}")


def split(inputs, attrs, prepared):
    x = inputs[0]
    axis = axis_index(attrs.get("axis", 0), x.ndim)
    dim = x.shape[axis]
    if len(inputs) > 1 and inputs[1] is not None:  # opset >= 13
        sizes = _ints(inputs[1])
    elif attrs.get("split") is not None:  # opset < 13
        sizes = [int(s) for s in attrs["split"]]
    else:
        # Equal parts: opset 18 names the count (num_outputs; the last part may be
        # smaller); before that the count is the node's number of outputs.
        n = int(attrs.get("num_outputs", attrs.get(N_OUTPUTS, 1)))
        part = -(-dim // n)
        sizes = [min(part, dim - i * part) for i in range(n)]
    if sum(sizes) != dim:
        raise ValueError(f"Split sizes {sizes} do not sum to dimension {dim}")
    # Basic slicing (views); np.split costs ~10x more per call in Python overhead.
    lead = (slice(None),) * axis
    out, start = [], 0
    for n in sizes:
        out.append(x[lead + (slice(start, start + n),)])
        start += n
    return out


def trilu(inputs, attrs, prepared):
    x = inputs[0]
    k = int(np.asarray(inputs[1]).reshape(())) if len(inputs) > 1 and inputs[1] is not None else 0
    return [np.triu(x, k) if attrs.get("upper", 1) else np.tril(x, k)]


def flatten(inputs, attrs, prepared):
    x = inputs[0]
    axis = attrs.get("axis", 1)
    axis = axis + x.ndim if axis < 0 else axis
    lead = int(np.prod(x.shape[:axis], dtype=np.int64))
    return [x.reshape(lead, int(np.prod(x.shape[axis:], dtype=np.int64)))]
