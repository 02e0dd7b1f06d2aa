"""Node attributes as op implementations read them, and the axis helpers they share.

Resolution stores ``NodeKernel.attributes`` as a read-only mapping of plain values.
``normalize_attributes`` accepts every form an attribute can arrive in (an
``onnx.AttributeProto``, bytes for strings, a ``TensorProto`` for tensors, or the
already-plain value) and returns plain Python / numpy values, so every op reads one
form: ints, floats, ``str``, lists of those, ``np.ndarray`` for tensors, and the
``onnx.GraphProto`` unchanged for subgraphs (only the reference fallback uses those).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from onnx_prep.core.model.weight_views import DATA_VIEW

# NOTE: reserved attribute key the action program adds for ops whose semantics depend
# on how many outputs the node declares (Split without `split`/`num_outputs`). It never
# collides with an ONNX attribute name (those are identifiers without a leading '_').
N_OUTPUTS = "_n_outputs"
# Reserved key for prepacked gathers: the element shape of one gathered row of the
# (unloaded) data tensor, from its WeightDescriptor, so the output keeps ONNX's shape.
ROW_SHAPE = "_row_shape"
# Reserved key for a gather reading a matmul's prepared B (a tied embedding,
# core/kernels/tied_embedding.py): row v of the table is column v of the prepared
# object (the reference backend's float32 [K, N]; the native buffer says so itself).
ROWS_AS_COLUMNS = "_rows_as_columns"
# Reserved key for a Concat whose first input is a graph input and whose output is a graph
# output (the KV cache: present = Concat(past, new)): it appends in place when it can
# (core/ops/append_buffer.py).
APPEND_IN_PLACE = "_append_in_place"
# Reserved key: the positions of the node's outputs it leaves unnamed (absent), for ops
# that can skip computing those (the builder's SkipSimplifiedLayerNormalization names
# its output and the residual sum, not the mean and inv_std_var).
ABSENT_OUTPUTS = "_absent_outputs"
# DATA_VIEW (core/model/weight_views.py): the dims a weight input folded at resolve time
# is read as, its input naming the initializer itself.
RESERVED = frozenset({N_OUTPUTS, ABSENT_OUTPUTS, ROW_SHAPE, ROWS_AS_COLUMNS, APPEND_IN_PLACE, DATA_VIEW})


def plain_value(value: Any) -> Any:
    """One attribute value in plain form (see the module docstring)."""
    import onnx
    from onnx import numpy_helper

    if isinstance(value, onnx.AttributeProto):
        value = onnx.helper.get_attribute_value(value)
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, (list, tuple)):
        return [plain_value(v) for v in value]
    return value


def normalize_attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {k: plain_value(v) for k, v in attributes.items()}


def axis_index(axis: int, rank: int) -> int:
    """ONNX axis (negative counts from the end) as a non-negative index; checks range."""
    a = int(axis)
    if a < -rank or a >= max(rank, 1):
        raise ValueError(f"axis {a} out of range for rank {rank}")
    return a + rank if a < 0 else a


def axes_from(inputs: list, position: int, attrs: Mapping[str, Any]) -> tuple[int, ...] | None:
    """Axes given either as the input at ``position`` (newer opsets) or as the ``axes``
    attribute (older opsets). A valid node has at most one of the two, so reading
    whichever is present implements both opsets. None means "not given"."""
    if len(inputs) > position and inputs[position] is not None:
        return tuple(int(a) for a in np.asarray(inputs[position]).reshape(-1))
    if "axes" in attrs and attrs["axes"] is not None:
        return tuple(int(a) for a in attrs["axes"])
    return None
