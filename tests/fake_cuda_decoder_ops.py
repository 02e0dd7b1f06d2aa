"""The fake driver's twins of core/cuda/decoder_ops.cu's entries (registered in
fake_cuda_kernels.KERNELS): each runs this package's CPU kernel on the fake's device
bytes at the launch's addresses and writes the result there, so a test of the whole
call sequence (copies in, launch, copies back after the synchronisation) checks real
numbers against the CPU op.

What only the device sees when a kernel runs (a position id outside the caches, an
index outside the table, a row's seqlens_k that does not fit) is handled as the CUDA
source handles it: that token, row or batch row is NaN (its present rows untouched),
the op's bit is set in the status word, and every other element is the CPU kernel's
(run with the bad entries replaced by good ones, their results then overwritten).

Fake-only checks, which a real device would not make: the argument types are the
entry's parameter list, and the grid and block are the geometry the source is
written for.
"""
from __future__ import annotations

import numpy as np

from onnx_prep import native
from onnx_prep.core.cuda.device_decoder_ops import (GATHER_THREADS, GQA_APPEND_ROWS, GQA_THREADS, GRID_YZ_MAX,
                                                     KINDS, NORM_THREADS, PARAMS, ROTARY_THREADS, ZP_KINDS)
from onnx_prep.core.cuda.driver import DriverCallError
from onnx_prep.native import attention

KIND_NAMES = {v: k for k, v in KINDS.items()}
ZP_NAMES = {v: k for k, v in ZP_KINDS.items()}


def _refuse(detail: str) -> DriverCallError:
    return DriverCallError("cuLaunchKernel", 1, "CUDA_ERROR_INVALID_VALUE", f"(fake-only check) {detail}")


def _geometry(name: str, grid: tuple, v: dict) -> tuple[tuple, tuple]:
    if name == "decoder_row_norm":
        return (v["rows"], 1, 1), (NORM_THREADS, 1, 1)
    if name == "decoder_rotary":
        return (v["heads"], v["seq"], v["batch"]), (ROTARY_THREADS, 1, 1)
    if name == "decoder_gqa_append":
        tiles = (v["seq"] + GQA_APPEND_ROWS - 1) // GQA_APPEND_ROWS  # the kernel loops over tiles past grid.z
        return (v["kv_num_heads"], v["batch"], min(tiles, GRID_YZ_MAX)), (GQA_THREADS, 1, 1)
    if name == "decoder_gqa_attend":
        return (v["num_heads"], min(v["seq"], GRID_YZ_MAX), v["batch"]), (GQA_THREADS, 1, 1)
    return (max(grid[0], 1), 1, 1), (GATHER_THREADS, 1, 1)  # a block per index: n is the grid's


def check_decoder_op(name: str, grid: tuple, block: tuple, args: tuple) -> dict:
    """The launch's arguments by name, once its types and geometry are the entry's."""
    params = PARAMS[name]
    if tuple(t for t, _ in args) != tuple(t for _, t in params):
        raise _refuse(f"{name} takes {[n for n, _ in params]}, got {len(args)} arguments of other types")
    v = {n: value for (n, _), (_, value) in zip(params, args)}
    want = _geometry(name, grid, v)
    if (tuple(grid), tuple(block)) != want:
        raise _refuse(f"{name} runs as grid {want[0]} block {want[1]}, got {grid} {block}")
    return v


def _floats(driver, address: int, count: int) -> np.ndarray:
    return np.frombuffer(driver.read(address, 4 * count), dtype=np.float32).copy()


def _heads(driver, address: int, B: int, S: int, heads: int, H: int, strides: tuple) -> np.ndarray:
    """``[B, S, heads * H]`` from head rows at ``address + 4 (b, s, h) . strides``."""
    return np.stack([_floats(driver, address + 4 * (b * strides[0] + s * strides[1] + h * strides[2]), H)
                     for b in range(B) for s in range(S) for h in range(heads)]).reshape(B, S, heads * H)


