"""Comparing one step value by value (core/decode/node_comparison.py, ``run --compare ort
--per-node``): the rule on real arrays, the prepared runtime's values kept by its program
(and nothing kept when that is off), ONNX Runtime's values exposed from an in-memory copy
of the model reading its external data in place, and the first divergent node found on
real exports: none where both runtimes compute the same thing, the first QDQ MatMul
where ONNX Runtime's default config quantizes its activations to int8.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import ort_or_skip, real_export
from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.decode.export_hints import ExportHints
from onnx_prep.core.decode.generation import step_feeds
from onnx_prep.core.decode.node_comparison import (INT8_PER_NODE_TOLERANCE, PER_NODE_TOLERANCE, compare_first_step,
                                                   compare_values, diff_value, tolerance_for)
from onnx_prep.core.io.external_data import ExternalDataReader
from onnx_prep.core.kernels.prepack import prepack_all, source_loader
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.model.transforms import is_fused_dequantize_matmul
from onnx_prep.core.runtime.action_program import _FIRST_SLOT, ActionProgram
from onnx_prep.core.runtime.session import Session

ort_or_skip()
from onnx_prep.core.decode.ort_runner import OrtRunner, like_for_like_config  # noqa: E402

R = np.random.default_rng(11)

# -- the rule


def test_within_tolerance_is_relative_to_the_reference_range():
    ref = np.linspace(-50.0, 50.0, 64, dtype=np.float32).reshape(8, 8)  # range 100
    ours = ref.copy()
    ours[3, 5] += np.float32(0.09)  # 9e-4 of the range: within 1e-3
    d = diff_value(ours, ref)
    assert not d.diverges and d.max_diff_index == (3, 5) and d.scale == pytest.approx(100.0)
    ours[3, 5] += np.float32(0.02)  # 1.1e-3: beyond
    d = diff_value(ours, ref, node="n", op_type="Add", value="v", position=7)
    assert d.reason == "values" and d.max_diff_index == (3, 5) and d.position == 7
    assert d.relative_diff == pytest.approx(0.11 / 100, rel=1e-3)
    assert d.ours.shape == (8, 8) and d.reference.max == pytest.approx(50.0)


def test_a_constant_value_is_scaled_by_its_magnitude_and_zeros_by_one():
    ref = np.full((4,), 1000.0, np.float32)
    assert not diff_value(ref + np.float32(0.5), ref).diverges  # 5e-4 of 1000
    assert diff_value(ref + np.float32(2.0), ref).reason == "values"
    zeros = np.zeros((3,), np.float32)
    assert not diff_value(zeros + np.float32(5e-4), zeros).diverges
    assert diff_value(zeros + np.float32(2e-3), zeros).reason == "values"


def test_integers_must_be_equal_and_shape_dtype_nonfinite_diverge():
    ids = np.arange(6, dtype=np.int64)
    assert not diff_value(ids, ids.copy()).diverges
    off = ids.copy()
    off[4] += 1
    d = diff_value(off, ids)  # 1 of a range of 5: within 1e-3 as a float, not as an integer
    assert d.reason == "values" and d.max_diff_index == (4,)
    assert diff_value(ids.reshape(2, 3), ids).reason == "shape"
    assert diff_value(ids.astype(np.int32), ids).reason == "dtype"
    x = R.standard_normal(10).astype(np.float32)
    nan_both = x.copy()
    nan_both[2] = np.nan
    assert not diff_value(nan_both, nan_both.copy()).diverges  # the same NaN: agreed
    inf_ours = nan_both.copy()
    inf_ours[2] = np.inf
    d = diff_value(inf_ours, nan_both)
    assert d.reason == "nonfinite" and d.ours.nonfinite == d.reference.nonfinite == 1


def test_compare_values_names_the_first_divergent_node_in_order():
    a = R.standard_normal((2, 3)).astype(np.float32)
    order = [("n0", "Relu", ("v0",)), ("n1", "MatMul", ("v1", "")), ("n2", "Add", ("v2",)), ("n3", "Neg", ("v3",))]
    ours = {"v0": a, "v1": a + 1, "v2": a * 3, "v3": a}
    ref = {"v0": a, "v1": a, "v2": a, "v3": a}  # v1 and v2 differ; v3 not in ours' order? it is: equal
    c = compare_values(order, ours, ref)
    assert c.diverges and c.first_divergence.node == "n1" and c.first_divergence.position == 1
    assert c.compared == 4 and c.divergent == 2 and c.largest.node == "n2"
    assert not compare_values(order, ref, ref).diverges
    # a value one side lacks is not compared
    assert compare_values(order, {"v0": a}, ref).compared == 1


# -- the prepared runtime keeps its values


@pytest.fixture(scope="module")
def small(small_llm_path):
    resolved = resolve_model(small_llm_path)
    io = DecoderIO.discover(resolved.inputs, resolved.outputs, None, model=str(small_llm_path))
    prompt = np.array([[1, 2, 3, 4, 5]], np.int64)
    return resolved, step_feeds(io, prompt, io.empty_past(1), 0)


def test_keep_values_fetches_every_value_and_the_default_keeps_none(small):
    resolved, feeds = small
    load = source_loader(resolved, ExternalDataReader.for_model(resolved))
    default, keeping = ActionProgram.compile(resolved), ActionProgram.compile(resolved, keep_values=True)
    prepared = prepack_all(resolved, load)
    weights = {n: load(n) for n in default.weight_names}
    # Off, the program is what it was: the same actions, frees and outputs, and after a
    # run its value list holds the graph's inputs and outputs and inline constants only.
    assert default.output_names == tuple(v.name for v in resolved.outputs)
    assert any(a.frees for a in default.actions) and not any(a.frees for a in keeping.actions)
    values = default.new_values(feeds, weights)
    default.execute(values, prepared)
    held = {n for n, s in default.slot_of.items() if s >= _FIRST_SLOT and values[s] is not None}
    allowed = set(default.output_names) | set(default.input_names) | set(resolved.inline_values) | set(weights)
    assert held <= allowed, held - allowed
    plain = default.fetch(values)
    kept = keeping.run(feeds, prepared, weights=weights)
    computed = {o for n in resolved.nodes for o in n.outputs if o}
    assert set(kept) == computed | set(plain) and len(kept) > 10 * len(plain)
    for name, value in plain.items():  # keeping changes no value
        np.testing.assert_array_equal(kept[name], value)


def test_session_keep_values_returns_every_value_with_the_same_outputs(small):
    resolved, feeds = small
    with Session(resolved, sequential=True) as plain, Session(resolved, sequential=True, keep_values=True) as keep:
        a, b = plain.run(feeds), keep.run(feeds)
    assert set(a) == {v.name for v in resolved.outputs} and set(b) > set(a)
    assert all(n.outputs[0] in b for n in resolved.nodes if n.outputs and n.outputs[0])
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


# -- ONNX Runtime exposes its values


def test_exposing_reads_the_external_data_in_place_and_changes_no_output(small, small_llm_path):
    resolved, feeds = small
    before = sorted(p.name for p in small_llm_path.parent.iterdir())
    inner = [o for n in resolved.nodes for o in n.outputs if o][:40]
    with Session(resolved, sequential=True, keep_values=True) as session:
        types = {k: v.dtype for k, v in session.run(feeds).items()}
    with OrtRunner(small_llm_path) as plain, \
            OrtRunner.exposing(small_llm_path, inner, fallback_types=types) as exposed:
        a, b = plain.run(feeds), exposed.run(feeds)
    assert sorted(p.name for p in small_llm_path.parent.iterdir()) == before  # nothing written beside it
    assert set(inner) <= set(b) and set(a) < set(b) and exposed.untyped == ()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    # Without the other runtime's types, what follows the fixture's com.microsoft ops
    # (its quantized embedding, MatMulNBits) has none: left out, and listed.
    with OrtRunner.exposing(small_llm_path, inner) as bare:
        assert bare.untyped and set(bare.untyped) < set(inner)
        assert set(bare.output_names) == set(a) | (set(inner) - set(bare.untyped))


def test_exposing_types_contrib_outputs_from_the_other_runtime():
    # ONNX shape inference knows no com.microsoft op: a MatMulNBits output and what
    # follows it have no inferred type; the prepared runtime's dtype stands in.
    path = real_export("quantizer-llama-nbits-asym")
    resolved = resolve_model(path)
    graph_outputs = {v.name for v in resolved.outputs}
    nbits = [n.outputs[0] for n in resolved.nodes if n.op_type == "MatMulNBits" and n.outputs[0] not in graph_outputs]
    assert len(nbits) > 10
    with OrtRunner.exposing(path, nbits) as bare:
        assert set(bare.untyped) == set(nbits)
    with OrtRunner.exposing(path, nbits, fallback_types={n: np.float32 for n in nbits}) as typed:
        assert typed.untyped == () and set(nbits) <= set(typed.output_names)


# -- the first divergent node on real exports


def _first_step(path):
    resolved = resolve_model(path)
    hints = ExportHints.from_config(path)
    io = DecoderIO.discover(resolved.inputs, resolved.outputs, None, model=str(path),
                            hints=hints or (lambda: ExportHints.for_model(path)))
    return resolved, step_feeds(io, np.array([[1, 2, 3, 4]], np.int64), io.empty_past(1), 0)


def _per_node(resolved, feeds, config):
    return compare_first_step(resolved, feeds, lambda: Session(resolved, keep_values=True), session_config=config)


@pytest.mark.parametrize("name", ["quantizer-llama-qdq-sym", "builder-llama-qdq-b32"])
def test_qdq_export_diverges_first_at_the_first_qdq_matmul_under_ort_defaults(name):
    resolved, feeds = _first_step(real_export(name))
    first_qdq = next(i for i, n in enumerate(resolved.nodes) if is_fused_dequantize_matmul(n))
    # Like for like (ONNX Runtime's fused QDQ MatMuls in fp32, as ours): every value
    # agrees within 1e-5 of its range (1e-6 measured), nothing diverges.
    same = _per_node(resolved, feeds, like_for_like_config())
    assert not same.diverges and same.compared > 30 and same.untyped == ()
    assert same.largest.relative_diff < 1e-5
    # ONNX Runtime's defaults (level 4: int8 activations): the first QDQ MatMul is the
    # first value beyond tolerance (2.2-2.4e-3 of its range measured), and nothing before it.
    default = _per_node(resolved, feeds, {})
    d = default.first_divergence
    assert d is not None and d.position == first_qdq and d.node == resolved.nodes[first_qdq].name
    assert d.op_type == "MatMul" and d.reason == "values" and d.relative_diff > PER_NODE_TOLERANCE
    assert d.ours.shape == d.reference.shape and d.max_diff_index is not None
    assert default.divergent > 1  # what follows inherits it


@pytest.mark.parametrize("name", ["quantizer-llama-nbits-asym", "builder-llama-acc4-b32"])
def test_matmulnbits_export_agrees_value_by_value(name):
    # MatMulNBits nodes carry their own accuracy level, which both runtimes honour
    # (level 4 in the builder's: int8 activations in both).
    resolved, feeds = _first_step(real_export(name))
    for config in (like_for_like_config(), {}):
        c = _per_node(resolved, feeds, config)
        assert not c.diverges and c.compared > 30 and c.untyped == ()
        assert c.largest.relative_diff < 1e-5


def test_a_level_4_export_is_compared_at_the_int8_tolerance():
    """The tied Qwen2 builder export at level 4: its first QKV matmul reads RMSNorm rows
    whose last-bit differences round some values to the other int8 step (2e-3 of the
    range): beyond the fp32 tolerance, within the int8 one, which the comparison takes
    for a model with int8 activations and says so. An fp32 model keeps 1e-3."""
    resolved, feeds = _first_step(real_export("builder-qwen2-acc4-b32"))
    assert tolerance_for(resolved)[0] == INT8_PER_NODE_TOLERANCE
    c = _per_node(resolved, feeds, like_for_like_config())
    assert not c.diverges and c.tolerance == INT8_PER_NODE_TOLERANCE and "accuracy level 4" in c.tolerance_basis
    assert PER_NODE_TOLERANCE < c.largest.relative_diff < INT8_PER_NODE_TOLERANCE  # what 1e-3 flagged
    fp32, _ = _first_step(real_export("quantizer-llama-nbits-asym"))
    assert tolerance_for(fp32) == (PER_NODE_TOLERANCE, "fp32")
