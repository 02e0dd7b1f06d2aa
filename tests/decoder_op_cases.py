"""What the device decoder-op tests share, on the fake driver and on a real device alike:
random inputs of each op (row_norm, rotary, gqa, int4_gather), the CPU op's outputs
for them (core/ops and the native kernels the runtime calls), and the same op run on
a device through DeviceDecoderOps (inputs copied into plain device buffers, the
launch, the outputs copied back after the stream is synchronised)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from onnx_prep import native
from onnx_prep.core.cuda.device_decoder_ops import DeviceDecoderOps
from onnx_prep.core.cuda.device_slot_pool import DeviceView
from onnx_prep.core.ops import norm
from onnx_prep.core.ops.attention import attention_with_past
from onnx_prep.core.ops.attributes import N_OUTPUTS
from onnx_prep.core.ops.rotary import rotary_embedding, rotary_from_tables, rotary_geometry
from onnx_prep.native.attention import group_query_attention


class Buffers:
    """Plain device buffers (cuMemAlloc) filled from numpy arrays, read back, freed."""

    def __init__(self, driver) -> None:
        self.d, self.addresses = driver, []

    def put(self, a: np.ndarray) -> int:
        a = np.ascontiguousarray(a)
        address = self.d.mem_alloc(max(a.nbytes, 16))
        self.addresses.append(address)
        if a.nbytes:
            self.d.copy_to_device(address, a.view(np.uint8).reshape(-1))
        return address

    def get(self, address: int, shape: tuple, dtype=np.float32) -> np.ndarray:
        count = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return np.frombuffer(self.d.copy_to_host(address, count), dtype).reshape(shape).copy()

    def close(self) -> None:
        for address in self.addresses:
            self.d.mem_free(address)
        self.addresses.clear()


def _f32(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


# -- row_norm ---------------------------------------------------------------------------
@dataclass
class NormCase:
    x: np.ndarray  # [rows, n]
    gamma: np.ndarray
    simplified: bool
    epsilon: float
    skip: np.ndarray | None = None  # [rows, n] (the Skip forms)
    beta: np.ndarray | None = None
    bias: np.ndarray | None = None

    def cpu(self) -> dict[str, np.ndarray]:
        """The CPU op's output (and the Skip forms' input_skip_bias_sum)."""
        attrs = {"epsilon": self.epsilon}
        if self.skip is None:
            inputs = [self.x, self.gamma] + ([] if self.simplified or self.beta is None else [self.beta])
            op = norm.simplified_layer_normalization if self.simplified else norm.layer_normalization
            return {"y": op(inputs, {**attrs, N_OUTPUTS: 1}, None)[0]}
        if self.simplified:
            inputs = [self.x, self.skip, self.gamma] + ([] if self.bias is None else [self.bias])
            outs = norm.skip_simplified_layer_normalization(inputs, {**attrs, N_OUTPUTS: 4}, None)
        else:
            inputs = [self.x, self.skip, self.gamma, self.beta, self.bias]
            outs = norm.skip_layer_normalization(inputs, {**attrs, N_OUTPUTS: 4}, None)
        return {"y": outs[0], "sum": outs[3]}

    def device(self, ops: DeviceDecoderOps, bufs: Buffers, stream) -> dict[str, np.ndarray]:
        rows, n = self.x.shape
        put = lambda a: 0 if a is None else bufs.put(a)  # noqa: E731
        y, total = bufs.put(np.zeros_like(self.x)), bufs.put(np.zeros_like(self.x))
        ops.row_norm(stream, put(self.x), put(self.gamma), y, rows, n, epsilon=self.epsilon,
                     simplified=self.simplified, skip=put(self.skip), skip_rows=0 if self.skip is None else rows,
                     bias=put(self.bias), beta=put(self.beta), sum_out=total if self.skip is not None else 0)
        ops.driver.stream_synchronize(stream)
        got = {"y": bufs.get(y, self.x.shape)}
        if self.skip is not None:
            got["sum"] = bufs.get(total, self.x.shape)
        return got


def norm_case(seed: int, rows: int, n: int, *, simplified: bool, skip: bool, beta: bool = False,
              bias: bool = False) -> NormCase:
    rng = np.random.default_rng(seed)
    x = (_f32(rng, rows, n) * 3 + rng.uniform(-2, 2)).astype(np.float32)
    return NormCase(x, _f32(rng, n), simplified, float(rng.choice([1e-5, 1e-6, 0.1])),
                    skip=_f32(rng, rows, n) if skip else None,
                    beta=_f32(rng, n) if beta and not simplified else None,
                    bias=_f32(rng, n) if bias and skip else None)


# -- rotary -----------------------------------------------------------------------------
@dataclass
class RotaryCase:
    x: np.ndarray
    pos: np.ndarray  # int64 [B, S] or [1]
    cos: np.ndarray
    sin: np.ndarray
    attrs: dict

    def geometry(self) -> tuple[int, int, int, bool]:
        return rotary_geometry(self.x.shape, self.cos.shape[1], int(self.attrs.get("num_heads", 0)),
                               int(self.attrs.get("rotary_embedding_dim", 0)))

    def cpu(self) -> dict[str, np.ndarray]:
        return {"y": rotary_embedding([self.x, self.pos, self.cos, self.sin], self.attrs, None)[0]}

    def device(self, ops: DeviceDecoderOps, bufs: Buffers, stream, *, in_place: bool = False,
               status: int = 0) -> dict[str, np.ndarray]:
        heads, H, rot, transposed = self.geometry()
        B = self.x.shape[0]
        S = self.x.shape[2] if transposed else self.x.shape[1]
        x = bufs.put(self.x)
        y = x if in_place else bufs.put(np.zeros_like(self.x))
        ops.rotary(stream, x, y, bufs.put(self.pos), bufs.put(self.cos), bufs.put(self.sin), batch=B, seq=S,
                   heads=heads, head_size=H, rotary_dim=rot, max_pos=self.cos.shape[0], transposed=transposed,
                   interleaved=bool(self.attrs.get("interleaved", 0)), pos_per_token=self.pos.size != 1,
                   status=status)
        ops.driver.stream_synchronize(stream)
        return {"y": bufs.get(y, self.x.shape)}


def rotary_case(seed: int, B: int, S: int, heads: int, H: int, rot: int, *, transposed: bool, interleaved: bool,
                per_token: bool, max_pos: int = 64) -> RotaryCase:
    rng = np.random.default_rng(seed)
    x = _f32(rng, B, heads, S, H) if transposed else _f32(rng, B, S, heads * H)
    pos = rng.integers(0, max_pos, (B, S)) if per_token else np.array([rng.integers(0, max_pos - S + 1)])
    angles = rng.uniform(-np.pi, np.pi, (max_pos, rot // 2))
    attrs = {"interleaved": int(interleaved), "num_heads": heads}
    if rot != H:
        attrs["rotary_embedding_dim"] = rot
    return RotaryCase(x, pos.astype(np.int64), np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32),
                      attrs)


@dataclass
class TablesRotaryCase:
    """onnx_prep.fused::RotaryEmbedding(x, cos, sin): x ``[B, heads, S, D]``, tables
    ``[cb, 1, S, D]`` with equal halves, read in place as caches of rows D apart."""

    x: np.ndarray
    cos: np.ndarray
    sin: np.ndarray

    def cpu(self) -> dict[str, np.ndarray]:
        return {"y": rotary_from_tables([self.x, self.cos, self.sin], {}, None)[0]}

    def device(self, ops: DeviceDecoderOps, bufs: Buffers, stream) -> dict[str, np.ndarray]:
        B, heads, S, D = self.x.shape
        cb = self.cos.shape[0]
        pos = np.zeros(1, np.int64) if cb == 1 else np.arange(B * S, dtype=np.int64).reshape(B, S)
        x, y = bufs.put(self.x), bufs.put(np.zeros_like(self.x))
        ops.rotary(stream, x, y, bufs.put(pos), bufs.put(self.cos), bufs.put(self.sin), batch=B, seq=S, heads=heads,
                   head_size=D, rotary_dim=D, max_pos=cb * S, transposed=True, interleaved=False,
                   pos_per_token=cb != 1, cache_stride=D)
        ops.driver.stream_synchronize(stream)
        return {"y": bufs.get(y, self.x.shape)}


def tables_rotary_case(seed: int, B: int, heads: int, S: int, D: int, *, per_row: bool) -> TablesRotaryCase:
    rng = np.random.default_rng(seed)
    cb = B if per_row else 1
    angles = rng.uniform(-np.pi, np.pi, (cb, 1, S, D // 2))
    cos, sin = (np.concatenate([f(angles)] * 2, axis=-1).astype(np.float32) for f in (np.cos, np.sin))
    return TablesRotaryCase(_f32(rng, B, heads, S, D), cos, sin)


# -- gqa --------------------------------------------------------------------------------
@dataclass
class GqaCase:
    q: np.ndarray  # [B, S, N * H], or packed QKV [B, S, (N + 2 KN) * H] (k and v None)
    k: np.ndarray | None
    v: np.ndarray | None
    past: tuple[np.ndarray, np.ndarray] | None  # [B, KN, P, H] each, apart from present (None: shared)
    present: tuple[np.ndarray, np.ndarray]  # [B, KN, capacity, H], the past's rows in it when shared
    past_len: int
    seqlens: np.ndarray  # int32 or int64 [B]
    total: int
    num_heads: int
    kv_num_heads: int
    cos: np.ndarray | None = None
    sin: np.ndarray | None = None
    interleaved: bool = False
    scale: float = 0.0

    @property
    def shape(self) -> tuple[int, int, int]:
        B, S, D = self.q.shape
        heads = self.num_heads + (0 if self.k is not None else 2 * self.kv_num_heads)
        return B, S, D // heads

    def present_len(self) -> int:
        return max(self.total, self.past_len)

    def _pasts(self, present):
        if self.past is not None:
            return self.past
        return tuple(p[:, :, :self.past_len] for p in present) if self.past_len else (None, None)

    def cpu(self) -> dict[str, np.ndarray]:
        present = tuple(p.copy() for p in self.present)
        L = self.present_len()
        pk, pv = self._pasts(present)
        out, _, _ = group_query_attention(
            self.q, self.k, self.v, pk, pv, self.seqlens, self.total, self.cos, self.sin,
            num_heads=self.num_heads, kv_num_heads=self.kv_num_heads, scale=self.scale,
            interleaved=self.interleaved, present=(present[0][:, :, :L], present[1][:, :, :L]))
        return {"out": out, "present_key": present[0], "present_value": present[1]}

    def device(self, ops: DeviceDecoderOps, bufs: Buffers, stream, *, status: int = 0) -> dict[str, np.ndarray]:
        B, S, H = self.shape
        N, KN = self.num_heads, self.kv_num_heads
        q = bufs.put(self.q)
        if self.k is None:  # packed QKV: k and v are offsets into q's rows
            D = self.q.shape[2]
            k, v, q_strides = q + 4 * N * H, q + 4 * (N + KN) * H, (S * D, D, H)
            kv_strides = q_strides
        else:
            k, v, q_strides, kv_strides = bufs.put(self.k), bufs.put(self.v), None, None
        present = [bufs.put(p) for p in self.present]
        capacity = self.present[0].shape[2]
        if self.past is not None:
            past, past_stride = [bufs.put(p) for p in self.past], self.past[0].shape[2]
        elif self.past_len:
            past, past_stride = present, capacity
        else:
            past, past_stride = [0, 0], 0
        out = bufs.put(np.zeros((B, S, N * H), np.float32))
        rotary = {} if self.cos is None else dict(cos_cache=bufs.put(self.cos), sin_cache=bufs.put(self.sin),
                                                 cache_rows=self.cos.shape[0], cache_width=self.cos.shape[1])
        ops.gqa(stream, q, k, v, past[0], past[1], present[0], present[1], bufs.put(self.seqlens), out,
                batch=B, seq=S, num_heads=N, kv_num_heads=KN, head_size=H, past_len=self.past_len,
                total_sequence_length=self.total, past_stride=past_stride, present_stride=capacity,
                q_strides=q_strides, kv_strides=kv_strides, seqlens_dtype=str(self.seqlens.dtype), interleaved=self.interleaved, scale=self.scale,
                status=status, **rotary)
        ops.driver.stream_synchronize(stream)
        return {"out": bufs.get(out, (B, S, N * H)), "present_key": bufs.get(present[0], self.present[0].shape),
                "present_value": bufs.get(present[1], self.present[1].shape)}


def gqa_case(seed: int, B: int, S: int, N: int, KN: int, H: int, P: int, *, shared: bool, packed: bool = False,
             rotary: bool = False, interleaved: bool = False, seqlens_i32: bool = False, first_prompt: bool = False,
             room: int = 3, scale: float = 0.0) -> GqaCase:
    """A decode step (or, ``first_prompt``, a first prompt of S rows): row b has a past of
    up to P rows (row 0 the full P; others shorter where S == 1), present buffers of
    room rows past what the step needs, the past's rows in them when ``shared``."""
    rng = np.random.default_rng(seed)
    if first_prompt:
        P, pasts = 0, np.zeros(B, np.int64)
        seqlens = rng.integers(1, S + 1, B) - 1  # rows of different lengths
        seqlens[0] = S - 1
        total = S
    else:
        pasts = np.array([P] + [int(rng.integers(0, P + 1)) if S == 1 else P for _ in range(B - 1)])
        seqlens = pasts + S - 1
        total = int(seqlens.max()) + 1
    L = max(total, P)
    capacity = L + room
    heads = N + 2 * KN if packed else N
    q = _f32(rng, B, S, heads * H)
    k = None if packed else _f32(rng, B, S, KN * H)
    v = None if packed else _f32(rng, B, S, KN * H)
    present = [np.full((B, KN, capacity, H), 7.0, np.float32) for _ in range(2)]  # 7: "not written"
    past = None
    if P:
        rows = [_f32(rng, B, KN, P, H) for _ in range(2)]
        if shared:
            for p, r in zip(present, rows):
                p[:, :, :P] = r
        else:
            past = tuple(rows)
    cos = sin = None
    if rotary:
        angles = rng.uniform(-np.pi, np.pi, (L + 2, H // 4))  # rotary dim H / 2
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    return GqaCase(q, k, v, past, tuple(present), P, seqlens.astype(np.int32 if seqlens_i32 else np.int64), total,
                   N, KN, cos, sin, interleaved, scale)


GQA_CASES = [  # B, S, N, KN, H, P, gqa_case's options: what the fake and the GPU tests run
    (1, 1, 4, 2, 64, 9, dict(shared=True)),
    (3, 1, 8, 2, 32, 17, dict(shared=True, seqlens_i32=True)),  # rows of different pasts
    (2, 1, 4, 4, 16, 5, dict(shared=False)),
    (1, 4, 6, 2, 32, 11, dict(shared=True, packed=True)),
    (1, 8, 4, 1, 64, 30, dict(shared=False, rotary=True)),
    (2, 1, 4, 2, 32, 6, dict(shared=True, packed=True, rotary=True, interleaved=True, scale=0.3)),
    (2, 5, 2, 1, 8, 0, dict(shared=True, first_prompt=True)),
    (1, 1, 2, 2, 256, 0, dict(shared=True)),  # no past at all
    (1, 1, 8, 4, 24, 2000, dict(shared=True, rotary=True)),  # past over one chunk of staged keys
    # prompts of more rows than a decode step's 8 (two append tiles and more; each row causal)
    (1, 9, 4, 2, 32, 0, dict(shared=True, first_prompt=True)),
    (1, 33, 4, 2, 64, 12, dict(shared=True, rotary=True)),  # a continued prompt over a past
    (2, 300, 1, 1, 16, 0, dict(shared=True, packed=True, first_prompt=True)),  # rows of different lengths
]


@dataclass
class FusedAttentionCase:
    """onnx_prep.fused::Attention(q, k, v, past_key, past_value, P, P + S): BNSH q ``[B, N,
    S, H]``, k / v ``[B, KN, S, H]``, past ``[B, KN, P, H]``; present = Concat(past, new),
    written on the device into buffers with room after the rows."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    past: tuple[np.ndarray, np.ndarray]
    scale: float

    def cpu(self) -> dict[str, np.ndarray]:
        P, S = self.past[0].shape[2], self.q.shape[2]
        out, pk, pv = attention_with_past([self.q, self.k, self.v, *self.past, np.array(P), np.array(P + S)],
                                          {"scale": self.scale, "mask_fill": -3.4e38}, None)
        return {"out": out, "present_key": pk, "present_value": pv}

    def device(self, ops: DeviceDecoderOps, bufs: Buffers, stream) -> dict[str, np.ndarray]:
        B, N, S, H = self.q.shape
        KN, P = self.k.shape[1], self.past[0].shape[2]
        present = [bufs.put(np.zeros((B, KN, P + S + 2, H), np.float32)) for _ in range(2)]
        out = bufs.put(np.zeros((B, S, N, H), np.float32))
        ops.gqa(stream, bufs.put(self.q), bufs.put(self.k), bufs.put(self.v), bufs.put(self.past[0]),
                bufs.put(self.past[1]), present[0], present[1], bufs.put(np.full(B, P + S - 1, np.int64)), out,
                batch=B, seq=S, num_heads=N, kv_num_heads=KN, head_size=H, past_len=P, total_sequence_length=P + S,
                present_stride=P + S + 2, q_strides=(N * S * H, H, S * H), kv_strides=(KN * S * H, H, S * H),
                scale=self.scale, same_past=True)
        ops.driver.stream_synchronize(stream)
        return {"out": bufs.get(out, (B, S, N, H)),
                **{name: bufs.get(p, (B, KN, P + S + 2, H))[:, :, :P + S]
                   for name, p in zip(("present_key", "present_value"), present)}}


# B, N, KN, S, H, P of the fused Attention over prompts longer than a decode step: what
# the fake, emulated and GPU tests add to their own decode cases.
FUSED_PROMPT_CASES = [(1, 4, 4, 9, 32, 0), (1, 4, 1, 33, 32, 7), (1, 2, 1, 300, 16, 0)]


def fused_attention_case(seed: int, B: int, N: int, KN: int, S: int, H: int, P: int) -> FusedAttentionCase:
    rng = np.random.default_rng(seed)
    return FusedAttentionCase(_f32(rng, B, N, S, H), _f32(rng, B, KN, S, H), _f32(rng, B, KN, S, H),
                              (_f32(rng, B, KN, P, H), _f32(rng, B, KN, P, H)), float(rng.uniform(0.05, 0.3)))


# -- int4_gather ------------------------------------------------------------------------
@dataclass
class GatherCase:
    packed: np.ndarray
    indices: np.ndarray  # int64 [n]
    K: int
    extra: dict = field(default_factory=dict)

    def cpu(self) -> dict[str, np.ndarray]:
        return {"rows": native.gather_block_quantized(self.indices, self.packed)}

    def device(self, ops: DeviceDecoderOps, bufs: Buffers, stream, *, ld_out: int | None = None,
               status: int = 0) -> dict[str, np.ndarray]:
        n, ld = self.indices.size, ld_out or self.K
        table = DeviceView(bufs.put(self.packed), self.packed.nbytes)
        out = bufs.put(np.zeros((n, ld), np.float32))
        ops.int4_gather(stream, bufs.put(self.indices), n, table, out, host_packed=self.packed, ld_out=ld_out,
                        status=status)
        ops.driver.stream_synchronize(stream)
        return {"rows": bufs.get(out, (n, ld))[:, :self.K]}


def gather_case(seed: int, V: int, K: int, bs: int, zp: str, n: int, *, tied: bool) -> GatherCase:
    """A gather table of V rows of K codes (``tied``: the LM head's matmul object, row v
    its output column v)."""
    rng = np.random.default_rng(seed)
    nb = -(-K // bs)
    if tied:
        from test_native_reference import random_matmul_nbits

        B, s, z = random_matmul_nbits(rng, K=K, N=V, block_size=bs, zp=zp)
        packed = native.prepack_matmul_nbits(B, s, z, K=K, N=V, block_size=bs)
    else:
        data = rng.integers(0, 256, (V, nb, bs // 2), dtype=np.uint8)
        scales = rng.uniform(0.01, 0.1, (V, nb, 1)).astype(np.float32)
        zeros = {"none": None, "u4": rng.integers(0, 16, (V, nb, 1), dtype=np.uint8),
                 "float": rng.uniform(0, 15, (V, nb, 1)).astype(np.float32)}[zp]
        packed = native.prepack_gather_block_quantized(data, scales, zeros, block_size=bs)
        K = nb * bs
    indices = rng.integers(-V, V, n).astype(np.int64)
    return GatherCase(packed, indices, K)
