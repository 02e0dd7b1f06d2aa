"""com.microsoft GroupQueryAttention in C (``attention.c``), with the GIL released.

``group_query_attention`` takes the op's inputs as numpy arrays (fp32 compute; an
fp16 input is widened and the outputs narrowed back) and returns ``(output,
present_key, present_value)``. Semantics: ONNX Runtime's CPU kernel (docs/ops.md,
"GroupQueryAttention"); the shape rules it checks are checked here, one line each.
"""
from __future__ import annotations

import math

import numpy as np

from onnx_prep.native._module import check, ffi, lib
from onnx_prep.native.isa import isa_id
from onnx_prep.native.packed import ptr


def _f32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


def _dims(what: str, x: np.ndarray, rank: int) -> tuple[int, ...]:
    if x.ndim != rank:
        raise ValueError(f"GroupQueryAttention: {what} has rank {x.ndim}, expected {rank}")
    return x.shape


def _kv_buffer(x: np.ndarray | None, shape: tuple, *, writable: bool = True) -> tuple[np.ndarray, int] | None:
    """(x, rows from one head to the next) when x is an fp32 ``shape`` array laid out as
    the kernel reads KV (C-contiguous but for room along axis 2), else None."""
    if x is None or x.dtype != np.float32 or x.shape != tuple(shape) or (writable and not x.flags.writeable):
        return None
    B, KN, L, H = x.shape
    st = x.strides
    if B * KN == 1 and (L == 1 or st[2] == 4 * H) and (H == 1 or st[3] == 4) and st[1] % (4 * H) == 0 \
            and st[1] // (4 * H) >= L:
        # NOTE: one head: numpy calls the rows of a larger buffer C-contiguous (a size-1
        # axis's stride does not count), but their head stride is the buffer's; a past and
        # a present sharing the buffer (a KV cache appended in place) must say the same one
        return x, st[1] // (4 * H)
    if x.flags.c_contiguous:
        return x, L
    if st[3] != 4 or st[2] != 4 * H or st[1] % (4 * H) or st[1] // (4 * H) < L or (B > 1 and st[0] != KN * st[1]):
        return None
    return x, st[1] // (4 * H)


def _address(x: np.ndarray | None):
    """A float pointer to x's first element (x may be a strided view; the caller keeps
    x alive for the call)."""
    return ffi.NULL if x is None else ffi.cast("float *", x.ctypes.data)


