"""The decoder's fused ops on a CUDA device, what a decode step runs besides the INT4
matmul (device_int4_matmul.py), so that every op of a step can be on the device and
the step captured as one graph (issue #20): the resolver's ``row_norm``, ``rotary``,
``gqa`` and ``int4_gather`` kernels, fp32, with their CPU kernels' semantics.

The kernels are CUDA C (``decoder_ops.cu`` beside this file, shipped as package data),
compiled through the driver protocol (NVRTC for the device's own architecture) ONCE
per process and device, on first use:

- ``decoder_row_norm``: (Skip)SimplifiedLayerNormalization and (Skip)LayerNormalization
  over rows (output ``y``; the Skip forms' ``input_skip_bias_sum`` when asked for); a
  block per row, the sums as a fixed tree;
- ``decoder_rotary``: RotaryEmbedding (both layouts, interleaved or not, position ids
  per token or one start id); a block per (head, token, batch row); the CPU's bits;
- ``decoder_gqa_append`` then ``decoder_gqa_attend``: GroupQueryAttention for a
  decode step or a prompt of any length over past / present KV in the CPU kernel's
  BNSH layout (a present that is the past's own buffer gets only the new rows), rotary
  inside or not; a block per (kv head, batch row, tile of GQA_APPEND_ROWS new rows),
  then per (query head, row, batch row), each row causal over keys [0, past + row]
  (rows beyond a grid's y, 65535, loop in the blocks); a decode step of 1..8 rows is
  one append block per (kv head, batch row), as before prompts ran here;
- ``decoder_int4_gather``: GatherBlockQuantized rows from either INT4 packed kind (the
  gather's records, or the LM head's matmul object for a tied embedding); the CPU's
  bits.

Each ``plan_*`` checks what the host knows before a launch (shapes, strides, the
addresses' alignment, what the CPU kernel refuses, named as it names it) and
:class:`DeviceDecoderOps` queues the launch on a stream and returns at once. What
only the device knows when the kernel runs (position ids, gathered indices, a row's
``seqlens_k``, which change between replays of a captured graph) is checked there:
the element is written as NaN and its op's bit set in a ``status`` word (an int32 in
device memory, zeroed by the caller), read after the synchronisation:
:func:`check_status`.
"""
from __future__ import annotations

import ctypes
import math
from pathlib import Path
from typing import Any, Mapping

from onnx_prep.core.cuda.device_slot_pool import DeviceView
from onnx_prep.core.cuda.compiled_kernels import CompiledKernels, KernelLaunch
from onnx_prep.core.cuda.driver import DeviceDriver
from onnx_prep.core.errors import DeviceError

__all__ = ["KernelLaunch", "DeviceDecoderOps", "ENTRIES", "PARAMS", "STATUS_BITS", "check_gqa_attributes",
           "check_status", "kernel_source", "plan_gqa", "plan_int4_gather", "plan_row_norm", "plan_rotary",
           "status_problems"]

SOURCE = Path(__file__).with_name("decoder_ops.cu")
_P, _U64, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
_GQA = (("q", _P), ("q_b", _U64), ("q_s", _U64), ("q_h", _U64), ("k", _P), ("v", _P), ("kv_b", _U64),
        ("kv_s", _U64), ("kv_h", _U64), ("past_key", _P), ("past_value", _P), ("past_stride", _U64), ("present_key", _P), ("present_value", _P), ("present_stride", _U64),
        ("seqlens", _P), ("seqlens_i32", _I32), ("cos_cache", _P), ("sin_cache", _P), ("cache_rows", _I64),
        ("out", _P), ("ld_out", _U64), ("batch", _I32), ("seq", _I32), ("num_heads", _I32),
        ("kv_num_heads", _I32), ("head_size", _I32), ("past_len", _I64), ("present_len", _I64),
        ("rotary_dim", _I32), ("interleaved", _I32), ("first_prompt", _I32), ("scale", _F32), ("status", _P))
