"""One forward of any model: the ``onnx-prep run`` of a model that is not a decoder
(model_kind.py), or of any model given ``--inputs`` or ``--shape``. The record is the
``onnx-prep.graph-run/2`` document (docs/run.md, "One forward of any model"; pinned by
``core/schemas/graph-run.schema.json``).

The forward runs through the same runner a decode uses (``run_record``: the prepared
runtime's ``Session``, or ONNX Runtime with ``--runtime ort``), on the feeds of
graph_feeds.py, once. Each output is summarised (shape, dtype, min / max / mean over its
finite values, how many are not finite) and, with ``outputs_out``, written whole to an
``.npz`` by output name, atomically. With ``compare="ort"`` ONNX Runtime runs the same
feeds and each output is compared: equal shapes and dtypes, NaN at the same places, and

- floating outputs: max |ours - ORT| <= rtol x max |ORT| + ``FLOAT_ATOL``, rtol
  ``FLOAT_RTOL`` for 32- and 64-bit floats and ``HALF_RTOL`` for 16-bit ones (a few
  of their steps);
- integer and bool outputs: equal.

1e-4 of the output's scale leaves room for fp32 sums taken in other orders through a
deep graph (a whole decoder agrees to ~2e-6 of its logit range, docs/testing.md);
INT4 scales 1% off miss it by 100x (tests/test_run_any_model.py). An output past its
bound is a finding (``compare.agrees`` false; ``run`` exits 1). With ``per_node`` the
same feeds then run value by value through both (node_comparison.py, ``--per-node``).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from onnx_prep.core.decode.graph_feeds import graph_feeds, parse_input_files, parse_shape_bindings
from onnx_prep.core.decode.model_kind import ModelKind
from onnx_prep.core.errors import ModelIOError, UsageError, Where
from onnx_prep.core.model.resolved_model import ValueInfo

SCHEMA = "onnx-prep.graph-run/2"
FLOAT_RTOL = 1e-4
HALF_RTOL = 4e-3  # float16 and bfloat16: 2^-10 and 2^-7 steps
FLOAT_ATOL = 1e-6

# ``open_runner(runtime) -> (ms already spent parsing, runner)``; ``cache()``: the
# prepared cache the prepared runner opened (None before, or without one).
OpenRunner = Callable[[str], tuple[float, Any]]
# ``per_node(feeds)``: the forward compared value by value (node_comparison.py's record)
PerNode = Callable[[Mapping[str, np.ndarray]], dict]


def record_graph_run(path: Path, options, kind: ModelKind, inputs: Sequence[ValueInfo],
                     outputs: Sequence[ValueInfo], *, open_runner: OpenRunner,
                     cache: Callable[[], Any], budget: int, per_node: PerNode | None = None) -> dict:
    """Run one forward with ``options.runtime`` (and ``options.compare``, compared; with
    ``per_node``, value by value too) and return the ``onnx-prep.graph-run/2`` record.
    ``options`` is ``run_record.RunOptions``; ``budget`` the bytes generated inputs may take."""
    bindings = parse_shape_bindings(options.shape)
    feeds = graph_feeds(inputs, parse_input_files(options.inputs), bindings, model=str(path), budget=budget)
    for array in feeds.arrays.values():  # both runtimes get the very same bytes
        array.flags.writeable = False
    names = [vi.name for vi in outputs]
    try:
        open_ms, run_ms, out, pages = _forward(open_runner, options.runtime, feeds.arrays, names, path)
        opened = cache()
        committed = opened.commit() if opened is not None and opened.policy.value == "build-if-missing" else None
    finally:
        if cache() is not None:
            cache().close()
    if options.outputs_out is not None:
        _write(options.outputs_out, out)
    doc = {"schema": SCHEMA, "model": str(path), "runtime": options.runtime, "kind": kind.to_json(),
           "inputs": feeds.to_json(), "shape": bindings,
           "outputs": [summarize(n, out[n]) for n in names],
           "outputs_file": None if options.outputs_out is None else str(options.outputs_out),
           "timings": {"open_ms": open_ms, "run_ms": run_ms}, "source_pages": pages,
           "cache": None if cache() is None else {**cache().summary(), "committed": committed},
           "compare": None}
    if options.compare is not None:
        ref_open_ms, ref_run_ms, ref, _ = _forward(open_runner, options.compare, feeds.arrays, names, path)
        rows = [compare_output(n, out[n], ref[n]) for n in names]
        doc["compare"] = {"runtime": options.compare, "outputs": rows, "agrees": all(r["ok"] for r in rows),
                          "timings": {"open_ms": ref_open_ms, "run_ms": ref_run_ms},
                          "per_node": None if per_node is None else per_node(feeds.arrays)}
    return doc


def _forward(open_runner: OpenRunner, runtime: str, feeds: Mapping[str, np.ndarray], names: Sequence[str],
             path: Path) -> tuple[float, float, dict[str, np.ndarray], str | None]:
    """(open ms, forward ms, every output by name, the source-pages choice or None)."""
    t0 = time.perf_counter()
    parsed_ms, runner = open_runner(runtime)
    try:
        open_ms = parsed_ms + (time.perf_counter() - t0) * 1e3
        t1 = time.perf_counter()
        out = runner.run(dict(feeds))
        run_ms = (time.perf_counter() - t1) * 1e3
        pages = getattr(runner, "source_pages", None)
    finally:
        if hasattr(runner, "close"):
            runner.close()
    absent = [n for n in names if n not in out]
    if absent:
        raise ModelIOError(f"{runtime} returned no output {', '.join(map(repr, absent))}", Where(model=str(path)))
    return open_ms, run_ms, {n: np.asarray(out[n]) for n in names}, pages


def _write(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    from onnx_prep.core.io.atomic_file import write_arrays_atomically

    try:
        write_arrays_atomically(path, arrays)
    except OSError as exc:
        raise UsageError(f"cannot write the outputs: {exc.strerror or exc}", Where(file=str(path))) from exc


def summarize(name: str, array: np.ndarray) -> dict:
    """An output's name, dtype, shape, and min / max / mean over its finite values (null
    when it has none, or is not numeric), with the count of values that are not finite."""
    doc = {"name": name, "dtype": str(array.dtype), "shape": list(array.shape),
           "min": None, "max": None, "mean": None, "non_finite": 0}
    values = _as_float(array)
    if values is None:
        return doc
    finite = np.isfinite(values)
    doc["non_finite"] = int(values.size - np.count_nonzero(finite))
    if finite.any():
        kept = values[finite] if doc["non_finite"] else values
        doc.update(min=float(kept.min()), max=float(kept.max()), mean=float(kept.mean()))
    return doc


def _as_float(array: np.ndarray) -> np.ndarray | None:
    """float64 values of a real numeric array (bool as 0/1, bfloat16 through float32), else None."""
    if array.dtype.kind in "fiub" or array.dtype.name == "bfloat16":
        return array.astype(np.float64)
    return None


def rtol_of(dtype: np.dtype) -> float | None:
    """The relative bound of a floating dtype (module docstring); None: compared exactly."""
    if dtype.kind == "f" or dtype.name == "bfloat16":
        return HALF_RTOL if dtype.itemsize == 2 else FLOAT_RTOL
    return None


def compare_output(name: str, ours: np.ndarray, ref: np.ndarray) -> dict:
    """One output against ONNX Runtime's: ``max_abs_diff`` and the ``limit`` it is held
    to, ``ok``, and ``mismatch`` saying why the two cannot be compared (then
    ``max_abs_diff`` is null)."""
    row = {"name": name, "max_abs_diff": None, "limit": 0.0, "ok": False, "mismatch": None}
    if ours.shape != ref.shape:
        row["mismatch"] = f"shape {list(ours.shape)} vs {list(ref.shape)}"
        return row
    if ours.dtype != ref.dtype:
        row["mismatch"] = f"dtype {ours.dtype} vs {ref.dtype}"
        return row
    a, b = _as_float(ours), _as_float(ref)
    if a is None:  # strings and the like: equal or not
        equal = bool(np.array_equal(ours, ref))
        row.update(ok=equal, max_abs_diff=0.0 if equal else None, mismatch=None if equal else "values differ")
        return row
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if not np.array_equal(nan_a, nan_b):
        row["mismatch"] = f"NaN at {int(np.count_nonzero(nan_a != nan_b))} places only one side has"
        return row
    both = ~nan_a
    diff = np.abs(a[both] - b[both]) if both.any() else np.zeros(0)
    with np.errstate(invalid="ignore"):  # inf - inf where both are the same infinity
        same_inf = np.isinf(a[both]) & (a[both] == b[both])
    diff = np.where(same_inf, 0.0, diff)
    rtol = rtol_of(ours.dtype)
    finite_ref = b[both][np.isfinite(b[both])]
    scale = float(np.abs(finite_ref).max()) if finite_ref.size else 0.0
    limit = 0.0 if rtol is None else rtol * scale + FLOAT_ATOL
    worst = float(diff.max()) if diff.size else 0.0
    row.update(max_abs_diff=worst if np.isfinite(worst) else None, limit=limit, ok=bool(worst <= limit))
    if not np.isfinite(worst):
        row["mismatch"] = "an infinity only one side has"
    return row
