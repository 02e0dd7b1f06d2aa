"""ActionProgram on small hand-built models (resolved with the real resolver): ranges,
freeing, errors, prepared bindings, the reference fallback, and ORT agreement."""
from __future__ import annotations

import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import ort_or_skip
from onnx_prep.core.runtime.action_program import DISCARD_SLOT, NONE_SLOT, ActionProgram, PreparedBinding, direct_replay
from onnx_prep.core.errors import ModelIOError, OnnxPrepError, TaskFailedError, UnsupportedOpError
from onnx_prep.core.io.external_data import ExternalDataReader
from onnx_prep.core.kernels.prepack import prepack_all, source_loader
from onnx_prep.core.model.resolution import resolve_model

R = np.random.default_rng(5)
B_WEIGHT = R.standard_normal((4, 6)).astype(np.float32)
TABLE = R.standard_normal((10, 6)).astype(np.float32)


def _save(model: onnx.ModelProto, path, external: bool = True):
    model.ir_version = 10
    if external:
        onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=path.name + ".data", size_threshold=64)
    else:
        onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory):
    """x[2,4] -> Gemm(const B, packed) -> Relu -> Pad (reference) -> CumSum (reference);
    tokens -> Gather(const table) -> Add with the Gemm branch; one dead-end output."""
    nodes = [
        helper.make_node("Gemm", ["x", "B"], ["g"], name="gemm", transB=0),
        helper.make_node("Relu", ["g"], ["r"], name="relu"),
        helper.make_node("Constant", [], ["pads"], name="pads",
                         value=numpy_helper.from_array(np.array([0, 1, 0, 1], np.int64))),
        helper.make_node("Pad", ["r", "pads"], ["p"], name="pad", mode="edge"),
        helper.make_node("Constant", [], ["ax"], name="ax", value=numpy_helper.from_array(np.array(1, np.int64))),
        helper.make_node("CumSum", ["p", "ax"], ["c"], name="cumsum"),
        helper.make_node("Gather", ["table", "tokens"], ["e"], name="embed"),
        helper.make_node("Slice", ["c", "s0", "s1", "s2"], ["cs"], name="slice"),
        helper.make_node("Add", ["cs", "e"], ["y"], name="add"),
        helper.make_node("Split", ["g"], ["g0", "g1"], name="split", axis=1, num_outputs=2),
        helper.make_node("Mul", ["g0", "g1"], ["z"], name="mul"),
    ]
    inits = [numpy_helper.from_array(B_WEIGHT, "B"), numpy_helper.from_array(TABLE, "table"),
             numpy_helper.from_array(np.array([1], np.int64), "s0"),
             numpy_helper.from_array(np.array([7], np.int64), "s1"),
             numpy_helper.from_array(np.array([1], np.int64), "s2")]
    g = helper.make_graph(nodes, "mixed",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
                           helper.make_tensor_value_info("tokens", TensorProto.INT64, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 6]),
                           helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3])],
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    path = _save(m, tmp_path_factory.mktemp("mixed") / "mixed.onnx")
    resolved = resolve_model(path)
    load = source_loader(resolved, ExternalDataReader.for_model(resolved))
    return path, resolved, load


def _feeds():
    return {"x": R.standard_normal((2, 4)).astype(np.float32), "tokens": np.array([3, -1], np.int64)}


def _weights(program, load):
    return {n: load(n) for n in program.weight_names}


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_program_matches_ort(mixed_model, backend):
    ort = ort_or_skip()
    path, resolved, load = mixed_model
    kernels = {n.name: n.kernel for n in resolved.nodes}
    assert kernels["gemm"] == "gemm_packed" and kernels["pad"] == "reference" and kernels["cumsum"] == "reference"
    program = ActionProgram.compile(resolved)
    prepared = prepack_all(resolved, load, backend=backend)
    feeds = _feeds()
    ours = program.run(feeds, prepared, weights=_weights(program, load))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    theirs = dict(zip(["y", "z"], sess.run(None, feeds)))
    assert set(ours) == {"y", "z"}
    for k in theirs:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-5, atol=1e-5)
    # Negative control: the Gemm's weight 0.1% off (prepacked wrong) fails the tolerance.
    def wrong_load(name):
        return load(name) * np.float32(1.001) if name == "B" else load(name)

    wrong = program.run(feeds, prepack_all(resolved, wrong_load, backend=backend), weights=_weights(program, load))
    for k in theirs:
        with pytest.raises(AssertionError):
            np.testing.assert_allclose(wrong[k], theirs[k], rtol=1e-5, atol=1e-5)