# Each entry's parameters, in order (decoder_ops.cu says the same).
PARAMS: dict[str, tuple[tuple[str, type], ...]] = {
    "decoder_row_norm": (("x", _P), ("skip", _P), ("skip_rows", _U64), ("bias", _P), ("gamma", _P), ("beta", _P),
                         ("y", _P), ("sum_out", _P), ("rows", _I32), ("n", _I32), ("epsilon", _F32),
                         ("simplified", _I32)),
    "decoder_rotary": (("x", _P), ("y", _P), ("pos", _P), ("pos_per_token", _I32), ("cos_cache", _P),
                       ("sin_cache", _P), ("cache_stride", _U64), ("max_pos", _I64), ("batch", _I32), ("seq", _I32), ("heads", _I32),
                       ("head_size", _I32), ("rot_dim", _I32), ("transposed", _I32), ("interleaved", _I32),
                       ("status", _P)),
    "decoder_gqa_append": _GQA,
    "decoder_gqa_attend": _GQA,
    "decoder_int4_gather": (("indices", _P), ("packed", _P), ("out", _P), ("ld_out", _U64), ("kind", _I32),
                            ("V", _I64), ("K", _I32), ("block_size", _I32), ("n_blocks", _I32), ("zp_kind", _I32),
                            ("stride", _U64), ("status", _P)),
}
ENTRIES = tuple(PARAMS)
# The geometry decoder_ops.cu is written for (its #defines).
NORM_THREADS, ROTARY_THREADS, GATHER_THREADS, GQA_THREADS = 256, 64, 256, 128
GQA_MAX_HEAD = 256
GQA_APPEND_ROWS = 8  # new rows a decoder_gqa_append block writes: a decode step (1..8 rows) is one block
KINDS = {"int4_matmul": 1, "int4_gather": 2}
ZP_KINDS = {"none": 0, "u4": 1, "float": 2}
STATUS_BITS = {1: "int4_gather: an index is outside [-V, V) (its row is NaN)",
               2: "rotary: a position id is outside the cos / sin caches (its token is NaN)",
               4: "gqa: a row's seqlens_k does not fit the sequence, the KV buffers or the caches "
                  "(its output is NaN, its present rows untouched)"}
INT32_MAX = 2**31 - 1
GRID_YZ_MAX = 65535  # a launch's grid.y and grid.z (grid.x: 2^31 - 1)


def kernel_source() -> str:
    return SOURCE.read_text()


def _launch(name: str, grid: tuple, block: tuple, values: Mapping[str, Any]) -> KernelLaunch:
    return KernelLaunch(name, tuple(grid), tuple(block), tuple((ctype, values[n]) for n, ctype in PARAMS[name]),
                        tuple(n for n, _ in PARAMS[name]))


def _aligned(op: str, alignment: int = 4, **addresses: int | None) -> None:
    """Each named device address is ``alignment``-byte aligned; None: a required one
    given as 0."""
    for what, address in addresses.items():
        if address is None:
            raise DeviceError(f"device {op}: {what} is required (got a null address)")
        if address % alignment:
            raise DeviceError(f"device {op}: the address of {what} {address:#x} is not {alignment}-byte aligned")


def _required(address: int) -> int | None:
    return address or None


def _counts(op: str, *, grid_yz: tuple[str, ...] = (), **values: int) -> None:
    """Each count is 1 .. INT32_MAX, those in ``grid_yz`` (a grid's y or z: one block
    each) 1 .. GRID_YZ_MAX."""
    for what, value in values.items():
        most = GRID_YZ_MAX if what in grid_yz else INT32_MAX
        if not 1 <= value <= most:
            raise DeviceError(f"device {op}: {what}={value} must be 1 .. {most}")


