"""Tied embeddings: a GatherBlockQuantized (the embedding) and a MatMulNBits (the LM
head) over one INT4 weight read ONE prepared object, the matmul's.

The matmul's layout (``int4mm``) holds every row of the table: row v of the embedding
is output column v of the LM head's B, and the native gather reads it there with the
bits the gather's own layout (``int4gather``) gives (native/gather.c). So a tied weight
is packed once, cached once and held once; ``int4gather`` remains for untied tables.

``tie_gathers`` ties an ``int4_gather`` choice to an ``int4_matmul`` choice (a
MatMulNBits node) when the two read the same table the same way:

- data: the same initializer (the gather's may be a folded view of it, ``DATA_VIEW``);
- geometry: the same block_size, the matmul's N = the table's rows V and its K = the
  gather's row length (whole blocks: a padded K tail is never tied);
- scales: the same initializer, or two of one dtype and byte length with equal
  declared sha256 digests (the same values in each op's shape: ONNX Runtime refuses
  one op's scale shape in the other, so an exporter writes them twice);
- zero points: none on either, or the same bytes (by name or digest) in the form both
  ops read alike: V * ceil(n_blocks / 2) bytes, two codes a byte along the blocks.

Resolution does no I/O: equal bytes are known from names or declared digests only (a
FILE_CHECKSUM digest names its offset, so two tensors never share one), and the tie
trusts a declared digest as the prepared cache does. The tied gather replaces its own
inputs (data, scales[, zero points]) with the matmul's object; the matmul's node packs
it (``prepack.packing_nodes``); a scale or zero-point initializer only the gather read
is left unread (``unread_initializers``).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Iterable, Mapping, Sequence

import numpy as np

from onnx_prep.core.kernels import int4_gather, int4_matmul
from onnx_prep.core.kernels.int4_weights import zero_points_of
from onnx_prep.core.kernels.spec import KernelChoice
from onnx_prep.core.model.prepared_key import PrepackRequest
from onnx_prep.core.model.transforms import GraphNode
from onnx_prep.core.model.weights import WeightDescriptor
from onnx_prep.core.ops.registry import MS_DOMAIN


def tie_gathers(nodes: Sequence[GraphNode], choices: Sequence[KernelChoice],
                constants: Mapping[str, WeightDescriptor]) -> list[KernelChoice]:
    """``choices`` (one per node) with each tied gather's requirement replaced by its
    LM head's (see the module docstring); every other choice unchanged."""
    heads: dict[str, list[tuple[GraphNode, PrepackRequest]]] = {}
    for node, choice in zip(nodes, choices):
        if choice.kernel == int4_matmul.ID and node.domain == MS_DOMAIN and choice.requirements:
            req = choice.requirements[0]
            heads.setdefault(req.source_lineage[0], []).append((node, req))
    tied = list(choices)
    for i, (node, choice) in enumerate(zip(nodes, choices)):
        if choice.kernel != int4_gather.ID or not choice.requirements:
            continue
        req = choice.requirements[0]
        for head, head_req in heads.get(req.source_lineage[0], ()):
            if _reads_alike(node, req, head, head_req, constants):
                tied[i] = KernelChoice(choice.kernel, (head_req,),
                                       MappingProxyType({head_req.key: req.source_lineage}))
                break
    return tied


def unread_initializers(nodes: Sequence[GraphNode], choices: Sequence[KernelChoice],
                        graph_outputs: Iterable[str]) -> set[str]:
    """Initializers a node names only among the inputs its prepared object replaces
    and no prepared object derives from (a tied gather's own scales): never read."""
    lineage = {n for c in choices for r in c.requirements for n in r.source_lineage}
    replaced: set[str] = set()
    read = set(graph_outputs)
    for node, choice in zip(nodes, choices):
        names = {n for ns in choice.prepared_inputs.values() for n in ns}
        replaced |= names
        read.update(n for n in node.reads() if n not in names)
    return replaced - lineage - read


def _reads_alike(gather: GraphNode, g: PrepackRequest, head: GraphNode, h: PrepackRequest,
                 constants: Mapping[str, WeightDescriptor]) -> bool:
    gl, hl = g.source_lineage, h.source_lineage
    if g.device != h.device or len(gl) != len(hl):
        return False
    bs = int(head.attributes["block_size"])
    if int(gather.attributes.get("block_size", int4_gather.DEFAULT_BLOCK_SIZE)) != bs:
        return False
    scales = constants[gl[1]]
    v = int(scales.dims[0]) if scales.dims else 0
    if v == 0:
        return False
    n_blocks = _elements(scales) // v
    if int(head.attributes["K"]) != n_blocks * bs or int(head.attributes["N"]) != v:
        return False
    if zero_points_of(g.layout) != zero_points_of(h.layout):
        return False
    if not _same_bytes(scales, constants[hl[1]]):
        return False
    if len(gl) > 2:
        zp = constants[gl[2]]
        if not _same_bytes(zp, constants[hl[2]]) or zp.length != v * ((n_blocks + 1) // 2):
            return False
    return True


def _same_bytes(a: WeightDescriptor, b: WeightDescriptor) -> bool:
    """One initializer, or two whose declared digests say they hold the same bytes."""
    if a.name == b.name:
        return True
    return (a.dtype == b.dtype and a.length == b.length and a.digest is not None
            and a.digest == b.digest)


def _elements(d: WeightDescriptor) -> int:
    return int(np.prod(d.dims, dtype=np.int64)) if d.dims else 1
