"""WeightDescriptor: what resolution knows about one initializer, without its bytes."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class DigestSource(str, enum.Enum):
    """Where a weight's digest came from. Only the first two are trusted."""

    TENSOR_METADATA = "tensor-metadata"  # sha256 and/or xxh3 of the tensor's bytes in metadata_props (fine)
    FILE_CHECKSUM = "file-checksum"  # spec `checksum` (sha1 of the whole file) + offset + length (coarse)
    NONE = "none"


# metadata_props keys carrying a per-tensor digest: "sha256:<64 hex>" and "xxh3:<16 hex>"
# (XXH3-64 of the same bytes; core/io/content_digest.py). ``onnx-prep digest`` records
# both. A load checks the XXH3 one when the model has it: same protection against a
# changed or torn data file, at ~16x the speed (content_digest.py says why).
TENSOR_DIGEST_KEY = "onnx_prep.sha256"
TENSOR_FAST_DIGEST_KEY = "onnx_prep.xxh3"


@dataclass(frozen=True, slots=True)
class WeightDescriptor:
    """Metadata of one initializer. Constructing or reading one never does I/O.

    ``file`` is the external-data location relative to the model's folder, or None
    for a tensor stored inline in the model protobuf (then offset=0 and length is
    the inline byte size). ``digest`` is the weight's identity: ``"sha256:<hex>"`` for
    TENSOR_METADATA (``"xxh3:<hex>"`` where the model records only that one) or
    ``"sha1:<hex>@<offset>+<length>"`` for FILE_CHECKSUM; None for NONE.
    ``fast_digest`` is the ``"xxh3:<hex>"`` the model records beside it, or None.
    """

    name: str
    dtype: str  # numpy-style name: "uint8", "float32", "float16", "int4", "uint4", ...
    onnx_type: int  # onnx.TensorProto.DataType value
    dims: tuple[int, ...]
    file: str | None
    offset: int
    length: int
    digest: str | None
    digest_source: DigestSource
    fast_digest: str | None = None

    @property
    def external(self) -> bool:
        return self.file is not None

    @property
    def trusted(self) -> bool:
        return self.digest_source is not DigestSource.NONE

    @property
    def load_digest(self) -> str | None:
        """The per-tensor digest a load checks: the XXH3 one where recorded, else the
        identity (None unless TENSOR_METADATA)."""
        if self.digest_source is not DigestSource.TENSOR_METADATA:
            return None
        return self.fast_digest or self.digest

    @property
    def tensor_digests(self) -> tuple[str, ...]:
        """Every per-tensor digest the model records (``check --verify-payloads`` checks
        them all)."""
        if self.digest_source is not DigestSource.TENSOR_METADATA:
            return ()
        return tuple(dict.fromkeys(d for d in (self.digest, self.fast_digest) if d))

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "dims": list(self.dims),
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
            "digest": self.digest,
            "digest_source": self.digest_source.value,
            "fast_digest": self.fast_digest,
            "trusted": self.trusted,
        }
