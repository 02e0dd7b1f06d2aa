"""GatherBlockQuantized (gather_axis 0, quantize_axis last): native gather vs numpy
dequantization, zero-point forms, negative and bad indices, determinism."""
from __future__ import annotations

import numpy as np
import pytest

from onnx_prep import native
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
