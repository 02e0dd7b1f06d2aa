"""com.microsoft GroupQueryAttention: the op the ``gqa`` kernel runs (core/kernels/gqa.py).

Inputs: query, key?, value? (absent: query is packed QKV), past_key?, past_value?,
seqlens_k (int32 [B], total length - 1 per row), total_sequence_length (int32 scalar),
cos_cache?, sin_cache? (read when do_rotary = 1). Outputs: output, present_key,
present_value. Semantics and layouts: docs/ops.md, "GroupQueryAttention"; the C kernel
(``onnx_prep.native.group_query_attention``) computes it, and ``reference_gqa`` below
is the numpy twin for machines without the native module.

Present: a node the action program marks (``APPEND_IN_PLACE``: past inputs from graph
inputs, present outputs to graph outputs, the decoder's KV cache) writes it into an
append buffer (core/ops/append_buffer.py), as a marked Concat does: a present of
``past + S`` rows (a growing cache, every batch row at the same length) whose past is
the claimed prefix of a buffer with room gets only its S new rows written, the past
rows stay where they are; otherwise a fresh buffer with room is filled (past rows
copied). Other nodes get fresh arrays, as ONNX Runtime writes them without a shared
buffer. ONNX Runtime's own shared buffer (past and present one max-length array, the
lengths in seqlens_k) is the kernel's ``present=(past_key, past_value)``; the runtime
does not bind it: a session would have to allocate the KV inputs at their maximum
length once and feed each step's present back as its past.

``attention_with_past`` runs ``onnx_prep.fused::Attention``, the causal attention over a
KV cache that pattern fusion makes of standard ops (core/model/attention_pattern.py says
what it matches and the attributes it sets), on the same C kernel; ``masked_attention``
runs ``onnx_prep.fused::MaskedAttention``, the attention of the Hugging Face exports
(any additive mask, kv heads repeated) over the caches their Concats extended.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from onnx_prep.core.errors import NativeError
from onnx_prep.core.ops import append_buffer, intra_op
from onnx_prep.core.ops.attributes import APPEND_IN_PLACE
from onnx_prep.core.ops.nn import softmax


def _inputs(inputs: list) -> list:
    return list(inputs) + [None] * (9 - len(inputs))


def group_query_attention(inputs, attrs: Mapping[str, Any], prepared):
    q, k, v, pk, pv, seqlens_k, total, cos, sin = _inputs(inputs)[:9]
    rotary = int(attrs.get("do_rotary", 0)) == 1
    window_cache = int(attrs.get("sliding_window_cache", 0)) == 1
    kwargs = _gqa_kwargs(attrs)
    args = (q, k, v, pk, pv, seqlens_k, total, cos if rotary else None, sin if rotary else None)
    from onnx_prep import native

    try:
        kernel = native.group_query_attention
    except NativeError:  # pragma: no cover - only without the native module
        return list(reference_gqa(*args, sliding_window_cache=window_cache, **kwargs))
    if window_cache:  # present is the past's capacity, rows moved as the window slides: never an append
        return list(kernel(*args, sliding_window_cache=True, **kwargs))
    mark = attrs.get(APPEND_IN_PLACE)
    if mark and _appends(q, pk, pv, seqlens_k, total):
        rows = int(np.asarray(total).reshape(-1)[0])
        kwargs["present"] = _extended(pk, pv, rows, _kv_spreads(mark, own_shares=False))
        return list(native.gqa_decode(*args, **kwargs))  # the lean call: the same checks and bits
    return list(kernel(*args, **kwargs))


def _kv_spreads(mark: tuple[int, int], *, own_shares: bool) -> tuple[float, float]:
    """Where a marked node's key and value buffers sit in the spread of their room
    (append_buffer.room_after), from its mark ``(position, count)``: one share for both
    (GroupQueryAttention), or a share each (the fused Attention: its keys and values
    then run out of room on different steps)."""
    position, count = mark
    if own_shares:
        return (2 * position + 0.5) / (2 * count), (2 * position + 1.5) / (2 * count)
    return ((position + 0.5) / count,) * 2


def _extended(past_key, past_value, rows: int, spreads: tuple[float, float]) -> tuple:
    """The present key and value: ``rows`` rows of room after each past (append_buffer.extend)."""
    return (append_buffer.extend(past_key, 2, rows, spread=spreads[0])[0],
            append_buffer.extend(past_value, 2, rows, spread=spreads[1])[0])


def bind_group_query_attention(attrs: Mapping[str, Any]):
    """``group_query_attention`` for one node, its attributes read once: a node the
    action program marked ``APPEND_IN_PLACE`` gets a bound decode step
    (``native.GqaStep``) for the steps that append one row to every batch row's cache
    in place; any other call, and any other node, runs ``group_query_attention``.
    Same bits either way (tests/test_native_gqa.py)."""
    mark = attrs.get(APPEND_IN_PLACE)
    if not mark or int(attrs.get("sliding_window_cache", 0)) == 1:
        return group_query_attention
    from onnx_prep import native

    try:
        step = native.GqaStep(num_heads=int(attrs["num_heads"]), kv_num_heads=int(attrs["kv_num_heads"]),
                              scale=float(attrs.get("scale", 0.0)),
                              interleaved=int(attrs.get("rotary_interleaved", 0)) == 1,
                              local_window_size=int(attrs.get("local_window_size", -1)),
                              softcap=float(attrs.get("softcap", 0.0)))
    except NativeError:  # pragma: no cover - only without the native module
        return group_query_attention
    rotary = int(attrs.get("do_rotary", 0)) == 1
    spreads = _kv_spreads(mark, own_shares=False)

    def decode_step(inputs, attrs, prepared):
        if len(inputs) >= 9 and inputs[1] is None and inputs[2] is None:  # packed QKV (inputs 9-11: refused)
            q, _, _, pk, pv, seqlens_k, total, cos, sin = inputs[:9]
            if (type(pk) is np.ndarray and type(pv) is np.ndarray and pk.ndim == 4 and type(q) is np.ndarray
                    and q.ndim == 3 and q.shape[1] == 1 and pv.shape == pk.shape and _appends(q, pk, pv, seqlens_k,
                                                                                                  total)):
                rows = pk.shape[2] + 1
                present = _extended(pk, pv, rows, spreads)
                box, chunks = intra_op.attention_split(pk.shape[0] * pk.shape[1], 2 * pk.nbytes)
                out = step(q, pk, pv, seqlens_k, total, cos if rotary else None, sin if rotary else None, present,
                           box, chunks)
                if out is not None:
                    if box is not None:
                        intra_op.count_attention_split()
                    return list(out)
                # not the step's form (a copied cache, say): the general call, present given
                kwargs = _gqa_kwargs(attrs)
                return list(native.gqa_decode(q, None, None, pk, pv, seqlens_k, total, cos if rotary else None,
                                              sin if rotary else None, present=present, **kwargs))
        return group_query_attention(inputs, attrs, prepared)

    decode_step.unbound = group_query_attention  # what it stands in for (scripts/ab_decode_step.py)
    return decode_step


group_query_attention.bind = bind_group_query_attention


def _gqa_kwargs(attrs: Mapping[str, Any]) -> dict:
    return dict(num_heads=int(attrs["num_heads"]), kv_num_heads=int(attrs["kv_num_heads"]),
                scale=float(attrs.get("scale", 0.0)), interleaved=int(attrs.get("rotary_interleaved", 0)) == 1,
                local_window_size=int(attrs.get("local_window_size", -1)), softcap=float(attrs.get("softcap", 0.0)))


def attention_with_past(inputs, attrs: Mapping[str, Any], prepared):
    """onnx_prep.fused::Attention(q, k, v, past_key, past_value, mask_start, mask_end) ->
    (output, present_key, present_value): the ops it replaced (core/model/attention_pattern.py),
    ``present = Concat(past, new, axis)``, ``probs = Softmax(MatMul(q, Transpose(present_key,
    [0, 1, 3, 2])) * scale (/ scale with divide = 1) + mask, -1)``, ``output =
    Transpose(MatMul(probs, present_value), [0, 2, 1, 3])``, the mask ``Where(keys <=
    queries, 0, mask_fill)`` over ``keys = Range(0, mask_end)``, ``queries =
    Range(mask_start, mask_end)`` as columns.

    float32 BNSH inputs with one past length P, kv heads equal to the query heads or 1,
    ``mask_start == P`` and ``mask_end == P + S`` (the mask is then exactly causal: query
    row s, at position P + s, sees keys 0..P + s) run the native kernel; masked keys get
    weight 0 there, as ``exp(mask_fill + score - max)`` is in float32 for the fills the
    fusion accepts. Anything else computes the formula in numpy (the unfused ops'
    broadcasting and errors), so the node means what the ops it replaced meant.
    """
    q, k, v, past_key, past_value, start, end = inputs[:7]
    start, end = int(np.asarray(start).reshape(-1)[0]), int(np.asarray(end).reshape(-1)[0])
    scale = float(attrs["scale"])
    divide = int(attrs.get("divide", 0)) == 1
    fast = _fast_path(q, k, v, past_key, past_value, start, end, int(attrs.get("axis", 2)))
    if fast:
        kernel = _native_kernel("attention_with_past")
        if kernel is not None:
            present = None
            mark = attrs.get(APPEND_IN_PLACE)
            if mark:
                present = _extended(past_key, past_value, end, _kv_spreads(mark, own_shares=True))
            return list(kernel(q, k, v, past_key, past_value, scale=1.0 / scale if divide else scale,
                               present=present))
    return list(reference_attention(q, k, v, past_key, past_value, start, end, scale=scale, divide=divide,
                                    mask_fill=float(attrs["mask_fill"]), axis=int(attrs.get("axis", 2))))


def bind_attention_with_past(attrs: Mapping[str, Any]):
    """``attention_with_past`` for one node, its attributes read once: a marked node's
    decode step (one query row, every batch row at the past's length, its caches in
    append buffers) is one call, ``native.GqaStep.separate``; anything else runs
    ``attention_with_past``. Same bits (tests/test_attention_fusion.py)."""
    mark = attrs.get(APPEND_IN_PLACE)
    if not mark or int(attrs.get("axis", 2)) not in (2, -2):
        return attention_with_past
    from onnx_prep import native

    scale = float(attrs["scale"])
    if int(attrs.get("divide", 0)) == 1:
        scale = 1.0 / scale
    if not scale:  # the kernel reads 0 as "1 / sqrt(head size)": the general call says what 0 means
        return attention_with_past
    spreads = _kv_spreads(mark, own_shares=True)
    steps: dict[tuple[int, int], Any] = {}  # (N, KN) -> the bound step

    def decode_step(inputs, attrs, prepared):
        q, k, v, past_key, past_value, start, end = inputs[:7]
        if (type(q) is np.ndarray and q.ndim == 4 and q.shape[2] == 1 and type(k) is np.ndarray and k.ndim == 4
                and type(past_key) is np.ndarray and type(past_value) is np.ndarray and past_key.ndim == 4
                and past_value.shape == past_key.shape and past_key.shape[2]):
            P = past_key.shape[2]
            if int(np.asarray(start).reshape(-1)[0]) == P and int(np.asarray(end).reshape(-1)[0]) == P + 1 \
                    and _fast_path(q, k, v, past_key, past_value, P, P + 1, 2):
                N, KN = q.shape[1], k.shape[1]
                step = steps.get((N, KN))
                if step is None:
                    step = steps[(N, KN)] = native.GqaStep(num_heads=N, kv_num_heads=KN, scale=scale,
                                                           interleaved=False)
                present = _extended(past_key, past_value, P + 1, spreads)
                box, chunks = intra_op.attention_split(past_key.shape[0] * KN, 2 * past_key.nbytes)
                out = step.separate(q, k, v, past_key, past_value, present, box, chunks)
                if out is not None:
                    if box is not None:
                        intra_op.count_attention_split()
                    return list(out)
                return list(native.attention_with_past(q, k, v, past_key, past_value, scale=scale, present=present))
        return attention_with_past(inputs, attrs, prepared)

    decode_step.unbound = attention_with_past  # what it stands in for (scripts/ab_decode_step.py)
    return decode_step


attention_with_past.bind = bind_attention_with_past


def _native_kernel(name: str):
    """The native module's ``name``, or None without the native module."""
    from onnx_prep import native

    try:
        return getattr(native, name)
    except NativeError:  # pragma: no cover - only without the native module
        return None


