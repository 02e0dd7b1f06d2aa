"""The kernel registry: every registered spec is complete, layout keys never collide
between kernels, each prepared kernel's exact packed size is the length its prepack
writes (on small real models with real external data), and a kernel added as one spec
plus one registration runs through resolution, the plan and a session."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pytest
from onnx import TensorProto, helper
from test_resolve_models import (
    MS,
    Tensor,
    from_array,
    gemm_model,
    matmul_nbits_model,
    qdq_matmul_model,
    tied_int4_model,
    write_model,
)

from onnx_prep.core.io.external_data import ExternalDataReader
from onnx_prep.core.kernels import registry
from onnx_prep.core.kernels.binding import get_op
from onnx_prep.core.kernels.prepack import consumer_node, packed_size, prepack, source_loader
from onnx_prep.core.kernels.spec import REFERENCE, KernelSpec, PreparedForm, prepared_choice
from onnx_prep.core.model.prepared_key import PrepackRequest
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.ops.attributes import normalize_attributes

SPECS = registry.KERNEL_SPECS
PREPARED = [s for s in SPECS if s.prepared is not None]
# Specific kernels of activations only, or of small constants read as they are (norm
# weights, rotary caches): no constant input worth a prepared object.
RAW_INPUT_KERNELS = frozenset({"gqa", "row_norm", "rotary", "activation"})


def test_registry_lists_each_kernel_once_specific_before_generic():
    ids = [s.id for s in SPECS]
    assert len(set(ids)) == len(ids)
    assert registry.KERNELS == tuple(ids)
    # Resolution output orders kernels this way (onnx-prep resolve --json).
    assert ids == ["int4_matmul", "int4_gather", "gqa", "gemm_packed", "row_norm", "rotary", "activation", "numpy",
                   "reference"]
    first_generic = next(i for i, s in enumerate(SPECS) if s.generic)
    assert all(s.generic for s in SPECS[first_generic:]), "a generic kernel would hide the ones after it"
    assert SPECS[-1].op_types is None  # the last resort takes any op


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.id)
def test_every_spec_is_complete(spec: KernelSpec):
    assert isinstance(spec.id, str) and spec.id
    assert registry.kernel_spec(spec.id) is spec
    assert callable(spec.match) and callable(spec.implementation)
    assert spec.bind_attrs is None or callable(spec.bind_attrs)
    if spec.op_types is not None:
        assert isinstance(spec.op_types, frozenset) and spec.op_types
        for domain, op_type in spec.op_types:
            assert isinstance(domain, str) and isinstance(op_type, str) and op_type
            impl = spec.implementation(op_type, domain, 17)
            if not spec.generic:  # a specific kernel implements every op it takes
                assert callable(impl), (spec.id, domain, op_type)
                assert get_op(op_type, domain, spec.id, 17) is impl
    form = spec.prepared
    if spec.generic:
        assert form is None  # generic kernels read raw inputs
        return
    if spec.id in RAW_INPUT_KERNELS:
        assert form is None
        return
    assert isinstance(form, PreparedForm)
    assert isinstance(form.position, int) and form.position >= 0
    assert isinstance(form.layout_name, str) and form.layout_name and "." not in form.layout_name
    assert callable(form.layout) and callable(form.prepack) and callable(form.packed_size)
    assert registry.prepared_position(spec.id) == form.position


def test_layout_names_are_unique():
    names = [s.prepared.layout_name for s in PREPARED]
    assert len(set(names)) == len(names), names


def test_prepared_position_of_a_kernel_without_one():
    assert registry.prepared_position("numpy") is None
    assert registry.prepared_position(None) is None


# ---------------------------------------------------------------- small real instances

# Models with each prepared kernel, its zero-point kinds and both source layouts.
INSTANCES = {
    "matmul-nbits": lambda d: matmul_nbits_model(d),
    "matmul-nbits-u4-zp": lambda d: matmul_nbits_model(d, k=96, bs=32, zero_points=True),
    "qdq-int4": lambda d: qdq_matmul_model(d),
    "qdq-uint4-zp-fp16": lambda d: qdq_matmul_model(d, signed=False, zero_points=True, scale_dtype=np.float16),
    "tied-gather-and-head": lambda d: tied_int4_model(d),
    "gemm-and-matmul": lambda d: gemm_model(d),
}


@pytest.fixture(scope="module")
def instances(tmp_path_factory):
    """[(instance, kernel id, request, consumer node, sources)] over every instance."""
    out = []
    for name, build in INSTANCES.items():
        resolved = resolve_model(build(tmp_path_factory.mktemp(name)))
        load = source_loader(resolved, ExternalDataReader.for_model(resolved))
        for key, req in resolved.requests.items():
            node = consumer_node(resolved, key)
            out.append((name, resolved, req, node, [load(n) for n in req.source_lineage]))
    return out


def test_instances_cover_every_prepared_kernel(instances):
    assert {node.kernel for _, _, _, node, _ in instances} == {s.id for s in PREPARED}


def test_layout_keys_start_with_their_kernels_name(instances):
    for name, _, req, node, _ in instances:
        form = registry.kernel_spec(node.kernel).prepared
        assert req.layout.startswith(form.layout_name + ".v"), (name, req.layout)


def test_packed_size_is_the_length_prepack_writes(instances):
    for name, resolved, req, node, sources in instances:
        form = registry.kernel_spec(node.kernel).prepared
        attrs = normalize_attributes(node.attributes)
        for backend in ("native", REFERENCE):
            packed = form.prepack(sources, attrs, backend, None)
            size = form.packed_size(req, attrs, resolved.weights, backend)
            assert packed.nbytes == size, (name, node.kernel, backend)
            # the dispatch the session and the plan call agrees with the spec
            assert packed_size(node.kernel, req, resolved, backend=backend) == size
        # native: packing into an exact buffer (a stable slot's view) writes the same bytes
        want = form.prepack(sources, attrs, "native", None)
        out = np.full(want.nbytes, 0xA5, dtype=np.uint8)
        got = prepack(node.kernel, req, dict(zip(req.source_lineage, sources)), node.attributes, out=out)
        assert np.shares_memory(got, out)
        np.testing.assert_array_equal(out, want)


def test_prepared_position_is_an_input_the_object_replaces(instances):
    for name, _, req, node, _ in instances:
        replaced = node.prepared_inputs[req.key]
        pos = registry.prepared_position(node.kernel)
        assert node.inputs[pos] in replaced, (name, node.name, pos)


# ------------------------------------------------- a kernel added as one spec + one line

TOY_DOMAIN = "test.kspec"


def _toy_match(node, ctx):
    w = ctx.constant(node, 1)
    if w is None or w.onnx_type != TensorProto.FLOAT or len(w.dims) != 1:
        return None
    req = PrepackRequest(w.name, (w.name,), f"toyscale.v1.n{w.dims[0]}", ctx.device)
    return prepared_choice("toy_scale", req, (w.name,))


def _toy_prepack(sources: list[np.ndarray], attrs: Mapping[str, Any], backend: str, out):
    w = (sources[0].astype(np.float32) * np.float32(attrs.get("gain", 1.0))).reshape(-1)
    if backend == REFERENCE:
        return w
    packed = w.view(np.uint8)
    if out is None:
        return packed.copy()
    out[:] = packed
    return out


def _toy_packed_size(request, attrs, weights, backend) -> int:
    return int(np.prod(weights[request.source_lineage[0]].dims)) * 4


def _toy_scale(inputs, attrs, prepared):
    """Y = X * (gain * W), W from its prepared form."""
    w = prepared[1]
    return [inputs[0] * (w.view(np.float32) if w.dtype == np.uint8 else w)]


TOY = KernelSpec(
    id="toy_scale",
    op_types=frozenset({(TOY_DOMAIN, "ScaleRows")}),
    match=_toy_match,
    implementation=lambda op_type, domain, opset: _toy_scale if (domain, op_type) == (TOY_DOMAIN, "ScaleRows")
    else None,
    prepared=PreparedForm(position=1, layout_name="toyscale", layout=lambda *, n: f"toyscale.v1.n{n}",
                          prepack=_toy_prepack, packed_size=_toy_packed_size),
)


def _toy_model(out_dir: Path) -> Path:
    w = np.arange(1, 9, dtype=np.float32)
    nodes = [helper.make_node("ScaleRows", ["X", "W"], ["s"], name="scale", domain=TOY_DOMAIN, gain=0.5),
             helper.make_node("Add", ["s", "X"], ["Y"], name="add")]
    f = TensorProto.FLOAT
    return write_model(out_dir, nodes, [from_array("W", w)], [helper.make_tensor_value_info("X", f, [2, 8])],
                       [helper.make_tensor_value_info("Y", f, [2, 8])], opsets={"": 21, TOY_DOMAIN: 1})


def test_a_kernel_registered_in_one_place_runs_end_to_end(tmp_path, monkeypatch):
    from onnx_prep.core.runtime.session import Session

    path = _toy_model(tmp_path)
    assert resolve_model(path).nodes[0].kernel is None  # unknown before registration
    # What adding the module's SPEC to the tuple in registry.py does.
    monkeypatch.setattr(registry, "KERNEL_SPECS", (TOY, *registry.KERNEL_SPECS))
    monkeypatch.setattr(registry, "KERNELS", (TOY.id, *registry.KERNELS))
    resolved = resolve_model(path)
    scale = resolved.nodes[0]
    assert scale.kernel == "toy_scale" and [r.layout for r in scale.requirements] == ["toyscale.v1.n8"]
    assert not resolved.unsupported
    x = np.random.default_rng(5).standard_normal((2, 8)).astype(np.float32)
    want = x * (np.arange(1, 9, dtype=np.float32) * np.float32(0.5)) + x
    with Session(resolved) as session:
        got = session.run({"X": x})["Y"]
    np.testing.assert_array_equal(got, want)


def test_an_int4_matmul_no_kernel_takes_stays_unsupported(tmp_path):
    """MatMulNBits that no kernel can take (g_idx) stays unsupported: the specific
    kernel declines and no generic one claims a com.microsoft op."""
    r = np.random.default_rng(0)
    b = r.integers(0, 256, size=(8, 2, 16), dtype=np.uint8)
    s = r.uniform(0.01, 0.05, size=(16,)).astype(np.float32)
    g = np.zeros(64, dtype=np.int32)
    tensors = [Tensor("B", TensorProto.UINT8, b.shape, b.tobytes()), from_array("s", s), from_array("g", g)]
    nodes = [helper.make_node("MatMulNBits", ["A", "B", "s", "", "g"], ["Y"], name="mm", domain=MS,
                              K=64, N=8, bits=4, block_size=32)]
    path = write_model(tmp_path, nodes, tensors, [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, 64])],
                       [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 8])], opsets={"": 21, MS: 1})
    resolved = resolve_model(path)
    assert resolved.nodes[0].kernel is None
    assert [u.op_type for u in resolved.unsupported] == ["MatMulNBits"]
