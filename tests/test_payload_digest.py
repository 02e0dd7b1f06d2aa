"""Payload digests (core/cache/payload_digest.py): XXH3-64 in C (what the writer uses)
equals the reference at every length path (published vectors, pinned vectors, and the
`xxhash` package for every length to 2100), whatever the cut of the stream into updates
and whichever ISA's loop ran; XXH64 (caches written before) equals the reference too
(published vectors, and the XXH64 every zstd frame with a checksum carries); sha256
digests of older caches still check."""
from __future__ import annotations

import hashlib
import random
import struct

import numpy as np
import pytest

from onnx_prep import native
from onnx_prep.core.cache.payload_digest import (
    ALGORITHMS,
    PAYLOAD_DIGEST,
    WRITE_ALGORITHM,
    PayloadHasher,
    payload_digest_of,
)
from onnx_prep.native.isa import ISAS
from test_native_reference import isa_params

ISA_PATHS = isa_params(ISAS)  # scalar, avx2, avx512; a path this CPU lacks shows as a skip


def sanity_buffer(n: int) -> bytes:
    """The byte pattern the reference's published test vectors hash: the top byte of a
    64-bit multiplicative sequence."""
    out, g = bytearray(n), 2654435761
    for i in range(n):
        out[i] = g >> 56
        g = (g * 11400714785074694797) & ((1 << 64) - 1)
    return bytes(out)


def pattern(n: int) -> np.ndarray:
    """A deterministic pattern of any length: the top byte of i * 0x9E3779B185EBCA87."""
    i = np.arange(n, dtype=np.uint64)
    return ((i * np.uint64(0x9E3779B185EBCA87)) >> np.uint64(56)).astype(np.uint8)


def xxh3(data, isa: str | None = None, cuts=()) -> str:
    """The digest of ``data`` fed in pieces at the offsets ``cuts``."""
    h = PayloadHasher("xxh3", isa=isa)
    mv = memoryview(np.ascontiguousarray(data)).cast("B")
    pos = 0
    for c in sorted(cuts):
        h.update(mv[pos:c])
        pos = c
    h.update(mv[pos:])
    return h.digest()


def test_the_writer_uses_xxh3():
    assert WRITE_ALGORITHM == "xxh3"
    assert payload_digest_of(b"") == "xxh3:2d06800538d394c2"


# The reference's own sanity vectors (XXH3_64bits, seed 0, over sanity_buffer), one per
# length path: 0, 1-3, 4-8, 9-16, 17-128 (each 32-byte step), 129-240, then the stripe
# loop: one block with an overlapping last stripe, one ending on a stripe, two ending on
# a block, three ending on a stripe, three with an overlapping last stripe.
PUBLISHED_XXH3 = [(0, 0x2D06800538D394C2), (1, 0xC44BDFF4074EECDB), (6, 0x27B56A84CD2D7325),
                  (12, 0xA713DAF0DFBB77E7), (24, 0xA3FE70BF9D3510EB), (48, 0x397DA259ECBA1F11),
                  (80, 0xBCDEFBBB2C47C90A), (195, 0xCD94217EE362EC3A), (403, 0xCDEB804D65C6DEA4),
                  (512, 0x617E49599013CB6B), (2048, 0xDD59E2C3A5F038E0), (2240, 0x6E73A90539CF2948),
                  (2367, 0xCB37AEB9E5D361ED)]


@pytest.mark.parametrize("isa", ISA_PATHS)
def test_published_xxh3_vectors(isa):
    data = np.frombuffer(sanity_buffer(2367), dtype=np.uint8)
    for n, want in PUBLISHED_XXH3:
        assert xxh3(data[:n], isa) == f"xxh3:{want:016x}", n


# XXH3_64bits of pattern(n), from the reference (the `xxhash` package): every length
# path and its edges, stripes and blocks with and without a partial last stripe.
PINNED_XXH3 = [(0, "2d06800538d394c2"), (1, "c44bdff4074eecdb"), (3, "e14090f554a5ea90"),
               (16, "81e9eb8634460bb9"), (17, "9998430fd0a655be"), (128, "75eca5c5d5594884"),
               (129, "a05da42e7a4e4667"), (240, "5eb2467c8c9e3969"), (241, "2d431e984c441f15"),
               (1023, "4e30bb611faa8f67"), (1024, "e99def1145f12936"), (1025, "83cba9b371e4e7f4"),
               (4096 + 7, "f5c9e0ac3e19e32a"), ((1 << 20) + 13, "467de862091f3d37")]


@pytest.mark.parametrize("isa", ISA_PATHS)
def test_pinned_xxh3_vectors_in_one_update_and_in_stripes_and_single_bytes(isa):
    for n, want in PINNED_XXH3:
        data = pattern(n)
        assert xxh3(data, isa) == "xxh3:" + want, n
        # cuts on stripe and buffer edges, and one byte before the end
        cuts = [c for c in (1, 63, 64, 65, 255, 256, 257, 1024, n - 1) if 0 < c < n]
        assert xxh3(data, isa, cuts) == "xxh3:" + want, n
    small = pattern(1100)  # byte by byte through the short paths and the first blocks
    assert xxh3(small, isa, range(1, 1100)) == xxh3(small)