def _write_rows(driver, address: int, rows: np.ndarray, stride: int) -> None:
    for r, row in enumerate(rows):
        driver.write(address + 4 * r * stride, np.ascontiguousarray(row, np.float32).tobytes())


def _flag(driver, status: int, bit: int) -> None:
    if status:
        word = int(np.frombuffer(driver.read(status, 4), np.uint32)[0]) | bit
        driver.write(status, np.uint32(word).tobytes())


def row_norm(driver, name: str, grid: tuple, block: tuple, args: tuple) -> None:
    v = check_decoder_op(name, grid, block, args)
    rows, n = v["rows"], v["n"]
    x = _floats(driver, v["x"], rows * n).reshape(rows, n)
    skip = _floats(driver, v["skip"], v["skip_rows"] * n).reshape(-1, n) if v["skip"] else None
    bias = _floats(driver, v["bias"], n) if v["bias"] else None
    beta = _floats(driver, v["beta"], n) if v["beta"] and not v["simplified"] else None
    r = native.norm_rows(x, _floats(driver, v["gamma"], n), beta=beta, skip=skip, bias=bias, epsilon=v["epsilon"],
                         simplified=bool(v["simplified"]), want_sum=bool(v["sum_out"]))
    driver.write(v["y"], r.y.tobytes())
    if v["sum_out"]:
        driver.write(v["sum_out"], r.sum.tobytes())