def _fast_path(q, k, v, past_key, past_value, start: int, end: int, axis: int) -> bool:
    arrays = (q, k, v, past_key, past_value)
    if any(not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 4 for x in arrays) or \
            axis not in (2, -2):
        return False
    B, N, S, H = q.shape
    KN, P = k.shape[1], past_key.shape[2]
    return KN in (N, 1) and k.shape == v.shape == (B, KN, S, H) and past_key.shape == past_value.shape == \
        (B, KN, P, H) and start == P and end == P + S and S > 0


def reference_attention(q, k, v, past_key, past_value, start: int, end: int, *, scale: float, divide: bool,
                        mask_fill: float, axis: int = 2):
    """The unfused ops' formula in numpy (``attention_with_past`` says which)."""
    present_key = np.concatenate([past_key, k], axis=axis)
    present_value = np.concatenate([past_value, v], axis=axis)
    scores = np.matmul(q, present_key.transpose(0, 1, 3, 2))
    c = np.asarray(scale, dtype=scores.dtype)
    scores = scores / c if divide else scores * c
    keys, queries = np.arange(0, end, dtype=np.int64), np.arange(start, end, dtype=np.int64)
    mask = np.where(keys[None, :] <= queries[:, None], np.float32(0.0), np.float32(mask_fill))
    probs = softmax([scores + mask], {"axis": -1}, None)[0]
    return np.matmul(probs, present_value).transpose(0, 2, 1, 3), present_key, present_value