def test_action_i_is_node_i_and_slots_are_ints(mixed_model):
    _, resolved, _ = mixed_model
    program = ActionProgram.compile(resolved)
    assert len(program) == len(resolved.nodes)
    for i, (a, n) in enumerate(zip(program.actions, resolved.nodes)):
        assert a.node_index == n.index == i and a.name == n.name
        assert all(isinstance(s, int) for s in a.inputs + a.outputs)
    gemm = next(a for a in program.actions if a.name == "gemm")
    # B is replaced by its prepared object: the input slot is the None slot.
    assert gemm.inputs[1] == NONE_SLOT and gemm.prepared == ((1, resolved.nodes[0].requirements[0].key),)


def test_ranges_replay_equals_full_run(mixed_model):
    _, resolved, load = mixed_model
    program = ActionProgram.compile(resolved)
    prepared = prepack_all(resolved, load)
    feeds, weights = _feeds(), _weights(program, load)
    full = program.run(feeds, prepared, weights=weights)
    n = len(program)
    for cuts in ([], list(range(1, n)), [1, 5], [n - 1]):
        bounds = [0, *cuts, n]
        values = program.new_values(feeds, weights)
        for b, e in zip(bounds, bounds[1:]):
            out = program.run(None, prepared, actions=(b, e), values=values)
        assert out.keys() == full.keys()
        for k in full:
            np.testing.assert_array_equal(out[k], full[k])


def test_intermediates_are_freed_after_their_last_use(mixed_model):
    _, resolved, load = mixed_model
    program = ActionProgram.compile(resolved)
    prepared = prepack_all(resolved, load)
    values = program.new_values(_feeds(), _weights(program, load))
    last_read = {}
    for i, a in enumerate(program.actions):
        for s in a.inputs:
            last_read[s] = i
    outputs = {program.slot_of[n] for n in program.output_names}
    for i in range(len(program)):
        program.execute(values, prepared, i, i + 1)
        for s, v in enumerate(values):
            if s in (NONE_SLOT, DISCARD_SLOT):
                assert v is None
            elif s not in outputs and last_read.get(s, -1) <= i and v is not None:
                # Only template constants (inline initializers) may outlive their readers.
                assert any(s == program.slot_of[k] for k in resolved.inline_values), (i, s)
    live = [s for s, v in enumerate(values) if v is not None]
    assert set(live) - outputs <= {program.slot_of[k] for k in resolved.inline_values if k in program.slot_of}


def test_missing_and_unknown_feeds_raise_model_io_error(mixed_model):
    _, resolved, load = mixed_model
    program = ActionProgram.compile(resolved)
    with pytest.raises(ModelIOError, match="missing input.*tokens"):
        program.new_values({"x": np.zeros((2, 4), np.float32)}, _weights(program, load))
    with pytest.raises(ModelIOError, match="unknown input.*bogus"):
        program.new_values({**_feeds(), "bogus": np.zeros(1)}, _weights(program, load))


def test_failing_op_raises_task_failed_naming_the_node(mixed_model):
    _, resolved, load = mixed_model
    program = ActionProgram.compile(resolved)
    bad = {"x": np.zeros((2, 5), np.float32), "tokens": np.array([0, 1], np.int64)}  # K mismatch
    with pytest.raises(TaskFailedError) as ei:
        program.run(bad, prepack_all(resolved, load), weights=_weights(program, load))
    assert ei.value.where.node == "gemm" and ei.value.__cause__ is not None


def test_missing_prepared_object_is_named(mixed_model):
    _, resolved, load = mixed_model
    program = ActionProgram.compile(resolved)
    with pytest.raises(OnnxPrepError, match="not resident") as ei:
        program.run(_feeds(), {}, weights=_weights(program, load))
    assert ei.value.where.node == "gemm"
    with pytest.raises(OnnxPrepError, match="not resident"):
        program.bind_prepared({})


