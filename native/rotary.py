"""com.microsoft RotaryEmbedding in C (``rotary.c``), GIL released."""
from __future__ import annotations

import numpy as np

from onnx_prep.native._module import ffi, lib, check
from onnx_prep.native.packed import ptr


def rotary_embedding(x: np.ndarray, position_ids: np.ndarray, cos_cache: np.ndarray,
                     sin_cache: np.ndarray, *, heads: int, head_size: int, rotary_dim: int,
                     transposed: bool, interleaved: bool) -> np.ndarray:
    """Rotate ``x`` (float32 ``[B, S, heads * head_size]`` or ``[B, heads, S, head_size]``
    when ``transposed``) by the angles of ``position_ids`` (``[B, S]``, or one start id:
    token s at id + s); caches ``[max_pos, rotary_dim / 2]``. A position outside the
    caches is an IndexError naming it."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    b = x.shape[0]
    s = x.shape[2] if transposed else x.shape[1]
    if x.size != b * s * heads * head_size:
        raise ValueError(f"rotary_embedding: x of shape {x.shape} is not {heads} heads of {head_size}")
    pos = np.ascontiguousarray(position_ids, dtype=np.int64)
    per_token = pos.size != 1
    if per_token and pos.shape != (b, s):
        raise ValueError(f"rotary_embedding: position_ids of shape {pos.shape}, expected ({b}, {s}) or one id")
    cos = np.ascontiguousarray(cos_cache, dtype=np.float32)
    sin = np.ascontiguousarray(sin_cache, dtype=np.float32)
    if cos.ndim != 2 or cos.shape != sin.shape or cos.shape[1] * 2 != rotary_dim:
        raise ValueError(f"rotary_embedding: caches {cos.shape} / {sin.shape}, expected [max_pos, {rotary_dim // 2}]")
    y = np.empty_like(x)
    args = (ptr(x, "float *"), ptr(y, "float *"), b, s, heads, head_size, rotary_dim, int(bool(transposed)),
            int(bool(interleaved)), ptr(pos, "int64_t *"), int(per_token), ptr(cos, "float *"),
            ptr(sin, "float *"), cos.shape[0])
    # the kernel checks every position before it writes: the bad one is asked for only
    # when there is one (no allocation per call on the decode path)
    status = lib.op_rotary_embedding(*args, ffi.NULL)
    if status == lib.OP_E_INDEX:
        bad = ffi.new("size_t *")
        status = lib.op_rotary_embedding(*args, bad)
        i = int(bad[0])
        where = f"position_ids[{i // s}, {i % s}] = {int(pos.reshape(-1)[i])}" if per_token else \
            f"positions {int(pos.reshape(-1)[0])}..{int(pos.reshape(-1)[0]) + s - 1}"
        raise IndexError(f"rotary_embedding: {where} is outside the caches' {cos.shape[0]} positions")
    check(status, "rotary_embedding")
    return y