def test_every_length_to_2100_equals_the_reference_package():
    xxhash = pytest.importorskip("xxhash", reason="the `xxhash` package is the reference here")
    data = np.random.default_rng(7).integers(0, 256, 2100, dtype=np.uint8)
    raw = data.tobytes()
    for n in range(2101):
        want = f"xxh3:{xxhash.xxh3_64_intdigest(raw[:n]):016x}"
        assert xxh3(data[:n]) == want, n
        assert xxh3(data[:n], cuts=[n // 3, n // 3 + 1, (2 * n) // 3]) == want, n


@pytest.mark.parametrize("isa", ISA_PATHS)
def test_random_chunkings_of_3_mib_give_the_one_shot_digest(isa):
    data = np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8)
    whole = xxh3(data, "scalar")
    xxhash = None
    try:
        import xxhash
    except ImportError:
        pass
    if xxhash is not None:  # the reference too, where present (the other checks do not need it)
        assert whole == f"xxh3:{xxhash.xxh3_64_intdigest(data.tobytes()):016x}"
    rng = random.Random(isa)
    for _ in range(8):
        cuts, pos = [], 0
        while pos < data.size:
            pos += rng.choice([0, 1, 2, 63, 64, 65, 255, 256, 257, 1023, 1024, 1025,
                               rng.randrange(1, 300_000)])
            cuts.append(min(pos, data.size))
        assert xxh3(data, isa, cuts) == whole
    flipped = data.copy()
    flipped[(3 << 20) - 100] ^= 1  # in the last stripes
    assert xxh3(flipped, isa) != whole


@pytest.mark.parametrize("isa", ISA_PATHS)
def test_each_isa_runs_its_own_stripe_loop(isa, monkeypatch):
    """Every path gives the scalar twin's digest, so equal digests cannot show that the
    SIMD loop ran: the loop records its kernel code (native.last_kernel)."""
    data = pattern(100_000)
    want = xxh3(data, "scalar")
    assert xxh3(data, isa) == want
    assert native.last_kernel() == isa
    monkeypatch.setenv("ONNX_PREP_ISA", isa)  # the kernels' default: the runtime's way
    assert xxh3(data) == want
    assert native.last_kernel() == isa
    xxh3(data[:100], isa)  # short: buffered, then the short path in the digest
    assert native.last_kernel() is None


def test_a_hasher_refuses_an_isa_it_cannot_run():
    from onnx_prep.native._module import ffi, lib

    state = ffi.new("op_xxh3_state *")
    lib.op_xxh3_reset(state)
    chosen = state.isa
    assert lib.op_xxh3_set_isa(state, 99) == lib.OP_E_ISA and state.isa == chosen
    for name in ISAS:  # an ISA this CPU or build lacks (none, on a full AVX-512 machine)
        if native.unavailable_reason(name):
            with pytest.raises(native.NativeError):
                PayloadHasher("xxh3", isa=name)


def test_published_xxh64_vectors():
    assert payload_digest_of(b"", "xxh64") == "xxh64:ef46db3751d8e999"
    assert payload_digest_of(b"abc", "xxh64") == "xxh64:44bc2cf5ad770999"
    data = sanity_buffer(222)
    assert payload_digest_of(data[:1], "xxh64") == "xxh64:e934a84adb052768"
    assert payload_digest_of(data, "xxh64") == "xxh64:b641ae8cb691c174"


@pytest.mark.parametrize("n", [1, 3, 4, 7, 8, 31, 32, 33, 63, 64, 65, 1000, 4097, 1 << 20])
def test_xxh64_equals_the_checksum_in_zstd_frames(n):
    zstandard = pytest.importorskip("zstandard", reason="the zstd frame checksum is the reference here")
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(data)
    low32 = struct.unpack("<I", frame[-4:])[0]  # a frame's checksum: XXH64's low 32 bits
    assert int(payload_digest_of(data, "xxh64").split(":")[1], 16) & 0xFFFFFFFF == low32


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_any_split_of_the_stream_gives_the_same_digest(algorithm):
    data = np.random.default_rng(1).integers(0, 256, 10_000, dtype=np.uint8)
    whole = payload_digest_of(data, algorithm)
    for cuts in ([1], [5, 31], [32, 32, 33], [7, 1, 2, 3, 4000]):
        h = PayloadHasher(algorithm)
        pos = 0
        for c in cuts:
            h.update(data[pos:pos + c])
            pos += c
        h.update(data[pos:])
        assert h.digest() == whole
    flipped = data.copy()
    flipped[5000] ^= 1
    assert payload_digest_of(flipped, algorithm) != whole


def test_older_digests_check_in_the_algorithm_they_name():
    data = b"prepared bytes" * 100
    for old in ("sha256:" + hashlib.sha256(data).hexdigest(), payload_digest_of(data, "xxh64")):
        h = PayloadHasher.matching(old)
        h.update(data)
        assert h.digest() == old and PAYLOAD_DIGEST.match(old)
    assert PAYLOAD_DIGEST.match(payload_digest_of(data))
    for bad in ("md5:" + "0" * 32, "xxh3:" + "0" * 15, "xxh3:" + "0" * 64, "xxh128:" + "0" * 32):
        assert not PAYLOAD_DIGEST.match(bad), bad
    with pytest.raises(ValueError, match="unknown digest algorithm"):
        PayloadHasher("md5")
