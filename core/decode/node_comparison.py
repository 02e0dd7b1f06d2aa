"""Where two runtimes first disagree: one step run by both with every intermediate value
exposed, compared value by value in topological order (``run --compare ort
--per-node``, docs/run.md).

The prepared runtime exposes its values through a session whose program keeps them
(``SessionOptions.keep_values``); ONNX Runtime through an in-memory copy of the model
whose graph outputs include them (``OrtRunner.exposing``). Values one side does not
compute are not compared: the DequantizeLinear outputs the prepared runtime fuses into
its INT4 matmul, and values ONNX shape inference gives no type (listed as ``untyped``).

A value *diverges* when its shape or dtype differs, when its non-finite entries (NaN,
+-inf) are not the same, or when its largest absolute difference exceeds
``tolerance`` x its scale: the reference's range (max - min of its finite entries), or
its largest magnitude where the range is 0, or 1 where that is 0 too. Integer and
boolean values must be equal. The first node (in the resolved model's order, which is
topological) with a divergent output is the one named; both values' statistics say how.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

# Same scale as the run's near-tie tolerance and the oracle tests' logit tolerance
# (core/decode/generation.py, TIE_TOLERANCE). The fp32 agreement of the two runtimes on
# the real exports is ~1e-6 of each value's range; ONNX Runtime's int8 activations
# (accuracy level 4) put its first QDQ MatMul above 1e-3.
PER_NODE_TOLERANCE = 1e-3
# Where the model quantizes activations to int8 (a MatMulNBits at accuracy level 4), on
# both sides as ONNX Runtime's MLAS does: an input that differs in its last bit (two
# RMSNorms' fp32 sums) can round to the other int8 step where it lies on an exact half,
# which moves the matmul's output by ~1e-3 of its range (the tied Qwen2 builder export:
# 2e-3 at its first QKV matmul, 4.3e-3 at the logits). The oracle tests' level-4 logit
# tolerance (tests/test_real_export_runs.py, INT8_RTOL).
INT8_PER_NODE_TOLERANCE = 1.5e-2


def tolerance_for(resolved) -> tuple[float, str]:
    """The per-node tolerance for ``resolved`` and why: ``INT8_PER_NODE_TOLERANCE`` when
    a MatMulNBits node computes with int8 activations (accuracy level 4), else
    ``PER_NODE_TOLERANCE`` (fp32 on both sides)."""
    int8 = [n.name for n in resolved.nodes
            if n.op_type == "MatMulNBits" and int(n.attributes.get("accuracy_level", 0)) == 4]
    if int8:
        return INT8_PER_NODE_TOLERANCE, f"int8 activations (accuracy level 4 on {len(int8)} MatMulNBits)"
    return PER_NODE_TOLERANCE, "fp32"


@dataclass(frozen=True)
class ValueStats:
    """A value's shape, dtype and statistics over its finite entries (None if none)."""

    shape: tuple[int, ...]
    dtype: str
    min: float | None
    max: float | None
    mean: float | None
    nonfinite: int  # NaN and +-inf entries

    @classmethod
    def of(cls, value: np.ndarray) -> "ValueStats":
        a = np.asarray(value)
        if a.dtype.kind not in "biuf" or a.size == 0:
            return cls(tuple(a.shape), str(a.dtype), None, None, None, 0)
        x = a.astype(np.float64)
        finite = np.isfinite(x)
        ok = x[finite]
        if not ok.size:
            return cls(tuple(a.shape), str(a.dtype), None, None, None, int(x.size))
        return cls(tuple(a.shape), str(a.dtype), float(ok.min()), float(ok.max()), float(ok.mean()),
                   int(x.size - ok.size))

    def to_json(self) -> dict:
        return {**asdict(self), "shape": list(self.shape)}


@dataclass(frozen=True)
class ValueDifference:
    """One value of one node, in both runtimes. ``reason``: None (within tolerance),
    "shape", "dtype", "nonfinite" or "values"; ``max_diff_index``: where the largest
    absolute difference is (None when the values cannot be compared element-wise)."""

    node: str
    op_type: str
    value: str
    position: int  # the node's index in topological order
    ours: ValueStats
    reference: ValueStats
    max_abs_diff: float | None
    max_diff_index: tuple[int, ...] | None
    scale: float | None
    relative_diff: float | None  # max_abs_diff / scale
    reason: str | None

    @property
    def diverges(self) -> bool:
        return self.reason is not None

    def to_json(self) -> dict:
        return {**asdict(self), "ours": self.ours.to_json(), "reference": self.reference.to_json(),
                "max_diff_index": None if self.max_diff_index is None else list(self.max_diff_index)}