def plan_row_norm(x: int, gamma: int, y: int, rows: int, n: int, *, epsilon: float, simplified: bool,
                  skip: int = 0, skip_rows: int = 0, bias: int = 0, beta: int = 0, sum_out: int = 0
                  ) -> KernelLaunch:
    """The launch of ``y = norm(x (+ skip) (+ bias)) * gamma (+ beta)`` over ``rows``
    contiguous fp32 rows of ``n`` (RMSNorm when ``simplified``, else LayerNorm); skip
    ``[skip_rows, n]`` repeats over the rows; ``sum_out`` (rows of n) receives the
    input the norm read, the Skip forms' ``input_skip_bias_sum``. ``y`` may be ``x``.
    A norm over the axes from ``axis`` on (LayerNormalization) is ``rows = prod(shape[:
    axis])`` rows of ``n = prod(shape[axis:])``, gamma and beta expanded to ``[n]``. Not
    produced: the mean / inv_std_var statistics outputs (the builder's graphs read
    none)."""
    op = "row_norm"
    _counts(op, rows=rows, n=n)
    _aligned(op, x=_required(x), gamma=_required(gamma), y=_required(y), skip=skip, bias=bias, beta=beta,
             sum_out=sum_out)
    if not epsilon >= 0 or math.isinf(epsilon):
        raise DeviceError(f"device {op}: epsilon {epsilon:g} is negative or not finite")
    if bool(skip) != bool(skip_rows) or (skip and rows % skip_rows):
        raise DeviceError(f"device {op}: skip of {skip_rows} rows does not repeat over {rows} rows"
                          + ("" if skip else " (no skip address)"))
    if simplified and beta:
        raise DeviceError(f"device {op}: SimplifiedLayerNormalization (RMSNorm) takes no beta")
    if sum_out and sum_out in (x, y):
        raise DeviceError(f"device {op}: the sum output {sum_out:#x} must not be the input or the output buffer")
    values = dict(x=x, skip=skip, skip_rows=skip_rows, bias=bias, gamma=gamma, beta=beta, y=y, sum_out=sum_out,
                  rows=rows, n=n, epsilon=float(epsilon), simplified=int(bool(simplified)))
    return _launch("decoder_row_norm", (rows, 1, 1), (NORM_THREADS, 1, 1), values)


def plan_rotary(x: int, y: int, pos: int, cos_cache: int, sin_cache: int, *, batch: int, seq: int, heads: int,
                head_size: int, rotary_dim: int, max_pos: int, transposed: bool, interleaved: bool,
                pos_per_token: bool, cache_stride: int | None = None, status: int = 0) -> KernelLaunch:
    """The launch of RotaryEmbedding over fp32 ``x`` (``[B, S, heads * head_size]``, or
    ``[B, heads, S, head_size]`` when ``transposed``) into ``y`` (may be ``x``); int64
    position ids ``[B, S]`` (``pos_per_token``) or one start id; caches ``[max_pos,
    rotary_dim / 2]``, rows ``cache_stride`` floats apart (default ``rotary_dim / 2``).
    The geometry is the CPU op's (core/ops/rotary.py ``rotary_geometry`` derives it
    from the node's attributes). ``onnx_prep.fused::RotaryEmbedding(x, cos, sin)``
    (``rotary_from_tables``) is the same launch over its tables ``[cb, 1, S, D]`` read in
    place: transposed, ``rotary_dim = D``, ``cache_stride = D``, ``max_pos = cb * S``,
    start id 0 (cb 1) or position ids ``b * S + s`` (cb = B)."""
    op = "rotary"
    _counts(op, grid_yz=("batch", "seq"), batch=batch, seq=seq, heads=heads, head_size=head_size, max_pos=max_pos)
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_size:
        raise DeviceError(f"device {op}: rotary dim {rotary_dim} must be even, 2 .. head size {head_size}")
    cache_stride = rotary_dim // 2 if cache_stride is None else cache_stride
    if cache_stride < rotary_dim // 2:
        raise DeviceError(f"device {op}: cache rows {cache_stride} floats apart are narrower than rotary dim "
                          f"{rotary_dim} / 2")
    _aligned(op, x=_required(x), y=_required(y), cos_cache=_required(cos_cache), sin_cache=_required(sin_cache),
             status=status)
    _aligned(op, 8, position_ids=_required(pos))
    values = dict(x=x, y=y, pos=pos, pos_per_token=int(bool(pos_per_token)), cos_cache=cos_cache,
                  sin_cache=sin_cache, cache_stride=cache_stride, max_pos=max_pos, batch=batch, seq=seq, heads=heads, head_size=head_size,
                  rot_dim=rotary_dim, transposed=int(bool(transposed)), interleaved=int(bool(interleaved)),
                  status=status)
    return _launch("decoder_rotary", (heads, seq, batch), (ROTARY_THREADS, 1, 1), values)