def rotary(driver, name: str, grid: tuple, block: tuple, args: tuple) -> None:
    v = check_decoder_op(name, grid, block, args)
    B, S, heads, H, rd = v["batch"], v["seq"], v["heads"], v["head_size"], v["rot_dim"]
    x = _floats(driver, v["x"], B * S * heads * H)
    x = x.reshape(B, heads, S, H) if v["transposed"] else x.reshape(B, S, heads * H)
    count = B * S if v["pos_per_token"] else 1
    pos = np.frombuffer(driver.read(v["pos"], 8 * count), np.int64).copy()
    pos = pos.reshape(B, S) if v["pos_per_token"] else (pos[0] + np.arange(S, dtype=np.int64))[None].repeat(B, 0)
    bad = (pos < 0) | (pos >= v["max_pos"])
    span = (v["max_pos"] - 1) * v["cache_stride"] + rd // 2
    cos, sin = ((np.concatenate([_floats(driver, v[c], span), np.zeros(v["cache_stride"] - rd // 2, np.float32)])
                 .reshape(-1, v["cache_stride"])[:, :rd // 2]) for c in ("cos_cache", "sin_cache"))
    y = native.rotary_embedding(x, np.where(bad, 0, pos), cos, sin, heads=heads, head_size=H, rotary_dim=rd,
                                transposed=bool(v["transposed"]), interleaved=bool(v["interleaved"]))
    if bad.any():
        (y.transpose(0, 2, 1, 3) if v["transposed"] else y.reshape(B, S, heads, H))[bad] = np.nan
        _flag(driver, v["status"], 2)
    driver.write(v["y"], y.tobytes())


def _gqa_bad_rows(v: dict, seqlens: np.ndarray) -> np.ndarray:
    """Which batch rows' seqlens_k do not fit (decoder_ops.cu gqa_row)."""
    S = v["seq"]
    t = seqlens.astype(np.int64) + 1
    past = np.zeros_like(t) if v["first_prompt"] else t - S
    bad = (t < 1) | (past < 0) | (past + S > v["present_len"]) | ((t > S) if v["first_prompt"] else False)
    bad |= (past > 0) & (past > v["past_len"])
    if v["rotary_dim"]:
        bad |= past + S > v["cache_rows"]
    return bad


def gqa(driver, name: str, grid: tuple, block: tuple, args: tuple) -> None:
    """Both entries run the CPU kernel over the device's buffers; the append writes its
    present rows back, the attend its output."""
    v = check_decoder_op(name, grid, block, args)
    B, S, N, KN, H = v["batch"], v["seq"], v["num_heads"], v["kv_num_heads"], v["head_size"]
    P, L, ps, qs = v["past_len"], v["present_len"], v["past_stride"], v["present_stride"]
    q = _heads(driver, v["q"], B, S, N, H, (v["q_b"], v["q_s"], v["q_h"]))
    k = _heads(driver, v["k"], B, S, KN, H, (v["kv_b"], v["kv_s"], v["kv_h"]))
    val = _heads(driver, v["v"], B, S, KN, H, (v["kv_b"], v["kv_s"], v["kv_h"]))
    seq_type = np.int32 if v["seqlens_i32"] else np.int64
    seqlens = np.frombuffer(driver.read(v["seqlens"], B * np.dtype(seq_type).itemsize), seq_type).astype(np.int64)
    bad = _gqa_bad_rows(v, seqlens)
    present = [_floats(driver, v[f"present_{w}"], B * KN * qs * H).reshape(B, KN, qs, H) for w in ("key", "value")]
    before = [p.copy() for p in present]
    pasts = []
    for w, p in zip(("key", "value"), present):
        if not v[f"past_{w}"] or P == 0:
            pasts.append(None)
        elif v[f"past_{w}"] == v[f"present_{w}"]:
            pasts.append(p[:, :, :P])  # the shared buffer: the CPU kernel writes only the new rows
        else:
            pasts.append(_floats(driver, v[f"past_{w}"], B * KN * ps * H).reshape(B, KN, ps, H)[:, :, :P])
    rd = v["rotary_dim"]
    cos = sin = None
    if rd:
        cos = _floats(driver, v["cos_cache"], v["cache_rows"] * rd // 2).reshape(-1, rd // 2)
        sin = _floats(driver, v["sin_cache"], v["cache_rows"] * rd // 2).reshape(-1, rd // 2)
    good_seqlens = np.where(bad, S - 1, seqlens)  # a first row of S: fits every buffer the plan allows
    out, _, _ = attention._launch(
        q, k, val, pasts[0], pasts[1], good_seqlens, cos, sin, (present[0][:, :, :L], present[1][:, :, :L]), None,
        L, batch=B, seq=S, num_heads=N, kv_num_heads=KN, head_size=H, past_len=P, present_len=L, rotary_dim=rd,
        cache_rows=v["cache_rows"] if rd else 0, interleaved=v["interleaved"], first_prompt=v["first_prompt"],
        scale=v["scale"])
    if bad.any():
        _flag(driver, v["status"], 4)
    if name == "decoder_gqa_append":
        for w, p, old in zip(("key", "value"), present, before):
            p[bad] = old[bad]
            driver.write(v[f"present_{w}"], p.tobytes())
    else:
        out[bad] = np.nan
        _write_rows(driver, v["out"], out.reshape(B * S, N * H), v["ld_out"])


def int4_gather(driver, name: str, grid: tuple, block: tuple, args: tuple) -> None:
    v = check_decoder_op(name, grid, block, args)
    n, V, K, bs, zp = grid[0], v["V"], v["K"], v["block_size"], ZP_NAMES[v["zp_kind"]]
    if KIND_NAMES[v["kind"]] == "int4_matmul":
        size = native.matmul_nbits_packed_size(K=K, N=V, block_size=bs, zero_points=zp)
    else:
        size = native.gather_packed_size(V=V, n_blocks=v["n_blocks"], block_size=bs, zero_points=zp)
    packed = np.frombuffer(driver.read(v["packed"], size), dtype=np.uint8).copy()
    indices = np.frombuffer(driver.read(v["indices"], 8 * n), np.int64).copy()
    bad = (indices < -V) | (indices >= V)
    rows = native.gather_block_quantized(np.where(bad, 0, indices), packed)
    if bad.any():
        rows[bad] = np.nan
        _flag(driver, v["status"], 1)
    _write_rows(driver, v["out"], rows, v["ld_out"])


# name -> (check at launch, run when the stream gets to it)
KERNELS = {"decoder_row_norm": (check_decoder_op, row_norm), "decoder_rotary": (check_decoder_op, rotary),
           "decoder_gqa_append": (check_decoder_op, gqa), "decoder_gqa_attend": (check_decoder_op, gqa),
           "decoder_int4_gather": (check_decoder_op, int4_gather)}