def masked_attention(inputs, attrs: Mapping[str, Any], prepared):
    """onnx_prep.fused::MaskedAttention(q, key_cache, value_cache, mask, key_expand,
    key_shape, value_expand, value_shape) -> (output, *shapes): the ops it replaced
    (core/model/attention_pattern.py), with ``repeat(x, e, r) = Reshape(Expand(Unsqueeze(x,
    [2]), e), r)`` when ``repeat`` = 1 (the kv heads repeated for the query heads; else x),
    ``probs = Softmax(MatMul(q * query_scale, Transpose(repeat(key_cache), [0, 1, 3, 2]) *
    key_scale) * scale (/ scale with divide = 1) + mask, -1)``, zeroed where NaN when
    ``nan_to_zero`` = 1 (``Where(IsNaN(p), 0, p)``), ``output = MatMul(probs,
    repeat(value_cache))`` ([B, N, S, H]); then, for each entry of ``shape_outputs`` (0:
    the repeated keys, 1: the repeated values), that tensor's shape (a Shape node the
    fusion took in).

    float32 inputs, caches ``[B, KN, T, H]``, query ``[B, N, S <= T, H]``, a repeat whose
    shapes make each kv head G = N / KN query heads in a row (or KN equal to N or 1 without
    one) and a mask broadcasting to ``[B, N, S, T]`` run the native kernel
    (``native.attention_over_cache``) with the three scales folded into one: the scores
    differ from the ops' by the rounding of that product (a few float32 ulps; the
    tolerances of tests/test_hf_attention_fusion.py). Anything else computes the ops'
    formula in numpy (their broadcasting and errors).
    """
    q, key, value, mask, kx, ks, vx, vs = (list(inputs) + [None] * 8)[:8]
    a = {name: float(attrs.get(name, 1.0)) for name in ("query_scale", "key_scale", "scale")}
    divide, nan_to_zero = int(attrs.get("divide", 0)) == 1, int(attrs.get("nan_to_zero", 0)) == 1
    repeat = int(attrs.get("repeat", 0)) == 1
    shape_of = [int(x) for x in attrs.get("shape_outputs", ())]
    fast = _masked_fast_path(q, key, value, mask, (kx, ks, vx, vs) if repeat else None)
    if fast:
        kernel = _native_kernel("attention_over_cache")
        if kernel is not None:
            scale = a["query_scale"] * a["key_scale"] * (1.0 / a["scale"] if divide else a["scale"])
            out = kernel(q, key, value, scale=scale, mask=mask, nan_to_zero=nan_to_zero)
            B, N, _, H = q.shape
            repeated = np.array([B, N, key.shape[2], H], np.int64)
            return [out, *(repeated.copy() for _ in shape_of)]
    out, rk, rv = reference_masked_attention(q, key, value, mask, (kx, ks, vx, vs) if repeat else None,
                                             divide=divide, nan_to_zero=nan_to_zero, **a)
    return [out, *(np.array((rk, rv)[i].shape, np.int64) for i in shape_of)]


