"""The registered kernels, and the kernel choice per node.

``KERNEL_SPECS`` is the one list of kernels (a ``KernelSpec`` per module, spec.py says
what one holds); the first whose ``op_types`` and ``match`` take a node runs it:

==============  ==========================================================================
``int4_matmul`` com.microsoft MatMulNBits, and the fused DequantizeLinear(int4)+MatMul
                node (``int4_matmul.py``)
``int4_gather`` com.microsoft GatherBlockQuantized (``int4_gather.py``)
``gqa``         com.microsoft GroupQueryAttention (``gqa.py``)
``gemm_packed`` Gemm / MatMul with a constant 2-D fp32 B (``gemm_packed.py``)
``row_norm``    LayerNormalization, SimplifiedLayerNormalization, com.microsoft
                SkipLayerNormalization / SkipSimplifiedLayerNormalization (``row_norm.py``)
``rotary``      com.microsoft RotaryEmbedding (``rotary.py``)
``activation``  com.microsoft QuickGelu (``activation.py``)
``numpy``       a default-domain op in ``NUMPY_OPS`` (``numpy_ops.py``)
``reference``   any other op ``onnx.reference`` implements (``reference_ops.py``)
``None``        no kernel: the node is listed in ``ResolvedModel.unsupported``
==============  ==========================================================================

Layout keys name every parameter that changes the packed bytes; two nodes asking for
the same (lineage, layout, device) share one prepared object (``PrepackRequest.key``).
"""
from __future__ import annotations

from typing import Mapping

from onnx_prep.core.errors import UnsupportedOpError
from onnx_prep.core.kernels import (activation, gemm_packed, gqa, int4_gather, int4_matmul, numpy_ops,
                                    reference_ops, rotary, row_norm)
from onnx_prep.core.kernels.spec import UNSUPPORTED, KernelChoice, KernelSpec, MatchContext
from onnx_prep.core.model.transforms import GraphNode
from onnx_prep.core.model.weights import WeightDescriptor
from onnx_prep.core.ops.registry import MS_DOMAIN  # noqa: F401 - the one definition, re-exported

# First match wins: the specific kernels before the generic ones.
KERNEL_SPECS: tuple[KernelSpec, ...] = (
    int4_matmul.SPEC,
    int4_gather.SPEC,
    gqa.SPEC,
    gemm_packed.SPEC,
    row_norm.SPEC,
    rotary.SPEC,
    activation.SPEC,
    numpy_ops.SPEC,
    reference_ops.SPEC,
)

KERNELS = tuple(spec.id for spec in KERNEL_SPECS)


def kernel_spec(kernel_id: str | None) -> KernelSpec:
    """The spec of ``kernel_id``; UnsupportedOpError for an unknown id."""
    for spec in KERNEL_SPECS:
        if spec.id == kernel_id:
            return spec
    raise UnsupportedOpError(f"no kernel {kernel_id!r}")


def prepared_position(kernel_id: str | None) -> int | None:
    """The input position the kernel reads its prepared object at (None: it has none)."""
    spec = next((s for s in KERNEL_SPECS if s.id == kernel_id), None)
    return spec.prepared.position if spec is not None and spec.prepared is not None else None


def choose_kernel(node: GraphNode, constants: Mapping[str, WeightDescriptor], *,
                  opsets: Mapping[str, int], local_functions: frozenset[tuple[str, str]] = frozenset(),
                  device: str = "cpu") -> KernelChoice:
    """The kernel for ``node`` and the prepared objects it consumes. Pure: no I/O."""
    ctx = MatchContext(constants, opsets, local_functions, device)
    for spec in KERNEL_SPECS:
        if spec.takes(node):
            choice = spec.match(node, ctx)
            if choice is not None:
                return choice
    return UNSUPPORTED
