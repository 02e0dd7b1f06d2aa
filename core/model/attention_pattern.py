"""The ``attention`` fusion pattern (run by ``fusion.fuse_patterns`` with the others):
causal scaled-dot-product attention over a KV cache, spelled with standard ops, becomes
one ``onnx_prep.fused::Attention`` node that the ``gqa`` kernel's C code computes
(core/ops/attention.py ``attention_with_past``).

Matched, from the anchor (a Softmax) outwards, every intermediate read by the next node
of the pattern alone:

- ``present_key = Concat(past_key, k, axis 2)``, ``present_value = Concat(past_value, v,
  axis 2)``, each read by the pattern alone (a graph output too: the decoder's KV cache);
- ``scores = MatMul(q, Transpose(present_key, perm [0, 1, 3, 2]))``, then no scale or a
  ``Mul`` / ``Div`` by a scalar constant;
- ``Add`` of the mask (either side), ``Softmax`` with ``axis = -1`` given (its default
  depends on the opset), ``MatMul(probs, present_value)``, ``Transpose(perm [0, 2, 1, 3])``
  (the node's output);
- the mask ``Where(LessOrEqual(Unsqueeze(Range(0, end, 1), [0]), Unsqueeze(Range(start,
  end, 1), [-1])), 0, fill)``: 0 and fill float32 scalar constants, fill <= -1e9, the
  two Ranges ending at the same value.

Why that mask is exactly causal-with-past: it is ``[end - start, end]``, row i letting
key j through iff ``j <= start + i``. Added to scores ``[B, N, S, P + S]`` it broadcasts
without error only when ``end == P + S`` (or 1) and ``end - start == S`` (or 1); in
the regular case ``start == P`` and query row i, at absolute position P + i, sees keys
0..P + i. The fused node takes ``start`` and ``end`` as inputs and checks that case at
each call (the native kernel); any other (a broadcast of a one-row or one-column mask,
another layout, another dtype) computes the ops' formula in numpy, so the node means
what the ops meant for every input. A masked key's weight is ``exp(score + fill -
max)``: 0 in float32 for finite scores whose spread is below ``|fill| - 104``, which is
why fill must be at most -1e9 (exports write float32's lowest value).

The masked form (``match_masked_attention``), taken when the mask is not that causal
one (the Hugging Face exports: padding and causality combined from ``attention_mask``):
the Add's other input is the mask whatever makes it, and it becomes an input of
``onnx_prep.fused::MaskedAttention``; Q and K may each be scaled by a scalar ``Mul``
(the exports' √scale on both), the kv heads repeated by ``Reshape(Expand(Unsqueeze(cache,
[2]), e), r)`` (``e`` and ``r`` inputs, checked at each call) and the Softmax followed by
``Where(IsNaN(p), 0, p)``. The caches stay with their Concats (their Shape readers make
the repeat's shapes: taking the Concats in would feed the node its own outputs). The
kernel computes softmax(scale q.k + mask) over every key for any mask values, so no
proof about the mask is needed (core/ops/attention.py ``masked_attention``).

The anchor is a Softmax over a MatMul's scores (through at most three element-wise
steps); near-misses name it and the first thing that breaks: the axis, an intermediate
read elsewhere, a key that is not a KV Concat, a repeat that is not the one above, a
Where after the Softmax other than the IsNaN one.
"""
from __future__ import annotations

import numpy as np

from onnx_prep.core.model.fusion import FUSED_DOMAIN, _Graph, _Miss
from onnx_prep.core.model.transforms import GraphNode

ATTENTION = "attention"
MAX_FILL = -1e9  # the largest mask fill whose masked weights are 0 (see the module docstring)


_SCORE_STEPS = ("Add", "Sub", "Mul", "Div", "Where", "Cast")  # what may stand between scores and Softmax


def attention_anchor(g: _Graph, node: GraphNode) -> tuple | None:
    """() when ``node`` is a Softmax over a MatMul's scores (through at most three
    element-wise steps: a scale, a mask), the anchor of the pattern; else None."""
    if (node.op_type, node.domain) != ("Softmax", "") or not node.inputs:
        return None
    frontier = [node.inputs[0]]
    for _ in range(4):
        producers = [g.producer.get(v) for v in frontier]
        if any(p is not None and (p.op_type, p.domain) == ("MatMul", "") for p in producers):
            return ()
        frontier = [v for p in producers if p is not None and p.domain == "" and p.op_type in _SCORE_STEPS
                    for v in p.inputs if v]
    return None


def _node(g: _Graph, value: str, op_type: str, what: str) -> GraphNode:
    n = g.made_by(value, op_type)
    if n is None:
        found = g.producer.get(value)
        raise _Miss(f"{what} {value} is made by {found.op_type + ' ' + found.name if found else 'no node'}, "
                    f"not {op_type}")
    return n


