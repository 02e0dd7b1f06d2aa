"""The op table: coverage of the numpy kernel's op set, the onnx.reference fallback
against ORT, and typed errors for ops nothing can run."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from ops_oracle import check_against_ort

from conftest import ort_or_skip
from onnx_prep.core import ops
from onnx_prep.core.errors import UnsupportedOpError
from onnx_prep.core.kernels.binding import get_op
from onnx_prep.core.kernels.numpy_ops import NUMPY_OPS
from onnx_prep.core.ops import ReferenceOp

R = np.random.default_rng(99)


def test_every_op_the_numpy_kernel_takes_has_a_numpy_implementation():
    missing = NUMPY_OPS - ops.NUMPY_OP_TYPES
    assert not missing, f"the numpy kernel takes these but core/ops lacks them: {sorted(missing)}"
    for op_type in NUMPY_OPS:
        fn = get_op(op_type, "", "numpy", 17)
        assert not fn.__name__.startswith("reference_"), op_type


def test_public_surface():
    assert set(ops.__all__) == {"MS_DOMAIN", "NUMPY_OP_TYPES", "OpImpl", "ReferenceOp", "numpy_op"}
    for name in ops.__all__:
        assert getattr(ops, name) is not None, name


def test_softmax_variant_follows_opset():
    assert get_op("Softmax", "", "numpy", 11) is not get_op("Softmax", "", "numpy", 13)


def test_unknown_kernel_and_domain_raise_typed_errors():
    with pytest.raises(UnsupportedOpError):
        get_op("Foo", "", "no_such_kernel")
    with pytest.raises(UnsupportedOpError):
        get_op("Gather", "", "int4_matmul")
    with pytest.raises(UnsupportedOpError):
        ReferenceOp("MyOp", "custom.domain", {}, 1, node_name="n0")
    with pytest.raises(UnsupportedOpError, match="NoSuchOp"):
        ReferenceOp("NoSuchOp", "", {}, 17, node_name="n1")


# Ops outside NUMPY_OPS: the kernel choice sends them to ``reference``.
FALLBACK_CASES = [
    ("pad", "Pad", [R.standard_normal((2, 3)).astype(np.float32), np.array([0, 1, 1, 0], np.int64)],
     {"mode": "reflect"}),
    ("cumsum", "CumSum", [R.standard_normal((3, 4)).astype(np.float32), np.array(1, np.int64)],
     {"exclusive": 1, "reverse": 1}),
    ("einsum", "Einsum", [R.standard_normal((2, 3)).astype(np.float32), R.standard_normal((3, 4)).astype(np.float32)],
     {"equation": "ij,jk->ik"}),
    ("hard-sigmoid", "HardSigmoid", [R.standard_normal((5,)).astype(np.float32)], {"alpha": 0.3}),
    ("topk", "TopK", [R.standard_normal((3, 6)).astype(np.float32), np.array([2], np.int64)], {"axis": -1}),
    ("resize-nearest", "Resize", [R.standard_normal((1, 1, 2, 2)).astype(np.float32), None,
                                  np.array([1, 1, 2, 2], np.float32)], {"mode": "nearest"}),
    ("clip", "Clip", [R.standard_normal((5,)).astype(np.float32), np.float32(-0.5), np.float32(0.5)], {}),
    ("hard-swish-function-body", "HardSwish", [R.standard_normal((6,)).astype(np.float32) * 4], {}),
    ("mvn-function-body", "MeanVarianceNormalization", [R.standard_normal((2, 3, 4, 2)).astype(np.float32)], {}),
    ("mod", "Mod", [np.array([5, -7, 9], np.int64), np.array([3, 3, -4], np.int64)], {}),
]


@pytest.mark.parametrize("case", FALLBACK_CASES, ids=[c[0] for c in FALLBACK_CASES])
def test_reference_fallback_matches_ort(case):
    ort_or_skip()
    _, op_type, inputs, attrs = case
    n_out = 2 if op_type == "TopK" else 1
    check_against_ort(op_type, inputs, attrs, opset=17, kernel="reference", n_out=n_out)


def test_reference_op_binds_attributes_once():
    op = ReferenceOp("LeakyRelu", "", {"alpha": 0.5}, 17)
    x = np.float32([-2.0, 3.0])
    # The attrs argument is ignored: the node's own attributes were bound at construction.
    (y,) = op([x], {"alpha": 0.1}, {})
    np.testing.assert_array_equal(y, np.float32([-1.0, 3.0]))


def test_reference_handles_empty_list_attribute_via_schema():
    # An empty list carries no element type; the op schema supplies it (INTS here).
    x = R.standard_normal((2, 3)).astype(np.float32)
    op = ReferenceOp("ReduceMax", "", {"axes": [], "keepdims": 0}, 11)
    (y,) = op([x])
    assert float(y) == float(x.max())


def test_cast_to_string_uses_reference():
    (y,) = get_op("Cast", "", "numpy", 17)([np.float32([1.5])], {"to": TensorProto.STRING}, {})
    assert str(y.reshape(-1)[0]) == "1.5"


def test_attribute_protos_are_normalised():
    from onnx_prep.core.ops.attributes import normalize_attributes

    a = normalize_attributes({"s": helper.make_attribute("s", "abc"), "i": helper.make_attribute("i", [1, 2]),
                              "t": helper.make_attribute("t", helper.make_tensor("t", TensorProto.INT64, [2], [3, 4]))})
    assert a["s"] == "abc" and a["i"] == [1, 2]
    np.testing.assert_array_equal(a["t"], np.array([3, 4], np.int64))
