"""Pattern fusion at resolve: subgraphs of standard ops rewritten to one node of an op a
native kernel runs (``fuse_patterns``, called by ``transforms.run_transforms``).

Exports from torch spell RMSNorm and the rotate-half rotary as chains of small ops; each
costs a dispatch and a numpy pass per step. A pattern is matched by op type, wiring
and constant values (the constants from Constant nodes and small inline initializers;
no payload byte is read), and fused only when every intermediate value is read by the
next node of the pattern alone and is no graph output, so nothing outside sees the
difference. The fused node takes the name and outputs of the pattern's last node and
lists every node it replaces in ``fused_from``.

Patterns (``PATTERNS``):

- ``rms_norm`` → ``SimplifiedLayerNormalization(x, weight, axis=-1, epsilon)`` (the
  ``row_norm`` kernel): ``x * 1/sqrt(mean(x^2, -1) + eps) * weight`` with the square
  ``Mul(x, x)`` or ``Pow(x, 2)``, the inverse ``Reciprocal(Sqrt)``, ``Div(1, Sqrt)`` or
  ``Div(x, Sqrt)``, then a ``Mul`` by a constant 1-D float weight (through Identity
  nodes), a ``Cast`` to float before it only when ``x`` itself is a ``Cast`` to float.
- ``rotary`` → ``onnx_prep.fused::RotaryEmbedding(x, cos, sin, half)`` (the ``rotary``
  kernel, core/ops/rotary.py ``rotary_from_tables``): ``x * cos + rotate_half(x) * sin``
  with ``rotate_half(x) = Concat(-x[..., h:], x[..., :h])`` by ``Split`` or ``Slice`` on
  the last axis, ``h`` half the last axis (equal split, constant bounds, or the
  export's ``Shape(x)[-1] / 2``). The native kernel uses one angle per pair, so the
  cos / sin tables must have equal halves: they must be computed as ``Concat(f, f)``
  on the last axis followed only by Cos / Sin, Cast, Unsqueeze (not of the last axis),
  Identity and Mul / Div by a scalar constant.
- ``attention`` → ``onnx_prep.fused::Attention(q, k, v, past_key, past_value, start,
  end)`` (the ``gqa`` kernel's C code): causal attention over a KV cache, the Concats of
  the cache included; matched in its own module (attention_pattern.py: what, and why the
  mask it accepts is exactly causal-with-past); with any other mask (the Hugging Face
  exports'), ``onnx_prep.fused::MaskedAttention(q, key_cache, value_cache, mask, ...)``,
  the mask an input.

- ``silu`` → ``com.microsoft::QuickGelu(x, alpha)`` (the ``activation`` kernel, as ONNX
  Runtime's own fusion of the same pair): ``x * Sigmoid(x)`` (alpha 1, SiLU / Swish, the
  gate of a SwiGLU MLP) or ``x * Sigmoid(x * c)`` with ``c`` a scalar constant (alpha
  ``c``), the Mul's operands in either order.

Where a pattern's anchor is found (the ReduceMean of a square; a Sigmoid whose output
a Mul by its own input reads; the Add of two Muls one
of which reads a rotate-half Concat; a Softmax over a MatMul's scores) but something
breaks the match, a ``NearMiss`` names the node and why (an intermediate read
elsewhere, an epsilon that is not a constant, an axis that is not the last).

A float16 chain is computed in float32 by the fused kernels (as ONNX Runtime's own
fusions do): its last bits may differ from the unfused ops'.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np
from onnx import TensorProto, numpy_helper

from onnx_prep.core.model.dtypes import DTYPES

from onnx_prep.core.model.transforms import GraphNode
from onnx_prep.core.model.weights import WeightDescriptor

FUSED_DOMAIN = "onnx_prep.fused"  # ops that exist only as the result of a fusion here
RMS_NORM, ROTARY, ATTENTION, SILU = "rms_norm", "rotary", "attention", "silu"
PATTERNS = (RMS_NORM, ROTARY, ATTENTION, SILU)
_SMALL = 64  # a constant of at most this many elements is read for matching


@dataclass(frozen=True)
class Fusion:
    """One fused node: the pattern, its name (the pattern's last node), what it replaced."""

    pattern: str
    node: str
    fused_from: tuple[str, ...]

    def to_json(self) -> dict:
        return {"pattern": self.pattern, "node": self.node, "fused_from": list(self.fused_from)}


@dataclass(frozen=True)
class NearMiss:
    """A pattern's anchor that was not fused, and why."""

    pattern: str
    node: str
    reason: str

    def to_json(self) -> dict:
        return {"pattern": self.pattern, "node": self.node, "reason": self.reason}


class _Miss(Exception):
    pass


def constant_values(nodes: Iterable[GraphNode], inline: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The values matching may read: Constant nodes' outputs and ``inline`` (small inline
    initializers that no graph input overrides)."""
    values = dict(inline)
    for n in nodes:
        if n.op_type != "Constant" or n.domain != "" or len(n.outputs) != 1:
            continue
        a = n.attributes
        for key in ("value", "value_float", "value_floats", "value_int", "value_ints"):
            if key in a:
                v = np.asarray(a[key])
                if v.size <= _SMALL:
                    values[n.outputs[0]] = v
                break
    return values


def small_inline_values(constants: Mapping[str, WeightDescriptor], tensors: Mapping[str, TensorProto]) -> dict:
    """The values of inline constant initializers of at most ``_SMALL`` elements (what
    matching reads: an epsilon, an exponent, axes). A malformed one is left out: the
    resolution names it when it reads the active inline values."""
    values = {}
    for name, d in constants.items():
        if d.file is None and not DTYPES[d.onnx_type].packed and int(np.prod(d.dims, dtype=np.int64)) <= _SMALL:
            try:
                values[name] = numpy_helper.to_array(tensors[name])
            except Exception:  # noqa: BLE001 - resolution raises the typed error
                continue
    return values


def fusion_record(enabled: bool, fusions: Iterable[Fusion], near_misses: Iterable[NearMiss]) -> dict:
    """The ``fusion`` part of the resolve record (docs/resolve.md): whether fusion ran,
    each pattern's fused nodes, each near-miss and why."""
    patterns: dict[str, list[str]] = {}
    for f in fusions:
        patterns.setdefault(f.pattern, []).append(f.node)
    return {
        "enabled": enabled,
        "patterns": [{"pattern": p, "count": len(ns), "nodes": ns} for p, ns in patterns.items()],
        "near_misses": [m.to_json() for m in near_misses],
    }


class _Graph:
    """Producers, consumers and constants of the node list being matched."""

    def __init__(self, nodes: list[GraphNode], values: Mapping[str, np.ndarray],
                 weights: Mapping[str, WeightDescriptor], graph_outputs: set[str]) -> None:
        self.values, self.weights, self.outputs = values, weights, graph_outputs
        self.producer: dict[str, GraphNode] = {o: n for n in nodes for o in n.outputs if o}
        self.consumers: dict[str, list[GraphNode]] = {}
        for n in nodes:
            for name in {*n.reads()}:
                self.consumers.setdefault(name, []).append(n)

    def made_by(self, value: str, op_type: str) -> GraphNode | None:
        n = self.producer.get(value)
        return n if n is not None and n.op_type == op_type and n.domain == "" else None

    def const(self, value: str) -> np.ndarray | None:
        return self.values.get(value)

    def only_reader(self, value: str, expected: GraphNode | None = None) -> GraphNode:
        """The one node reading intermediate ``value`` (``expected`` when given)."""
        if value in self.outputs:
            raise _Miss(f"intermediate {value} is a graph output")
        readers = self.consumers.get(value, [])
        others = [n for n in readers if n is not expected] if expected is not None else readers[1:]
        if others:
            raise _Miss(f"intermediate {value} is used by node {others[0].name}")
        if not readers:
            raise _Miss(f"intermediate {value} is not used")
        return readers[0]

    def weight(self, value: str) -> WeightDescriptor | None:
        """The constant initializer ``value`` is, through Identity nodes."""
        for _ in range(8):
            if value in self.weights:
                return self.weights[value]
            n = self.made_by(value, "Identity")
            if n is None:
                return None
            value = n.inputs[0]
        return None


def _other(node: GraphNode, value: str) -> str:
    a, b = (list(node.inputs) + ["", ""])[:2]
    return b if a == value else a


def _scalar(g: _Graph, value: str, what: str) -> float:
    c = g.const(value)
    if c is None:
        raise _Miss(f"{what} {value} is not a constant")
    if c.size != 1:
        raise _Miss(f"{what} {value} is not a scalar (shape {list(c.shape)})")
    return float(c.reshape(-1)[0])


# --------------------------------------------------------------------------- RMSNorm

def _rms_anchor(g: _Graph, node: GraphNode) -> tuple[str, GraphNode] | None:
    """(x, square node) when ``node`` is a ReduceMean of a square of x."""
    if node.op_type != "ReduceMean" or node.domain != "" or not node.inputs:
        return None
    sq = g.producer.get(node.inputs[0])
    if sq is None or sq.domain != "" or len(sq.inputs) != 2:
        return None
    if sq.op_type == "Mul" and sq.inputs[0] == sq.inputs[1]:
        return sq.inputs[0], sq
    if sq.op_type == "Pow":
        return sq.inputs[0], sq
    return None


def _match_rms_norm(g: _Graph, mean: GraphNode, x: str, sq: GraphNode) -> tuple[GraphNode, list[GraphNode]]:
    if sq.op_type == "Pow":
        exponent = _scalar(g, sq.inputs[1], "Pow exponent")
        if exponent != 2.0:
            raise _Miss(f"Pow exponent {exponent:g} is not 2")
    if len(mean.inputs) > 1 and mean.inputs[1]:
        axes = g.const(mean.inputs[1])
        if axes is None:
            raise _Miss(f"ReduceMean axes {mean.inputs[1]} are not a constant")
        axes = [int(v) for v in axes.reshape(-1)]
    else:
        axes = [int(v) for v in mean.attributes.get("axes", ())]
    if axes != [-1]:
        raise _Miss(f"ReduceMean axes {axes} are not [-1] (the last axis)")
    if int(mean.attributes.get("keepdims", 1)) != 1:
        raise _Miss("ReduceMean keepdims is 0")
    g.only_reader(sq.outputs[0], mean)
    chain = [sq, mean]
    add = g.only_reader(mean.outputs[0])
    if (add.op_type, add.domain) != ("Add", ""):
        raise _Miss(f"the mean is followed by {add.op_type} {add.name}, not an Add of epsilon")
    eps = _scalar(g, _other(add, mean.outputs[0]), "epsilon")
    if eps < 0:
        raise _Miss(f"epsilon {eps:g} is negative")
    sqrt = g.only_reader(add.outputs[0])
    if (sqrt.op_type, sqrt.domain) != ("Sqrt", ""):
        raise _Miss(f"the mean plus epsilon is followed by {sqrt.op_type} {sqrt.name}, not Sqrt")
    chain += [add, sqrt]
    nxt = g.only_reader(sqrt.outputs[0])
    if (nxt.op_type, nxt.domain) == ("Div", "") and nxt.inputs[1] == sqrt.outputs[0] and nxt.inputs[0] == x:
        normalized = nxt  # x / sqrt(...)
    else:
        if (nxt.op_type, nxt.domain) == ("Reciprocal", ""):
            pass
        elif (nxt.op_type, nxt.domain) == ("Div", "") and nxt.inputs[1] == sqrt.outputs[0]:
            one = _scalar(g, nxt.inputs[0], "numerator")
            if one != 1.0:
                raise _Miss(f"Div {nxt.name} divides {one:g}, not 1, by the root")
        else:
            raise _Miss(f"the root is followed by {nxt.op_type} {nxt.name}, not Reciprocal or Div")
        chain.append(nxt)
        normalized = g.only_reader(nxt.outputs[0])
        if (normalized.op_type, normalized.domain) != ("Mul", "") or _other(normalized, nxt.outputs[0]) != x:
            raise _Miss(f"the inverse root is read by {normalized.op_type} {normalized.name}, not a Mul by the input")
    chain.append(normalized)
    out = normalized.outputs[0]
    scale = g.only_reader(out)
    if (scale.op_type, scale.domain) == ("Cast", ""):
        source = g.made_by(x, "Cast")
        if int(scale.attributes.get("to", 0)) != TensorProto.FLOAT or source is None or \
                int(source.attributes.get("to", 0)) != TensorProto.FLOAT:
            raise _Miss(f"Cast {scale.name} in the chain: the input is not known to be float32")
        chain.append(scale)
        out = scale.outputs[0]
        scale = g.only_reader(out)
    weight = g.weight(_other(scale, out)) if (scale.op_type, scale.domain) == ("Mul", "") else None
    if weight is None or len(weight.dims) != 1 or weight.dtype not in ("float32", "float16"):
        raise _Miss(f"the normalized value is read by {scale.op_type} {scale.name}, not a Mul by a constant "
                    f"1-D float weight")
    chain.append(scale)
    fused = GraphNode(scale.name, "SimplifiedLayerNormalization", "", [x, weight.name], [scale.outputs[0]],
                      {"axis": -1, "epsilon": eps}, fused_from=tuple(n.name for n in chain))
    return fused, chain


# ---------------------------------------------------------------------------- rotary

def _rotate_half_mul(g: _Graph, node: GraphNode | None) -> tuple[GraphNode, GraphNode, str] | None:
    """(the Mul, the rotate-half Concat, the other factor) when ``node`` is a Mul reading
    a Concat whose first input is a Neg."""
    if node is None or (node.op_type, node.domain) != ("Mul", "") or len(node.inputs) != 2:
        return None
    for i in (0, 1):
        cat = g.made_by(node.inputs[i], "Concat")
        if cat is not None and len(cat.inputs) == 2 and g.made_by(cat.inputs[0], "Neg") is not None:
            return node, cat, node.inputs[1 - i]
    return None


def _axis_is_last(g: _Graph, axis: int, x: str) -> bool:
    if axis == -1:
        return True
    perm = getattr(g.made_by(x, "Transpose"), "attributes", {}).get("perm")
    return perm is not None and axis == len(perm) - 1


def _half_of_last_axis(g: _Graph, value: str, x: str) -> bool:
    """Whether ``value`` is computed as ``Shape(x)[last] / 2`` (through Cast, Unsqueeze)."""
    for _ in range(6):
        n = g.producer.get(value)
        if n is None or n.op_type not in ("Cast", "Unsqueeze", "Identity"):
            break
        value = n.inputs[0]
    div = g.made_by(value, "Div")
    if div is None or g.const(div.inputs[1]) is None or g.const(div.inputs[1]).size != 1 or \
            float(g.const(div.inputs[1]).reshape(-1)[0]) != 2.0:
        return False
    gather = g.made_by(div.inputs[0], "Gather")
    shape = g.made_by(gather.inputs[0], "Shape") if gather is not None else None
    index = g.const(gather.inputs[1]) if gather is not None else None
    return shape is not None and shape.inputs[0] == x and index is not None and index.size == 1 and \
        not shape.attributes.get("start") and "end" not in shape.attributes and \
        _axis_is_last(g, int(index.reshape(-1)[0]), x)


def _halves(g: _Graph, cat: GraphNode, x: str) -> tuple[list[GraphNode], int]:
    """The Split / Slice nodes giving the Concat's halves of x, and the half: the constant,
    0 for floor(D / 2) (the Slices' ``Shape(x)[-1] / 2``), -1 for ceil(D / 2) (a Split in
    two without sizes)."""
    neg = g.made_by(cat.inputs[0], "Neg")
    g.only_reader(neg.outputs[0], cat)
    second, first = neg.inputs[0], cat.inputs[1]
    split = g.made_by(first, "Split")
    if split is not None:
        if g.producer.get(second) is not split or list(split.outputs) != [first, second]:
            raise _Miss(f"Split {split.name} does not give the two halves in order")
        if not _axis_is_last(g, int(split.attributes.get("axis", 0)), split.inputs[0]):
            raise _Miss(f"Split {split.name} is not on the last axis")
        sizes = g.const(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1] else \
            np.asarray(split.attributes.get("split", ()))
        if sizes is None or (sizes.size and (sizes.size != 2 or sizes[0] != sizes[1])):
            raise _Miss(f"Split {split.name} sizes are not two equal constants")
        for o in split.outputs:
            g.only_reader(o, neg if o == second else cat)
        # equal constant sizes are the half; without sizes the first part is ceil(D / 2)
        return [split, neg], int(sizes.reshape(-1)[0]) if sizes.size else -1
    lo, hi = g.made_by(first, "Slice"), g.made_by(second, "Slice")
    if lo is None or hi is None:
        raise _Miss("the rotate-half Concat's inputs are not a Split or two Slices")
    if lo.inputs[0] != x or hi.inputs[0] != x:
        raise _Miss(f"Slices {lo.name} and {hi.name} do not both read {x}")
    for s in (lo, hi):
        axes = g.const(s.inputs[3]) if len(s.inputs) > 3 and s.inputs[3] else None
        steps = g.const(s.inputs[4]) if len(s.inputs) > 4 and s.inputs[4] else np.ones(1)
        if axes is None or axes.size != 1 or not _axis_is_last(g, int(axes.reshape(-1)[0]), x):
            raise _Miss(f"Slice {s.name} is not on the last axis")
        if steps is None or steps.size != 1 or int(steps.reshape(-1)[0]) != 1:
            raise _Miss(f"Slice {s.name} steps are not 1")
    g.only_reader(lo.outputs[0], cat)
    g.only_reader(hi.outputs[0], neg)
    start, end = g.const(lo.inputs[1]), g.const(hi.inputs[2])
    if start is None or start.size != 1 or int(start.reshape(-1)[0]) != 0 or \
            end is None or end.size != 1 or int(end.reshape(-1)[0]) < 2 ** 31:
        raise _Miss(f"Slices {lo.name} and {hi.name} are not [0:h] and [h:]")
    h_lo, h_hi = g.const(lo.inputs[2]), g.const(hi.inputs[1])
    if h_lo is not None and h_hi is not None and h_lo.size == 1 and h_hi.size == 1 and h_lo.item() == h_hi.item():
        return [lo, hi, neg], int(h_lo.item())
    if _half_of_last_axis(g, lo.inputs[2], x) and _half_of_last_axis(g, hi.inputs[1], x):
        return [lo, hi, neg], 0
    raise _Miss(f"Slices {lo.name} and {hi.name} do not split at one constant or at half the last axis")


_TABLE_STEPS = ("Cos", "Sin", "Cast", "Unsqueeze", "Identity", "Mul", "Div")


def _equal_halves(g: _Graph, table: str) -> None:
    """A _Miss unless ``table``'s halves along the last axis are equal by construction."""
    value = table
    for _ in range(12):
        n = g.producer.get(value)
        if n is None or n.domain != "":
            break
        if n.op_type == "Concat" and len(n.inputs) == 2 and n.inputs[0] == n.inputs[1] and \
                _axis_is_last(g, int(n.attributes.get("axis", 0)), n.outputs[0]):
            return
        if n.op_type not in _TABLE_STEPS:
            break
        if n.op_type in ("Mul", "Div"):
            scalar = [i for i, v in enumerate(n.inputs[:2]) if g.const(v) is not None and g.const(v).size == 1]
            if 1 in scalar or (n.op_type == "Mul" and 0 in scalar):
                value = n.inputs[0] if 1 in scalar else n.inputs[1]
                continue
            break
        if n.op_type == "Unsqueeze":
            axes = g.const(n.inputs[1]) if len(n.inputs) > 1 else np.asarray(n.attributes.get("axes", ()))
            if axes is None or any(int(a) < 0 for a in axes.reshape(-1)):
                break  # a negative axis could make the last axis new
        value = n.inputs[0]
    raise _Miss(f"table {table}: its halves are not equal by construction (Concat(f, f) on the last axis)")


def _rotary_anchor(g: _Graph, node: GraphNode) -> tuple[tuple, GraphNode] | None:
    if (node.op_type, node.domain) != ("Add", "") or len(node.inputs) != 2:
        return None
    a, b = g.producer.get(node.inputs[0]), g.producer.get(node.inputs[1])
    for rot_side, cos_side in ((a, b), (b, a)):
        rot = _rotate_half_mul(g, rot_side)
        if rot is not None and cos_side is not None and (cos_side.op_type, cos_side.domain) == ("Mul", ""):
            return rot, cos_side
    return None


def _match_rotary(g: _Graph, add: GraphNode, rot: tuple, cos_mul: GraphNode) -> tuple[GraphNode, list[GraphNode]]:
    rot_mul, cat, sin = rot
    neg = g.made_by(cat.inputs[0], "Neg")
    source = g.producer.get(cat.inputs[1])
    x = source.inputs[0] if source is not None and source.inputs else ""
    if not _axis_is_last(g, int(cat.attributes.get("axis", 0)), x):
        raise _Miss(f"Concat {cat.name} is not on the last axis")
    if x not in cos_mul.inputs:
        raise _Miss(f"{cos_mul.name} does not multiply the value rotate_half reads ({x or neg.inputs[0]})")
    cos = _other(cos_mul, x)
    g.only_reader(cat.outputs[0], rot_mul)
    g.only_reader(rot_mul.outputs[0], add)
    g.only_reader(cos_mul.outputs[0], add)
    pieces, half = _halves(g, cat, x)
    _equal_halves(g, cos)
    _equal_halves(g, sin)
    chain = [*pieces, cat, cos_mul, rot_mul, add]
    fused = GraphNode(add.name, "RotaryEmbedding", FUSED_DOMAIN, [x, cos, sin], [add.outputs[0]], {"half": half},
                      fused_from=tuple(n.name for n in chain))
    return fused, chain


# ------------------------------------------------------------------------------ SiLU

def _silu_anchor(g: _Graph, node: GraphNode) -> tuple[str, GraphNode | None, GraphNode] | None:
    """(x, the Mul scaling x before the Sigmoid or None, the Mul by x after it) when
    ``node`` is a Sigmoid of x (or of x * c) whose output a Mul by that x reads."""
    if (node.op_type, node.domain) != ("Sigmoid", "") or len(node.inputs) != 1 or len(node.outputs) != 1:
        return None
    s = node.outputs[0]
    readers = [r for r in g.consumers.get(s, []) if (r.op_type, r.domain) == ("Mul", "") and len(r.inputs) == 2]

    def times(v: str) -> GraphNode | None:
        return next((r for r in readers if _other(r, s) == v and v != s), None)

    x = node.inputs[0]
    mul = times(x)
    if mul is not None:
        return x, None, mul
    pre = g.made_by(x, "Mul")
    if pre is not None and len(pre.inputs) == 2:
        for i in (0, 1):
            if g.const(pre.inputs[1 - i]) is not None and (mul := times(pre.inputs[i])) is not None:
                return pre.inputs[i], pre, mul
    return None


def _match_silu(g: _Graph, sig: GraphNode, x: str, scaled: GraphNode | None,
                mul: GraphNode) -> tuple[GraphNode, list[GraphNode]]:
    alpha, chain = 1.0, [sig, mul]
    if scaled is not None:
        alpha = _scalar(g, _other(scaled, x), "the Sigmoid's scale")
        g.only_reader(scaled.outputs[0], sig)
        chain.insert(0, scaled)
    g.only_reader(sig.outputs[0], mul)
    fused = GraphNode(mul.name, "QuickGelu", "com.microsoft", [x], [mul.outputs[0]], {"alpha": alpha},
                      fused_from=tuple(n.name for n in chain))
    return fused, chain


# ------------------------------------------------------------------------------ pass

def fuse_patterns(nodes: list[GraphNode], values: Mapping[str, np.ndarray], weights: Mapping[str, WeightDescriptor],
                  graph_outputs: set[str]) -> tuple[list[GraphNode], list[Fusion], list[NearMiss]]:
    """Fuse every pattern found in ``nodes`` (topological order, kept); ``weights`` are the
    constant initializers, ``values`` what ``constant_values`` gives. Returns the new node
    list (each fused node where its pattern's last node was), the fusions and the near-misses."""
    # attention_pattern imports this module's matching framework: imported here, not on top
    from onnx_prep.core.model.attention_pattern import attention_anchor, match_attention

    matchers = ((RMS_NORM, _rms_anchor, _match_rms_norm), (ROTARY, _rotary_anchor, _match_rotary),
                (ATTENTION, attention_anchor, match_attention), (SILU, _silu_anchor, _match_silu))
    g = _Graph(nodes, values, weights, graph_outputs)
    fusions: list[Fusion] = []
    misses: list[NearMiss] = []
    replaced: dict[int, GraphNode | None] = {}  # id(node) -> fused node at its place, or None: removed
    for node in nodes:
        if id(node) in replaced:
            continue
        for pattern, anchor_of, match in matchers:
            anchor = anchor_of(g, node)
            if anchor is not None:
                break
        else:
            continue
        try:
            fused, chain = match(g, node, *anchor)
        except _Miss as miss:
            misses.append(NearMiss(pattern, node.name, str(miss)))
            continue
        if any(id(n) in replaced for n in chain):
            misses.append(NearMiss(pattern, node.name, "overlaps a pattern fused before"))
            continue
        for n in chain:
            replaced[id(n)] = None
        replaced[id(chain[-1])] = fused
        fusions.append(Fusion(pattern, fused.name, fused.fused_from))
    if not fusions:
        return nodes, fusions, misses
    out = [replaced.get(id(n), n) for n in nodes]
    return _in_order([n for n in out if n is not None]), fusions, misses


def _in_order(nodes: list[GraphNode]) -> list[GraphNode]:
    """``nodes`` unchanged when every node comes after the producers of what it reads,
    else stably sorted so (a fused node takes its chain's last place; a node that read a
    value the chain made earlier, a Shape reader taken in, moves after it). Values no
    node makes (graph inputs, initializers) are ready from the start."""
    made = {o: i for i, n in enumerate(nodes) for o in n.outputs if o}
    if all(made.get(v, -1) < i for i, n in enumerate(nodes) for v in n.reads()):
        return nodes
    import heapq

    waiting = [len({made[v] for v in n.reads() if v in made}) for n in nodes]
    readers: dict[int, list[int]] = {}
    for i, n in enumerate(nodes):
        for p in {made[v] for v in n.reads() if v in made}:
            readers.setdefault(p, []).append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(nodes[i])
        for r in readers.get(i, []):
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, r)
    if len(order) != len(nodes):  # pragma: no cover - a fusion never makes a cycle of a DAG
        raise AssertionError("fused graph has a cycle")
    return order
