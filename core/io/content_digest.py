"""Content digests: a streaming hash of bytes, named ``<algorithm>:<hex>``.

One hasher for every digest this package checks: a weight's bytes as a model records
them (``onnx_prep.xxh3`` and ``onnx_prep.sha256`` in an initializer's
``metadata_props``; core/model/weights.py) and a cache entry's stored payload
(core/cache/payload_digest.py). The algorithms:

- ``xxh3``: XXH3-64, seed 0, the default secret; big-endian hex of the 64-bit value,
  16 digits. In C at memory speed (native/checksum.c; AVX2 / AVX-512 stripe loops).
- ``xxh64``: XXH64, seed 0, 16 digits (cache format version 2).
- ``sha256``: 64 digits, through hashlib (OpenSSL; SHA-NI where the CPU has it).

NOTE: which one a reader checks. A digest stored beside the bytes it covers (in the same
model, in the same manifest) detects corruption: a torn copy, a data file replaced by
another version, a flipped bit. It cannot detect tampering, since whoever can rewrite
the bytes can rewrite the digest too; so a 64-bit non-cryptographic hash does the job,
at ~16x SHA-256's speed on this project's machines (30 vs 1.9 GB/s a core,
scripts/bench_checksum.py). SHA-256 stays where identity across many files matters (a
cache entry's source lineage) and for ``check --verify-payloads``.
"""
from __future__ import annotations

import hashlib
import re

__all__ = ["ALGORITHMS", "DIGEST_FORM", "ContentHasher", "digest_of"]

ALGORITHMS = ("xxh3", "xxh64", "sha256")
# "<algorithm>:<lowercase hex>" of every algorithm above.
DIGEST_FORM = re.compile(r"^((xxh3|xxh64):[0-9a-f]{16}|sha256:[0-9a-f]{64})$")


class ContentHasher:
    """Streaming digest in ``algorithm`` (one of :data:`ALGORITHMS`): ``update(bytes-like)``
    then ``digest()`` -> ``"<algorithm>:<hex>"``. The C update releases the GIL, and so
    does hashlib's for large buffers, so two workers hash two buffers at once. ``isa``
    picks the XXH3 loop (None: the kernels' ISA, ``ONNX_PREP_ISA`` or the best detected;
    every ISA gives the same digest)."""

    __slots__ = ("algorithm", "_state", "_sha", "_update", "_digest")

    def __init__(self, algorithm: str = "xxh3", *, isa: str | None = None) -> None:
        self.algorithm = algorithm
        self._sha = None
        if algorithm == "xxh3":
            from onnx_prep.native._module import check, ffi, lib
            from onnx_prep.native.isa import isa_id

            self._state = ffi.new("op_xxh3_state *")
            lib.op_xxh3_reset(self._state)
            check(lib.op_xxh3_set_isa(self._state, isa_id(isa)), "content digest (xxh3)")
            self._update, self._digest = lib.op_xxh3_update, lib.op_xxh3_digest
        elif algorithm == "xxh64":
            from onnx_prep.native._module import ffi, lib

            self._state = ffi.new("op_xxh64_state *")
            lib.op_xxh64_reset(self._state, 0)
            self._update, self._digest = lib.op_xxh64_update, lib.op_xxh64_digest
        elif algorithm == "sha256":
            self._sha = hashlib.sha256()
        else:
            raise ValueError(f"unknown digest algorithm {algorithm!r}")

    @classmethod
    def matching(cls, digest: str) -> ContentHasher:
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


def digest_of(data, algorithm: str = "xxh3") -> str:
    """The digest of one whole buffer."""
    h = ContentHasher(algorithm)
    h.update(data)
    return h.digest()
