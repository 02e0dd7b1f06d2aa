"""Packed-buffer headers: every packed buffer starts with a 64-byte header that
names its kind, format version, shape and parameters (see onnx_prep_native.h).
The C side validates it on every kernel call; this module reads it for Python."""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from onnx_prep.native._module import check, ffi, lib

HEADER_SIZE = 64
KINDS = {lib.OP_KIND_INT4_MATMUL: "int4_matmul", lib.OP_KIND_INT4_GATHER: "int4_gather",
         lib.OP_KIND_GEMM_B: "gemm_b"}
_KIND_CODES = {v: k for k, v in KINDS.items()}
ZP_KINDS = {"none": lib.OP_ZP_NONE, "u4": lib.OP_ZP_U4, "float": lib.OP_ZP_FLOAT}
_ZP_NAMES = {v: k for k, v in ZP_KINDS.items()}
ALIGNMENT = 64


@dataclass(frozen=True)
class PackedHeader:
    kind: str
    format_version: int
    K: int
    N: int
    block_size: int
    n_blocks: int
    zero_points: str
    accuracy_level: int
    scales_were_f16: bool
    trans_b: bool
    panel_n: int
    panel_stride: int
    total_size: int


def as_packed(packed: np.ndarray) -> np.ndarray:
    """``packed`` as a C-contiguous 1-D uint8 array (no copy), or ValueError."""
    if not isinstance(packed, np.ndarray) or packed.dtype != np.uint8:
        raise ValueError("packed buffer must be a numpy uint8 array")
    if not packed.flags.c_contiguous:
        raise ValueError("packed buffer must be C-contiguous")
    return packed.reshape(-1)


def read_header(packed: np.ndarray, expected_kind: int = 0, *, header_only: bool = False
                ) -> tuple[object, PackedHeader]:
    """Validate and read the header; returns (the cdata header, PackedHeader).
    Raises NativeError if the bytes are not a valid packed buffer (of that kind).
    ``header_only``: ``packed`` is the first HEADER_SIZE bytes alone (an object on a
    device, its header read back): its size is taken as the header's own total size
    (the C check reads only the header's bytes)."""
    p = as_packed(packed)
    size = p.nbytes
    if header_only:
        if p.nbytes != HEADER_SIZE:
            raise ValueError(f"a packed header alone is {HEADER_SIZE} bytes, not {p.nbytes}")
        size = int.from_bytes(p[56:64].tobytes(), "little")  # op_packed_header.total_size
    h = ffi.new("op_packed_header *")
    check(lib.op_packed_header_read(ffi.from_buffer("uint8_t[]", p), size, expected_kind, h),
          "packed buffer")
    flags = h.flags
    info = PackedHeader(
        kind=KINDS[h.kind], format_version=h.format_version, K=h.K, N=h.N,
        block_size=h.block_size, n_blocks=h.n_blocks,
        zero_points=_ZP_NAMES.get(flags & lib.OP_FLAG_ZP_MASK, "none"),
        accuracy_level=(flags & lib.OP_FLAG_ACC_MASK) >> lib.OP_FLAG_ACC_SHIFT,
        scales_were_f16=bool(flags & lib.OP_FLAG_SCALES_F16),
        trans_b=bool(flags & lib.OP_FLAG_TRANS_B), panel_n=h.panel_n,
        panel_stride=h.panel_stride, total_size=h.total_size)
    return h, info


_MAGIC_KIND = struct.Struct("<IHH")
_K_N = struct.Struct("<QQ")


def k_n(packed: np.ndarray, expected_kind: int, *other_kinds: int) -> tuple[int, int]:
    """(K, N) of a packed buffer of ``expected_kind`` (or one of ``other_kinds``),
    cheaply (the hot path of every kernel call).

    Reads only what Python needs to shape the output; the C kernel validates the
    whole header on every call. Anything unexpected takes the full check, which
    raises the precise error."""
    kinds = (expected_kind, *other_kinds)
    if (type(packed) is np.ndarray and packed.dtype == np.uint8 and packed.ndim == 1
            and packed.flags.c_contiguous and packed.nbytes >= HEADER_SIZE):
        magic, version, kind = _MAGIC_KIND.unpack_from(packed, 0)
        if magic == lib.OP_PACK_MAGIC and version == lib.OP_PACK_FORMAT_VERSION and kind in kinds:
            return _K_N.unpack_from(packed, 16)
    info = read_header(packed, 0 if other_kinds else expected_kind)[1]
    if _KIND_CODES[info.kind] not in kinds:
        check(lib.OP_E_HEADER, "packed buffer")
    return info.K, info.N


def packed_header(packed: np.ndarray) -> PackedHeader:
    """The validated header of any packed buffer."""
    return read_header(packed)[1]


def new_buffer(nbytes: int, out: np.ndarray | None, what: str) -> np.ndarray:
    """A writable uint8 buffer of exactly ``nbytes``: ``out[:nbytes]`` if given (it
    may be longer, e.g. a StableSlot view rounded to its granule), else a fresh
    64-byte-aligned array."""
    if out is not None:
        if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.ndim != 1 \
                or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"{what}: out must be a writable C-contiguous 1-D uint8 array")
        if out.nbytes < nbytes:
            raise ValueError(f"{what}: out holds {out.nbytes} bytes, {nbytes} needed")
        return out[:nbytes]
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    shift = (-raw.ctypes.data) % ALIGNMENT
    return raw[shift:shift + nbytes]


def ptr(arr: np.ndarray | None, ctype: str):
    """A cffi pointer into ``arr``'s buffer (NULL for None). The caller keeps ``arr``
    alive for the duration of the C call."""
    if arr is None:
        return ffi.NULL
    return ffi.from_buffer(_ARRAY_TYPES[ctype], arr)


_ARRAY_TYPES = {"float *": "float[]", "double *": "double[]", "uint8_t *": "uint8_t[]", "int64_t *": "int64_t[]"}