def diff_value(ours: np.ndarray, reference: np.ndarray, *, tolerance: float = PER_NODE_TOLERANCE,
               node: str = "", op_type: str = "", value: str = "", position: int = 0) -> ValueDifference:
    """``ours`` against ``reference`` under the module's rule (see the docstring)."""
    a, r = np.asarray(ours), np.asarray(reference)
    sa, sr = ValueStats.of(a), ValueStats.of(r)

    def result(reason, max_abs=None, index=None, scale=None):
        rel = None if max_abs is None or scale is None else max_abs / scale
        return ValueDifference(node, op_type, value, position, sa, sr, max_abs, index, scale, rel, reason)

    if a.shape != r.shape:
        return result("shape")
    if a.dtype != r.dtype:
        return result("dtype")
    if a.size == 0:
        return result(None)
    if a.dtype.kind not in "biuf":  # strings and the like: equal or not
        return result(None if np.array_equal(a, r) else "values")
    x, y = a.astype(np.float64), r.astype(np.float64)
    fx, fy = np.isfinite(x), np.isfinite(y)
    same_nonfinite = np.array_equal(fx, fy) and np.array_equal(x[~fx], y[~fy], equal_nan=True)
    diff = np.zeros(x.shape)
    np.subtract(x, y, out=diff, where=fx & fy)
    np.abs(diff, out=diff)
    index = tuple(int(i) for i in np.unravel_index(int(np.argmax(diff)), diff.shape))
    max_abs = float(diff[index])
    finite_ref = y[fy]
    scale = float(finite_ref.max() - finite_ref.min()) if finite_ref.size else 0.0
    if scale == 0.0:
        scale = float(np.abs(finite_ref).max()) if finite_ref.size else 0.0
    scale = scale or 1.0
    if not same_nonfinite:
        return result("nonfinite", max_abs, index, scale)
    exact = a.dtype.kind in "biu"
    over = max_abs > 0 if exact else max_abs > tolerance * scale
    return result("values" if over else None, max_abs, index, scale)


@dataclass(frozen=True)
class NodeComparison:
    """One step compared value by value. ``first_divergence``: the first divergent value
    in topological order (None: all within tolerance); ``largest``: the value with the
    largest relative difference among those compared; ``divergent``: how many values
    diverge (later ones may only inherit the first's difference)."""

    tolerance: float
    tolerance_basis: str  # why this tolerance (tolerance_for): "fp32", "int8 activations (...)", "given"
    compared: int
    divergent: int
    first_divergence: ValueDifference | None
    largest: ValueDifference | None
    untyped: tuple[str, ...]  # values ONNX Runtime could not be asked for (no known type)
    reference_config: Mapping[str, str]  # the reference session's config entries

    @property
    def diverges(self) -> bool:
        return self.first_divergence is not None

    def to_json(self) -> dict:
        return {"step": 0, "tolerance": self.tolerance, "tolerance_basis": self.tolerance_basis,
                "compared": self.compared, "divergent": self.divergent,
                "first_divergence": None if self.first_divergence is None else self.first_divergence.to_json(),
                "largest": None if self.largest is None else self.largest.to_json(),
                "untyped": list(self.untyped), "reference_config": dict(self.reference_config)}


# (node name, op type, output names) in topological order
NodeOrder = Sequence[tuple[str, str, Sequence[str]]]


def compare_values(order: NodeOrder, ours: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], *,
                   tolerance: float = PER_NODE_TOLERANCE, untyped: Sequence[str] = (),
                   reference_config: Mapping[str, str] | None = None,
                   tolerance_basis: str = "given") -> NodeComparison:
    """Every output of every node in ``order`` that both mappings hold, compared."""
    compared = divergent = 0
    first = largest = None
    for position, (node, op_type, outputs) in enumerate(order):
        for name in outputs:
            if not name or name not in ours or name not in reference:
                continue
            d = diff_value(ours[name], reference[name], tolerance=tolerance, node=node, op_type=op_type,
                           value=name, position=position)
            compared += 1
            if d.diverges:
                divergent += 1
                first = first or d
            if d.relative_diff is not None and (largest is None or d.relative_diff > largest.relative_diff):
                largest = d
    return NodeComparison(tolerance, tolerance_basis, compared, divergent, first, largest, tuple(untyped),
                          dict(reference_config or {}))


def compare_first_step(resolved, feeds: Mapping[str, np.ndarray], open_ours: Callable[[], object], *,
                       threads: int | None = None, session_config: Mapping[str, str] | None = None,
                       tolerance: float | None = None) -> NodeComparison:
    """Run ``feeds`` (a decode's first step) through the prepared runtime that
    ``open_ours()`` opens (a runner whose ``run`` returns every value: a session with
    ``keep_values``) and through ONNX Runtime with every value it can expose
    (``session_config``: its session config entries), and compare them (``tolerance``:
    None, the model's own, :func:`tolerance_for`)."""
    from onnx_prep.core.decode.ort_runner import OrtRunner

    order = [(n.name, n.op_type, tuple(n.outputs)) for n in resolved.nodes]
    ours_runner = open_ours()
    try:
        # copies: a value may be a view of a weight in the session's slots, gone once it closes
        ours = {k: np.array(v, copy=True) for k, v in ours_runner.run(dict(feeds)).items()}
    finally:
        ours_runner.close()
    # Only what ours computed: exposing a value ours fused away would unfuse ONNX Runtime there
    wanted = [o for _, _, outs in order for o in outs if o in ours]
    with OrtRunner.exposing(resolved.model_path, wanted, threads, session_config=session_config,
                            fallback_types={k: v.dtype for k, v in ours.items()}) as ort:
        reference = ort.run(dict(feeds))
        untyped = ort.untyped
    basis = "given"
    if tolerance is None:
        tolerance, basis = tolerance_for(resolved)
    return compare_values(order, ours, reference, tolerance=tolerance, untyped=untyped,
                          reference_config=session_config, tolerance_basis=basis)
