"""The ``activation`` kernel: com.microsoft QuickGelu, computed by the native activation
kernel (core/ops/activation.py; semantics there, tolerances in docs/kernels.md), also
the node the ``silu`` fusion makes from ``Sigmoid(x) * x`` (core/model/fusion.py). No
prepared object.

Refuses, as ONNX Runtime does, a node without its input.
"""
from __future__ import annotations

from onnx_prep.core.kernels.spec import KernelChoice, KernelSpec, MatchContext, node_input, refuse
from onnx_prep.core.model.transforms import GraphNode
from onnx_prep.core.ops import activation
from onnx_prep.core.ops.registry import MS_DOMAIN

ID = "activation"
_CHOICE = KernelChoice(ID)
_IMPLEMENTATIONS = {(MS_DOMAIN, "QuickGelu"): activation.quick_gelu}


def match(node: GraphNode, ctx: MatchContext) -> KernelChoice | None:
    if not node.inputs or not node_input(node, 0):
        raise refuse(node, "X is required")
    return _CHOICE


SPEC = KernelSpec.of_table(ID, _IMPLEMENTATIONS, match)
