"""A node's implementation, from its kernel's spec: ``bind_node`` (once per node, when
the action program compiles) and ``get_op`` (one op type, for tests and tools)."""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from onnx_prep.core.errors import UnsupportedOpError, Where
from onnx_prep.core.kernels.registry import kernel_spec
from onnx_prep.core.ops.attributes import ABSENT_OUTPUTS, N_OUTPUTS, normalize_attributes
from onnx_prep.core.ops.reference import ReferenceOp, run_reference
from onnx_prep.core.ops.registry import OpImpl


class BoundOp(NamedTuple):
    fn: OpImpl
    attrs: dict[str, Any]
    implicit_inputs: tuple[str, ...]  # outer-scope values the subgraphs read, passed after the inputs


def get_op(op_type: str, domain: str = "", kernel_id: str | None = "numpy", opset: int | None = None) -> OpImpl:
    """The implementation of one op for one kernel id.

    For a generic kernel without an implementation of the op (``reference``, a numpy
    op type the op table lacks) the returned function instantiates the
    ``onnx.reference`` op per distinct attribute set on first call; ``bind_node``
    builds it once per node instead.
    Raises UnsupportedOpError when nothing can run the op.
    """
    try:
        spec = kernel_spec(kernel_id)
    except UnsupportedOpError:
        raise UnsupportedOpError(
            f"no kernel for {domain or 'ai.onnx'}::{op_type} (kernel id {kernel_id!r})") from None
    impl = spec.implementation(op_type, domain, opset)
    if impl is not None:
        return impl
    if not spec.generic:
        raise UnsupportedOpError(f"kernel {kernel_id!r} has no implementation for {op_type}")

    def via_reference(inputs, attrs, prepared, _t=op_type, _d=domain, _o=opset):
        return run_reference(_t, _d, attrs, inputs, _o)

    via_reference.__name__ = f"reference_{op_type}"
    return via_reference


def bind_node(node, opsets: Mapping[str, int], weights: Mapping[str, Any] | None = None) -> BoundOp:
    """The implementation of one ``NodeKernel``, resolved once at compile time.

    Adds the reserved attributes the ops read (``N_OUTPUTS``, ``ABSENT_OUTPUTS``; the kernel's own, e.g.
    ``ROW_SHAPE`` for a prepacked gather, from the WeightDescriptors), instantiates the
    reference implementation where a generic kernel has none, and lists the
    outer-scope values a control-flow node's subgraphs read (the caller appends them
    to the inputs).
    """
    if node.kernel is None:
        raise UnsupportedOpError(f"no kernel for {node.domain or 'ai.onnx'}::{node.op_type}",
                                 Where(node=node.name))
    domain = "" if node.domain == "ai.onnx" else node.domain
    opset = opsets.get(domain, opsets.get("ai.onnx")) if domain == "" else opsets.get(domain)
    attrs = normalize_attributes(node.attributes)
    attrs[N_OUTPUTS] = len(node.outputs)
    attrs[ABSENT_OUTPUTS] = tuple(i for i, name in enumerate(node.outputs) if not name)
    try:
        spec = kernel_spec(node.kernel)
    except UnsupportedOpError:
        raise UnsupportedOpError(f"no kernel for {domain or 'ai.onnx'}::{node.op_type} (kernel id {node.kernel!r})",
                                 Where(node=node.name)) from None
    if spec.bind_attrs is not None and weights is not None:
        spec.bind_attrs(node, attrs, weights)
    impl = spec.implementation(node.op_type, domain, opset)
    if impl is None and spec.generic:
        implicit = tuple(node.implicit_inputs)
        fn = ReferenceOp(node.op_type, domain, attrs, opset, node_name=node.name, opsets=opsets,
                         present_inputs=[bool(n) for n in node.inputs], implicit_inputs=implicit)
        return BoundOp(fn, attrs, implicit)
    if impl is None:
        raise UnsupportedOpError(f"kernel {node.kernel!r} has no implementation for {node.op_type}",
                                 Where(node=node.name))
    return BoundOp(impl, attrs, ())