def _read_only_by(g: _Graph, value: str, reader: GraphNode) -> None:
    """A _Miss unless ``reader`` is the only node reading ``value`` (which may be a graph
    output: the KV cache's present)."""
    others = [n for n in g.consumers.get(value, []) if n is not reader]
    if others:
        raise _Miss(f"{value} is also read by node {others[0].name}")


def _ints(g: _Graph, value: str, what: str) -> list[int]:
    c = g.const(value) if value else None
    if c is None:
        raise _Miss(f"{what} {value} is not a constant")
    return [int(x) for x in c.reshape(-1)]


def _perm(node: GraphNode, want: list[int]) -> None:
    perm = [int(p) for p in node.attributes.get("perm", ())]
    if perm != want:
        raise _Miss(f"Transpose {node.name} perm {perm} is not {want}")


def _kv_concat(g: _Graph, value: str, reader: GraphNode, what: str) -> GraphNode:
    cat = _node(g, value, "Concat", what)
    if len(cat.inputs) != 2 or int(cat.attributes.get("axis", 0)) not in (2, -2):
        raise _Miss(f"Concat {cat.name} is not Concat(past, new) on axis 2")
    _read_only_by(g, value, reader)
    return cat


def _unsqueezed(g: _Graph, value: str, axes: tuple[list[int], ...], what: str) -> str:
    u = _node(g, value, "Unsqueeze", what)
    got = _ints(g, u.inputs[1], "Unsqueeze axes") if len(u.inputs) > 1 and u.inputs[1] else \
        [int(a) for a in u.attributes.get("axes", ())]
    if got not in axes:
        raise _Miss(f"the mask is not causal: Unsqueeze {u.name} axes {got} are not {axes[0]}")
    return u.inputs[0]


def _range(g: _Graph, value: str, what: str) -> GraphNode:
    r = _node(g, value, "Range", f"the mask's {what} positions")
    if len(r.inputs) != 3 or _ints(g, r.inputs[2], "Range step") != [1]:
        raise _Miss(f"the mask is not causal: Range {r.name} step is not the constant 1")
    return r


def _causal_mask(g: _Graph, mask: str) -> tuple[str, str, float]:
    """(start, end, fill) of a causal mask (the module docstring's form), else a _Miss."""
    where = _node(g, mask, "Where", "the mask")
    zero, fill = (g.const(v) for v in where.inputs[1:3])
    for v, name in ((zero, where.inputs[1]), (fill, where.inputs[2])):
        if v is None or v.size != 1 or v.dtype != np.float32:
            raise _Miss(f"the mask's value {name} is not a float32 scalar constant")
    if float(zero.reshape(-1)[0]) != 0.0:
        raise _Miss(f"the mask is not causal: Where {where.name} lets keys through with {float(zero.reshape(-1)[0]):g}, "
                    f"not 0")
    fill = float(fill.reshape(-1)[0])
    if not fill <= MAX_FILL:
        raise _Miss(f"the mask's fill {fill:g} is above {MAX_FILL:g}: masked keys would keep a weight")
    cond = _node(g, where.inputs[0], "LessOrEqual", "the mask's condition")
    keys = _range(g, _unsqueezed(g, cond.inputs[0], ([0],), "the mask's key row"), "key")
    queries = _range(g, _unsqueezed(g, cond.inputs[1], ([-1], [1]), "the mask's query column"), "query")
    if _ints(g, keys.inputs[0], "the key Range start") != [0]:
        raise _Miss(f"the mask is not causal: key Range {keys.name} does not start at 0")
    if keys.inputs[1] != queries.inputs[1]:
        raise _Miss(f"the mask is not causal: Ranges {keys.name} and {queries.name} end at different values "
                    f"({keys.inputs[1]}, {queries.inputs[1]})")
    return queries.inputs[0], queries.inputs[1], fill


def _scaled_by(g: _Graph, value: str, reader: GraphNode, ops: tuple[str, ...]) -> tuple[str, float, int, list]:
    """(input, scale, divide, [node]) when ``value`` is made by a ``Mul`` (or, in ``ops``,
    ``Div``) by a scalar constant read by ``reader`` alone; else (value, 1.0, 0, [])."""
    node = g.producer.get(value)
    if node is None or node.domain != "" or node.op_type not in ops:
        return value, 1.0, 0, []
    consts = [i for i in (0, 1) if g.const(node.inputs[i]) is not None and g.const(node.inputs[i]).size == 1]
    if node.op_type == "Div":
        consts = [i for i in consts if i == 1]
    if not consts:
        raise _Miss(f"{node.op_type} {node.name} does not scale by a scalar constant")
    scale = float(g.const(node.inputs[consts[0]]).reshape(-1)[0])
    divide = int(node.op_type == "Div")
    if divide and scale == 0.0:
        raise _Miss(f"Div {node.name} divides by 0")
    g.only_reader(value, reader)
    return node.inputs[1 - consts[0]], scale, divide, [node]


