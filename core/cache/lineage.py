"""Lineage: the identity of the bytes a packed object was built from, and of the code
that packed them. A cache entry is reused only when both match (docs/cache-format.md,
"Identity").

- The lineage digest covers, in the request's order, every source's name, element type,
  dimensions and content digest. Content digests come from the model (a per-tensor
  SHA-256 or the data file's SHA-1 checksum, verified as the bytes are read) or, for a
  tensor stored inline in the model, from hashing those bytes. A source with neither has
  no identity before it is read: entries built from it are never reused, however they
  were recorded. Paths, sizes and modification times are never identity.
- The kernel ABI names the packer's format and the machine facts the packed bytes depend
  on (byte order, pointer width). The packed format's version travels beside it.
"""
from __future__ import annotations

import hashlib
import json
import struct
import sys
from typing import Mapping

import numpy as np

from onnx_prep.core.model.prepared_key import PrepackRequest
from onnx_prep.core.model.weights import WeightDescriptor

__all__ = ["kernel_abi", "lineage_digest", "packed_format_version", "source_identity", "inline_digest"]


def packed_format_version() -> int:
    from onnx_prep.native.layouts import PACK_FORMAT_VERSION

    return PACK_FORMAT_VERSION


def kernel_abi() -> str:
    """The packer's identity: what must be equal for packed bytes to be readable here."""
    return (f"onnx_prep.native/pack-v{packed_format_version()}/"
            f"{sys.byteorder}-endian/{8 * struct.calcsize('P')}-bit")


def inline_digest(value: np.ndarray) -> str:
    return "sha256:" + hashlib.sha256(np.ascontiguousarray(value).view(np.uint8)).hexdigest()


def source_identity(desc: WeightDescriptor, digest: str) -> dict:
    return {"name": desc.name, "onnx_type": desc.onnx_type, "dims": list(desc.dims), "digest": digest}


def lineage_digest(request: PrepackRequest, weights: Mapping[str, WeightDescriptor],
                   digests: Mapping[str, str | None]) -> str | None:
    """The request's lineage digest from each source's content ``digests[name]``; None
    when some source has no digest (it has no identity yet)."""
    parts = []
    for name in request.source_lineage:
        digest = digests.get(name)
        if digest is None:
            return None
        parts.append(source_identity(weights[name], digest))
    blob = json.dumps(parts, separators=(",", ":"), sort_keys=True).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()
