"""The packed-format version is one fact: the value the packers write into every
header, OP_PACK_FORMAT_VERSION of onnx_prep_native.h, what C reports through
op_pack_format_version(), and native/layouts.py's PACK_FORMAT_VERSION (which every
kernel's layout keys, and so the prepared cache, carry) all agree, and no header names
another."""
from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np

from onnx_prep import native
from onnx_prep.core.kernels.gemm_packed import gemm_b_layout
from onnx_prep.core.kernels.int4_gather import gather_block_quantized_layout
from onnx_prep.core.kernels.int4_matmul import matmul_nbits_layout
from onnx_prep.native import layouts
from onnx_prep.native._module import lib

NATIVE_DIR = Path(layouts.__file__).resolve().parent


def _packed_buffers():
    rng = np.random.default_rng(0)
    B = rng.integers(0, 256, (8, 2, 16), dtype=np.uint8)
    yield "int4 matmul", native.prepack_matmul_nbits(B, rng.random((8, 2)).astype(np.float32), None,
                                                     K=64, N=8, block_size=32)
    yield "int4 gather", native.prepack_gather_block_quantized(B, rng.random((8, 2, 1)).astype(np.float32),
                                                               None, block_size=32)
    yield "gemm b", native.prepack_gemm_b(np.ones((4, 5), np.float32), trans_b=False)


def test_c_headers_layouts_and_packed_bytes_carry_one_format_version():
    version = lib.op_pack_format_version()
    assert version == lib.OP_PACK_FORMAT_VERSION == layouts.PACK_FORMAT_VERSION
    header = (NATIVE_DIR / "onnx_prep_native.h").read_text()
    assert [int(v) for v in re.findall(r"OP_PACK_FORMAT_VERSION\s*=\s*(\d+)", header)] == [version]
    for name, packed in _packed_buffers():
        magic, written = struct.unpack_from("<IH", packed, 0)
        assert magic == lib.OP_PACK_MAGIC and written == version, name
        assert native.packed_header(packed).format_version == version, name
    for key in (matmul_nbits_layout(block_size=32, zero_points="none", scale_dtype="float32", accuracy_level=4),
                gather_block_quantized_layout(block_size=32, zero_points="u4", scale_dtype="float16"),
                gemm_b_layout(trans_b=True)):
        assert f".v{version}." in key, key


def test_no_native_source_states_another_format_version():
    # prose such as "format version 2" in a comment was how the number drifted once
    for path in sorted(NATIVE_DIR.glob("*.[ch]")) + sorted(NATIVE_DIR.glob("*.py")):
        stated = re.findall(r"format[ _]version\s*[=:]?\s*(\d+)", path.read_text(), re.I)
        assert all(int(v) == lib.op_pack_format_version() for v in stated), (path.name, stated)