def _scores_side(g: _Graph, add: GraphNode) -> int | None:
    """Which input of ``add`` holds the scores (a MatMul's, through a scalar Mul / Div)."""
    for i in (0, 1):
        n = g.producer.get(add.inputs[i])
        if n is not None and n.domain == "" and n.op_type in ("Mul", "Div"):
            n = next((g.producer.get(v) for v in n.inputs if g.made_by(v, "MatMul") is not None), None)
        if n is not None and (n.op_type, n.domain) == ("MatMul", ""):
            return i
    return None


def match_attention(g: _Graph, softmax: GraphNode) -> tuple[GraphNode, list[GraphNode]]:
    axis = softmax.attributes.get("axis")
    if axis is None or int(axis) != -1:
        raise _Miss(f"Softmax axis {axis} is not -1 (the last axis)" if axis is not None else
                    "Softmax axis is not given (its default depends on the opset)")
    add = _node(g, softmax.inputs[0], "Add", "the Softmax input")
    g.only_reader(add.outputs[0], softmax)
    side = [i for i in (0, 1) if g.made_by(add.inputs[i], "Where") is not None]
    try:
        if not side:
            raise _Miss(f"Add {add.name} adds no Where mask")
        causal = _causal_mask(g, add.inputs[side[0]])
    except _Miss as not_causal:
        scores_side = _scores_side(g, add)
        if scores_side is None:
            raise _Miss(f"{not_causal}; and Add {add.name} adds nothing to a MatMul's scores") from None
        return match_masked_attention(g, softmax, add, scores_side)
    mask, scaled = add.inputs[side[0]], add.inputs[1 - side[0]]
    start, end, fill = causal
    scaled, scale, divide, chain_scale = _scaled_by(g, scaled, add, ("Mul", "Div"))
    scores = _node(g, scaled, "MatMul", "the scores")
    g.only_reader(scores.outputs[0], chain_scale[0] if chain_scale else add)
    q, kt = scores.inputs[:2]
    key_t = _node(g, kt, "Transpose", "the transposed key")
    _perm(key_t, [0, 1, 3, 2])
    g.only_reader(kt, scores)
    k_cat = _kv_concat(g, key_t.inputs[0], key_t, "the key")
    context = g.only_reader(softmax.outputs[0])
    if (context.op_type, context.domain) != ("MatMul", "") or context.inputs[0] != softmax.outputs[0]:
        raise _Miss(f"the weights are read by {context.op_type} {context.name}, not a MatMul by the values")
    v_cat = _kv_concat(g, context.inputs[1], context, "the value")
    if int(v_cat.attributes.get("axis", 0)) != int(k_cat.attributes.get("axis", 0)):
        raise _Miss(f"Concats {k_cat.name} and {v_cat.name} are on different axes")
    out = g.only_reader(context.outputs[0])
    if (out.op_type, out.domain) != ("Transpose", ""):
        raise _Miss(f"the context is read by {out.op_type} {out.name}, not Transpose [0, 2, 1, 3]")
    _perm(out, [0, 2, 1, 3])
    chain = [k_cat, v_cat, key_t, scores, *chain_scale, add, softmax, context, out]
    fused = GraphNode(
        out.name, "Attention", FUSED_DOMAIN,
        [q, k_cat.inputs[1], v_cat.inputs[1], k_cat.inputs[0], v_cat.inputs[0], start, end],
        [out.outputs[0], k_cat.outputs[0], v_cat.outputs[0]],
        {"scale": scale, "divide": divide, "mask_fill": fill, "axis": int(k_cat.attributes.get("axis", 0))},
        fused_from=tuple(n.name for n in chain))
    return fused, chain


