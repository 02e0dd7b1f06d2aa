"""Payload digests: the checksum a cache entry's stored bytes carry.

A payload digest is written ``<algorithm>:<hex>``. The writer uses ``xxh64`` (XXH64,
seed 0, big-endian hex of the 64-bit value, 16 digits), computed in C at memory speed;
the reader also accepts ``sha256`` (64 digits), what caches were written with before.

NOTE: why a fast checksum rather than SHA-256: this digest detects corruption (a
flipped bit, a torn or truncated write), not tampering: it is stored in the manifest
beside the payload, so whoever can rewrite one can rewrite the other. SHA-256 ran at
~1 GB/s here, as slow as rebuilding the packed object from its sources, which defeated
the cache; XXH64 runs at memory speed. What an entry was built FROM (its lineage) is
still identified by SHA-256 digests of the sources (lineage.py).
"""
from __future__ import annotations

import hashlib
import re

__all__ = ["WRITE_ALGORITHM", "PAYLOAD_DIGEST", "PayloadHasher", "payload_digest_of"]

WRITE_ALGORITHM = "xxh64"
# The forms a reader accepts (manifest validation uses it).
PAYLOAD_DIGEST = re.compile(r"^(xxh64:[0-9a-f]{16}|sha256:[0-9a-f]{64})$")


class PayloadHasher:
    """Streaming digest of one payload in ``algorithm`` (``xxh64`` or ``sha256``):
    ``update(bytes-like)`` then ``digest()`` -> ``"<algorithm>:<hex>"``. The C update
    releases the GIL, so two workers check two payloads at once."""

    __slots__ = ("algorithm", "_state", "_sha")

    def __init__(self, algorithm: str = WRITE_ALGORITHM) -> None:
        self.algorithm = algorithm
        self._sha = None
        if algorithm == "xxh64":
            from onnx_prep.native._module import ffi, lib

            self._state = ffi.new("op_xxh64_state *")
            lib.op_xxh64_reset(self._state, 0)
        elif algorithm == "sha256":
            self._sha = hashlib.sha256()
        else:
            raise ValueError(f"unknown payload digest algorithm {algorithm!r}")

    @classmethod
    def matching(cls, digest: str) -> PayloadHasher:
        """A hasher in the algorithm of ``digest`` (``"xxh64:..."`` or ``"sha256:..."``)."""
        return cls(digest.split(":", 1)[0])

    def update(self, data) -> None:
        if self._sha is not None:
            self._sha.update(data)
            return
        from onnx_prep.native._module import ffi, lib

        mv = memoryview(data).cast("B")
        if mv.nbytes:
            lib.op_xxh64_update(self._state, ffi.from_buffer(mv), mv.nbytes)

    def digest(self) -> str:
        if self._sha is not None:
            return "sha256:" + self._sha.hexdigest()
        from onnx_prep.native._module import lib

        return f"xxh64:{lib.op_xxh64_digest(self._state):016x}"


def payload_digest_of(data, algorithm: str = WRITE_ALGORITHM) -> str:
    """The digest of one whole buffer."""
    h = PayloadHasher(algorithm)
    h.update(data)
    return h.digest()