def _reshaped(shape: tuple[int, ...], target) -> tuple[int, ...] | None:
    """What Reshape (allowzero 0) makes of ``shape`` with ``target``, or None if it fails."""
    dims = [shape[i] if d == 0 and i < len(shape) else int(d) for i, d in enumerate(np.asarray(target).reshape(-1))]
    total = int(np.prod(shape, dtype=np.int64))
    if dims.count(-1) == 1:
        known = int(np.prod([d for d in dims if d != -1], dtype=np.int64))
        if known <= 0 or total % known:
            return None
        dims[dims.index(-1)] = total // known
    return tuple(dims) if int(np.prod(dims, dtype=np.int64)) == total and min(dims, default=0) >= 0 else None


def _masked_fast_path(q, key, value, mask, repeat) -> int:
    """G (query heads per kv head) when the native kernel computes the node exactly
    (``masked_attention`` says when), else 0."""
    if any(not isinstance(x, np.ndarray) or x.dtype != np.float32 for x in (q, key, value, mask)) or \
            q.ndim != 4 or key.ndim != 4 or key.shape != value.shape or mask.ndim > 4:
        return 0
    (B, N, S, H), (KB, KN, T, KH) = q.shape, key.shape
    if (KB, KH) != (B, H) or not 1 <= S <= T or N % KN:
        return 0
    G = N // KN
    if repeat is None:
        if KN not in (N, 1):
            return 0
    else:
        for x, (e, r) in ((key, repeat[:2]), (value, repeat[2:])):
            if e is None or r is None:
                return 0
            try:
                five = np.broadcast_shapes((B, KN, 1, T, H), tuple(int(d) for d in np.asarray(e).reshape(-1)))
            except ValueError:
                return 0
            if five != (B, KN, G, T, H) or _reshaped(five, r) != (B, N, T, H):
                return 0
    try:
        np.broadcast_shapes(mask.shape, (B, N, S, T))
    except ValueError:
        return 0
    return G if np.broadcast_shapes(mask.shape, (B, N, S, T)) == (B, N, S, T) else 0


