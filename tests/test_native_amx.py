"""The INT4 matmul on AMX tiles (native/kernels_amx.c): several rows at once, the same
bits as the AVX-512 VNNI panels and the scalar twin (exact integer sums per block, the
panels' own epilogue). Runs where the CPU has AMX-INT8 and Linux grants its tile state;
elsewhere the comparisons skip, saying so, and the setting is shown to change nothing."""
from __future__ import annotations

import numpy as np
import pytest

from onnx_prep import native
from test_native_reference import random_matmul_nbits

HAS_AMX = native.cpu_features()["amx"]
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="no AMX-INT8 here (or the OS did not grant its tile state)")

# (M, K, N, block_size, zero points): rows around each level's threshold (4 at levels
# 0-3, each whole 16 at level 4, the rest of the rows on the panels), several 16-row
# chunks, blocks of 16-256 codes (several tile products a block past 64), K past the
# last block, N ending inside a panel and inside a tile.
CASES = [
    (3, 300, 80, 32, "u4"), (4, 130, 64, 16, "none"), (5, 256, 100, 64, "float"),
    (8, 256, 64, 32, "u4"), (9, 200, 70, 64, "float"), (15, 512, 130, 128, "none"),
    (16, 100, 37, 16, "u4"), (17, 1024, 200, 256, "float"), (24, 640, 65, 32, "none"),
    (33, 2048, 256, 32, "u4"), (40, 96, 19, 32, "float"),
]


def _case(seed, M, K, N, bs, zp, level):
    rng = np.random.default_rng(seed)
    B, s, z = random_matmul_nbits(rng, K=K, N=N, block_size=bs, zp=zp)
    packed = native.prepack_matmul_nbits(B, s, z, K=K, N=N, block_size=bs, accuracy_level=level)
    # rows of very different magnitudes: each block's exponent (bfp) or scale (int8) differs
    A = (rng.standard_normal((M, K)) * 10.0 ** rng.integers(-3, 4, (M, 1))).astype(np.float32)
    return A, packed, rng.standard_normal(N).astype(np.float32)


def _run(A, packed, bias, amx, **kw):
    before = native.set_amx(amx)
    try:
        return native.matmul_nbits(A, packed, bias=bias, **kw), native.last_kernel()
    finally:
        native.set_amx(before)


@needs_amx
@pytest.mark.parametrize("level", [0, 1, 4])
def test_tiles_give_the_panels_and_the_scalar_bits(level):
    for i, (M, K, N, bs, zp) in enumerate(CASES):
        A, packed, bias = _case(i, M, K, N, bs, zp, level)
        on, ran = _run(A, packed, bias if i % 2 else None, True)
        off, ran_off = _run(A, packed, bias if i % 2 else None, False)
        ref = native.matmul_nbits(A, packed, bias=bias if i % 2 else None, isa="scalar")
        tiles = M >= (16 if level == 4 else 4)
        assert (ran, ran_off) == ("amx" if tiles else "avx512-vnni", "avx512-vnni"), (level, M)
        np.testing.assert_array_equal(on, off, err_msg=f"level {level} case {i}")
        np.testing.assert_array_equal(on, ref, err_msg=f"level {level} case {i}")


@needs_amx
def test_column_ranges_inside_panels_and_tiles():
    """A split matmul's chunks run on several threads, each configuring its own tiles:
    a range starting and ending inside tiles writes exactly its columns."""
    for level in (0, 4):
        A, packed, bias = _case(7, 16, 320, 200, 32, "u4", level)
        whole, _ = _run(A, packed, bias, False)
        for cb, ce in [(0, 200), (5, 70), (64, 128), (100, 101), (130, 200)]:
            y = np.full((16, 200), np.nan, np.float32)
            part, ran = _run(A, packed, bias, True, out=y, col_begin=cb, col_end=ce)
            assert ran == "amx"
            np.testing.assert_array_equal(part[:, cb:ce], whole[:, cb:ce])
            assert np.isnan(part[:, :cb]).all() and np.isnan(part[:, ce:]).all()


def test_the_setting_is_process_wide_and_returns_the_previous():
    before = native.set_amx(False)
    try:
        assert native.set_amx(True) is False
        assert native.set_amx(True) is True
    finally:
        native.set_amx(before)


def test_without_tiles_the_setting_changes_no_kernel():
    """Where AMX cannot run (this CPU, or a forced ISA below AVX-512), both settings run
    the same code."""
    A, packed, bias = _case(3, 16, 256, 64, 32, "u4", 0)
    for isa in [i for i in ("scalar", "avx512-novnni") if native.unavailable_reason(i) is None]:
        on, ran_on = _run(A, packed, bias, True, isa=isa)
        off, ran_off = _run(A, packed, bias, False, isa=isa)
        assert ran_on == ran_off != "amx"
        np.testing.assert_array_equal(on, off)
    if not HAS_AMX:
        assert _run(A, packed, bias, True)[1] != "amx"