def group_query_attention(query: np.ndarray, key: np.ndarray | None, value: np.ndarray | None,
                          past_key: np.ndarray | None, past_value: np.ndarray | None,
                          seqlens_k: np.ndarray, total_sequence_length: int | np.ndarray,
                          cos_cache: np.ndarray | None = None, sin_cache: np.ndarray | None = None, *,
                          num_heads: int, kv_num_heads: int, scale: float = 0.0, interleaved: bool = False,
                          local_window_size: int = -1, softcap: float = 0.0, sliding_window_cache: bool = False,
                          present: tuple[np.ndarray, np.ndarray] | None = None, isa: str | None = None
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Output ``[B, S, num_heads * H]`` and present key / value ``[B, kv_num_heads,
    max(total_sequence_length, past length), H]`` (the past's length with
    ``sliding_window_cache``).

    ``local_window_size`` W >= 0: the query at position p sees keys p + 1 - W .. p only
    (none: zeros). ``softcap`` > 0: scores become ``softcap * tanh(score / softcap)``
    before the softmax. ``sliding_window_cache``: past and present are window-sized
    buffers of one capacity C (the past's length, >= W > 0) holding each row's most
    recent positions from row 0, evicted as ONNX Runtime evicts them
    (native/onnx_prep_native.h says how).

    key and value None: ``query`` is packed ``[B, S, (num_heads + 2 kv_num_heads) H]``.
    Rotary runs when cos / sin caches are given. ``present``: the (key, value) arrays to
    write present into (fp32, C-contiguous but for room after their rows along axis 2,
    as a prefix view of a longer buffer is); one that starts where its past starts is
    the past's own buffer: only the new rows are written (ONNX Runtime's shared buffer,
    and the runtime's append buffers). Past buffers with room after their rows are read
    in place, any other past is copied to fp32 first.
    """
    out_dtype = np.asarray(query).dtype
    B, S, D = _dims("query", np.asarray(query), 3)
    if num_heads % kv_num_heads:
        raise ValueError(f"GroupQueryAttention: num_heads {num_heads} is not a multiple of "
                         f"kv_num_heads {kv_num_heads}")
    if (key is None) != (value is None):
        raise ValueError("GroupQueryAttention: key and value must be both present or both absent")
    heads = num_heads if key is not None else num_heads + 2 * kv_num_heads
    H = D // heads
    if H < 1 or H % 8 or H * heads != D:
        raise ValueError(f"GroupQueryAttention: query's last dimension {D} is not {heads} heads "
                         f"({'num_heads' if key is not None else 'packed QKV'}) of a multiple of 8")
    if key is None:  # packed QKV: split the last axis
        q32 = _f32(query)
        query = q32[..., :num_heads * H]
        key = q32[..., num_heads * H:(num_heads + kv_num_heads) * H]
        value = q32[..., (num_heads + kv_num_heads) * H:]
    else:
        for what, x in (("key", key), ("value", value)):
            if _dims(what, np.asarray(x), 3) != (B, S, kv_num_heads * H):
                raise ValueError(f"GroupQueryAttention: {what} shape {list(np.shape(x))} is not "
                                 f"[{B}, {S}, {kv_num_heads * H}] (batch, sequence, kv_num_heads * head size)")
    q, k, v = _f32(query), _f32(key), _f32(value)
    total = int(np.asarray(total_sequence_length).reshape(-1)[0])
    past_len = 0
    if (past_key is None) != (past_value is None):
        raise ValueError("GroupQueryAttention: past_key and past_value must be both present or both absent")
    if past_key is not None:
        for what, x in (("past_key", past_key), ("past_value", past_value)):
            d = _dims(what, np.asarray(x), 4)
            if d[0] != B or d[1] != kv_num_heads or d[3] != H or d[2] != np.shape(past_key)[2]:
                raise ValueError(f"GroupQueryAttention: {what} shape {list(d)} is not [{B}, {kv_num_heads}, "
                                 f"past length, {H}] (BNSH)")
        past_len = int(np.shape(past_key)[2])
    present_len = max(total, past_len)
    if sliding_window_cache:  # ONNX Runtime's rules, in its words where it has them
        if past_key is None:
            raise ValueError("GroupQueryAttention: sliding_window_cache = 1 requires past_key and past_value")
        if local_window_size < 1:
            raise ValueError(f"GroupQueryAttention: sliding_window_cache = 1 requires local_window_size > 0, "
                             f"got {local_window_size}")
        if past_len < local_window_size:
            raise ValueError(f"GroupQueryAttention: sliding_window_cache: KV cache capacity ({past_len}, past_key's "
                             f"dimension 2) must be at least local_window_size ({local_window_size})")
        present_len = past_len
    first_prompt = S == total
    if not first_prompt and S != 1 and B != 1:
        raise ValueError(f"GroupQueryAttention: a continued prompt (sequence {S}, total {total}) needs batch 1")
    rotary_dim = 0
    if (cos_cache is None) != (sin_cache is None):
        raise ValueError("GroupQueryAttention: cos_cache and sin_cache must be both present or both absent")
    if cos_cache is not None:
        cos, sin = _f32(cos_cache), _f32(sin_cache)
        if cos.ndim != 2 or cos.shape != sin.shape or 2 * cos.shape[1] > H or cos.shape[0] < total:
            raise ValueError(f"GroupQueryAttention: cos/sin caches {list(cos.shape)} / {list(sin.shape)} are not "
                             f"[>= total_sequence_length {total}, <= head size {H} / 2]")
        rotary_dim = 2 * cos.shape[1]
    else:
        cos = sin = None
    seq = np.ascontiguousarray(np.asarray(seqlens_k).reshape(-1), dtype=np.int64)
    if seq.size != B:
        raise ValueError(f"GroupQueryAttention: seqlens_k has {seq.size} values for batch {B}")
    if sliding_window_cache and first_prompt and seq.size and int(seq.min()) + 1 < S:
        b = int(seq.argmin())
        raise ValueError(f"GroupQueryAttention: seqlens_k[{b}] = {int(seq[b])} is too small for sequence_length {S} "
                         f"(sliding_window_cache = 1 takes a first prompt without padding rows)")
    out, present_k, present_v = _launch(
        q, k, v, past_key, past_value, seq, cos, sin, present, isa, total,
        batch=B, seq=S, num_heads=num_heads, kv_num_heads=kv_num_heads, head_size=H, past_len=past_len,
        present_len=present_len, rotary_dim=rotary_dim, cache_rows=0 if cos is None else cos.shape[0],
        interleaved=int(bool(interleaved)), first_prompt=int(first_prompt),
        scale=float(scale) if scale else 1.0 / float(np.sqrt(H)),
        **_window_fields(local_window_size, softcap, sliding_window_cache))
    if out_dtype != np.float32:
        return out.astype(out_dtype), present_k.astype(out_dtype), present_v.astype(out_dtype)
    return out, present_k, present_v


def _window_fields(local_window_size: int, softcap: float, sliding_window_cache: bool) -> dict:
    """The op_gqa_params fields of a window and a softcap: ONNX Runtime's CPU kernel
    windows for any W >= 0 and caps for softcap > 0 only (others: none)."""
    windowed = int(local_window_size) >= 0
    return dict(window=int(local_window_size) if windowed else 0, windowed=int(windowed),
                softcap=float(softcap) if softcap > 0 else 0.0, window_cache=int(bool(sliding_window_cache)))


_F32 = np.dtype(np.float32)
_SEQ_TYPES = (np.dtype(np.int32), np.dtype(np.int64))
_NO_WINDOW = _window_fields(-1, 0.0, False)


def _plain(x, ndim: int) -> bool:
    """``x`` is a C-contiguous float32 ndarray of rank ``ndim`` (the kernel's own form)."""
    return type(x) is np.ndarray and x.dtype == _F32 and x.ndim == ndim and x.flags.c_contiguous


def gqa_decode(query: np.ndarray, key: np.ndarray | None, value: np.ndarray | None, past_key: np.ndarray,
               past_value: np.ndarray, seqlens_k: np.ndarray, total_sequence_length,
               cos_cache: np.ndarray | None, sin_cache: np.ndarray | None, *, num_heads: int,
               kv_num_heads: int, scale: float, interleaved: bool, local_window_size: int = -1,
               softcap: float = 0.0,
               present: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``group_query_attention(...)`` for a decode step as the runtime makes it: float32
    q / k / v in the kernel's form (or packed QKV: key and value None), past KV views
    with room after their rows, the present buffers given (the append buffers), int32 /
    int64 ``seqlens_k``, float32 cos / sin tables or none. The same checks of what the
    kernel trusts (every shape, the buffers' rows) and the same C call with the same
    arguments: the same bits. Anything else goes through ``group_query_attention``.

    NOTE: what it saves is small: the general wrapper's conversions and checks, 24.3 ->
    22.6 us a call hot (32 heads, past 40; the C kernel ~2 us of it, the rest is Python
    around one C call, in _launch as much as here)."""
    def general():
        return group_query_attention(query, key, value, past_key, past_value, seqlens_k, total_sequence_length,
                                     cos_cache, sin_cache, num_heads=num_heads, kv_num_heads=kv_num_heads,
                                     scale=scale, interleaved=interleaved, local_window_size=local_window_size,
                                     softcap=softcap, present=present)

    present_k, present_v = present
    N, KN = num_heads, kv_num_heads
    packed = key is None and value is None
    if not (_plain(query, 3) and (packed or (_plain(key, 3) and _plain(value, 3)))
            and type(past_key) is np.ndarray and type(past_value) is np.ndarray and past_key.ndim == 4
            and type(seqlens_k) is np.ndarray and seqlens_k.dtype in _SEQ_TYPES
            and (cos_cache is None or (_plain(cos_cache, 2) and _plain(sin_cache, 2)))
            and N > 0 and KN > 0):
        return general()
    B, S, D = query.shape
    q, k, v = query, key, value
    if packed:  # packed QKV [B, S, (N + 2 KN) H]: its three parts (views when B * S == 1)
        H = D // (N + 2 * KN)
        if H < 1 or H * (N + 2 * KN) != D:
            return general()
        q, k, v = _packed_parts(query, N, KN, H)
        D = N * H
    H = D // N
    P = past_key.shape[2]
    total = int(total_sequence_length.reshape(-1)[0]) if type(total_sequence_length) is np.ndarray \
        else int(total_sequence_length)
    L = max(total, P)
    kv = (B, S, KN * H)
    rd = 0 if cos_cache is None else 2 * cos_cache.shape[1]
    past = (B, KN, P, H)
    if (N % KN or H < 1 or H % 8 or H * N != D or k.shape != kv or v.shape != kv
            or past_value.shape != past or seqlens_k.shape != (B,) or S == total
            or (S != 1 and B != 1) or (rd and (cos_cache.shape != sin_cache.shape or rd > H
                                                or cos_cache.shape[0] < total))):
        return general()
    seq = seqlens_k if seqlens_k.dtype == np.int64 and seqlens_k.flags.c_contiguous \
        else np.ascontiguousarray(seqlens_k, dtype=np.int64)
    return _launch(q, k, v, past_key, past_value, seq, cos_cache, sin_cache, present, None, total,
                   batch=B, seq=S, num_heads=N, kv_num_heads=KN, head_size=H, past_len=P, present_len=L,
                   rotary_dim=rd, cache_rows=cos_cache.shape[0] if rd else 0,
                   interleaved=1 if interleaved else 0, first_prompt=0,
                   scale=float(scale) if scale else 1.0 / math.sqrt(H),
                   **(_NO_WINDOW if local_window_size < 0 and not softcap > 0
                      else _window_fields(local_window_size, softcap, False)))


class GqaStep:
    """One GroupQueryAttention node's decode step with its attributes bound once: packed
    QKV ``[B, 1, (N + 2 KN) H]`` float32, past KV views whose buffers hold the present
    (``present``: the views an append buffer handed out for the pasts extended in place,
    one row longer; their ``base`` is the pasts' ``base``, and both start at its start,
    which is the caller's word: core/ops/append_buffer.py ``extend`` checked it), every
    row at the past's length (``seqlens_k`` all P, total P + 1). Call it
    as ``gqa_decode`` minus the key, value and attributes: ``(output, present_key,
    present_value)``, or None when the arguments are not that form (the caller then
    takes ``gqa_decode``, which takes anything). With ``box`` (a ``Mailbox`` whose helpers
    are lent to this run) and ``chunks`` > 1, the units are shared with the helpers.

    The same checks of what the kernel trusts (every shape, stride and table length)
    and the same C call with the same arguments as ``gqa_decode``: the same bits. The
    kernel is given the buffers themselves, so it stays inside them whatever a view.

    NOTE: why a bound call. In a decode step each op runs after a GEMV has streamed
    megabytes of weights past the caches, where every Python object the call touches
    costs a miss: ``gqa_decode`` took ~130-220 us a call there against ~27 us in its C
    kernel (builder Llama, 32 heads, batch 1, past ~40), the general wrapper's
    conversions, a parameter struct built from a dict and four ``ndarray.ctypes``
    addresses (~3 us each even when hot). Here the node's constant fields are set once in
    a template struct that no call changes (two runs may call one node at once), copied
    per call; the buffers' addresses come from ``ffi.from_buffer`` on the append buffers
    themselves (~0.7 us)."""

    __slots__ = ("_template", "_size", "_heads")

    def __init__(self, *, num_heads: int, kv_num_heads: int, scale: float, interleaved: bool,
                 local_window_size: int = -1, softcap: float = 0.0) -> None:
        self._template = ffi.new("op_gqa_params *", dict(
            seq=1, num_heads=num_heads, kv_num_heads=kv_num_heads, interleaved=1 if interleaved else 0,
            first_prompt=0, **(_NO_WINDOW if local_window_size < 0 and not softcap > 0
                               else _window_fields(local_window_size, softcap, False))))
        self._size = ffi.sizeof("op_gqa_params")
        self._heads = (num_heads, kv_num_heads, float(scale))

    def __call__(self, query, past_key, past_value, seqlens_k, total_sequence_length, cos_cache, sin_cache,
                 present, box=None, chunks: int = 1):
        q = query
        if not (type(q) is np.ndarray and q.dtype == _F32 and q.ndim == 3 and q.flags.c_contiguous
                and q.shape[1] == 1):
            return None
        N, KN, _ = self._heads
        B, _, D = q.shape
        H = D // (N + 2 * KN)
        if H < 1 or H % 8 or H * (N + 2 * KN) != D:
            return None
        P = past_key.shape[2] if type(past_key) is np.ndarray and past_key.ndim == 4 else -1
        if (type(seqlens_k) is not np.ndarray or seqlens_k.shape != (B,) or seqlens_k.dtype not in _SEQ_TYPES
                or (int(total_sequence_length.item()) if type(total_sequence_length) is np.ndarray
                    else int(total_sequence_length)) != P + 1):
            return None
        if B == 1:
            if int(seqlens_k[0]) != P:
                return None
        elif not (seqlens_k == P).all():
            return None
        if cos_cache is not None:
            if not (_plain(cos_cache, 2) and _plain(sin_cache, 2) and cos_cache.shape == sin_cache.shape
                    and 2 * cos_cache.shape[1] <= H and cos_cache.shape[0] >= P + 1):
                return None
        elif sin_cache is not None:
            return None
        if B == 1:  # q, k and v side by side in one row
            qp = ffi.from_buffer("float[]", q)
            return self._run(qp, qp + N * H, qp + (N + KN) * H, q, B, H, past_key, past_value, present,
                             cos_cache, sin_cache, np.empty((B, 1, N * H), np.float32), box, chunks)
        parts = _packed_parts(q, N, KN, H)
        return self._run(*(ffi.from_buffer("float[]", x) for x in parts), parts, B, H, past_key, past_value,
                         present, cos_cache, sin_cache, np.empty((B, 1, N * H), np.float32), box, chunks)

    def separate(self, query, key, value, past_key, past_value, present, box=None, chunks: int = 1):
        """The step of the fused ``onnx_prep.fused::Attention`` (core/ops/attention.py):
        query ``[B, N, 1, H]``, key and value ``[B, KN, 1, H]`` (BNSH; with one row, each
        batch row's heads lie side by side, as the kernel reads them; a strided one is
        copied), no rotary, every batch row at the past's length. Output ``[B, 1, N, H]``;
        None for any other form."""
        N, KN, _ = self._heads
        rows = (query, key, value)
        if not all(type(x) is np.ndarray and x.dtype == _F32 and x.ndim == 4 for x in rows) or query.shape[2] != 1:
            return None
        B, _, _, H = query.shape
        if query.shape != (B, N, 1, H) or key.shape != (B, KN, 1, H) or value.shape != key.shape or H < 1:
            return None
        q, k, v = rows = tuple(x if x.flags.c_contiguous else np.ascontiguousarray(x) for x in rows)
        fb = ffi.from_buffer
        return self._run(fb("float[]", q), fb("float[]", k), fb("float[]", v), rows, B, H, past_key,
                         past_value, present, None, None, np.empty((B, 1, N, H), np.float32), box, chunks)

    def _run(self, qp, kp_new, vp_new, keep, B, H, past_key, past_value, present, cos_cache, sin_cache, out,
             box, chunks):
        """The C call, after the checks of the present and past buffers it is given: its
        units (batch row x kv head) in ``chunks`` chunks that ``box``'s helpers share
        (``op_mailbox_gqa``) when a mailbox is given and ``chunks`` > 1, else on this
        thread. The same bits either way."""
        _, KN, scale = self._heads
        present_k, present_v = present
        pk, pv = past_key, past_value
        if not (type(pk) is np.ndarray and type(pv) is np.ndarray and pk.dtype == _F32 and pv.dtype == _F32
                and type(present_k) is np.ndarray and type(present_v) is np.ndarray
                and present_k.base is not None and pk.base is present_k.base
                and present_v.base is not None and pv.base is present_v.base and pk.ndim == 4):
            return None
        P = pk.shape[2]
        if pk.shape != (B, KN, P, H) or pv.shape != pk.shape or present_k.shape != (B, KN, P + 1, H) \
                or present_v.shape != present_k.shape:
            return None
        # the layout the kernel reads: each head's rows contiguous, heads `rows_k` (keys)
        # or `rows_v` (values) rows apart in the buffer the views start at (the caller's word)
        kb, vb = present_k.base, present_v.base
        rows_k, rows_v = _head_rows(present_k, kb, H), _head_rows(present_v, vb, H)
        if rows_k is None or rows_v is None or min(rows_k, rows_v) < P + 1 or _head_rows(pk, kb, H) != rows_k \
                or _head_rows(pv, vb, H) != rows_v:
            return None
        p = ffi.new("op_gqa_params *")
        ffi.memmove(p, self._template, self._size)  # the node's constant fields; the template never changes
        p.batch, p.head_size, p.scale = B, H, scale if scale else 1.0 / math.sqrt(H)
        if cos_cache is not None:
            p.rotary_dim, p.cache_rows = 2 * cos_cache.shape[1], cos_cache.shape[0]
        p.past_len, p.present_len = P, P + 1
        p.past_key_stride = p.present_key_stride = rows_k  # each buffer its own room
        p.past_value_stride = p.present_value_stride = rows_v
        seq = np.full(B, P, np.int64)
        kp, vp = ffi.from_buffer("float[]", kb), ffi.from_buffer("float[]", vb)
        bad = ffi.new("int64_t *")
        args = (isa_id(None), p, qp, kp_new, vp_new, kp, vp, ffi.from_buffer("int64_t[]", seq),
                ptr(cos_cache, "float *"), ptr(sin_cache, "float *"), ffi.from_buffer("float[]", out), kp, vp)
        if box is not None and chunks > 1:
            status = lib.op_mailbox_gqa(box.c, *args, chunks, bad)
        else:
            status = lib.op_group_query_attention(*args, 0, B * KN, bad)
        del keep  # (held to here: the q / k / v rows the pointers read)
        if status == lib.OP_E_ARG and bad[0] >= 0:
            raise ValueError(f"GroupQueryAttention: seqlens_k[{int(bad[0])}] = {P} does not fit sequence 1, "
                             f"total_sequence_length {P + 1}, past length {P}"
                             + (f" and {cos_cache.shape[0]} cos/sin rows" if cos_cache is not None else ""))
        check(status, "group_query_attention")
        return out, present_k, present_v


def _packed_parts(query: np.ndarray, N: int, KN: int, H: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Packed QKV ``[B, S, (N + 2 KN) H]`` as its q, k and v, each C-contiguous (views
    when B * S == 1)."""
    return (np.ascontiguousarray(query[..., :N * H]), np.ascontiguousarray(query[..., N * H:(N + KN) * H]),
            np.ascontiguousarray(query[..., (N + KN) * H:]))


def _head_rows(view: np.ndarray, base: np.ndarray, H: int) -> int | None:
    """Rows from one kv head to the next in ``view``, a [B, KN, L, H] float32 view of the
    C-contiguous ``base`` [B, KN, rows, H] with base's strides, else None. Where the view
    starts is the caller's word (``GqaStep``); the kernel then stays inside ``base``
    wherever it starts."""
    if not (base.flags.c_contiguous and base.ndim == 4 and base.dtype == _F32 and base.shape[3] == H
            and base.shape[:2] == view.shape[:2] and view.strides == base.strides):
        return None
    return base.shape[2]


def _launch(q, k, v, past_key, past_value, seqlens, cos, sin, present, isa, total, mask=None, **params):
    """Run the C kernel on fp32 q / k / v ``[B, S, heads * H]`` (C-contiguous) and past KV
    ``[B, KN, P, H]`` (or None), writing present into ``present`` when given (else fresh
    arrays): ``(output [B, S, N * H], present key, present value)``. ``params``: the
    op_gqa_params fields but the strides; ``total`` the total length the error names."""
    B, KN, L, H = params["batch"], params["kv_num_heads"], params["present_len"], params["head_size"]
    if present is None:
        present_k = np.empty((B, KN, L, H), np.float32)
        present_v = np.empty_like(present_k)
    else:
        present_k, present_v = present
    kv = []  # (past, past stride, present, present stride) for keys, then values
    for name, past_x, present_x in (("key", past_key, present_k), ("value", past_value, present_v)):
        dest = _kv_buffer(present_x, (B, KN, L, H))
        if dest is None:
            raise ValueError(f"GroupQueryAttention: present_{name} must be a writable fp32 [{B}, {KN}, "
                             f"{L}, {H}] array, C-contiguous but for room after its rows")
        src = None if past_x is None else (_kv_buffer(np.asarray(past_x), np.shape(past_x), writable=False)
                                           or (_f32(past_x), 0))
        kv.append((src, dest))
    out = np.empty((B, params["seq"], params["num_heads"] * H), np.float32)
    (pk, pk_rows), (pv, pv_rows) = [src or (None, 0) for src, _ in kv]
    (_, qk_rows), (_, qv_rows) = [dest for _, dest in kv]
    fields = dict(past_key_stride=pk_rows, past_value_stride=pv_rows, present_key_stride=qk_rows,
                  present_value_stride=qv_rows, **params)
    if mask is not None:  # a float32 view [B, N, S, T] whose keys are contiguous (see _mask_view)
        fields.update(mask=_address(mask), **dict(zip(("mask_b", "mask_h", "mask_s"),
                                                      (st // 4 for st in mask.strides[:3]))))
    p = ffi.new("op_gqa_params *", fields)
    bad = ffi.new("int64_t *")
    status = lib.op_group_query_attention(
        isa_id(isa), p, ptr(q, "float *"), ptr(k, "float *"), ptr(v, "float *"), _address(pk),
        _address(pv), ptr(seqlens, "int64_t *"), ptr(cos, "float *"), ptr(sin, "float *"),
        ptr(out, "float *"), _address(present_k), _address(present_v), 0, B * KN, bad)
    if status == lib.OP_E_ARG and bad[0] >= 0:
        b = int(bad[0])
        raise ValueError(f"GroupQueryAttention: seqlens_k[{b}] = {int(seqlens[b])} does not fit sequence "
                         f"{params['seq']}, total_sequence_length {total}, past length {params['past_len']}"
                         + (f" and {p.cache_rows} cos/sin rows" if params["rotary_dim"] else ""))
    check(status, "group_query_attention")
    return out, present_k, present_v


def _mask_view(mask: np.ndarray, shape: tuple[int, int, int, int]) -> np.ndarray:
    """``mask`` as a float32 view broadcast to ``shape`` ([B, N, S, T]) whose last axis is
    contiguous (the kernel's strides for the others, 0 where broadcast); a ValueError when
    it does not broadcast."""
    m = np.asarray(mask)
    if m.dtype != np.float32 or m.ndim > 4:
        raise ValueError(f"attention: the mask must be float32 of rank <= 4, got {m.dtype} {list(m.shape)}")
    try:
        view = np.broadcast_to(m, shape)
    except ValueError:
        raise ValueError(f"attention: the mask {list(m.shape)} does not broadcast to {list(shape)} "
                         f"(batch, heads, queries, keys)") from None
    if view.strides[3] != 4 or any(st % 4 for st in view.strides):
        m4 = m.reshape((1,) * (4 - m.ndim) + m.shape)
        view = np.broadcast_to(np.ascontiguousarray(np.broadcast_to(m4, m4.shape[:3] + shape[3:])), shape)
    return view


def attention_with_past(query: np.ndarray, key: np.ndarray, value: np.ndarray, past_key: np.ndarray,
                        past_value: np.ndarray, *, scale: float, mask: np.ndarray | None = None,
                        nan_to_zero: bool = False,
                        present: tuple[np.ndarray, np.ndarray] | None = None, isa: str | None = None
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Causal attention over a KV cache, all in BNSH (the fused ``onnx_prep.fused::Attention``
    of core/ops/attention.py): query ``[B, N, S, H]``, new key / value ``[B, KN, S, H]``
    (KN divides N: query head h reads kv head h / (N / KN)), past key / value ``[B, KN, P,
    H]``. Present is ``Concat(past, new)`` on axis 2; query row s, at absolute position
    P + s, attends to present rows 0..P + s with weights ``softmax(scale * q.k)``.

    Returns output ``[B, S, N, H]`` (the heads of a row next to each other: what
    ``Transpose(0, 2, 1, 3)`` of the BNSH product is) and present key / value ``[B, KN,
    P + S, H]``, written into ``present`` when given (as ``group_query_attention``
    does: a present that starts where its past starts gets only the new rows). float32
    only; every row of the batch has the same past.

    ``mask`` (float32, broadcasting to ``[B, N, S, P + S]``) replaces the causal span:
    every query row weighs all P + S keys with ``softmax(scale * q.k + mask)``, so any
    mask (padding, causal, -inf or float32-lowest fills) means what an ``Add`` of it
    before the Softmax means. A row whose softmax is not a number (every key at -inf)
    is NaN, as the Softmax op gives, or 0 with ``nan_to_zero`` (the exports'
    ``Where(IsNaN(p), 0, p)`` after it).
    """
    shapes = [np.shape(x) for x in (query, key, value, past_key, past_value)]
    if any(len(s) != 4 for s in shapes):
        raise ValueError(f"attention: query, key, value, past key and past value must be 4-D (BNSH), got {shapes}")
    if any(np.asarray(x).dtype != np.float32 for x in (query, key, value, past_key, past_value)):
        raise ValueError("attention: every input must be float32")
    (B, N, S, H), (_, KN, _, _) = shapes[0], shapes[1]
    P = shapes[3][2]
    if KN < 1 or N % KN or shapes[1] != (B, KN, S, H) or shapes[2] != shapes[1] or \
            shapes[3] != (B, KN, P, H) or shapes[4] != shapes[3] or S < 1 or H < 1:
        raise ValueError(f"attention: shapes {shapes} are not query [B, N, S, H], key and value [B, KN, S, H], "
                         f"past key and value [B, KN, P, H] with KN dividing N")
    # [B, S, heads, H] rows as the kernel reads them: views when S == 1, else copies
    q, k, v = (_f32(np.asarray(x).transpose(0, 2, 1, 3)).reshape(B, S, -1) for x in (query, key, value))
    seq = np.full(B, P + S - 1, np.int64)
    mask_view = None if mask is None else _mask_view(mask, (B, N, S, P + S))
    out, present_k, present_v = _launch(
        q, k, v, past_key, past_value, seq, None, None, present, isa, P + S, mask=mask_view,
        nan_to_zero=int(bool(nan_to_zero)),
        batch=B, seq=S, num_heads=N, kv_num_heads=KN, head_size=H, past_len=P, present_len=P + S,
        rotary_dim=0, cache_rows=0, interleaved=0, first_prompt=int(P == 0), scale=float(scale))
    return out.reshape(B, S, N, H), present_k, present_v


def attention_over_cache(query: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray, *, scale: float,
                         mask: np.ndarray, nan_to_zero: bool = False, isa: str | None = None) -> np.ndarray:
    """Masked attention over complete KV caches, all in BNSH (the fused
    ``onnx_prep.fused::MaskedAttention`` of core/ops/attention.py): query ``[B, N, S, H]``,
    key / value caches ``[B, KN, T, H]`` (KN divides N: query head h reads kv head h / (N /
    KN); read in place, never written), ``mask`` float32 broadcasting to ``[B, N, S, T]``.
    Returns ``softmax(scale * q.k + mask) . v`` as ``[B, N, S, H]`` (a transposed view of
    the kernel's ``[B, S, N, H]`` rows); ``nan_to_zero`` as ``attention_with_past``'s."""
    shapes = [np.shape(x) for x in (query, key_cache, value_cache)]
    if any(len(s) != 4 for s in shapes) or any(np.asarray(x).dtype != np.float32
                                               for x in (query, key_cache, value_cache)):
        raise ValueError(f"attention: query and the caches must be float32 4-D (BNSH), got {shapes}")
    (B, N, S, H), (_, KN, T, _) = shapes[0], shapes[1]
    if KN < 1 or N % KN or shapes[1] != (B, KN, T, H) or shapes[2] != shapes[1] or not 1 <= S <= T or H < 1:
        raise ValueError(f"attention: shapes {shapes} are not query [B, N, S, H] and caches [B, KN, T >= S, H] "
                         f"with KN dividing N")
    caches = []
    for name, x in (("key", key_cache), ("value", value_cache)):
        buf = _kv_buffer(np.asarray(x), (B, KN, T, H), writable=False) or (_f32(x), T)
        caches.append(buf)
    (kc, k_rows), (vc, v_rows) = caches
    q = _f32(np.asarray(query).transpose(0, 2, 1, 3)).reshape(B, S, N * H)
    view = _mask_view(mask, (B, N, S, T))
    out = np.empty((B, S, N * H), np.float32)
    p = ffi.new("op_gqa_params *", dict(
        batch=B, seq=S, num_heads=N, kv_num_heads=KN, head_size=H, past_len=T, present_len=T,
        past_key_stride=k_rows, past_value_stride=v_rows, present_key_stride=k_rows, present_value_stride=v_rows,
        scale=float(scale), mask=_address(view), mask_b=view.strides[0] // 4, mask_h=view.strides[1] // 4,
        mask_s=view.strides[2] // 4, nan_to_zero=int(bool(nan_to_zero)), cache_only=1))
    seq = np.full(B, T - 1, np.int64)
    k_ptr, v_ptr = _address(kc), _address(vc)
    check(lib.op_group_query_attention(isa_id(isa), p, ptr(q, "float *"), k_ptr, v_ptr, k_ptr, v_ptr,
                                       ptr(seq, "int64_t *"), ffi.NULL, ffi.NULL, ptr(out, "float *"),
                                       k_ptr, v_ptr, 0, B * KN, ffi.NULL), "attention_over_cache")
    return out.reshape(B, S, N, H).transpose(0, 2, 1, 3)
