"""The transformation pipeline resolution runs before choosing kernels.

Operates on ``GraphNode`` (a mutable, resolution-internal node) and constant-initializer
descriptors only: no payload byte is read, so every decision here is made from
dtypes, dims and attributes.

Passes, in order (``run_transforms``):

0. ``normalize_accuracy_level`` — a MatMulNBits ``accuracy_level`` outside 0-4 becomes
   0: ONNX Runtime loads any value and computes in int8 at 4 only, in fp32 otherwise,
   which is what 0 names in the packed layout and the kernels.
1. ``fold_weight_views`` (``weight_views.py``) — a weight input that is a
   Reshape / Flatten / Squeeze / Unsqueeze / Identity of an initializer (the genai
   builder's tied embedding) reads the initializer itself, with the view's dims; what
   cannot be folded without reading bytes is refused.
2. ``fuse_dequantize_matmul`` — ``DequantizeLinear(int4|uint4 [K, N], axis=0,
   block_size) -> MatMul(A, .)`` becomes one node computing the MatMul with the INT4
   matmul kernel, fused_from both node names, with the layout key MatMulNBits gets
   for the same parameters (the packed bytes are the same; only the source layout
   differs, see ``QDQ_WEIGHT_LAYOUT``).
2b. ``fusion.fuse_patterns`` (unless turned off) — RMSNorm, rotate-half rotary and
   causal KV-cache attention chains of standard ops become one node of an op a native
   kernel runs (core/model/fusion.py, attention_pattern.py); their intermediate nodes
   (and a causal mask only fused attention read) are left dead.
3. ``prune_dead_nodes`` — drops nodes none of whose outputs reaches a graph output
   (this also drops the DequantizeLinear nodes step 2 bypassed and the view nodes
   step 1 folded).
4. ``used_initializers`` — the initializers a remaining node (or a graph output)
   reads, in order of first use; the rest are pruned.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np
from onnx import TensorProto

from onnx_prep.core.model.weight_views import FoldedView, fold_weight_views
from onnx_prep.core.model.weights import WeightDescriptor

# Attribute names/values the fused INT4 matmul node carries (MatMulNBits' own names where
# they exist). ``weight_layout`` tells the prepack step how to read the source:
MATMUL_NBITS_WEIGHT_LAYOUT = "NKb"  # MatMulNBits B: uint8 [N, k_blocks, block_size/2]
QDQ_WEIGHT_LAYOUT = "KN"  # DequantizeLinear x: int4/uint4 [K, N], blocks of block_size along K
# The accuracy level of a fused DequantizeLinear(int4) + MatMul: 0, fp32 compute, what the
# pair defines (fuse_dequantize_matmul). ONNX Runtime's fusion takes its level from a
# session key instead (core/decode/ort_runner.py, like_for_like_config).
FUSED_ACCURACY_LEVEL = 0


@dataclass
class GraphNode:
    """One node during resolution (mutable; frozen into ``NodeKernel`` at the end).

    ``implicit_inputs`` are outer-scope values read inside the node's subgraphs (If,
    Loop, Scan): reachability and initializer use count them like inputs.
    """

    name: str
    op_type: str
    domain: str  # "" for the default ONNX domain
    inputs: list[str]
    outputs: list[str]
    attributes: dict[str, Any]
    implicit_inputs: tuple[str, ...] = ()
    fused_from: tuple[str, ...] = ()

    def reads(self) -> Iterable[str]:
        for name in self.inputs:
            if name:
                yield name
        yield from self.implicit_inputs


@dataclass
class TransformResult:
    nodes: list[GraphNode]  # kept nodes, topological order
    used_initializers: list[str]  # first-use order
    fused_int4_matmuls: int
    fused_nodes_removed: int  # DequantizeLinear nodes bypassed by fusion
    dead_nodes_removed: int
    notes: list[str] = field(default_factory=list)
    folded_views: list[FoldedView] = field(default_factory=list)
    fusions: list = field(default_factory=list)  # fusion.Fusion, one per fused node
    near_misses: list = field(default_factory=list)  # fusion.NearMiss


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def fuse_dequantize_matmul(
    nodes: list[GraphNode], constants: Mapping[str, WeightDescriptor], graph_outputs: set[str]
) -> tuple[list[GraphNode], int, set[str]]:
    """Rewrite ``MatMul(A, DequantizeLinear(W_int4, s[, zp]))`` into an INT4 matmul node.

    Matches only what the INT4 kernel computes exactly: W a constant int4/uint4
    initializer ``[K, N]``, ``axis`` 0, ``block_size`` a power of two >= 16 (MatMulNBits'
    rule), scales (and zero points) constant ``[ceil(K/bs), N]``, scales fp16/fp32, and
    every consumer of the dequantized value is a MatMul reading it as B (and it is not
    a graph output). Anything else is left alone (executed as DequantizeLinear + MatMul).

    The fused node replaces the MatMul in place: same name and outputs, op_type
    "MatMul", inputs ``(A, W, scales[, zero_points])`` (MatMulNBits' order),
    attributes ``K, N, bits=4, block_size, accuracy_level=0, weight_layout="KN",
    weight_dtype``. Returns (nodes, fused count, names of bypassed DQ nodes).

    NOTE: accuracy_level 0 (fp32 compute): DequantizeLinear + MatMul is defined in fp32,
    so the fused node keeps that numerics (ONNX Runtime's own fusion picks level 4).
    """
    if not any(n.op_type == "DequantizeLinear" for n in nodes):
        return nodes, 0, set()
    consumers: dict[str, list[tuple[GraphNode, int]]] = {}
    for node in nodes:
        for i, name in enumerate(node.inputs):
            if name:
                consumers.setdefault(name, []).append((node, i))
        for name in node.implicit_inputs:
            consumers.setdefault(name, []).append((node, -1))

    fused = 0
    bypassed: set[str] = set()
    for dq in nodes:
        if dq.op_type != "DequantizeLinear" or dq.domain != "" or len(dq.outputs) != 1:
            continue
        plan = _dq_int4_params(dq, constants)
        if plan is None:
            continue
        out = dq.outputs[0]
        uses = consumers.get(out, [])
        if (not uses or out in graph_outputs
                or any(n.op_type != "MatMul" or n.domain != "" or i != 1 for n, i in uses)):
            continue
        for mm, _ in uses:
            mm.inputs = [mm.inputs[0], *plan["inputs"]]
            mm.attributes = dict(plan["attributes"])
            mm.fused_from = (dq.name, mm.name)
            fused += 1
        bypassed.add(dq.name)
    return nodes, fused, bypassed


def is_fused_dequantize_matmul(node) -> bool:
    """Whether ``node`` (a GraphNode or a resolved node) is a MatMul that
    ``fuse_dequantize_matmul`` made the INT4 matmul kernel's (other fusions, core/model/
    fusion.py, set ``fused_from`` too)."""
    return (node.op_type == "MatMul" and bool(node.fused_from)
            and node.attributes.get("weight_layout") == QDQ_WEIGHT_LAYOUT)


def _dq_int4_params(dq: GraphNode, constants: Mapping[str, WeightDescriptor]) -> dict | None:
    if len(dq.inputs) < 2:
        return None
    w = constants.get(dq.inputs[0])
    s = constants.get(dq.inputs[1])
    zp_name = dq.inputs[2] if len(dq.inputs) > 2 and dq.inputs[2] else None
    zp = constants.get(zp_name) if zp_name else None
    if w is None or s is None or (zp_name and zp is None):
        return None
    if w.onnx_type not in (TensorProto.INT4, TensorProto.UINT4) or len(w.dims) != 2:
        return None
    axis = int(dq.attributes.get("axis", 1))
    bs = int(dq.attributes.get("block_size", 0))
    if axis not in (0, -2) or not _is_pow2(bs) or bs < 16:
        return None
    k, n = w.dims
    kb = -(-k // bs)
    if s.dtype not in ("float16", "float32") or s.dims != (kb, n):
        return None
    out_dtype = int(dq.attributes.get("output_dtype", 0))
    if out_dtype not in (0, s.onnx_type):
        return None
    if zp is not None and (zp.onnx_type != w.onnx_type or zp.dims != (kb, n)):
        return None
    inputs = [w.name, s.name] + ([zp.name] if zp is not None else [])
    return {
        "inputs": inputs,
        "attributes": {
            "K": k, "N": n, "bits": 4, "block_size": bs, "accuracy_level": FUSED_ACCURACY_LEVEL,
            "weight_layout": QDQ_WEIGHT_LAYOUT, "weight_dtype": w.dtype,
        },
    }


def prune_dead_nodes(nodes: list[GraphNode], graph_outputs: set[str]) -> list[GraphNode]:
    """Keep the nodes from which a graph output is reachable (topological order kept)."""
    needed = set(graph_outputs)
    keep = [False] * len(nodes)
    for i in range(len(nodes) - 1, -1, -1):
        node = nodes[i]
        if any(o in needed for o in node.outputs):
            keep[i] = True
            needed.update(node.inputs)
            needed.update(node.implicit_inputs)
    return [n for n, k in zip(nodes, keep) if k]


def used_initializers(nodes: list[GraphNode], graph_outputs: Iterable[str],
                      initializer_names: Iterable[str]) -> list[str]:
    """Initializers read by ``nodes`` or named as graph outputs, in order of first use."""
    inits = set(initializer_names)
    seen: dict[str, None] = {}
    for node in nodes:
        for name in node.inputs:
            if name in inits:
                seen[name] = None  # dict keeps first insertion order
        for name in node.implicit_inputs:
            if name in inits:
                seen[name] = None
    for name in graph_outputs:
        if name in inits and name not in seen:
            seen[name] = None
    return list(seen)


def normalize_accuracy_level(nodes: list[GraphNode]) -> None:
    """Pass 0 (in place): see the module docstring."""
    for n in nodes:
        if (n.domain, n.op_type) == ("com.microsoft", "MatMulNBits") and \
                int(n.attributes.get("accuracy_level", 0)) not in range(5):
            n.attributes["accuracy_level"] = 0


def run_transforms(nodes: list[GraphNode], constants: Mapping[str, WeightDescriptor],
                   graph_outputs: list[str], initializer_names: Iterable[str],
                   inline_value: Callable[[str], "np.ndarray | None"] = lambda name: None, *,
                   fuse: bool = False, inline_values: Mapping[str, Any] | None = None) -> TransformResult:
    """The passes of the module docstring. ``inline_value(name)``: an inline
    initializer's value (a view's shape), None when it is external data. ``fuse`` runs
    pattern fusion, matching the constants of Constant nodes and of ``inline_values``
    (small inline initializers)."""
    outs = set(graph_outputs)
    total = len(nodes)
    normalize_accuracy_level(nodes)
    folded = fold_weight_views(nodes, constants, inline_value)
    nodes, fused, bypassed = fuse_dequantize_matmul(nodes, constants, outs)
    fusions, near_misses = [], []
    if fuse:
        from onnx_prep.core.model.fusion import constant_values, fuse_patterns

        nodes, fusions, near_misses = fuse_patterns(nodes, constant_values(nodes, inline_values or {}),
                                                    constants, outs)
        bypassed |= {name for f in fusions for name in f.fused_from}
    kept = prune_dead_nodes(nodes, outs)
    used = used_initializers(kept, graph_outputs, initializer_names)
    kept_names = {n.name for n in kept}
    removed_by_fusion = len(bypassed - kept_names)
    return TransformResult(
        nodes=kept, used_initializers=used, fused_int4_matmuls=fused,
        fused_nodes_removed=removed_by_fusion,
        dead_nodes_removed=total - len(kept) - removed_by_fusion, folded_views=folded,
        fusions=fusions, near_misses=near_misses,
    )
