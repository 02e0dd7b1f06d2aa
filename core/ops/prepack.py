"""Prepacking: source weights -> the prepared object a kernel reads.

``prepack(kernel_id, request, sources, node_attrs, backend=)`` is what the session's
prepack tasks call. Sources are found by the request's lineage, whose order the kernel
registry fixes (core/kernels/registry.py): ``int4_matmul`` (B, scales[, zero_points]),
``int4_gather`` (data, scales[, zero_points]), ``gemm_packed`` (B,). ``node_attrs`` are
the attributes of (any) consumer node; equal layout keys guarantee any consumer gives
the same bytes.

Backends:
- ``native`` (default): the self-describing ``uint8`` packed buffer of
  ``onnx_prep.native``; this is what the layout key names and what the cache persists.
- ``reference``: the float32 dequantized form the numpy ops read (``int4.py``); for
  tests and for machines without the native module. Never persisted.

Sources are numpy arrays as ``ExternalDataReader.read_array`` returns them (int4/uint4
stay packed uint8) or as ``ResolvedModel.inline_values`` holds them.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from onnx_prep.core.errors import OnnxPrepError, Where
from onnx_prep.core.ops import int4
from onnx_prep.core.ops.attributes import normalize_attributes
from onnx_prep.core.model.prepared_key import PrepackRequest

NATIVE = "native"
REFERENCE = "reference"

# Fused DequantizeLinear+MatMul nodes carry the source layout (core/model/transforms.py).
_QDQ_LAYOUT = "KN"


def _sources(request: PrepackRequest, sources: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    missing = [n for n in request.source_lineage if n not in sources]
    if missing:
        raise OnnxPrepError(f"prepack of {request.key}: source(s) not given: {', '.join(missing)}",
                            Where(tensor=missing[0]))
    return [np.asarray(sources[n]) for n in request.source_lineage]


def prepack(kernel_id: str, request: PrepackRequest, sources: Mapping[str, np.ndarray],
            node_attrs: Mapping[str, Any], *, backend: str = NATIVE,
            out: np.ndarray | None = None) -> np.ndarray:
    """The prepared object for ``request``: uint8 (native) or float32 (reference).

    ``out`` (native only): a uint8 buffer of exactly ``packed_size(...)`` bytes to pack
    into, e.g. a stable-VA slot's view, so the packed bytes are written once, in place."""
    if out is not None and backend != NATIVE:
        raise OnnxPrepError("out= is only supported by the native backend", Where(tensor=request.logical_value))
    attrs = normalize_attributes(node_attrs)
    src = _sources(request, sources)
    if kernel_id == "int4_matmul":
        b, scales, zp = matmul_nbits_sources(src, attrs)
        K, N, bs = int(attrs["K"]), int(attrs["N"]), int(attrs["block_size"])
        if backend == REFERENCE:
            return int4.dequantize_matmul_nbits(b, scales, zp, K=K, N=N, block_size=bs)
        from onnx_prep import native

        return native.prepack_matmul_nbits(
            np.ascontiguousarray(b), np.ascontiguousarray(scales).reshape(-1),
            None if zp is None else np.ascontiguousarray(zp),
            K=K, N=N, block_size=bs, accuracy_level=int(attrs.get("accuracy_level", 0)), out=out)
    if kernel_id == "int4_gather":
        data, scales = src[0], src[1]
        zp = src[2] if len(src) > 2 else None
        bs = int(attrs.get("block_size", 128))
        if backend == REFERENCE:
            return int4.dequantize_block_quantized(data, scales, zp, quantize_axis=int(attrs.get("quantize_axis", 1)),
                                                   block_size=bs, bits=int(attrs.get("bits", 4)))
        from onnx_prep import native

        v = data.shape[0]
        kb = scales.size // v
        return native.prepack_gather_block_quantized(
            np.ascontiguousarray(data).reshape(v, kb, bs // 2),
            np.ascontiguousarray(scales).reshape(v, kb, 1),
            None if zp is None else np.ascontiguousarray(zp), block_size=bs, out=out)
    if kernel_id == "gemm_packed":
        b = src[0].astype(np.float32, copy=False)
        trans_b = bool(int(attrs.get("transB", 0)))
        if backend == REFERENCE:
            return np.ascontiguousarray(b.T if trans_b else b)
        from onnx_prep import native

        return native.prepack_gemm_b(np.ascontiguousarray(b), trans_b=trans_b, out=out)
    raise OnnxPrepError(f"kernel {kernel_id!r} has no prepared form", Where(tensor=request.logical_value))


def matmul_nbits_sources(src: list[np.ndarray], attrs: Mapping[str, Any]
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(B uint8 [N, kb, bs/2], scales [N*kb], zero points or None) in MatMulNBits' form,
    converting a fused DequantizeLinear source (``weight_layout == "KN"``) on the way."""
    K, N, bs = int(attrs["K"]), int(attrs["N"]), int(attrs["block_size"])
    kb = -(-K // bs)
    b, scales = src[0], src[1]
    zp = src[2] if len(src) > 2 else None
    if attrs.get("weight_layout", "NKb") != _QDQ_LAYOUT:
        return b.reshape(N, kb, bs // 2), scales.reshape(-1), zp
    return dq_to_matmul_nbits(b, scales, zp, K=K, N=N, block_size=bs,
                              signed=str(attrs.get("weight_dtype", "int4")) == "int4")


def _codes(packed: np.ndarray, count: int, signed: bool) -> np.ndarray:
    """Unsigned 4-bit codes (offset binary) of ``count`` packed int4/uint4 elements."""
    c = int4.unpack_nibbles(np.asarray(packed, dtype=np.uint8).reshape(-1))[:count]
    # Two's complement int4 -> offset binary (code + 8): flip the sign bit.
    return c ^ np.uint8(8) if signed else c


def dq_to_matmul_nbits(w: np.ndarray, scales: np.ndarray, zp: np.ndarray | None, *, K: int, N: int,
                       block_size: int, signed: bool
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """DequantizeLinear(int4|uint4 [K, N], axis 0, block_size) sources -> MatMulNBits form.

    int4 codes become offset-binary uint4 (code + 8) with zero point zp + 8, so
    ``(code - zp) * scale`` is unchanged; int4 without zero points maps to the
    implicit 8; uint4 without zero points needs an explicit 0 (kernel_registry gives
    that layout ``zp-u4``).
    """
    kb = -(-K // block_size)
    codes = _codes(w, K * N, signed).reshape(K, N).T  # [N, K]
    if kb * block_size != K:
        pad = np.full((N, kb * block_size - K), 8, dtype=np.uint8)
        codes = np.concatenate([codes, pad], axis=1)
    b = int4.pack_nibbles(codes.reshape(N, kb, block_size), -1)  # [N, kb, bs/2]
    s = np.ascontiguousarray(np.asarray(scales).reshape(kb, N).T).reshape(-1)
    if zp is not None:
        z = _codes(zp, kb * N, signed).reshape(kb, N).T  # [N, kb]
    elif not signed:
        z = np.zeros((N, kb), dtype=np.uint8)
    else:
        return b, s, None
    return b, s, int4.pack_nibbles(z, -1)


def packed_size(kernel_id: str | None, request: PrepackRequest, resolved: Any,
                *, backend: str = NATIVE) -> int | None:
    """Exact bytes of the prepared object, from descriptors only (no I/O); None if
    the kernel has no prepared form. ``resolved`` supplies the consumer node's
    attributes and the sources' dims (the plan's size estimate calls this)."""
    node = next((n for n in resolved.nodes if request.key in n.prepared_inputs), None)
    if node is None or kernel_id not in ("int4_matmul", "int4_gather", "gemm_packed"):
        return None
    attrs = normalize_attributes(node.attributes)
    w = resolved.weights
    if kernel_id == "int4_matmul":
        K, N, bs = int(attrs["K"]), int(attrs["N"]), int(attrs["block_size"])
        if backend == REFERENCE:
            return K * N * 4
        from onnx_prep import native

        return int(native.matmul_nbits_packed_size(K=K, N=N, block_size=bs, zero_points=_zp_kind(request.layout),
                                                   accuracy_level=int(attrs.get("accuracy_level", 0))))
    if kernel_id == "int4_gather":
        d = w[request.source_lineage[0]].dims
        v, elems = d[0], int(np.prod(d)) * 2
        if backend == REFERENCE:
            return elems * 4
        bs = int(attrs.get("block_size", 128))
        from onnx_prep import native

        return int(native.gather_packed_size(V=v, n_blocks=elems // v // bs, block_size=bs,
                                             zero_points=_zp_kind(request.layout)))
    b = w[request.source_lineage[0]].dims
    k, n = (b[1], b[0]) if attrs.get("transB", 0) else (b[0], b[1])
    if backend == REFERENCE:
        return k * n * 4
    from onnx_prep import native

    return int(native.gemm_b_packed_size(K=k, N=n))


def _zp_kind(layout: str) -> str:
    """The zero-point kind a layout key names (native/layouts.py: ``.zp-<kind>.``)."""
    return layout.split(".zp-", 1)[1].split(".", 1)[0]


def consumer_node(resolved: Any, key: str):
    """The first node consuming prepared ``key`` (its attributes parameterise the prepack)."""
    node = next((n for n in resolved.nodes if key in n.prepared_inputs), None)
    if node is None:
        raise OnnxPrepError(f"no node consumes prepared object {key}", Where(model=str(resolved.model_path)))
    return node


def prepack_all(resolved: Any, load: Callable[[str], np.ndarray], *, backend: str = NATIVE
                ) -> dict[str, np.ndarray]:
    """Every prepared object of ``resolved``, sequentially: ``load(name)`` returns a source
    array (e.g. ``ExternalDataReader.read_array`` of its descriptor, or an inline value).

    For tests, tools and the direct-replay baseline; the session materializes the same
    objects through its plan's read / prepack tasks instead."""
    out: dict[str, np.ndarray] = {}
    for key, req in resolved.requests.items():
        node = consumer_node(resolved, key)
        sources = {n: load(n) for n in req.source_lineage}
        out[key] = prepack(node.kernel, req, sources, node.attributes, backend=backend)
    return out


def source_loader(resolved: Any, reader: Any) -> Callable[[str], np.ndarray]:
    """``load(name)`` over a resolved model: inline values as they are, external ones
    through ``reader.read_array`` (the one external-data reader)."""
    def load(name: str) -> np.ndarray:
        inline = resolved.inline_values.get(name)
        return inline if inline is not None else reader.read_array(resolved.weights[name])

    return load