def reference_masked_attention(q, key, value, mask, repeat, *, query_scale: float, key_scale: float, scale: float,
                               divide: bool, nan_to_zero: bool):
    """The unfused ops' formula in numpy (``masked_attention`` says which): (output, the
    repeated keys, the repeated values)."""
    from onnx_prep.core.ops.shape import expand, reshape

    def repeated(x, e, r):
        return reshape([expand([np.expand_dims(x, 2), e], {}, None)[0], r], {}, None)[0]

    rk, rv = (key, value) if repeat is None else (repeated(key, *repeat[:2]), repeated(value, *repeat[2:]))
    kt = np.transpose(rk, (0, 1, 3, 2)) * np.asarray(key_scale, dtype=rk.dtype)
    scores = np.matmul(q * np.asarray(query_scale, dtype=q.dtype), kt)
    c = np.asarray(scale, dtype=scores.dtype)
    probs = softmax([(scores / c if divide else scores * c) + mask], {"axis": -1}, None)[0]
    if nan_to_zero:
        probs = np.where(np.isnan(probs), np.asarray(0, probs.dtype), probs)
    return np.matmul(probs, rv), rk, rv


def _appends(q, past_key, past_value, seqlens_k, total) -> bool:
    """Present is the past with S rows appended: fp32, and every row's total length is
    ``past + S`` (a first prompt's rows, padding included, are all new)."""
    if past_key is None or past_value is None or q.dtype != np.float32:
        return False
    if past_key.dtype != np.float32 or past_value.dtype != np.float32 or past_key.shape != past_value.shape:
        return False
    S, P, t = q.shape[1], past_key.shape[2], int(np.asarray(total).reshape(-1)[0])
    if t != P + S:
        return False
    if P == 0:
        return True
    seq = np.asarray(seqlens_k)
    if seq.size == 1:  # batch 1, a decode step: one int, not three array ops
        return int(seq.reshape(-1)[0]) + 1 == t
    return bool(np.all(seq + 1 == t))


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """x [..., H] rotated with cos / sin [..., rotary_dim / 2] (broadcast over x's heads)."""
    half = cos.shape[-1]
    y = x.copy()
    if interleaved:
        x0, x1 = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        y[..., 0:2 * half:2], y[..., 1:2 * half:2] = x0 * cos - x1 * sin, x1 * cos + x0 * sin
    else:
        x0, x1 = x[..., :half], x[..., half:2 * half]
        y[..., :half], y[..., half:2 * half] = x0 * cos - x1 * sin, x1 * cos + x0 * sin
    return y


