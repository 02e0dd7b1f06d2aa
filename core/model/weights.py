"""WeightDescriptor: what resolution knows about one initializer, without its bytes."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class DigestSource(str, enum.Enum):
    """Where a weight's digest came from. Only the first two are trusted."""

    TENSOR_METADATA = "tensor-metadata"  # sha256 of the tensor's bytes in metadata_props (fine-grained)
    FILE_CHECKSUM = "file-checksum"  # spec `checksum` (sha1 of the whole file) + offset + length (coarse)
    NONE = "none"


# metadata_props key carrying a per-tensor digest, value "sha256:<64 hex>"
TENSOR_DIGEST_KEY = "onnx_prep.sha256"


@dataclass(frozen=True, slots=True)
class WeightDescriptor:
    """Metadata of one initializer. Constructing or reading one never does I/O.

    ``file`` is the external-data location relative to the model's folder, or None
    for a tensor stored inline in the model protobuf (then offset=0 and length is
    the inline byte size). ``digest`` is ``"sha256:<hex>"`` for TENSOR_METADATA or
    ``"sha1:<hex>@<offset>+<length>"`` for FILE_CHECKSUM; None for NONE.
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

    @property
    def external(self) -> bool:
        return self.file is not None

    @property
    def trusted(self) -> bool:
        return self.digest_source is not DigestSource.NONE

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
            "trusted": self.trusted,
        }
