"""com.microsoft RotaryEmbedding over the native kernel (``onnx_prep.native.rotary_embedding``),
or numpy where the native module is absent.

Semantics (ONNX Runtime's CPU kernel; tests/test_native_rotary.py checks them against it):
input ``[B, S, hidden]`` (heads of ``head_size`` side by side) or ``[B, heads, S,
head_size]``; position_ids ``[B, S]`` or one start id (token s at id + s); cos / sin
caches ``[max_pos, rotary_dim / 2]``. ``head_size`` is ``hidden / num_heads`` when
``rotary_embedding_dim`` is set, else twice the caches' width (num_heads then defaults
to ``hidden / head_size``); ``rotary_dim`` is ``rotary_embedding_dim`` or the head size.
The first ``rotary_dim`` values of each head rotate, as pairs ``(i, i + rotary_dim/2)``
or, ``interleaved``, ``(2i, 2i + 1)``: ``y_a = x_a cos - x_b sin``, ``y_b = x_b cos +
x_a sin``; the rest of the head is copied. float16 is computed in float32 and rounded
back. ``scale`` only rescales caches ONNX Runtime would rebuild (not done on CPU):
ignored, as there.
"""
from __future__ import annotations

import numpy as np

from onnx_prep.core.errors import NativeError


def rotary_geometry(x_shape: tuple[int, ...], cache_width: int, num_heads: int,
                    rotary_embedding_dim: int) -> tuple[int, int, int, bool]:
    """(heads, head_size, rotary_dim, transposed) of an input shape, ONNX Runtime's rules;
    ValueError naming the rule a shape breaks."""
    if len(x_shape) not in (3, 4):
        raise ValueError(f"RotaryEmbedding: input of rank {len(x_shape)}, expected 3 or 4")
    transposed = len(x_shape) == 4
    hidden = x_shape[1] * x_shape[3] if transposed else x_shape[2]
    if rotary_embedding_dim > 0:
        if num_heads <= 0:
            raise ValueError("RotaryEmbedding: num_heads must be given with rotary_embedding_dim")
        head_size = hidden // num_heads
    else:
        head_size = cache_width * 2
    if transposed:
        heads = x_shape[1]
        head_size = x_shape[3] if rotary_embedding_dim <= 0 else head_size
    else:
        heads = num_heads if num_heads > 0 else (hidden // head_size if head_size else 0)
    rot = rotary_embedding_dim if rotary_embedding_dim > 0 else head_size
    if rot > head_size or rot != 2 * cache_width or heads * head_size != hidden:
        raise ValueError(f"RotaryEmbedding: input {list(x_shape)} with caches of width {cache_width}, "
                         f"num_heads {num_heads}, rotary_embedding_dim {rotary_embedding_dim}: "
                         f"{heads} heads of {head_size} do not fit, or rotary dim {rot} is not twice "
                         f"the caches' width or exceeds the head size")
    return heads, head_size, rot, transposed


def rotary_embedding(inputs, attrs, prepared):
    """RotaryEmbedding(input, position_ids, cos_cache, sin_cache) -> output."""
    x, pos, cos, sin = inputs[:4]
    heads, head_size, rot, transposed = rotary_geometry(
        x.shape, cos.shape[-1], int(attrs.get("num_heads", 0)), int(attrs.get("rotary_embedding_dim", 0)))
    interleaved = int(attrs.get("interleaved", 0)) == 1
    x32 = x.astype(np.float32, copy=False)
    try:
        from onnx_prep import native

        y = native.rotary_embedding(x32, pos, cos, sin, heads=heads, head_size=head_size, rotary_dim=rot,
                                    transposed=transposed, interleaved=interleaved)
    except NativeError:
        y = _rotary_numpy(x32, pos, cos, sin, heads, head_size, rot, transposed, interleaved)
    return [y.astype(x.dtype, copy=False)]


def _rotary_numpy(x, pos, cos, sin, heads, head_size, rot, transposed, interleaved):
    b = x.shape[0]
    s = x.shape[2] if transposed else x.shape[1]
    h4 = x.reshape(b, heads, s, head_size) if transposed else x.reshape(b, s, heads, head_size)
    p = np.asarray(pos, np.int64).reshape(-1)
    p = (p[0] + np.arange(s))[None, :].repeat(b, 0) if p.size == 1 else p.reshape(b, s)
    if p.min() < 0 or p.max() >= cos.shape[0]:
        raise IndexError(f"rotary_embedding: a position id is outside the caches' {cos.shape[0]} positions")
    c, sn = np.asarray(cos, np.float32)[p], np.asarray(sin, np.float32)[p]  # [B, S, rot/2]
    c, sn = (c[:, None], sn[:, None]) if transposed else (c[:, :, None], sn[:, :, None])
    y = h4.copy()
    ia, ib = (slice(0, rot, 2), slice(1, rot, 2)) if interleaved else (slice(0, rot // 2), slice(rot // 2, rot))
    xa, xb = h4[..., ia], h4[..., ib]
    y[..., ia] = xa * c + (-xb) * sn
    y[..., ib] = xb * c + xa * sn
    return y.reshape(x.shape)


_START_0 = np.zeros(1, np.int64)  # one start id: token s at position s


def _half(attrs, d: int) -> int:
    half = int(attrs.get("half", 0))
    return half if half > 0 else (d + 1) // 2 if half < 0 else d // 2


def rotary_from_tables(inputs, attrs, prepared):
    """onnx_prep.fused::RotaryEmbedding(x, cos, sin) -> ``x * cos + rotate_half(x) * sin``,
    ``rotate_half(x) = Concat(-x[..., h:], x[..., :h])`` (``h`` the ``half`` attribute; 0:
    floor(D / 2), -1: ceil(D / 2), as the fusion found it): the rotate-half rotary fused at resolve
    (core/model/fusion.py), its tables [.., S, D] as the model computed them, with equal
    halves along the last axis (the fusion proves it).

    float32 x ``[B, heads, S, D]`` with ``D = 2h`` and float32 tables ``[B or 1, 1, S,
    D]`` run the native kernel: the tables' first halves, one row per token, are its
    caches, and the token's row its position. Any other shape or type computes the
    formula in numpy, so the node means what the ops it replaced meant.
    """
    x, cos, sin = inputs[:3]
    if x.ndim == 4 and cos.ndim == 4 and x.dtype == cos.dtype == sin.dtype == np.float32:
        b, heads, s, d = x.shape
        cb = cos.shape[0]
        half = _half(attrs, d)
        if cos.shape == sin.shape == (cb, 1, s, d) and d == 2 * half and cb in (1, b) and s:
            c = cos[:, 0, :, :half].reshape(cb * s, half)
            sn = sin[:, 0, :, :half].reshape(cb * s, half)
            pos = _START_0 if cb == 1 else np.arange(b * s, dtype=np.int64).reshape(b, s)
            try:
                from onnx_prep import native

                return [native.rotary_embedding(x, pos, c, sn, heads=heads, head_size=d, rotary_dim=d,
                                                transposed=True, interleaved=False)]
            except NativeError:
                pass
    half = _half(attrs, x.shape[-1] if x.ndim else 0)
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return [x * cos + rotated * sin]