def _repeat(g: _Graph, value: str, reader: GraphNode) -> tuple[str, list[str], list[GraphNode], list[GraphNode]]:
    """(cache, [expand shape, reshape shape], nodes, Shape readers) when ``value`` is the
    kv heads repeated, ``Reshape(Expand(Unsqueeze(cache, [2]), e), r)`` (allowzero 0),
    each step read by the next alone but the Reshape's Shape readers (their outputs
    become the fused node's); else (value, ['', ''], [], [])."""
    reshape = g.made_by(value, "Reshape")
    if reshape is None:
        return value, ["", ""], [], []
    if int(reshape.attributes.get("allowzero", 0)) != 0:
        raise _Miss(f"Reshape {reshape.name} has allowzero = 1")
    expand = _node(g, reshape.inputs[0], "Expand", "the repeated kv heads")
    unsq = _node(g, expand.inputs[0], "Unsqueeze", "the repeated kv heads")
    axes = _ints(g, unsq.inputs[1], "Unsqueeze axes") if len(unsq.inputs) > 1 and unsq.inputs[1] else \
        [int(a) for a in unsq.attributes.get("axes", ())]
    if axes not in ([2], [-3]):
        raise _Miss(f"Unsqueeze {unsq.name} axes {axes} are not [2] (a kv head repeat)")
    g.only_reader(unsq.outputs[0], expand)
    g.only_reader(expand.outputs[0], reshape)
    if value in g.outputs:
        raise _Miss(f"intermediate {value} is a graph output")
    shapes = []
    for n in g.consumers.get(value, []):
        if n is reader:
            continue
        if (n.op_type, n.domain) != ("Shape", "") or "start" in n.attributes or "end" in n.attributes:
            raise _Miss(f"intermediate {value} is used by node {n.name}")
        shapes.append(n)
    return unsq.inputs[0], [expand.inputs[1], reshape.inputs[1]], [unsq, expand, reshape], shapes


def match_masked_attention(g: _Graph, softmax: GraphNode, add: GraphNode, scores_side: int
                           ) -> tuple[GraphNode, list[GraphNode]]:
    """The Hugging Face exports' attention (the module docstring's second form): any
    additive mask, taken as an input, over key / value caches left to their Concats."""
    mask = add.inputs[1 - scores_side]
    scaled, scale, divide, chain_scale = _scaled_by(g, add.inputs[scores_side], add, ("Mul", "Div"))
    scores = _node(g, scaled, "MatMul", "the scores")
    g.only_reader(scores.outputs[0], chain_scale[0] if chain_scale else add)
    q, q_scale, _, q_mul = _scaled_by(g, scores.inputs[0], scores, ("Mul",))
    kt, k_scale, _, k_mul = _scaled_by(g, scores.inputs[1], scores, ("Mul",))
    key_t = _node(g, kt, "Transpose", "the transposed key")
    _perm(key_t, [0, 1, 3, 2])
    g.only_reader(kt, k_mul[0] if k_mul else scores)
    key, key_shapes, key_nodes, key_shape_readers = _repeat(g, key_t.inputs[0], key_t)
    probs, nan_nodes = softmax.outputs[0], []
    readers = g.consumers.get(probs, [])
    if probs in g.outputs:
        raise _Miss(f"intermediate {probs} is a graph output")
    if sorted(n.op_type for n in readers) == ["IsNaN", "Where"]:  # Where(IsNaN(p), 0, p): a NaN row is 0
        isnan, where = sorted(readers, key=lambda n: n.op_type)
        zero = g.const(where.inputs[1])
        if where.inputs[0] != isnan.outputs[0] or where.inputs[2] != probs or zero is None or zero.size != 1 or \
                float(zero.reshape(-1)[0]) != 0.0:
            raise _Miss(f"Where {where.name} is not Where(IsNaN(weights), 0, weights)")
        g.only_reader(isnan.outputs[0], where)
        probs, nan_nodes = where.outputs[0], [isnan, where]
    context = g.only_reader(probs)
    if (context.op_type, context.domain) != ("MatMul", "") or context.inputs[0] != probs:
        raise _Miss(f"the weights are read by {context.op_type} {context.name}, not a MatMul by the values")
    value, value_shapes, value_nodes, value_shape_readers = _repeat(g, context.inputs[1], context)
    if bool(key_nodes) != bool(value_nodes):
        raise _Miss("the kv heads of the keys and of the values are not repeated alike")
    shape_readers = [(0, n) for n in key_shape_readers] + [(1, n) for n in value_shape_readers]
    # the fused node takes the place of the chain's last node, the context MatMul; a Shape
    # reader taken in that sat after it has readers fusion.fuse_patterns then moves after
    chain = [*key_nodes, key_t, *k_mul, *q_mul, scores, *chain_scale, add, softmax, *nan_nodes, *value_nodes,
             *(n for _, n in shape_readers), context]
    fused = GraphNode(
        context.name, "MaskedAttention", FUSED_DOMAIN,
        [q, key, value, mask, *key_shapes, *value_shapes],
        [context.outputs[0], *(n.outputs[0] for _, n in shape_readers)],
        {"scale": scale, "divide": divide, "query_scale": q_scale, "key_scale": k_scale,
         "nan_to_zero": int(bool(nan_nodes)), "repeat": int(bool(key_nodes)),
         "shape_outputs": [i for i, _ in shape_readers]},
        fused_from=tuple(n.name for n in chain))
    return fused, chain
