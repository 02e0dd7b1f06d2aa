"""INT4 row gather with ``com.microsoft.GatherBlockQuantized`` semantics
(gather_axis 0, quantize_axis last, bits 4, uint8 data holding two codes per byte)."""
from __future__ import annotations

import numpy as np

from onnx_prep.native._module import check, ffi, lib
from onnx_prep.native.matmul_nbits import zero_point_arrays, zero_point_kind
from onnx_prep.native.packed import ZP_KINDS, k_n, new_buffer, ptr


def gather_zero_point_codes(zero_points: np.ndarray, V: int, n_blocks: int) -> np.ndarray:
    """uint8 zero points -> one uint4 code per (row, block), ``[V * n_blocks]``.

    Accepts the op's forms: one code per byte in the low nibble (``[V, n_blocks, 1]``,
    what quantize_axis = last gives for 3-D data) or two per byte along the blocks
    (``[V, ceil(n_blocks / 2)]``, 2-D data)."""
    zp = np.asarray(zero_points, dtype=np.uint8).reshape(-1)
    if zp.size == V * n_blocks:
        return np.ascontiguousarray(zp & 0x0F)
    per_row = (n_blocks + 1) // 2
    if zp.size == V * per_row:
        z = zp.reshape(V, per_row)
        codes = np.empty((V, per_row * 2), dtype=np.uint8)
        codes[:, 0::2] = z & 0x0F
        codes[:, 1::2] = z >> 4
        return np.ascontiguousarray(codes[:, :n_blocks]).reshape(-1)
    raise ValueError(f"zero points hold {zp.size} bytes; expected {V * n_blocks} or {V * per_row}")


def gather_packed_size(*, V: int, n_blocks: int, block_size: int, zero_points) -> int:
    """Exact byte size of the packed gather buffer (header included)."""
    size = lib.op_gather_packed_size(int(V), int(n_blocks), int(block_size),
                                     ZP_KINDS[zero_point_kind(zero_points)])
    if size == 0:
        raise ValueError(f"invalid GatherBlockQuantized shape V={V} n_blocks={n_blocks} block_size={block_size}")
    return int(size)


def prepack_gather_block_quantized(data: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None,
                                   *, block_size: int, out: np.ndarray | None = None) -> np.ndarray:
    """Pack GatherBlockQuantized sources. data: uint8 ``[V, n_blocks, block_size / 2]``
    (or ``[V, K / 2]``; the first dimension is the gathered one); scales fp16/fp32,
    ``V * n_blocks`` values (``[V, n_blocks, 1]``); zero_points None (implicit 8),
    uint8 (see :func:`gather_zero_point_codes`) or float. Deterministic."""
    bs = int(block_size)
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.ndim < 2:
        raise ValueError(f"data must be uint8 with the gathered rows first, got {data.dtype} {data.shape}")
    V = data.shape[0]
    row_bytes = data.size // V if V else 0
    if V == 0 or bs < 16 or (2 * row_bytes) % bs:
        raise ValueError(f"data rows of {row_bytes} bytes are not whole blocks of {bs} codes")
    nb = 2 * row_bytes // bs
    scales = np.asarray(scales)
    if scales.dtype not in (np.float16, np.float32) or scales.size != V * nb:
        raise ValueError(f"scales must be fp16/fp32 with V * n_blocks = {V * nb} values, got {scales.dtype} {scales.shape}")
    kind = zero_point_kind(zero_points)
    size = gather_packed_size(V=V, n_blocks=nb, block_size=bs, zero_points=kind)
    zu, zf = zero_point_arrays(zero_points, kind, V, nb, gather_zero_point_codes)
    d = np.ascontiguousarray(data)
    sc = np.ascontiguousarray(scales, dtype=np.float32).reshape(-1)
    buf = new_buffer(size, out, "prepack_gather_block_quantized")
    check(lib.op_prepack_gather(ptr(d, "uint8_t *"), ptr(sc, "float *"), ptr(zu, "uint8_t *"),
                                ptr(zf, "float *"), V, nb, bs, ZP_KINDS[kind],
                                int(scales.dtype == np.float16), ptr(buf, "uint8_t *"), size),
          "prepack_gather_block_quantized")
    return buf


def gather_block_quantized(indices: np.ndarray, packed: np.ndarray, *, out: np.ndarray | None = None
                           ) -> np.ndarray:
    """Dequantized rows ``[*indices.shape, K]`` (float32); negative indices count from
    the end; an index outside ``[-V, V)`` raises IndexError. Releases the GIL.

    ``packed``: a gather buffer (:func:`prepack_gather_block_quantized`), or a matmul
    buffer (``prepack_matmul_nbits``), whose row v is output column v of its B: a tied
    embedding reads its LM head's object; a row gives the same bits from either."""
    K, V = k_n(packed, lib.OP_KIND_INT4_GATHER, lib.OP_KIND_INT4_MATMUL)
    idx = np.ascontiguousarray(indices, dtype=np.int64)
    shape = idx.shape + (K,)
    if out is None:
        out = np.empty(shape, dtype=np.float32)
    elif out.dtype != np.float32 or out.shape != shape or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"gather_block_quantized: out must be writable C-contiguous float32 {shape}")
    bad = ffi.new("size_t *")
    flat = idx.reshape(-1)
    status = lib.op_gather_block_quantized(ptr(flat, "int64_t *"), flat.size, ptr(packed, "uint8_t *"),
                                           packed.nbytes, ptr(out, "float *"), bad)
    if status == lib.OP_E_INDEX:
        pos = int(bad[0])
        raise IndexError(f"gather index {int(flat[pos])} at position {pos} is outside [-{V}, {V})")
    check(status, "gather_block_quantized")
    return out