def check_gqa_attributes(attrs: Mapping[str, Any]) -> None:
    """DeviceError naming what a GroupQueryAttention node asks that the device kernels do
    not implement, in the CPU kernel's words (core/kernels/gqa.py, ``_REFUSED_ATTRIBUTES``):
    what the CPU kernel refuses, and the sliding window, softcap and window-sized cache,
    which only the CPU kernel implements (``_CPU_IMPLEMENTS``)."""
    from onnx_prep.core.kernels.gqa import _REFUSED_ATTRIBUTES

    n, kv = int(attrs.get("num_heads", 0)), int(attrs.get("kv_num_heads", 0))
    if n < 1 or kv < 1:
        raise DeviceError(f"device gqa: num_heads {n} and kv_num_heads {kv} must both be set and positive")
    if n % kv:
        raise DeviceError(f"device gqa: num_heads {n} is not a multiple of kv_num_heads {kv}")
    for name, default, what in _REFUSED_ATTRIBUTES:
        if name in attrs and attrs[name] != default:
            raise DeviceError(f"device gqa: {name} = {attrs[name]}: {what}")


def plan_gqa(q: int, k: int, v: int, past_key: int, past_value: int, present_key: int, present_value: int,
             seqlens_k: int, out: int, *, batch: int, seq: int, num_heads: int, kv_num_heads: int, head_size: int,
             past_len: int, total_sequence_length: int, past_stride: int | None = None,
             present_stride: int | None = None, q_strides: tuple[int, int, int] | None = None,
             kv_strides: tuple[int, int, int] | None = None, ld_out: int | None = None, seqlens_dtype: str = "int64", cos_cache: int = 0, sin_cache: int = 0,
             cache_rows: int = 0, cache_width: int = 0, interleaved: bool = False, scale: float = 0.0,
             same_past: bool = False, status: int = 0) -> tuple[KernelLaunch, KernelLaunch]:
    """The two launches (append, then attend) of GroupQueryAttention over fp32 rows:
    query head h of row s of batch row b at ``q + 4 (b, s, h) . q_strides`` (element
    strides, default BSNH ``[B, S, N * H]``: ``(S N H, N H, H)``), kv head j at ``k`` /
    ``v + 4 (b, s, j) . kv_strides`` (default ``(S KN H, KN H, H)``; a packed QKV row:
    q at its start, k and v at their offsets, both strides ``(S D, D, H)``; BNSH
    tensors: ``(N S H, H, S H)``), past KV ``[B, KN, past_stride, H]`` with
    ``past_len`` rows (0, 0 for none), present ``[B, KN, present_stride, H]`` of
    ``max(total, past_len)`` rows (present == past: the shared buffer, only the new rows
    written), ``seqlens_k`` ``[B]`` int64 or int32, cos / sin ``[cache_rows,
    cache_width]`` for rotary inside, output rows of ``ld_out`` (default ``num_heads *
    head_size``). ``scale`` 0: ``1 / sqrt(head_size)``. Refused, as the CPU kernel
    refuses them: the shape rules of native/attention.py; and what the device kernels
    do not build: a head over GQA_MAX_HEAD. Any number of query rows: the append's grid
    has a z block per GQA_APPEND_ROWS rows, the attend's a y block per row (both at most
    GRID_YZ_MAX, the kernels looping over the rest).

    ``onnx_prep.fused::Attention`` (``attention_with_past``'s native path: no mask
    beyond the causal one) is the same launches: BNSH strides for q, k and v, its
    ``scale`` (inverted when ``divide``), ``seqlens_k = P + S - 1`` for every row,
    ``total_sequence_length = P + S`` and ``same_past`` (every batch row has the past
    P, so GroupQueryAttention's rule that a continued prompt has batch 1 does not
    apply)."""
    op = "gqa"
    B, S, N, KN, H = batch, seq, num_heads, kv_num_heads, head_size
    _counts(op, grid_yz=("batch",), batch=B, seq=S, num_heads=N, kv_num_heads=KN, head_size=H,
            total_sequence_length=total_sequence_length)
    if N % KN:
        raise DeviceError(f"device gqa: num_heads {N} is not a multiple of kv_num_heads {KN}")
    if H % 8:
        raise DeviceError(f"device gqa: head size {H} is not a multiple of 8 (the CPU kernel's rule)")
    if H > GQA_MAX_HEAD:
        raise DeviceError(f"device gqa: head size {H} is over {GQA_MAX_HEAD}, the most the device kernels hold")
    total = total_sequence_length
    first_prompt = S == total
    if not first_prompt and S != 1 and B != 1 and not same_past:
        raise DeviceError(f"device gqa: a continued prompt (sequence {S}, total {total}) needs batch 1")
    if bool(past_key) != bool(past_value):
        raise DeviceError("device gqa: past_key and past_value must be both present or both absent")
    if past_len < 0 or (past_len and not past_key):
        raise DeviceError(f"device gqa: past length {past_len} without past buffers")
    present_len = max(total, past_len)
    past_stride = past_len if past_stride is None else past_stride
    present_stride = present_len if present_stride is None else present_stride
    if past_stride < past_len or present_stride < present_len:
        raise DeviceError(f"device gqa: row strides past {past_stride} / present {present_stride} are below "
                          f"the past length {past_len} / present length {present_len}")
    for what, past, present in (("key", past_key, present_key), ("value", past_value, present_value)):
        if past and past == present and past_stride != present_stride:
            raise DeviceError(f"device gqa: past_{what} is present_{what}'s buffer: one row stride, got "
                              f"{past_stride} and {present_stride}")
    q_strides = (S * N * H, N * H, H) if q_strides is None else tuple(q_strides)
    kv_strides = (S * KN * H, KN * H, H) if kv_strides is None else tuple(kv_strides)
    ld_out = N * H if ld_out is None else ld_out
    for what, strides in (("q", q_strides), ("k / v", kv_strides)):
        if len(strides) != 3 or min(strides) < H:
            raise DeviceError(f"device gqa: the (batch, row, head) strides of {what} {strides} must each be at "
                              f"least the head size {H}")
    if ld_out < N * H:
        raise DeviceError(f"device gqa: output row stride {ld_out} is below {N * H}")
    if seqlens_dtype not in ("int64", "int32"):
        raise DeviceError(f"device gqa: seqlens_k is {seqlens_dtype}, expected int32 or int64")
    if bool(cos_cache) != bool(sin_cache):
        raise DeviceError("device gqa: cos_cache and sin_cache must be both present or both absent")
    rotary_dim = 2 * cache_width if cos_cache else 0
    if cos_cache and (cache_width < 1 or rotary_dim > H or cache_rows < total):
        raise DeviceError(f"device gqa: cos/sin caches [{cache_rows}, {cache_width}] are not "
                          f"[>= total_sequence_length {total}, <= head size {H} / 2]")
    _aligned(op, q=_required(q), k=_required(k), v=_required(v), present_key=_required(present_key),
             present_value=_required(present_value), out=_required(out), past_key=past_key, past_value=past_value,
             cos_cache=cos_cache, sin_cache=sin_cache, status=status)
    _aligned(op, 8 if seqlens_dtype == "int64" else 4, seqlens_k=_required(seqlens_k))
    values = dict(q=q, q_b=q_strides[0], q_s=q_strides[1], q_h=q_strides[2], k=k, v=v, kv_b=kv_strides[0],
                  kv_s=kv_strides[1], kv_h=kv_strides[2], past_key=past_key, past_value=past_value,
                  past_stride=past_stride, present_key=present_key, present_value=present_value,
                  present_stride=present_stride, seqlens=seqlens_k, seqlens_i32=int(seqlens_dtype == "int32"),
                  cos_cache=cos_cache, sin_cache=sin_cache, cache_rows=cache_rows, out=out, ld_out=ld_out,
                  batch=B, seq=S, num_heads=N, kv_num_heads=KN, head_size=H, past_len=past_len,
                  present_len=present_len, rotary_dim=rotary_dim, interleaved=int(bool(interleaved)),
                  first_prompt=int(first_prompt), scale=float(scale) if scale else 1.0 / math.sqrt(H),
                  status=status)
    tiles = min(-(-S // GQA_APPEND_ROWS), GRID_YZ_MAX)
    return (_launch("decoder_gqa_append", (KN, B, tiles), (GQA_THREADS, 1, 1), values),
            _launch("decoder_gqa_attend", (N, min(S, GRID_YZ_MAX), B), (GQA_THREADS, 1, 1), values))


def plan_int4_gather(header: Any, indices: int, n: int, packed: DeviceView, out: int, *, ld_out: int | None = None,
                     status: int = 0) -> KernelLaunch:
    """The launch of ``out[i] = dequant(row indices[i])`` for ``n`` int64 indices over
    ``packed`` (``header``: its PackedHeader): an int4_gather buffer (V = its rows), or
    an int4_matmul buffer (a tied embedding: row v is output column v). Output rows of
    ``ld_out`` floats (default K)."""
    op = "int4_gather"
    if header.kind not in KINDS:
        raise DeviceError(f"the device int4_gather reads int4_gather or int4_matmul packed buffers, "
                          f"got a {header.kind} buffer")
    if packed.nbytes != header.total_size:
        raise DeviceError(f"the device view holds {packed.nbytes:,} bytes, its packed header says "
                          f"{header.total_size:,}")
    K, V = header.K, header.N
    _counts(op, indices=n, K=K)
    ld_out = K if ld_out is None else ld_out
    if ld_out < K:
        raise DeviceError(f"device {op}: output row stride {ld_out} is below K={K}")
    _aligned(op, out=_required(out), packed=_required(packed.address), status=status)
    _aligned(op, 8, indices=_required(indices))
    values = dict(indices=indices, packed=packed.address, out=out, ld_out=ld_out, kind=KINDS[header.kind], V=V, K=K,
                  block_size=header.block_size, n_blocks=header.n_blocks, zp_kind=ZP_KINDS[header.zero_points],
                  stride=header.panel_stride, status=status)
    return _launch("decoder_int4_gather", (n, 1, 1), (GATHER_THREADS, 1, 1), values)


def status_problems(word: int) -> list[str]:
    """What a status word's bits say, one line each (none: [])."""
    unknown = word & ~sum(STATUS_BITS)
    return [text for bit, text in STATUS_BITS.items() if word & bit] + (
        [f"unknown status bits {unknown:#x}"] if unknown else [])


def check_status(word: int) -> None:
    """DeviceError naming every problem the kernels flagged in ``word`` (read back after
    the stream was synchronised); nothing when it is 0."""
    problems = status_problems(int(word))
    if problems:
        raise DeviceError("device decoder ops flagged: " + "; ".join(problems))


# compiled once per process and device (compiled_kernels.py)
_KERNELS = CompiledKernels(lambda: kernel_source(), SOURCE.name, ENTRIES)
_functions = _KERNELS.functions


class DeviceDecoderOps:
    """The decoder's fused ops on one device, their kernels compiled on first use. Each
    method takes the ``plan_*`` function's arguments after the stream, queues the
    launch(es) and returns the plan."""

    def __init__(self, driver: DeviceDriver, ordinal: int = 0) -> None:
        self.driver = driver
        self.ordinal = ordinal
        self._functions = _functions(driver, ordinal)

    def _queue(self, stream: Any, *launches: KernelLaunch) -> None:
        for plan in launches:
            self.driver.launch(self._functions[plan.name], plan.grid, plan.block, plan.shared_bytes, stream,
                               plan.args)

    def row_norm(self, stream: Any, *args: Any, **kwargs: Any) -> KernelLaunch:
        plan = plan_row_norm(*args, **kwargs)
        self._queue(stream, plan)
        return plan

    def rotary(self, stream: Any, *args: Any, **kwargs: Any) -> KernelLaunch:
        plan = plan_rotary(*args, **kwargs)
        self._queue(stream, plan)
        return plan

    def gqa(self, stream: Any, *args: Any, **kwargs: Any) -> tuple[KernelLaunch, KernelLaunch]:
        plans = plan_gqa(*args, **kwargs)
        self._queue(stream, *plans)
        return plans

    def int4_gather(self, stream: Any, indices: int, n: int, packed: DeviceView, out: int, *, header: Any = None,
                    host_packed: Any = None, **kwargs: Any) -> KernelLaunch:
        """``header`` (a PackedHeader) or ``host_packed`` (the host copy of the packed
        bytes, whose header is read and validated) says the table's shape."""
        if header is None:
            if host_packed is None:
                raise DeviceError("the device int4_gather needs the packed header: give header= or host_packed=")
            from onnx_prep.native import packed_header

            header = packed_header(host_packed)
        plan = plan_int4_gather(header, indices, n, packed, out, **kwargs)
        self._queue(stream, plan)
        return plan
