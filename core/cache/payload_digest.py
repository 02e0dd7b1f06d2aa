"""Payload digests: the checksum a cache entry's stored bytes carry.

A payload digest is written ``<algorithm>:<hex>``. The writer uses ``xxh3`` (XXH3-64,
seed 0, the default secret; big-endian hex of the 64-bit value, 16 digits), computed
in C at memory speed. A reader checks an entry in the algorithm its digest names, so
caches written before stay valid: ``xxh64`` (XXH64, seed 0, 16 digits; format version
2) and ``sha256`` (64 digits; version 1).

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

import hashlib
import re

__all__ = ["ALGORITHMS", "WRITE_ALGORITHM", "PAYLOAD_DIGEST", "PayloadHasher", "payload_digest_of"]

WRITE_ALGORITHM = "xxh3"
ALGORITHMS = ("xxh3", "xxh64", "sha256")  # what a reader checks
# The forms a reader accepts (manifest validation uses it).
PAYLOAD_DIGEST = re.compile(r"^((xxh3|xxh64):[0-9a-f]{16}|sha256:[0-9a-f]{64})$")


class PayloadHasher:
    """Streaming digest of one payload in ``algorithm`` (one of :data:`ALGORITHMS`):
    ``update(bytes-like)`` then ``digest()`` -> ``"<algorithm>:<hex>"``. The C update
    releases the GIL, so two workers check two payloads at once. ``isa`` picks the
    XXH3 loop (None: the kernels' ISA, ``ONNX_PREP_ISA`` or the best detected; every
    ISA gives the same digest)."""

    __slots__ = ("algorithm", "_state", "_sha", "_update", "_digest")

    def __init__(self, algorithm: str = WRITE_ALGORITHM, *, isa: str | None = None) -> None:
        self.algorithm = algorithm
        self._sha = None
        if algorithm == "xxh3":
            from onnx_prep.native._module import check, ffi, lib
            from onnx_prep.native.isa import isa_id

            self._state = ffi.new("op_xxh3_state *")
            lib.op_xxh3_reset(self._state)
            check(lib.op_xxh3_set_isa(self._state, isa_id(isa)), "payload digest (xxh3)")
            self._update, self._digest = lib.op_xxh3_update, lib.op_xxh3_digest
        elif algorithm == "xxh64":
            from onnx_prep.native._module import ffi, lib

            self._state = ffi.new("op_xxh64_state *")
            lib.op_xxh64_reset(self._state, 0)
            self._update, self._digest = lib.op_xxh64_update, lib.op_xxh64_digest
        elif algorithm == "sha256":
            self._sha = hashlib.sha256()
        else:
            raise ValueError(f"unknown payload digest algorithm {algorithm!r}")

    @classmethod
    def matching(cls, digest: str) -> PayloadHasher:
        """A hasher in the algorithm of ``digest`` (``"xxh3:..."``, ``"xxh64:..."`` or
        ``"sha256:..."``)."""
        return cls(digest.split(":", 1)[0])

    def update(self, data) -> None:
        if self._sha is not None:
            self._sha.update(data)
            return
        from onnx_prep.native._module import ffi

        mv = memoryview(data).cast("B")
        if mv.nbytes:
            self._update(self._state, ffi.from_buffer(mv), mv.nbytes)

    def digest(self) -> str:
        if self._sha is not None:
            return "sha256:" + self._sha.hexdigest()
        return f"{self.algorithm}:{self._digest(self._state):016x}"


def payload_digest_of(data, algorithm: str = WRITE_ALGORITHM) -> str:
    """The digest of one whole buffer."""
    h = PayloadHasher(algorithm)
    h.update(data)
    return h.digest()