def test_binding_equals_mapping_and_direct_replay(mixed_model):
    _, resolved, load = mixed_model
    program = ActionProgram.compile(resolved)
    prepared = prepack_all(resolved, load)
    feeds, weights = _feeds(), _weights(program, load)
    a = program.run(feeds, prepared, weights=weights)
    binding = program.bind_prepared(prepared)
    assert isinstance(binding, PreparedBinding) and binding.keys == frozenset(program.requirements)
    b = program.run(feeds, binding, weights=weights)
    c = direct_replay(program, feeds, binding, weights=weights)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
        np.testing.assert_array_equal(a[k], c[k])


def test_raw_mode_needs_and_uses_raw_weights(mixed_model):
    _, resolved, load = mixed_model
    raw = ActionProgram.compile(resolved, use_prepared=False)
    assert "B" in raw.weight_names and not raw.requirements
    with pytest.raises(OnnxPrepError, match="raw weight"):
        raw.run(_feeds(), None)
    program = ActionProgram.compile(resolved)
    feeds = _feeds()
    want = program.run(feeds, prepack_all(resolved, load, backend="reference"), weights=_weights(program, load))
    got = raw.run(feeds, None, weights=_weights(raw, load))
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6)


def test_concurrent_runs_share_the_program_and_nothing_else(mixed_model):
    _, resolved, load = mixed_model
    program = ActionProgram.compile(resolved)
    binding = program.bind_prepared(prepack_all(resolved, load))
    weights = _weights(program, load)
    inputs = [_feeds() for _ in range(8)]
    want = [program.run(f, binding, weights=weights) for f in inputs]
    got: list = [None] * len(inputs)
    start = threading.Barrier(len(inputs))

    def worker(i):
        start.wait()
        for _ in range(20):
            got[i] = program.run(inputs[i], binding, weights=weights)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w, g in zip(want, got):
        for k in w:
            np.testing.assert_array_equal(w[k], g[k])


def test_node_without_kernel_fails_compile_naming_it(tmp_path):
    n = helper.make_node("Mystery", ["x"], ["y"], name="mystery0", domain="vendor.ops")
    g = helper.make_graph([n], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("vendor.ops", 1)])
    resolved = resolve_model(_save(m, tmp_path / "m.onnx", external=False))
    with pytest.raises(UnsupportedOpError) as ei:
        ActionProgram.compile(resolved)
    assert ei.value.where.node == "mystery0"


def test_compile_rejects_non_frozen():
    with pytest.raises(OnnxPrepError, match="frozen ResolvedModel"):
        ActionProgram.compile(object())  # type: ignore[arg-type]


def test_control_flow_with_outer_scope_values_matches_ort(tmp_path):
    """If whose branches read outer values (an activation and an initializer), and a Loop
    whose body reads an outer value: the reference fallback gets them as its context."""
    ort = ort_or_skip()
    f32 = TensorProto.FLOAT
    then_g = helper.make_graph([helper.make_node("Add", ["h", "w"], ["t_out"])], "then", [],
                               [helper.make_tensor_value_info("t_out", f32, [3])])
    else_g = helper.make_graph([helper.make_node("Sub", ["h", "w"], ["e_out"])], "else", [],
                               [helper.make_tensor_value_info("e_out", f32, [3])])
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Add", ["acc_in", "h"], ["acc_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_in", f32, [3])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_out", f32, [3])])
    nodes = [
        helper.make_node("Relu", ["x"], ["h"], name="relu"),
        helper.make_node("If", ["c"], ["y"], name="if0", then_branch=then_g, else_branch=else_g),
        helper.make_node("Loop", ["trips", "", "x"], ["z"], name="loop0", body=body),
    ]
    w = np.float32([10, 20, 30])
    g = helper.make_graph(nodes, "cf",
                          [helper.make_tensor_value_info("x", f32, [3]),
                           helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                           helper.make_tensor_value_info("trips", TensorProto.INT64, [])],
                          [helper.make_tensor_value_info("y", f32, [3]), helper.make_tensor_value_info("z", f32, [3])],
                          initializer=[numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    path = _save(m, tmp_path / "cf.onnx", external=False)
    resolved = resolve_model(path)
    assert {n.name: n.kernel for n in resolved.nodes}["if0"] == "reference"
    program = ActionProgram.compile(resolved)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for cond in (True, False):
        feeds = {"x": np.float32([-1, 2, 3]), "c": np.array(cond), "trips": np.array(3, np.int64)}
        ours = program.run(feeds, {})
        theirs = dict(zip(["y", "z"], sess.run(None, feeds)))
        for k in theirs:
            np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-6)
