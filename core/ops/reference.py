"""Generic fallback: any standard ONNX op through the ``onnx.reference`` implementations.

Slow (pure numpy written for clarity, one Python object per node) but complete for the
default and ``ai.onnx.ml`` domains, so any valid model executes. The kernel registry
assigns the ``reference`` kernel to every standard op without a numpy implementation
here; the numpy ops also use it for the corners they do not cover themselves (Cast to
bfloat16 / float8 / strings).

Known gap: control-flow ops (If, Loop, Scan) whose subgraphs read values of the outer
graph need those values as a context; the action program does not pass one, so such
nodes fail with UnsupportedOpError naming the node. Subgraphs that only read their own
inputs run.
"""
from __future__ import annotations

import threading
from typing import Any, Mapping

import numpy as np

from onnx_prep.core.errors import UnsupportedOpError, Where
from onnx_prep.core.ops.attributes import N_OUTPUTS, RESERVED

REFERENCE_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")


def _attribute_proto(op_type: str, domain: str, opset: int, name: str, value: Any):
    import onnx
    from onnx import helper, numpy_helper

    if isinstance(value, np.ndarray):
        value = numpy_helper.from_array(value, name)
    elif isinstance(value, (list, tuple)):
        value = [numpy_helper.from_array(v) if isinstance(v, np.ndarray) else v for v in value]
        if not value:
            # An empty list has no inferable type: take it from the op schema.
            schema = onnx.defs.get_schema(op_type, opset, domain)
            return helper.make_attribute(name, [], attr_type=schema.attributes[name].type)
    return helper.make_attribute(name, value)


class ReferenceOp:
    """One node bound to its ``onnx.reference`` implementation; an ``OpImpl``.

    Built once per node (compile time); ``__call__`` has the OpImpl signature and
    ignores the ``attrs`` it is given (they were bound at construction).
    """

    def __init__(self, op_type: str, domain: str, attrs: Mapping[str, Any], opset: int | None,
                 *, node_name: str = "", opsets: Mapping[str, int] | None = None) -> None:
        import onnx
        from onnx import helper

        domain = "" if domain == "ai.onnx" else domain
        if domain not in REFERENCE_DOMAINS:
            raise UnsupportedOpError(f"no reference implementation for {domain}::{op_type}",
                                     Where(node=node_name or None))
        if opset is None:
            opset = onnx.defs.onnx_opset_version() if domain == "" else 1
        self.op_type, self.domain, self.opset = op_type, domain, int(opset)
        node = onnx.NodeProto()
        node.op_type, node.domain, node.name = op_type, domain, node_name
        node.attribute.extend(
            _attribute_proto(op_type, domain, self.opset, k, v) for k, v in attrs.items() if k not in RESERVED
        )
        self._n_outputs = int(attrs.get(N_OUTPUTS, 1))
        node.output.extend(f"o{i}" for i in range(self._n_outputs))
        self._node = node
        try:
            if domain == "":
                from onnx.reference.ops import load_op
            else:
                from onnx.reference.ops.aionnxml import load_op
            cls = load_op(domain, op_type, self.opset)
        except Exception as e:  # onnx raises plain exceptions for unknown ops
            raise UnsupportedOpError(
                f"no reference implementation for {domain or 'ai.onnx'}::{op_type} at opset {self.opset}: {e}",
                Where(node=node_name or None)) from e
        from onnx.reference.reference_evaluator import ReferenceEvaluator

        run_params = {"log": lambda *a: None, "opsets": dict(opsets or {domain: self.opset}),
                      "verbose": 0, "new_ops": {}, "existing_functions": {},
                      "evaluator_cls": ReferenceEvaluator}
        self._impl = cls(node, run_params)
        self._node_name = node_name

    def __call__(self, inputs: list, attrs: Mapping[str, Any] | None = None,
                 prepared: Mapping | None = None) -> list:
        # Trailing absent optional inputs are dropped; inner ones stay None, which the
        # reference implementations read as "absent".
        args = list(inputs)
        while args and args[-1] is None:
            args.pop()
        try:
            out = self._impl.run(*args)
        except RuntimeError as e:
            if "context" in str(e):
                raise UnsupportedOpError(
                    f"{self.op_type}: subgraphs that read outer-scope values are not supported",
                    Where(node=self._node_name or None)) from e
            raise
        return [np.asarray(o) if not isinstance(o, np.ndarray) else o for o in out]


def _freeze(value: Any):
    if isinstance(value, np.ndarray):
        return ("nd", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return ("id", id(value))


_CACHE: dict[tuple, ReferenceOp] = {}
_CACHE_LOCK = threading.Lock()


def run_reference(op_type: str, domain: str, attrs: Mapping[str, Any], inputs: list,
                  opset: int | None = None) -> list:
    """Run one op through the reference implementation (instances cached by attributes).

    For occasional use inside numpy ops; the action program binds a ``ReferenceOp``
    per node instead.
    """
    key = (op_type, domain, opset, tuple((k, _freeze(v)) for k, v in sorted(attrs.items())))
    with _CACHE_LOCK:
        op = _CACHE.get(key)
        if op is None:
            op = _CACHE[key] = ReferenceOp(op_type, domain, attrs, opset)
    return op(inputs)
