"""Layout keys: names for packed formats. A layout key names EVERY parameter that
changes the packed bytes, so equal keys over equal sources mean equal bytes (the
prepared cache relies on this). Each kernel builds its own keys
(``core/kernels/<kernel>.py``, e.g. ``int4_matmul.matmul_nbits_layout``), every one
carrying the packed-format version below. Pure Python: resolution computes keys
without loading the native module.

NOTE: the packed formats are ISA-independent: every ISA path (scalar reference,
AVX2, AVX-512) reads the same bytes, so a cache built on one machine serves
another. The panel width (64 columns) is fixed by the format version, not chosen
per ISA.
"""
from __future__ import annotations

# The format version every packed header carries: OP_PACK_FORMAT_VERSION of
# onnx_prep_native.h, which the C module reports as op_pack_format_version(). Kept here
# as a literal so resolution needs no compiled module; tests/test_native_format_version.py
# holds the two (and the bytes the packers write) equal.
PACK_FORMAT_VERSION = 1