def _window_rows(T: int, C: int, W: int) -> int:
    """Positions a sliding-window cache of capacity C keeps after T tokens (ONNX Runtime's
    rule, native/onnx_prep_native.h): all up to C, then it drops C - W + 1 at once."""
    if T <= C:
        return T
    G = C - W + 1
    return T - G * -(-(T - C) // G)


def reference_gqa(q, k, v, past_key, past_value, seqlens_k, total_sequence_length, cos=None, sin=None, *,
                  num_heads: int, kv_num_heads: int, scale: float = 0.0, interleaved: bool = False,
                  local_window_size: int = -1, softcap: float = 0.0, sliding_window_cache: bool = False):
    """The numpy twin of the C kernel (same semantics, no shape checks beyond numpy's)."""
    out_dtype = q.dtype
    q = q.astype(np.float32)
    B, S, D = q.shape
    if k is None:  # packed QKV
        H = D // (num_heads + 2 * kv_num_heads)
        q, k, v = np.split(q, [num_heads * H, (num_heads + kv_num_heads) * H], axis=-1)
    H = q.shape[-1] // num_heads
    q = q.reshape(B, S, num_heads, H)
    k = k.astype(np.float32).reshape(B, S, kv_num_heads, H)
    v = v.astype(np.float32).reshape(B, S, kv_num_heads, H)
    total = int(np.asarray(total_sequence_length).reshape(-1)[0])
    past_len = 0 if past_key is None else past_key.shape[2]
    present_len = past_len if sliding_window_cache else max(total, past_len)
    first = S == total
    pk = np.zeros((B, kv_num_heads, present_len, H), np.float32)
    pv = np.zeros_like(pk)
    out = np.empty((B, S, num_heads, H), np.float32)
    alpha = np.float32(scale) if scale else np.float32(1.0 / np.sqrt(H))
    G = num_heads // kv_num_heads
    for b in range(B):
        t = int(seqlens_k[b]) + 1
        past = 0 if first else t - S
        # rows [0, kept) of the past hold positions [past - kept, past); keys by position
        kept = _window_rows(past, past_len, local_window_size) if sliding_window_cache else past
        pos = past + np.arange(S)
        qb, kb = q[b], k[b]
        if cos is not None:
            c, s_ = cos[pos][:, None, :], sin[pos][:, None, :]
            qb, kb = _rotate(qb, c, s_, interleaved), _rotate(kb, c, s_, interleaved)
        keys = np.concatenate([past_key[b, :, :kept] if kept else np.zeros((kv_num_heads, 0, H), np.float32),
                               kb.transpose(1, 0, 2)], axis=1)
        values = np.concatenate([past_value[b, :, :kept] if kept else np.zeros((kv_num_heads, 0, H), np.float32),
                                 v[b].transpose(1, 0, 2)], axis=1)
        first_pos = past - kept
        if sliding_window_cache:
            keep = _window_rows(t, past_len, local_window_size)
            pk[b, :, :keep], pv[b, :, :keep] = (x[:, t - keep - first_pos:t - first_pos] for x in (keys, values))
        else:
            pk[b, :, :kept + S], pv[b, :, :kept + S] = keys, values
        for h in range(num_heads):
            kh, vh = keys[h // G], values[h // G]
            for s in range(S):
                hi = min(past + s + 1, t)
                end = hi if softcap > 0 else past + s + 1  # a padding row's window: native/attention.c
                lo = max(0, end - local_window_size) if local_window_size >= 0 else 0
                if hi <= lo:  # a window that holds no key
                    out[b, s, h] = 0
                    continue
                w = alpha * (kh[lo - first_pos:hi - first_pos] @ qb[s, h])
                if softcap > 0:
                    w = np.float32(softcap) * np.tanh(w / np.float32(softcap))
                w = np.exp(w - w.max())
                out[b, s, h] = (w / w.sum()) @ vh[lo - first_pos:hi - first_pos]
    out = out.reshape(B, S, num_heads * H)
    return tuple(x if x.dtype == out_dtype else x.astype(out_dtype) for x in (out, pk, pv))
