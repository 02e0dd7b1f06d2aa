"""Payload digests (core/cache/payload_digest.py): XXH64 in C equals the reference
(published vectors, and the XXH64 that every zstd frame with a checksum carries), streams
across any split, and sha256 digests of older caches still check."""
from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from onnx_prep.core.cache.payload_digest import PAYLOAD_DIGEST, PayloadHasher, payload_digest_of


def test_published_xxh64_vectors():
    assert payload_digest_of(b"") == "xxh64:ef46db3751d8e999"
    assert payload_digest_of(b"abc") == "xxh64:44bc2cf5ad770999"


@pytest.mark.parametrize("n", [1, 3, 4, 7, 8, 31, 32, 33, 63, 64, 65, 1000, 4097, 1 << 20])
def test_xxh64_equals_the_checksum_in_zstd_frames(n):
    zstandard = pytest.importorskip("zstandard", reason="the zstd frame checksum is the reference here")
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(data)
    low32 = struct.unpack("<I", frame[-4:])[0]  # a frame's checksum: XXH64's low 32 bits
    assert int(payload_digest_of(data).split(":")[1], 16) & 0xFFFFFFFF == low32


def test_any_split_of_the_stream_gives_the_same_digest():
    data = np.random.default_rng(1).integers(0, 256, 10_000, dtype=np.uint8)
    whole = payload_digest_of(data)
    for cuts in ([1], [5, 31], [32, 32, 33], [7, 1, 2, 3, 4000]):
        h = PayloadHasher()
        pos = 0
        for c in cuts:
            h.update(data[pos:pos + c])
            pos += c
        h.update(data[pos:])
        assert h.digest() == whole
    flipped = data.copy()
    flipped[5000] ^= 1
    assert payload_digest_of(flipped) != whole


def test_older_sha256_digests_still_check():
    data = b"prepared bytes" * 100
    old = "sha256:" + hashlib.sha256(data).hexdigest()
    h = PayloadHasher.matching(old)
    h.update(data)
    assert h.digest() == old
    assert PAYLOAD_DIGEST.match(old) and PAYLOAD_DIGEST.match(payload_digest_of(data))
    assert not PAYLOAD_DIGEST.match("md5:" + "0" * 32)
    with pytest.raises(ValueError, match="unknown payload digest"):
        PayloadHasher("md5")
