"""GatherBlockQuantized (gather_axis 0, quantize_axis last): native gather vs numpy
dequantization, zero-point forms, negative and bad indices, determinism; rows read
from the matmul layout (a tied table) bit for bit as from the gather layout."""
from __future__ import annotations

import numpy as np
import pytest

from onnx_prep import native
from onnx_prep.core.errors import NativeError
from gil_release import run_checking_gil_release
from test_native_reference import nibbles


def _source(rng, V, K, bs, zp):
    kb = K // bs
    data = rng.integers(0, 256, (V, kb, bs // 2), dtype=np.uint8)
    scales = (rng.random((V, kb, 1)) * 0.1 + 0.01).astype(np.float32)
    z = None if zp == "none" else rng.integers(0, 16, (V, kb, 1), dtype=np.uint8)
    return data, scales, z


def _dequant(data, scales, z):
    V, kb, half = data.shape
    codes = nibbles(data).astype(np.float32)  # [V, kb, bs]
    zz = np.float32(8.0) if z is None else (z & 0x0F).astype(np.float32)
    return ((codes - zz) * scales).reshape(V, kb * half * 2)


@pytest.mark.parametrize("bs", [16, 32, 64, 128])
@pytest.mark.parametrize("zp", ["none", "u4"])
def test_gather_matches_numpy_bit_for_bit(bs, zp):
    rng = np.random.default_rng(bs)
    data, scales, z = _source(rng, 50, 4 * bs, bs, zp)
    packed = native.prepack_gather_block_quantized(data, scales, z, block_size=bs)
    idx = np.array([[0, 49, -1], [7, 7, -50]], dtype=np.int64)
    got = native.gather_block_quantized(idx, packed)
    assert got.shape == (2, 3, 4 * bs)
    np.testing.assert_array_equal(got, _dequant(data, scales, z)[idx])


def test_gather_zero_points_packed_two_per_byte_equal_one_per_byte():
    rng = np.random.default_rng(1)
    data, scales, z = _source(rng, 9, 96, 32, "u4")  # kb = 3
    zz = z.reshape(9, 3)
    packed2 = np.zeros((9, 2), np.uint8)
    packed2[:, 0] = zz[:, 0] | (zz[:, 1] << 4)
    packed2[:, 1] = zz[:, 2]
    a = native.prepack_gather_block_quantized(data, scales, z, block_size=32)
    b = native.prepack_gather_block_quantized(data, scales, packed2, block_size=32)
    assert a.tobytes() == b.tobytes()


def test_gather_out_of_range_index_raises_index_error():
    rng = np.random.default_rng(2)
    data, scales, z = _source(rng, 5, 32, 16, "none")
    packed = native.prepack_gather_block_quantized(data, scales, z, block_size=16)
    with pytest.raises(IndexError, match="gather index 5 at position 1"):
        native.gather_block_quantized(np.array([0, 5]), packed)
    with pytest.raises(IndexError):
        native.gather_block_quantized(np.array([-6]), packed)


def test_gather_packing_is_deterministic_and_fp16_scales_are_exact():
    rng = np.random.default_rng(3)
    data, scales, z = _source(rng, 11, 64, 16, "u4")
    s16 = scales.astype(np.float16)
    p1 = native.prepack_gather_block_quantized(data, s16, z, block_size=16)
    p2 = native.prepack_gather_block_quantized(data.copy(), s16.copy(), z.copy(), block_size=16)
    assert p1.tobytes() == p2.tobytes()
    assert native.packed_header(p1).scales_were_f16
    got = native.gather_block_quantized(np.arange(11), p1)
    np.testing.assert_array_equal(got, _dequant(data, s16.astype(np.float32), z))


# ------------------------------------------------ rows of the matmul layout (tied tables)

def _both_packings(rng, V, kb, bs, zp, scale_dtype, level=0):
    """One table packed both ways, the gather layout and the matmul layout (N = V,
    K = kb * bs), with zero points in each op's form of the same values. Returns
    (data, scales, zero points as the numpy dequantization takes them, gather, matmul)."""
    data = rng.integers(0, 256, (V, kb, bs // 2), dtype=np.uint8)
    scales = (rng.random((V, kb, 1)) * 0.1 + 0.01).astype(scale_dtype)
    if zp == "none":
        zg = zm = z = None
    elif zp == "u4":
        z = zg = rng.integers(0, 16, (V, kb, 1), dtype=np.uint8)  # one per byte
        two = np.zeros((V, 2 * ((kb + 1) // 2)), np.uint8)
        two[:, :kb] = z[:, :, 0]
        zm = (two[:, 0::2] | (two[:, 1::2] << 4)).astype(np.uint8)  # MatMulNBits: two per byte
    else:
        zg = zm = (rng.random((V, kb, 1)) * 15).astype(scale_dtype)
        z = None
    gather = native.prepack_gather_block_quantized(data, scales, zg, block_size=bs)
    matmul = native.prepack_matmul_nbits(data, scales.reshape(-1), zm, K=kb * bs, N=V, block_size=bs,
                                         accuracy_level=level)
    return data, scales, z, gather, matmul


@pytest.mark.parametrize("seed", range(12))
def test_rows_of_the_matmul_layout_equal_the_gather_layout_bit_for_bit(seed):
    """Random shapes (V across panel and tile edges, every block size), every zero-point
    form, fp16 and fp32 scales, every accuracy level the matmul header may carry: the
    same rows give the same bits from either layout (and the numpy dequantization's)."""
    rng = np.random.default_rng(100 + seed)
    bs = int(rng.choice([16, 32, 64, 128, 256]))
    V, kb = int(rng.integers(1, 200)), int(rng.integers(1, 6))
    zp = ["none", "u4", "float"][seed % 3]
    dtype = np.float16 if seed % 2 else np.float32
    data, scales, z, gather, matmul = _both_packings(rng, V, kb, bs, zp, dtype, level=seed % 5)
    idx = rng.integers(-V, V, (3, 5)).astype(np.int64)
    idx[0, :2] = [0, V - 1]
    got = native.gather_block_quantized(idx, matmul)
    want = native.gather_block_quantized(idx, gather)
    assert got.shape == want.shape == (3, 5, kb * bs)
    assert got.tobytes() == want.tobytes()
    if zp != "float":
        np.testing.assert_array_equal(got, _dequant(data, scales.astype(np.float32), z)[idx])


def test_rows_of_the_matmul_layout_stop_at_k():
    """A K with a padded last block: a row is the column's K values, the first K of
    the full rows' (the padding codes are never read)."""
    rng = np.random.default_rng(7)
    data, scales, _, gather, _ = _both_packings(rng, 70, 3, 32, "u4", np.float32)
    z = rng.integers(0, 256, (70, 2), dtype=np.uint8)
    full = native.prepack_matmul_nbits(data, scales.reshape(-1), z, K=96, N=70, block_size=32)
    short = native.prepack_matmul_nbits(data, scales.reshape(-1), z, K=81, N=70, block_size=32)
    idx = np.array([0, 17, 64, 69, -1])
    got = native.gather_block_quantized(idx, short)
    assert got.shape == (5, 81)
    assert got.tobytes() == native.gather_block_quantized(idx, full)[:, :81].tobytes()


def test_rows_of_the_matmul_layout_refuse_bad_indices_and_other_kinds():
    rng = np.random.default_rng(8)
    *_, matmul = _both_packings(rng, 65, 2, 16, "none", np.float32)
    with pytest.raises(IndexError, match="gather index 65 at position 1"):
        native.gather_block_quantized(np.array([0, 65]), matmul)
    gemm = native.prepack_gemm_b(np.ones((4, 3), np.float32), trans_b=False)
    with pytest.raises(NativeError):
        native.gather_block_quantized(np.array([0]), gemm)


def test_rows_of_the_matmul_layout_release_the_gil():
    rng = np.random.default_rng(9)
    data, scales, z, gather, matmul = _both_packings(rng, 4096, 8, 32, "none", np.float32)
    idx = np.arange(4096, dtype=np.int64)
    got = run_checking_gil_release(lambda: native.gather_block_quantized(idx, matmul))
    assert got.tobytes() == native.gather_block_quantized(idx, gather).tobytes()
