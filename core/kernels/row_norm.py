"""The ``row_norm`` kernel: LayerNormalization and SimplifiedLayerNormalization (the
latter registered by ONNX Runtime in the default domain, though not an ONNX op), and
com.microsoft SkipLayerNormalization / SkipSimplifiedLayerNormalization, computed by
the native row-normalization kernel (core/ops/norm.py; semantics there, tolerances in
docs/kernels.md). No prepared object: gamma, beta and bias are read as they are.

Takes float32 and float16 (computed in float32, as ONNX Runtime does). Refuses, as
ONNX Runtime does, a Skip form with fewer than three inputs, a negative epsilon or a
constant gamma / beta / bias that is not 1-D; leaves to the next kernel (unsupported
when none) another constant element type (double, bfloat16).
"""
from __future__ import annotations

from onnx_prep.core.kernels.spec import KernelChoice, KernelSpec, MatchContext, node_input, refuse
from onnx_prep.core.model.transforms import GraphNode
from onnx_prep.core.ops import norm
from onnx_prep.core.ops.registry import MS_DOMAIN, OpImpl

ID = "row_norm"

_IMPLEMENTATIONS: dict[tuple[str, str], OpImpl] = {
    ("", "LayerNormalization"): norm.layer_normalization,
    ("", "SimplifiedLayerNormalization"): norm.simplified_layer_normalization,
    (MS_DOMAIN, "SkipLayerNormalization"): norm.skip_layer_normalization,
    (MS_DOMAIN, "SkipSimplifiedLayerNormalization"): norm.skip_simplified_layer_normalization,
}
_FLOAT_TYPES = ("float32", "float16")
_CHOICE = KernelChoice(ID)


def match(node: GraphNode, ctx: MatchContext) -> KernelChoice | None:
    skip_form = node.domain == MS_DOMAIN
    if skip_form:
        if len(node.inputs) < 3 or not all(node_input(node, i) for i in range(3)):
            raise refuse(node, "input, skip and gamma are required")
        eps = float(node.attributes.get("epsilon", 1e-12))
        if eps < 0:
            raise refuse(node, f"epsilon {eps:g} is negative")
    elif len(node.inputs) < 2 or not node_input(node, 1):
        raise refuse(node, "X and scale are required")
    for i in range(len(node.inputs)):
        c = ctx.constant(node, i)
        if c is None or i == 0:
            continue
        if c.dtype not in _FLOAT_TYPES:
            return None
        if skip_form and i >= 2 and len(c.dims) != 1:
            raise refuse(node, f"input {i} has shape {list(c.dims)}, expected 1-D [hidden_size]", c.name)
    return _CHOICE


SPEC = KernelSpec.of_table(ID, _IMPLEMENTATIONS, match)
