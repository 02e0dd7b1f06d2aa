"""ONNX element types: the one table of what the project knows about each.

Every ``onnx.TensorProto.DataType`` the project reads has one ``DType`` here: its
name as resolve reports it (numpy's spelling: ``float32``, ``float64``, ``bfloat16``,
``int4``), ONNX's own spelling (``float``, ``double``: the one in type strings such as
``tensor(float)``, which ONNX Runtime reports too), its size in bits and its numpy
dtype. A code missing from ``DTYPES`` is a type the project does not handle.

Sub-byte types are stored packed: two int4 / uint4 / float4e2m1 per byte, four int2 /
uint2, the first element in the low bits. A packed tensor's payload rounds up to a
whole byte (``nbytes``), and the project hands it out as packed uint8 (see
``ExternalDataReader.read_array``).

The codes are ONNX's (fixed by its protobuf), written out rather than taken from
``onnx.TensorProto``: this module imports neither onnx nor numpy until a numpy dtype is
asked for, and does not depend on the installed onnx release naming the newest types.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class DType:
    code: int  # onnx.TensorProto.DataType
    name: str  # numpy's spelling (what resolve reports)
    onnx_name: str  # ONNX's spelling, as in the type string tensor(<onnx_name>)
    bits: int  # per element; 0 for string (no fixed size)

    @property
    def packed(self) -> bool:
        """Several elements per byte (sub-byte types), the first in the low bits."""
        return 0 < self.bits < 8

    def nbytes(self, numel: int) -> int:
        """Payload bytes of ``numel`` elements (a packed tensor rounds up to a byte)."""
        return (numel * self.bits + 7) // 8

    @cached_property
    def numpy(self) -> "np.dtype":
        """The numpy dtype of one element, in native byte order (ml_dtypes' types for
        bfloat16, float8, int4 and the like; object for string)."""
        import numpy as np
        from onnx import helper

        return np.dtype(helper.tensor_dtype_to_np_dtype(self.code))


DTYPES: Mapping[int, DType] = MappingProxyType({d.code: d for d in (
    DType(1, "float32", "float", 32),
    DType(2, "uint8", "uint8", 8),
    DType(3, "int8", "int8", 8),
    DType(4, "uint16", "uint16", 16),
    DType(5, "int16", "int16", 16),
    DType(6, "int32", "int32", 32),
    DType(7, "int64", "int64", 64),
    DType(8, "string", "string", 0),
    DType(9, "bool", "bool", 8),
    DType(10, "float16", "float16", 16),
    DType(11, "float64", "double", 64),
    DType(12, "uint32", "uint32", 32),
    DType(13, "uint64", "uint64", 64),
    DType(14, "complex64", "complex64", 64),
    DType(15, "complex128", "complex128", 128),
    DType(16, "bfloat16", "bfloat16", 16),
    DType(17, "float8e4m3fn", "float8e4m3fn", 8),
    DType(18, "float8e4m3fnuz", "float8e4m3fnuz", 8),
    DType(19, "float8e5m2", "float8e5m2", 8),
    DType(20, "float8e5m2fnuz", "float8e5m2fnuz", 8),
    DType(21, "uint4", "uint4", 4),
    DType(22, "int4", "int4", 4),
    DType(23, "float4e2m1", "float4e2m1", 4),
    DType(24, "float8e8m0", "float8e8m0", 8),
    DType(25, "uint2", "uint2", 2),
    DType(26, "int2", "int2", 2),
)})

_BY_ONNX_NAME = {d.onnx_name: d for d in DTYPES.values()}


def dtype_of_type_string(type_string: str) -> DType | None:
    """The element type of a tensor type string (``tensor(float)``); None for another
    kind of type (sequence, map) or an element type the project does not handle."""
    if type_string.startswith("tensor(") and type_string.endswith(")"):
        return _BY_ONNX_NAME.get(type_string[len("tensor("):-1])
    return None
