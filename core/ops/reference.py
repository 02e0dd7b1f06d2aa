"""Generic fallback: any standard ONNX op through the ``onnx.reference`` implementations.

Slow (pure numpy written for clarity, one Python object per node) but complete for the
default and ``ai.onnx.ml`` domains, so any valid model executes. The kernel registry
assigns the ``reference`` kernel to every standard op without a numpy implementation
here; the numpy ops also use it for the corners they do not cover themselves (Cast to
bfloat16 / float8 / strings).

Control flow (If, Loop, Scan): a subgraph may read values of the enclosing graph.
Resolution lists them (``NodeKernel.implicit_inputs``); the action program appends their
slots after the node's own inputs and ``ReferenceOp`` hands them to the implementation as
its context.
"""
from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

import numpy as np

from onnx_prep.core.errors import UnsupportedOpError, Where
from onnx_prep.core.ops import cancellation
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
                 *, node_name: str = "", opsets: Mapping[str, int] | None = None,
                 present_inputs: Sequence[bool] | None = None, implicit_inputs: Sequence[str] = ()) -> None:
        """``present_inputs``: which input positions the node fills (absent optional
        inputs are False); function-body expansions need the node's input list.
        ``implicit_inputs``: outer-scope names the node's subgraphs read; their values
        follow the regular inputs in every call."""
        import onnx

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
        node.input.extend(f"i{j}" if p else "" for j, p in enumerate(present_inputs or ()))
        self._node = node
        self._n_inputs = len(present_inputs) if present_inputs is not None else None
        self._implicit = tuple(implicit_inputs)
        self._node_name = node_name
        self._opsets = dict(opsets or {domain: self.opset})
        self._by_types: dict[tuple, Any] = {}
        self._impl = None
        try:
            self._impl = self._instantiate(None)
        except _context_error():
            # A context-dependent function body (expanded per input types): built on
            # first call from the actual input dtypes, then cached per dtype tuple.
            pass
        except Exception as e:  # onnx raises plain exceptions for unknown ops
            raise UnsupportedOpError(
                f"no reference implementation for {domain or 'ai.onnx'}::{op_type} at opset {self.opset}: {e}",
                Where(node=node_name or None)) from e

    def _instantiate(self, input_types):
        from onnx.reference.reference_evaluator import ReferenceEvaluator

        if self.domain == "":
            from onnx.reference.ops import load_op

            # evaluator_cls lets load_op expand ops defined by a function body.
            cls = load_op("", self.op_type, self.opset, evaluator_cls=ReferenceEvaluator,
                          node=self._node if input_types is not None else None, input_types=input_types)
        else:
            from onnx.reference.ops.aionnxml import load_op

            cls = load_op(self.domain, self.op_type, self.opset)
        run_params = {"log": lambda *a: None, "opsets": self._opsets, "verbose": 0, "new_ops": {},
                      "existing_functions": {}, "evaluator_cls": ReferenceEvaluator}
        impl = cls(self._node, run_params)
        body_run = getattr(impl, "_run_body", None)
        if body_run is not None:  # Loop: one call per iteration, where a cancelled run stops
            name = self._node_name or self.op_type

            def checked_body(*args, **kwargs):
                cancellation.check(f"{self.op_type} {name!r}")
                return body_run(*args, **kwargs)

            impl._run_body = checked_body
        return impl

    def _impl_for(self, args: list):
        from onnx import helper

        key = tuple(None if a is None else a.dtype.str for a in args)
        impl = self._by_types.get(key)
        if impl is None:
            types = [helper.make_tensor_type_proto(helper.np_dtype_to_tensor_dtype(a.dtype), None)
                     if a is not None else None for a in args]
            impl = self._by_types[key] = self._instantiate(types)
        return impl

    def __call__(self, inputs: list, attrs: Mapping[str, Any] | None = None,
                 prepared: Mapping | None = None) -> list:
        args = list(inputs)
        context = None
        if self._implicit:
            n = len(args) - len(self._implicit)
            context = dict(zip(self._implicit, args[n:]))
            args = args[:n]
        if self.op_type == "Loop" and len(args) > 1 and args[1] is None:
            # ONNX: an absent `cond` means "true"; onnx.reference's Loop would run zero
            # iterations (`while cond and ...`), ORT runs M.
            args[1] = np.array(True)
        # Trailing absent optional inputs are dropped; inner ones stay None, which the
        # reference implementations read as "absent".
        while args and args[-1] is None:
            args.pop()
        impl = self._impl if self._impl is not None else self._impl_for(args)
        if impl.need_context():
            out = impl.run(*args, context=context or {})
        else:
            out = impl.run(*args)
        return [np.asarray(o) if not isinstance(o, np.ndarray) else o for o in out]


def _context_error():
    from onnx.reference.op_run import RuntimeContextError

    return RuntimeContextError


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
    present = tuple(x is not None for x in inputs)
    key = (op_type, domain, opset, present, tuple((k, _freeze(v)) for k, v in sorted(attrs.items())))
    with _CACHE_LOCK:
        op = _CACHE.get(key)
        if op is None:
            op = _CACHE[key] = ReferenceOp(op_type, domain, attrs, opset, present_inputs=present)
    return op(inputs)
