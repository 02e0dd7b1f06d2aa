"""Plain-numpy references for the native kernels (shared by the test_native_* files),
and random source generators in the ops' exact source formats.

The references dequantize then multiply, in float64, so they are independent of the
kernels' folding of scales and zero points."""
from __future__ import annotations

import numpy as np
import pytest

from onnx_prep.native.isa import ISAS, VARIANTS


def isa_params(names) -> list:
    """``names`` as pytest parameters, each path this CPU or build lacks marked to skip
    with its reason: a missing ISA shows as a skip, never as a shorter list."""
    from onnx_prep import native

    params = []
    for name in names:
        reason = native.unavailable_reason(name)
        params.append(pytest.param(name, marks=pytest.mark.skip(reason=reason)) if reason else name)
    return params


# Every kernel path by name, whether or not it runs here (see isa_params).
ALL_ISAS = isa_params(ISAS + VARIANTS)
SIMD_ISAS = isa_params((ISAS + VARIANTS)[1:])


def expected_kernel(isa: str, path: str, rows: int = 1, level: int = 0) -> str:
    """The kernel code (native.last_kernel()) a call with ``isa`` must report, written
    out here independently of the C dispatcher: ``path`` "int" for the integer paths
    (accuracy levels 0-4), "fp32" for the FMA chains and gemm. VNNI serves "avx512"
    on the integer paths where the CPU has it, and AMX tiles (on by default) from 4
    rows at levels 0-3 and 16 at level 4; "avx512-novnni" never uses either."""
    from onnx_prep import native

    if isa == "avx512-novnni":
        return "avx512"
    if isa == "avx512" and path == "int" and native.cpu_features()["amx"] and rows >= (16 if level == 4 else 4):
        return "amx"
    if isa == "avx512" and path == "int" and native.cpu_features()["avx512_vnni"]:
        return "avx512-vnni"
    return isa


# Tolerances. The kernels compute per block s * (sum a*q - z * sum a) in fp32, so
# their rounding error is bounded relative to the FOLD MAGNITUDE
# sum_k |a_k| (|q_k| + |z|) |s| (not sum |a||w|, which is 0 when q = z).
FP32_UNIT_ROUNDOFF = 2.0 ** -24
# Level 4 rounds each a to the int8 grid of its block: |error| <= max|a_block| / 254.
INT8_HALF_STEP = 0.5 / 127
# Level 0 (block floating point) rounds each a to a 24-bit mantissa sharing the
# block's exponent: |error| <= 2^-22 max|a_block| (the grid step is <= 2^-21 max).
BFP_HALF_STEP = 2.0 ** -22


