"""Payload digests: the checksum a cache entry's stored bytes carry.

A payload digest is written ``<algorithm>:<hex>`` (core/io/content_digest.py, which
hashes). The writer uses ``xxh3`` (XXH3-64, seed 0, the default secret; big-endian hex
of the 64-bit value, 16 digits), computed in C at memory speed. A reader checks an
entry in the algorithm its digest names, so caches written before stay valid:
``xxh64`` (XXH64, seed 0, 16 digits; format version 2) and ``sha256`` (64 digits;
version 1).

NOTE: why a fast checksum rather than SHA-256: this digest detects corruption (a
flipped bit, a torn or truncated write), not tampering: it is stored in the manifest
beside the payload, so whoever can rewrite one can rewrite the other. SHA-256 ran at
~1 GB/s here, as slow as rebuilding the packed object from its sources, which defeated
the cache. What an entry was built FROM (its lineage) is still identified by SHA-256
digests of the sources (lineage.py).

NOTE: why XXH3 rather than XXH64: checking the digests is most of what a load from the
cache costs once its payloads are mapped, and XXH3's long-input loop runs on SIMD
lanes (AVX2, AVX-512; native/checksum_simd.c) where XXH64 is one multiply chain per
lane: over the 582 MiB medium cache file, mapped fresh, 2 threads (the reference's code,
the `xxhash` package), XXH64 took 25 ms and XXH3 18.5 ms (1 thread: 34 vs 22 ms);
scripts/bench_checksum.py prints the rates of this module's three algorithms.
"""
from __future__ import annotations

from onnx_prep.core.io.content_digest import ALGORITHMS, DIGEST_FORM, ContentHasher, digest_of

__all__ = ["ALGORITHMS", "WRITE_ALGORITHM", "PAYLOAD_DIGEST", "PayloadHasher", "payload_digest_of"]

WRITE_ALGORITHM = "xxh3"
# The forms a reader accepts (manifest validation uses it): every content digest.
PAYLOAD_DIGEST = DIGEST_FORM
# A payload's hasher is the content hasher (core/io/content_digest.py).
PayloadHasher = ContentHasher


def payload_digest_of(data, algorithm: str = WRITE_ALGORITHM) -> str:
    """The digest of one whole buffer."""
    return digest_of(data, algorithm)
