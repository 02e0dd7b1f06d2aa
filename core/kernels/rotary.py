"""The ``rotary`` kernel: com.microsoft RotaryEmbedding, computed by the native rotary
kernel (core/ops/rotary.py; semantics there, tolerances in docs/kernels.md). No
prepared object: the cos / sin caches are read as they are. Also the rotate-half rotary
fusion makes at resolve, ``onnx_prep.fused::RotaryEmbedding(x, cos, sin)`` (core/model/
fusion.py; ``rotary_from_tables``), which takes any tables: it is the formula it replaced.

Refuses, as ONNX Runtime does, fewer than four inputs, ``rotary_embedding_dim`` without
``num_heads``, and constant caches that are not 2-D or not of one shape. Leaves to the
next kernel (unsupported when none) ``is_packed_batching`` 1 (a packed-token layout
this kernel does not implement), an odd ``rotary_embedding_dim`` (no pairing), and
constant caches of another element type than float32 / float16.
"""
from __future__ import annotations

from onnx_prep.core.kernels.spec import KernelChoice, KernelSpec, MatchContext, node_input, refuse
from onnx_prep.core.model.fusion import FUSED_DOMAIN
from onnx_prep.core.model.transforms import GraphNode
from onnx_prep.core.ops import rotary
from onnx_prep.core.ops.registry import MS_DOMAIN

ID = "rotary"
_CHOICE = KernelChoice(ID)
_IMPLEMENTATIONS = {(MS_DOMAIN, "RotaryEmbedding"): rotary.rotary_embedding,
                    (FUSED_DOMAIN, "RotaryEmbedding"): rotary.rotary_from_tables}


def match(node: GraphNode, ctx: MatchContext) -> KernelChoice | None:
    if node.domain == FUSED_DOMAIN:
        return _CHOICE
    a = node.attributes
    if len(node.inputs) < 4 or not all(node_input(node, i) for i in range(4)):
        raise refuse(node, "input, position_ids, cos_cache and sin_cache are required")
    rot, heads = int(a.get("rotary_embedding_dim", 0)), int(a.get("num_heads", 0))
    if rot > 0 and heads <= 0:
        raise refuse(node, f"rotary_embedding_dim {rot} needs num_heads > 0 (num_heads is {heads})")
    caches = [ctx.constant(node, 2), ctx.constant(node, 3)]
    for c in caches:
        if c is not None and len(c.dims) != 2:
            raise refuse(node, f"cache has shape {list(c.dims)}, expected 2-D [max_position, rotary_dim / 2]",
                         c.name)
    if all(caches) and caches[0].dims != caches[1].dims:
        raise refuse(node, f"cos_cache {list(caches[0].dims)} and sin_cache {list(caches[1].dims)} differ",
                     caches[1].name)
    if int(a.get("is_packed_batching", 0)) == 1 or rot % 2:
        return None
    if any(c is not None and c.dtype not in ("float32", "float16") for c in caches):
        return None
    return _CHOICE


SPEC = KernelSpec.of_table(ID, _IMPLEMENTATIONS, match)