def fp32_rel_tol(K: int, block_size: int) -> float:
    """Worst-case relative error of the fp32 kernels: one rounding per term of the
    longest chain (block_size fmas, then one fold per block, bias, slack)."""
    return (block_size + -(-K // block_size) + 4) * FP32_UNIT_ROUNDOFF


def random_matmul_nbits(rng, *, K, N, block_size, zp="none", scale_dtype=np.float32):
    """MatMulNBits sources: B uint8 [N, kb, bs/2], scales [N*kb], zero points or None."""
    kb = -(-K // block_size)
    B = rng.integers(0, 256, (N, kb, block_size // 2), dtype=np.uint8)
    scales = (rng.random(N * kb) * 0.02 + 0.001).astype(scale_dtype)
    if zp == "none":
        z = None
    elif zp == "u4":
        z = rng.integers(0, 256, (N, (kb + 1) // 2), dtype=np.uint8)
    elif zp == "float":
        z = (rng.random(N * kb) * 15).astype(scale_dtype)
    else:
        raise ValueError(zp)
    return B, scales, z


def nibbles(b: np.ndarray) -> np.ndarray:
    """Unpack uint8 along the last axis into codes, low nibble first."""
    b = np.asarray(b, dtype=np.uint8)
    return np.stack([b & 0x0F, b >> 4], axis=-1).reshape(b.shape[:-1] + (b.shape[-1] * 2,))


def dequantize_matmul_nbits(B, scales, zp, *, K, N, block_size) -> np.ndarray:
    """float64 W [K, N] = (code - zero) * scale, MatMulNBits semantics."""
    kb = -(-K // block_size)
    codes = nibbles(B.reshape(N, kb, block_size // 2)).reshape(N, kb, block_size).astype(np.float64)
    s = np.asarray(scales, dtype=np.float64).reshape(N, kb, 1)
    if zp is None:
        z = np.full((N, kb, 1), 8.0)
    elif zp.dtype == np.uint8:
        z = nibbles(zp.reshape(N, -1))[:, :kb].astype(np.float64).reshape(N, kb, 1)
    else:
        z = np.asarray(zp, dtype=np.float64).reshape(N, kb, 1)
    w = ((codes - z) * s).reshape(N, kb * block_size)[:, :K]
    return w.T


def fold_weights(B, scales, zp, *, K, N, block_size) -> np.ndarray:
    """float64 [K, N] of (|code| + |zero|) * |scale|: multiplied by |A| it is the fold magnitude."""
    kb = -(-K // block_size)
    codes = nibbles(B.reshape(N, kb, block_size // 2)).reshape(N, kb, block_size).astype(np.float64)
    s = np.abs(np.asarray(scales, dtype=np.float64)).reshape(N, kb, 1)
    if zp is None:
        z = np.full((N, kb, 1), 8.0)
    elif zp.dtype == np.uint8:
        z = nibbles(zp.reshape(N, -1))[:, :kb].astype(np.float64).reshape(N, kb, 1)
    else:
        z = np.abs(np.asarray(zp, dtype=np.float64)).reshape(N, kb, 1)
    return ((codes + z) * s).reshape(N, kb * block_size)[:, :K].T


def block_rounding_bound(A, W, block_size, half_step) -> np.ndarray:
    """[M, N] bound on |A' @ W - A @ W| when A' rounds each a to a grid of
    half_step * max|a| of its block (level 4: int8; level 0: 24-bit mantissas)."""
    A64 = np.abs(np.asarray(A, dtype=np.float64))
    M, K = A64.shape
    bound = np.zeros((M, W.shape[1]))
    for k0 in range(0, K, block_size):
        amax = A64[:, k0:k0 + block_size].max(axis=1, keepdims=True)
        bound += amax * half_step * (np.abs(W[k0:k0 + block_size]).sum(axis=0))
    return bound


def int8_error_bound(A, W, block_size) -> np.ndarray:
    return block_rounding_bound(A, W, block_size, INT8_HALF_STEP)


def int8_rounded(A, block_size, *, reciprocal_scale: bool = False) -> np.ndarray:
    """float32 A as level 4 sees it: each row's blocks on the int8 grid of their max |a|
    (MLAS' rule, which the kernels follow: scale = max|a| / 127 and a8 = round-half-even
    (a * (127 / max|a|)), all in fp32), dequantized again. ``reciprocal_scale``: the
    multiplier 1 / scale instead (not MLAS': it rounds some exact halves the other way)."""
    A = np.asarray(A, dtype=np.float32)
    out = np.empty_like(A)
    for k0 in range(0, A.shape[1], block_size):
        blk = A[:, k0:k0 + block_size]
        amax = np.abs(blk).max(axis=1, keepdims=True)
        scale = amax / np.float32(127)
        num, den = (np.float32(1), scale) if reciprocal_scale else (np.float32(127), amax)
        inv = np.divide(num, den, out=np.zeros_like(amax), where=den != 0)
        out[:, k0:k0 + block_size] = np.clip(np.rint(blk * inv), -128, 127) * scale
    return out


# The three kernel families, as the tests name them: a level whose compute is block
# floating point (0; levels 1-3 compute alike), the IEEE fp32 FMA chains ("fma", a
# compute mode, not a level) and int8 (4).
KERNEL_MODES = [0, "fma", 4]


def mm_mode(A, packed, mode, **kw):
    """native.matmul_nbits in one of KERNEL_MODES (or any level 0-4)."""
    from onnx_prep import native

    if mode == "fma":
        return native.matmul_nbits(A, packed, compute="fma", **kw)
    return native.matmul_nbits(A, packed, accuracy_level=mode, **kw)


def level_bounds(A, W, fold_mag, *, K, block_size, level):
    """(relative tolerance on the fold magnitude, extra absolute bound) per accuracy
    level (0-4) or the "fma" compute mode."""
    nb = -(-K // block_size)
    if level == 4:  # exact integer sums; fp32 only in the per-block fold
        return (nb + 8) * FP32_UNIT_ROUNDOFF, int8_error_bound(A, W, block_size)
    if level in (0, 1, 2, 3):  # same, with A on a 24-bit grid
        return (nb + 8) * FP32_UNIT_ROUNDOFF, block_rounding_bound(A, W, block_size, BFP_HALF_STEP)
    assert level == "fma", level
    return fp32_rel_tol(K, block_size), 0.0


def matmul_reference(A, W, bias=None):
    """float64 A @ W (+ bias) and the per-output magnitude sum |A| @ |W| for tolerances."""
    A64 = np.asarray(A, dtype=np.float64)
    y = A64 @ W
    if bias is not None:
        y = y + bias
    return y, np.abs(A64) @ np.abs(W)


def assert_close_rel(got, want, magnitude, rel, what="", extra=0.0):
    """|got - want| <= rel * magnitude + extra (+ tiny), elementwise."""
    err = np.abs(np.asarray(got, dtype=np.float64) - want)
    bound = rel * magnitude + extra + 1e-30
    worst = np.max(err / bound) if err.size else 0.0
    assert worst <= 1.0, f"{what}: max error {worst:.3g}x the tolerance (rel {rel})"


def test_reference_dequantize_matches_definition():
    # One column, one block, explicit values: (code - 8) * scale.
    B = np.zeros((1, 1, 8), dtype=np.uint8)
    B[0, 0, :2] = [0x10, 0xF2]  # codes 0, 1, 2, 15
    W = dequantize_matmul_nbits(B, np.array([0.5], np.float32), None, K=4, N=1, block_size=16)
    # block_size 16 with K=4: only the first 4 codes are real
    assert W[:, 0].tolist() == [-4.0, -3.5, -3.0, 3.5]
