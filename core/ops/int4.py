"""INT4 ops: com.microsoft MatMulNBits and GatherBlockQuantized, and the prepared forms
they read.

Two prepared forms exist for every INT4 weight, told apart by dtype:

- ``uint8``: the native packed buffer (``onnx_prep.native.prepack_*``; self-describing,
  ISA-independent). Compute runs in C and releases the GIL.
- ``float32``: the numpy reference form, the dequantized weight (``[K, N]`` for a
  matmul, the full ``[V, ..., K]`` table for a gather). Used where the native module is
  absent and as the oracle the native kernels are checked against.

Without a prepared form the op dequantizes its raw inputs on every call (slow,
exact ONNX Runtime semantics; the numpy ``dequantize_*`` functions here are that
reference).

Semantics (checked against ONNX Runtime in tests/test_ops_int4.py):
- MatMulNBits: B uint8 ``[N, k_blocks, blob]`` with 4-bit codes low nibble first along
  K; scales ``[N * k_blocks]``; zero points packed uint4 ``[N, ceil(k_blocks/2)]``
  (two per byte along the blocks, low nibble first) or of the scales' float type
  ``[N * k_blocks]``; implicit zero point 8. ``W[n, k] = (code - zp) * scale``,
  ``Y = A @ W^T (+ bias)``.
- GatherBlockQuantized with uint8 data: two codes per byte along ``quantize_axis``
  (which thus holds half the elements), scales with ``ceil(elements / block_size)``
  along it, zero points packed the same way as data, implicit zero point 8.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from onnx_prep.core.model.transforms import MATMUL_NBITS_WEIGHT_LAYOUT, QDQ_WEIGHT_LAYOUT
from onnx_prep.core.errors import NativeError
from onnx_prep.core.ops import intra_op
from onnx_prep.core.ops.attributes import DATA_VIEW, ROW_SHAPE, ROWS_AS_COLUMNS, axis_index

_I4_TYPES = ("int4", "uint4")


# ----------------------------------------------------------------- nibble helpers

def unpack_nibbles(packed: np.ndarray, axis: int = -1) -> np.ndarray:
    """uint8 [..., n, ...] -> uint8 [..., 2n, ...]: low nibble first along ``axis``."""
    packed = np.moveaxis(np.asarray(packed, dtype=np.uint8), axis, -1)
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), dtype=np.uint8)
    out[..., 0::2] = packed & 15
    out[..., 1::2] = packed >> 4
    return np.moveaxis(out, -1, axis)


def pack_nibbles(codes: np.ndarray, axis: int = -1) -> np.ndarray:
    """Inverse of ``unpack_nibbles`` (an odd length is padded with a 0 nibble)."""
    codes = np.moveaxis(np.asarray(codes, dtype=np.uint8), axis, -1)
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (1,), np.uint8)], axis=-1)
    out = (codes[..., 0::2] & 15) | ((codes[..., 1::2] & 15) << 4)
    return np.moveaxis(out.astype(np.uint8), -1, axis)


# ------------------------------------------------------------ MatMulNBits reference

def dequantize_matmul_nbits(b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None,
                            *, K: int, N: int, block_size: int) -> np.ndarray:
    """The dequantized weight W^T as float32 ``[K, N]`` (ready for ``A @ W^T``)."""
    kb = -(-K // block_size)
    codes = unpack_nibbles(np.asarray(b).reshape(N, kb, block_size // 2), -1).astype(np.float32)
    s = np.asarray(scales).astype(np.float32).reshape(N, kb)
    if zero_points is None:
        z = np.float32(8.0)
    elif np.asarray(zero_points).dtype == np.uint8:
        z = unpack_nibbles(np.asarray(zero_points).reshape(N, -1), -1)[:, :kb].astype(np.float32)[:, :, None]
    else:
        z = np.asarray(zero_points).astype(np.float32).reshape(N, kb)[:, :, None]
    w = (codes - z) * s[:, :, None]  # [N, kb, bs]
    return np.ascontiguousarray(w.reshape(N, kb * block_size)[:, :K].T)


def _nbits_attrs(attrs: Mapping[str, Any]) -> tuple[int, int, int]:
    bits = int(attrs.get("bits", 4))
    if bits != 4:
        raise ValueError(f"MatMulNBits: only bits=4 is supported, got {bits}")
    return int(attrs["K"]), int(attrs["N"]), int(attrs["block_size"])


def matmul_nbits(inputs, attrs, prepared):
    """com.microsoft MatMulNBits: inputs A, B, scales, zero_points?, g_idx?, bias?."""
    a = inputs[0]
    K, N, block_size = _nbits_attrs(attrs)
    bias = inputs[5] if len(inputs) > 5 else None
    if len(inputs) > 4 and inputs[4] is not None:
        raise ValueError("MatMulNBits: g_idx (act-order) is not supported")
    out_dtype = a.dtype
    a2 = a.reshape(-1, K)
    if a2.dtype != np.float32:  # fp16 A (fp16 scales): compute in fp32, cast back
        a2 = a2.astype(np.float32)
    packed = prepared.get(1) if prepared else None
    if a2.shape[0] == 0:  # a zero-size dim (allowed): nothing to compute
        y = np.zeros((0, N), np.float32)
    elif packed is not None and packed.dtype == np.uint8:
        from onnx_prep import native

        a2 = np.ascontiguousarray(a2)
        b32 = None if bias is None else np.asarray(bias, np.float32)
        split = intra_op.current()
        if split is not None and intra_op.worth_splitting(packed.nbytes, a2.shape[0]):
            fork_join, parts = split
            box = intra_op.mailbox()
            chunks = intra_op.chunk_count(packed.nbytes, a2.shape[0], parts)
            ranges = intra_op.column_ranges(N, chunks, native.PANEL_N)
            intra_op.count_split(len(ranges))
            if box is not None:  # helpers wait in C: hand the chunks over there
                y, batch = _split_of(packed, ranges).batch(a2, bias=b32)
                box.fork_join(batch)
            else:
                y, calls = native.matmul_nbits_parts(a2, packed, ranges, bias=b32)
                fork_join(calls, helpers=parts - 1)
        else:
            y = native.matmul_nbits(a2, packed, bias=b32)
    else:
        w = packed if packed is not None else _raw_weight(inputs, attrs, K, N, block_size)
        y = a2 @ w
        if bias is not None:
            y += bias.astype(np.float32)
    y = y.reshape(a.shape[:-1] + (N,))
    return [y if y.dtype == out_dtype else y.astype(out_dtype)]


def bind_matmul_nbits(attrs: Mapping[str, Any]):
    """``matmul_nbits`` for one node, its attributes read once: a float32 A (C-contiguous,
    last dimension K) against a prepared INT4 weight, without bias or g_idx, in a run
    that splits it through its mailbox (a decode step's GEMV) is one call,
    ``native.MatmulSplit.through``; any other call runs ``matmul_nbits``. Same bits
    (tests/test_handoff.py)."""
    try:
        K, N, _ = _nbits_attrs(attrs)
    except (KeyError, ValueError):
        return matmul_nbits  # its call raises the error, naming the node
    from onnx_prep import native

    try:
        align = native.PANEL_N
    except NativeError:  # pragma: no cover - only without the native module
        return matmul_nbits
    last: list = [None]  # (id of the weight, rows, parts, its split) of the last split call: one tuple

    def gemv(inputs, attrs, prepared):
        a = inputs[0]
        packed = prepared.get(1) if prepared else None
        split = intra_op.current()
        if (split is not None and packed is not None and type(a) is np.ndarray and a.dtype == _F32
                and a.flags.c_contiguous and a.ndim and a.shape[-1] == K and a.size and packed.dtype == np.uint8
                and (len(inputs) <= 4 or all(x is None for x in inputs[4:6]))):
            M, parts = a.size // K, split[1]
            c = last[0]
            if c is not None and c[0] == id(packed) and c[1] == M and c[2] == parts and c[3].weight() is packed:
                s = c[3]  # the call before's weight (the split holds it weakly), rows and parts
            elif intra_op.worth_splitting(packed.nbytes, M):
                s = _split_of(packed, intra_op.column_ranges(N, intra_op.chunk_count(packed.nbytes, M, parts), align))
                last[0] = (id(packed), M, parts, s)
            else:
                s = None
            box = intra_op.mailbox() if s is not None else None
            if box is not None:
                intra_op.count_split(s.chunks)
                return [s.through(box, a)]
        return matmul_nbits(inputs, attrs, prepared)

    gemv.unbound = matmul_nbits  # what it stands in for (scripts/ab_decode_step.py)
    return gemv


matmul_nbits.bind = bind_matmul_nbits
_F32 = np.dtype(np.float32)


# NOTE: a split's fixed part (native.MatmulSplit: the weight and its chunks checked and
# handed to C) per prepared weight, built at its first split and reused while that very
# array lives (a prepared weight keeps its address): keyed by id, checked by identity,
# dropped when the array goes (the split holds it weakly). Building it every call cost
# ~3 of the ~7 us a decode GEMV's batch took in Python, on ~80 GEMVs a medium step.
_SPLITS: dict[int, Any] = {}


def _split_of(packed: np.ndarray, ranges) -> Any:
    from onnx_prep import native

    key = id(packed)
    split = _SPLITS.get(key)
    if split is None or split.weight() is not packed or split.chunks != len(ranges):
        split = native.MatmulSplit(packed, ranges, on_release=lambda _ref, key=key: _SPLITS.pop(key, None))
        _SPLITS[key] = split
    return split


def _raw_weight(inputs, attrs, K: int, N: int, block_size: int) -> np.ndarray:
    if attrs.get("weight_layout", MATMUL_NBITS_WEIGHT_LAYOUT) == QDQ_WEIGHT_LAYOUT:
        # A fused DequantizeLinear(int4 [K, N]) + MatMul node (core/model/transforms.py).
        b, s, z = matmul_nbits_sources([x for x in inputs[1:4] if x is not None], attrs)
    else:
        b, s, z = inputs[1], inputs[2], inputs[3] if len(inputs) > 3 else None
    return dequantize_matmul_nbits(b, s, z, K=K, N=N, block_size=block_size)


# ------------------------------------- fused DequantizeLinear sources -> MatMulNBits form

def matmul_nbits_sources(src: list[np.ndarray], attrs: Mapping[str, Any]
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(B uint8 [N, kb, bs/2], scales [N*kb], zero points or None) in MatMulNBits' form,
    converting a fused DequantizeLinear source (``weight_layout == "KN"``) on the way."""
    K, N, bs = int(attrs["K"]), int(attrs["N"]), int(attrs["block_size"])
    kb = -(-K // bs)
    b, scales = src[0], src[1]
    zp = src[2] if len(src) > 2 else None
    if attrs.get("weight_layout", MATMUL_NBITS_WEIGHT_LAYOUT) != QDQ_WEIGHT_LAYOUT:
        return b.reshape(N, kb, bs // 2), scales.reshape(-1), zp
    return dq_to_matmul_nbits(b, scales, zp, K=K, N=N, block_size=bs,
                              signed=str(attrs.get("weight_dtype", "int4")) == "int4")


def _codes(packed: np.ndarray, count: int, signed: bool) -> np.ndarray:
    """Unsigned 4-bit codes (offset binary) of ``count`` packed int4/uint4 elements."""
    c = unpack_nibbles(np.asarray(packed, dtype=np.uint8).reshape(-1))[:count]
    # Two's complement int4 -> offset binary (code + 8): flip the sign bit.
    return c ^ np.uint8(8) if signed else c


def dq_to_matmul_nbits(w: np.ndarray, scales: np.ndarray, zp: np.ndarray | None, *, K: int, N: int,
                       block_size: int, signed: bool
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """DequantizeLinear(int4|uint4 [K, N], axis 0, block_size) sources -> MatMulNBits form.

    int4 codes become offset-binary uint4 (code + 8) with zero point zp + 8, so
    ``(code - zp) * scale`` is unchanged; int4 without zero points maps to the
    implicit 8; uint4 without zero points needs an explicit 0 (the int4_matmul kernel
    gives that layout ``zp-u4``).
    """
    kb = -(-K // block_size)
    codes = _codes(w, K * N, signed).reshape(K, N).T  # [N, K]
    if kb * block_size != K:
        pad = np.full((N, kb * block_size - K), 8, dtype=np.uint8)
        codes = np.concatenate([codes, pad], axis=1)
    b = pack_nibbles(codes.reshape(N, kb, block_size), -1)  # [N, kb, bs/2]
    s = np.ascontiguousarray(np.asarray(scales).reshape(kb, N).T).reshape(-1)
    if zp is not None:
        z = _codes(zp, kb * N, signed).reshape(kb, N).T  # [N, kb]
    elif not signed:
        z = np.zeros((N, kb), dtype=np.uint8)
    else:
        return b, s, None
    return b, s, pack_nibbles(z, -1)


# ---------------------------------------------------- GatherBlockQuantized reference

def dequantize_block_quantized(data: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None,
                               *, quantize_axis: int, block_size: int, bits: int = 4) -> np.ndarray:
    """Dequantize a block-quantized tensor (GatherBlockQuantized encoding) to float32.

    ``data`` uint8 (two codes per byte along ``quantize_axis``) or an int4 / uint4 numpy
    dtype (one code per element)."""
    if bits != 4:
        raise ValueError(f"GatherBlockQuantized: only bits=4 is supported, got {bits}")
    data = np.asarray(data)
    qa = axis_index(quantize_axis, data.ndim)
    if data.dtype == np.uint8:
        codes = unpack_nibbles(data, qa).astype(np.float32)
        default_zp = 8.0
    elif str(data.dtype) in _I4_TYPES:
        codes = data.astype(np.float32)
        default_zp = 0.0
    else:
        raise ValueError(f"GatherBlockQuantized: unsupported data type {data.dtype}")
    elems = codes.shape[qa]
    s = np.repeat(np.asarray(scales).astype(np.float32), block_size, axis=qa)
    s = np.take(s, np.arange(elems), axis=qa)
    if zero_points is None:
        z = np.float32(default_zp)
    else:
        zp = np.asarray(zero_points)
        zp = unpack_nibbles(zp, qa) if zp.dtype == np.uint8 else zp
        nb = np.asarray(scales).shape[qa]
        zp = np.take(zp.astype(np.float32), np.arange(nb), axis=qa)
        z = np.take(np.repeat(zp, block_size, axis=qa), np.arange(elems), axis=qa)
    return (codes - z) * s


def gather_block_quantized(inputs, attrs, prepared):
    """com.microsoft GatherBlockQuantized: inputs data, indices, scales, zero_points?."""
    indices = inputs[1]
    gather_axis = int(attrs.get("gather_axis", 0))
    quantize_axis = int(attrs.get("quantize_axis", 1))
    block_size = int(attrs.get("block_size", 128))
    packed = prepared.get(0) if prepared else None
    scales = inputs[2]
    out_dtype = scales.dtype if scales is not None else np.float32
    if packed is not None and packed.dtype == np.uint8:
        from onnx_prep import native

        # The native gather covers gather_axis 0 / quantize_axis last (the kernel
        # registry assigns it only then) and returns [..., row elements]; ORT's output
        # keeps data's trailing dimensions, which the row reshapes into.
        y = native.gather_block_quantized(np.ascontiguousarray(indices, dtype=np.int64), packed)
        row_shape = attrs.get(ROW_SHAPE)
        if row_shape is not None:
            y = y.reshape(tuple(indices.shape) + tuple(row_shape))
    elif packed is not None and attrs.get(ROWS_AS_COLUMNS):
        # the LM head's dequantized B [K, V] (a tied embedding): row v is its column v
        y = np.moveaxis(np.take(packed, indices, axis=1), 0, -1)
        row_shape = attrs.get(ROW_SHAPE)
        if row_shape is not None:
            y = y.reshape(tuple(np.shape(indices)) + tuple(row_shape))
    elif packed is not None:
        ga = axis_index(gather_axis, packed.ndim)
        y = np.take(packed, indices, axis=ga)
    else:
        data = inputs[0]
        if attrs.get(DATA_VIEW) is not None:  # a view folded at resolve (core/model/weight_views.py)
            data = data.reshape(tuple(attrs[DATA_VIEW]))
        ga = axis_index(gather_axis, data.ndim)
        qa = axis_index(quantize_axis, data.ndim)
        if ga == qa:
            raise ValueError("GatherBlockQuantized: gather_axis equals quantize_axis")
        # Gather the rows first, then dequantize only them.
        zp = inputs[3] if len(inputs) > 3 else None
        rows = np.take(data, indices, axis=ga)
        s = np.take(scales, indices, axis=ga)
        z = None if zp is None else np.take(zp, indices, axis=ga)
        shift = np.ndim(indices) - 1
        y = dequantize_block_quantized(rows, s, z, quantize_axis=qa + shift if qa > ga else qa,
                                       block_size=block_size, bits=int(attrs.get("bits", 4)))
    return [y if y.dtype == out_dtype else y.astype(out_dtype)]
