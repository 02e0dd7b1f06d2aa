"""Device launchers of the decoder's fused ops (issue #20): what runs a resolved
decoder's ``row_norm``, ``rotary``, ``gqa`` and ``int4_gather`` nodes on the device
through DeviceDecoderOps (device_decoder_ops.py), registered with the device graph
runner's registry (device_launchers.py) when this module is imported (device_graph.py
imports it), so a decoder's whole step runs on the device.

Beside device_launchers.py's three questions (``check``, ``outputs``, ``launches``), a
launcher here may answer three more, which the runner reads with defaults:

- ``staged(call)``: small host arrays the launch reads from device memory that are not
  values of the graph (the fused rotary's position ids, the fused Attention's
  ``seqlens_k``), computed on the host from shapes and host inputs; the runner copies
  them into the arena within the step (as it copies a host feed), so a captured step
  replays with this step's values; ``call.staged`` holds them as DeviceTensors;
- ``uses_status``: the launch reports what only the device sees (a position id outside
  the caches, an index outside the table, a row's seqlens_k that does not fit) in the
  runner's status word (``call.kernels.status``), which the runner zeroes at the start
  of the step and reads back after its synchronisation, raising one DeviceError line;
- ``unwritten``: output positions the device kernel does not write (the norms'
  mean / inv_std_var statistics); a node whose graph reads one is refused by name.

Inputs read on the host (``host_inputs``) are the ones the plans take as numbers:
GroupQueryAttention's ``total_sequence_length``, the fused Attention's mask start and
end. Everything else a plan takes as an address is a device input (a host feed such as
``seqlens_k`` or ``position_ids`` is copied in by the runner).

Not covered, refused by name: ``onnx_prep.fused::MaskedAttention`` (any additive mask;
no device kernel: it has no launcher), other dtypes than float32. A prompt of any
length runs on the device (the attention's launches tile its rows).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from onnx_prep.core.cuda import device_decoder_ops as dops
from onnx_prep.core.cuda.device_launchers import (Alias, DeviceTensor, LaunchCall, TensorSpec, _float32,
                                                  register_launcher)
from onnx_prep.core.errors import DeviceError

__all__ = ["Attention", "GroupQueryAttention", "Int4Gather", "RowNorm", "Rotary"]

_MS, _FUSED = "com.microsoft", "onnx_prep.fused"
_F32 = np.dtype(np.float32)


def _queue(call: LaunchCall, *plans: dops.KernelLaunch) -> list[tuple[Any, Any]]:
    functions = call.kernels.decoder_ops._functions
    return [(functions[p.name], p) for p in plans]


def _address(x: Any) -> int:
    return x.address if isinstance(x, DeviceTensor) else 0


def _input(call: LaunchCall, pos: int) -> Any:
    return call.inputs[pos] if pos < len(call.inputs) else None


def _scalar(value: Any, what: str) -> int:
    a = np.asarray(value).reshape(-1)
    if a.size != 1:
        raise DeviceError(f"{what} must hold one value, got shape {list(np.shape(value))}")
    return int(a[0])


def _vector(x: DeviceTensor, n: int, what: str) -> None:
    """``x`` holds exactly ``n`` elements (a gamma / beta / bias row of the norm)."""
    if x.size != n:
        raise DeviceError(f"{what} of shape {list(x.shape)} is not one row of {n} (its device kernel reads "
                          f"{n} floats; a broadcast one is not expanded)")


class RowNorm:
    """(Skip)SimplifiedLayerNormalization and (Skip)LayerNormalization: output 0, and the
    Skip forms' ``input_skip_bias_sum`` (output 3); never the statistics."""

    host_inputs = frozenset()
    uses_status = False

    def __init__(self, skip: bool, simplified: bool) -> None:
        self.skip, self.simplified = skip, simplified
        self.unwritten = frozenset({1, 2})  # mean / inv_std_var (Simplified: inv_std_var at 1)

    def check(self, node, in_dtypes):
        return _float32(node, in_dtypes, range(len(node.inputs)))

    def _rows(self, call):
        x = call.inputs[0]
        if self.skip:
            n = x.shape[-1] if x.shape else 1
        else:
            rank = len(x.shape)
            axis = int(call.action.attrs.get("axis", -1))
            axis = axis + rank if axis < 0 else axis
            n = math.prod(x.shape[axis:])
        return (x.size // n if n else 0), n

    def outputs(self, call):
        x = call.inputs[0]
        stat = tuple(x.shape[:-1]) + (1,)  # never written (``unwritten``), only placed
        specs = [TensorSpec(tuple(x.shape), _F32), TensorSpec(stat, _F32), TensorSpec(stat, _F32)]
        return (specs + [TensorSpec(tuple(x.shape), _F32)])[:len(call.action.outputs)]

    def launches(self, call):
        x, y = call.inputs[0], call.outputs[0]
        rows, n = self._rows(call)
        if rows == 0 or n == 0:
            return []
        eps = float(call.action.attrs.get("epsilon", 1e-12 if self.skip else 1e-5))
        if self.skip:
            skip, gamma = call.inputs[1], call.inputs[2]
            beta = None if self.simplified else _input(call, 3)
            bias = _input(call, 3) if self.simplified else _input(call, 4)
            if skip.size % n or rows % (skip.size // n):
                raise DeviceError(f"skip of shape {list(skip.shape)} does not repeat over {rows} rows of {n}")
            skip_rows = skip.size // n
        else:
            skip, skip_rows, gamma, bias = None, 0, call.inputs[1], None
            beta = None if self.simplified else _input(call, 2)
        for what, t in (("gamma", gamma), ("beta", beta), ("bias", bias)):
            if t is not None:
                _vector(t, n, what)
        total = call.outputs[3] if self.skip and len(call.outputs) > 3 else None
        plan = dops.plan_row_norm(x.address, gamma.address, y.address, rows, n, epsilon=eps,
                                  simplified=self.simplified, skip=_address(skip), skip_rows=skip_rows,
                                  bias=_address(bias), beta=_address(beta), sum_out=_address(total))
        return _queue(call, plan)


class Rotary:
    """com.microsoft RotaryEmbedding(x, position_ids, cos_cache, sin_cache) and
    ``onnx_prep.fused::RotaryEmbedding(x, cos, sin)`` (its ``[cb, 1, S, D]`` tables read in
    place, the position ids staged: start id 0 for one table, ``b * S + s`` for one per
    batch row)."""

    host_inputs = frozenset()
    uses_status = True
    unwritten = frozenset()

    def check(self, node, in_dtypes):
        if node.domain == _FUSED:
            return _float32(node, in_dtypes, (0, 1, 2))
        return _float32(node, in_dtypes, (0, 2, 3)) or (
            None if len(in_dtypes) < 2 or in_dtypes[1] in (None, np.int64) else
            f"its device kernel reads int64 position ids, input 1 ({node.inputs[1]}) is {in_dtypes[1]}")

    def outputs(self, call):
        return [TensorSpec(tuple(call.inputs[0].shape), _F32)]

    def _fused_geometry(self, call):
        x, cos, sin = call.inputs[:3]
        if len(x.shape) != 4 or len(cos.shape) != 4:
            raise DeviceError(f"the fused rotary on the device takes x [B, heads, S, D] and tables [cb, 1, S, D], "
                              f"got {list(x.shape)} and {list(cos.shape)}")
        B, heads, S, D = x.shape
        cb = cos.shape[0]
        half = int(call.action.attrs.get("half", 0))
        half = half if half > 0 else (D + 1) // 2 if half < 0 else D // 2
        if not (cos.shape == sin.shape == (cb, 1, S, D) and D == 2 * half and cb in (1, B) and S):
            raise DeviceError(f"the fused rotary on the device needs tables [1 or {B}, 1, {S}, {D}] of equal halves "
                              f"(half {half}), got cos {list(cos.shape)} and sin {list(sin.shape)}")
        return B, heads, S, D, cb

    def staged(self, call):
        if call.node.domain != _FUSED:
            return []
        B, _, S, _, cb = self._fused_geometry(call)
        return [np.zeros(1, np.int64) if cb == 1 else np.arange(B * S, dtype=np.int64).reshape(B, S)]

    def launches(self, call):
        x, y, status = call.inputs[0], call.outputs[0], call.kernels.status
        if x.size == 0:
            return []
        if call.node.domain == _FUSED:
            B, heads, S, D, cb = self._fused_geometry(call)
            plan = dops.plan_rotary(x.address, y.address, call.staged[0].address, call.inputs[1].address,
                                    call.inputs[2].address, batch=B, seq=S, heads=heads, head_size=D, rotary_dim=D,
                                    max_pos=cb * S, transposed=True, interleaved=False, pos_per_token=cb != 1,
                                    cache_stride=D, status=status)
            return _queue(call, plan)
        from onnx_prep.core.ops.rotary import rotary_geometry

        pos, cos, sin = call.inputs[1:4]
        a = call.action.attrs
        try:
            heads, H, rot, transposed = rotary_geometry(tuple(x.shape), cos.shape[-1], int(a.get("num_heads", 0)),
                                                        int(a.get("rotary_embedding_dim", 0)))
        except ValueError as e:
            raise DeviceError(str(e)) from None
        B = x.shape[0]
        S = x.shape[2] if transposed else x.shape[1]
        if pos.size not in (1, B * S):
            raise DeviceError(f"position ids of shape {list(pos.shape)} are neither one start id nor [{B}, {S}]")
        plan = dops.plan_rotary(x.address, y.address, pos.address, cos.address, sin.address, batch=B, seq=S,
                                heads=heads, head_size=H, rotary_dim=rot, max_pos=cos.shape[0],
                                transposed=transposed, interleaved=int(a.get("interleaved", 0)) == 1,
                                pos_per_token=pos.size != 1, status=status)
        return _queue(call, plan)


def _gqa_head(call) -> tuple[int, int, int, int, int, bool]:
    a = call.action.attrs
    q = call.inputs[0]
    N, KN = int(a["num_heads"]), int(a["kv_num_heads"])
    packed = _input(call, 1) is None
    if len(q.shape) != 3:
        raise DeviceError(f"GroupQueryAttention query of shape {list(q.shape)}, expected [batch, sequence, hidden]")
    B, S, D = q.shape
    heads = N + 2 * KN if packed else N
    if D % heads:
        raise DeviceError(f"GroupQueryAttention query width {D} is not {heads} heads")
    return B, S, N, KN, D // heads, packed


class GroupQueryAttention:
    """com.microsoft GroupQueryAttention (separate or packed QKV, past and present apart,
    rotary inside): the device's append then attend launches; ``seqlens_k`` is a device
    input (a host feed copied in), ``total_sequence_length`` is read on the host."""

    host_inputs = frozenset({6})
    uses_status = True
    unwritten = frozenset({3})

    def check(self, node, in_dtypes):
        try:
            dops.check_gqa_attributes(node.attributes)
        except DeviceError as e:
            return str(e)
        seqlens = in_dtypes[5] if len(in_dtypes) > 5 else None
        if seqlens is not None and seqlens not in (np.int32, np.int64):
            return f"its device kernel reads int32 or int64 seqlens_k, input 5 ({node.inputs[5]}) is {seqlens}"
        return _float32(node, in_dtypes, [p for p in (0, 1, 2, 3, 4, 7, 8) if p < len(node.inputs)])

    def _lengths(self, call):
        past = _input(call, 3)
        P = past.shape[2] if past is not None else 0
        total = _scalar(call.inputs[6], "GroupQueryAttention total_sequence_length")
        return P, total, max(total, P)

    def outputs(self, call):
        B, S, N, KN, H, _ = _gqa_head(call)
        P, _, L = self._lengths(call)
        if P and L == P:  # the past holds the total: the present is its buffer (a KV cache at a fixed capacity)
            kv = [Alias(3, (B, KN, L, H)), Alias(4, (B, KN, L, H))]
        else:
            kv = [TensorSpec((B, KN, L, H), _F32), TensorSpec((B, KN, L, H), _F32)]
        return [TensorSpec((B, S, N * H), _F32), *kv][:len(call.action.outputs)]

    def launches(self, call):
        a = call.action.attrs
        B, S, N, KN, H, packed = _gqa_head(call)
        P, total, L = self._lengths(call)
        q, seqlens = call.inputs[0], call.inputs[5]
        if packed:
            D = q.shape[2]
            k, v, q_strides = q.address + 4 * N * H, q.address + 4 * (N + KN) * H, (S * D, D, H)
            kv_strides = q_strides
        else:
            k, v, q_strides, kv_strides = call.inputs[1].address, call.inputs[2].address, None, None
        if seqlens.size != B:
            raise DeviceError(f"GroupQueryAttention seqlens_k of shape {list(seqlens.shape)}, expected [{B}]")
        rotary = {}
        if int(a.get("do_rotary", 0)) == 1:
            cos, sin = call.inputs[7], call.inputs[8]
            rotary = dict(cos_cache=cos.address, sin_cache=sin.address, cache_rows=cos.shape[0],
                          cache_width=cos.shape[1])
        past_k, past_v = (_input(call, 3), _input(call, 4)) if P else (None, None)
        out = call.outputs
        present_k = out[1].address if len(out) > 1 else None
        present_v = out[2].address if len(out) > 2 else None
        if present_k is None or present_v is None:
            raise DeviceError("GroupQueryAttention on the device writes present_key and present_value: "
                              "the node must name both")
        plans = dops.plan_gqa(q.address, k, v, _address(past_k), _address(past_v), present_k, present_v,
                              seqlens.address, out[0].address, batch=B, seq=S, num_heads=N, kv_num_heads=KN,
                              head_size=H, past_len=P, total_sequence_length=total, past_stride=P, present_stride=L,
                              q_strides=q_strides, kv_strides=kv_strides, seqlens_dtype=seqlens.dtype.name,
                              interleaved=int(a.get("rotary_interleaved", 0)) == 1,
                              scale=float(a.get("scale", 0.0)), status=call.kernels.status, **rotary)
        return _queue(call, *plans)


class Attention:
    """``onnx_prep.fused::Attention(q, k, v, past_key, past_value, start, end)`` (BNSH,
    causal over the KV cache): the GQA launches over BNSH strides with ``seqlens_k = P +
    S - 1`` per row (staged), its scale; the mask start and end read on the host and
    required to be P and P + S (what the CPU kernel's fast path requires)."""

    host_inputs = frozenset({5, 6})
    uses_status = True
    unwritten = frozenset()

    def check(self, node, in_dtypes):
        axis = int(node.attributes.get("axis", 2))
        if axis not in (2, -2):
            return f"its device kernel concatenates the cache along axis 2, not {axis}"
        return _float32(node, in_dtypes, (0, 1, 2, 3, 4))

    def _geometry(self, call):
        q, k, v, pk, pv = call.inputs[:5]
        if len(q.shape) != 4 or len(k.shape) != 4:
            raise DeviceError(f"the fused Attention on the device takes BNSH tensors, got q {list(q.shape)}")
        B, N, S, H = q.shape
        KN, P = k.shape[1], pk.shape[2]
        if k.shape != v.shape or k.shape != (B, KN, S, H) or pk.shape != pv.shape or pk.shape != (B, KN, P, H):
            raise DeviceError(f"the fused Attention on the device: q {list(q.shape)}, k {list(k.shape)}, "
                              f"v {list(v.shape)}, past {list(pk.shape)} / {list(pv.shape)} are not one BNSH "
                              "geometry")
        if KN not in (N, 1):  # what the op means (core/ops/attention.py): the heads broadcast, or one
            raise DeviceError(f"the fused Attention's keys have {KN} heads for {N} query heads: the op "
                              "broadcasts one key head or matches each query head, as the MatMuls it replaced")
        start = _scalar(call.inputs[5], "the fused Attention's mask start")
        end = _scalar(call.inputs[6], "the fused Attention's mask end")
        if (start, end) != (P, P + S):
            raise DeviceError(f"the fused Attention on the device is causal over the cache: mask start {start} and "
                              f"end {end} must be the past {P} and {P + S}")
        return B, N, S, H, KN, P

    def outputs(self, call):
        B, N, S, H, KN, P = self._geometry(call)
        return [TensorSpec((B, S, N, H), _F32), TensorSpec((B, KN, P + S, H), _F32),
                TensorSpec((B, KN, P + S, H), _F32)][:len(call.action.outputs)]

    def staged(self, call):
        B, _, S, _, _, P = self._geometry(call)
        return [np.full(B, P + S - 1, np.int64)]

    def launches(self, call):
        B, N, S, H, KN, P = self._geometry(call)
        q, k, v, pk, pv = call.inputs[:5]
        scale = float(call.action.attrs["scale"])
        if int(call.action.attrs.get("divide", 0)) == 1:
            scale = 1.0 / scale
        out = call.outputs
        if len(out) < 3:
            raise DeviceError("the fused Attention on the device writes the present key and value: the node must "
                              "name both")
        plans = dops.plan_gqa(q.address, k.address, v.address, pk.address if P else 0, pv.address if P else 0,
                              out[1].address, out[2].address, call.staged[0].address, out[0].address, batch=B, seq=S,
                              num_heads=N, kv_num_heads=KN, head_size=H, past_len=P, total_sequence_length=P + S,
                              past_stride=P, present_stride=P + S, q_strides=(N * S * H, H, S * H),
                              kv_strides=(KN * S * H, H, S * H), scale=scale, same_past=True,
                              status=call.kernels.status)
        return _queue(call, *plans)


class Int4Gather:
    """com.microsoft GatherBlockQuantized on its packed object (the gather's own records,
    or the LM head's matmul object for a tied embedding): int64 indices on the device,
    rows of K floats, shaped as the CPU op shapes them (the data's trailing dims)."""

    host_inputs = frozenset()
    uses_status = True
    unwritten = frozenset()

    def check(self, node, in_dtypes):
        idx = in_dtypes[1] if len(in_dtypes) > 1 else None
        if idx is not None and idx != np.int64:
            return f"its device kernel reads int64 indices, input 1 ({node.inputs[1]}) is {idx}"
        return None

    def _object(self, call):
        (_, key), = call.action.prepared
        return call.kernels.prepared[key]

    def outputs(self, call):
        from onnx_prep.core.ops.attributes import ROW_SHAPE

        idx, header = call.inputs[1], self._object(call).header
        row = tuple(call.action.attrs.get(ROW_SHAPE) or (header.K,))
        if math.prod(row) != header.K:
            raise DeviceError(f"GatherBlockQuantized rows of shape {list(row)} are not the packed table's K="
                              f"{header.K}")
        return [TensorSpec(tuple(idx.shape) + row, _F32)]

    def launches(self, call):
        idx, obj = call.inputs[1], self._object(call)
        if idx.size == 0:
            return []
        plan = dops.plan_int4_gather(obj.header, idx.address, idx.size, obj.view, call.outputs[0].address,
                                     status=call.kernels.status)
        return _queue(call, plan)


for _op, _skip, _simplified in (("LayerNormalization", False, False), ("SimplifiedLayerNormalization", False, True),
                                ("SkipLayerNormalization", True, False),
                                ("SkipSimplifiedLayerNormalization", True, True)):
    register_launcher(_op, "row_norm", RowNorm(_skip, _simplified))
register_launcher("RotaryEmbedding", "rotary", Rotary())
register_launcher("GroupQueryAttention", "gqa", GroupQueryAttention())
register_launcher("Attention", "gqa", Attention())
register_launcher("GatherBlockQuantized", "int4_gather", Int4Gather())
