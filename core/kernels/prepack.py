"""Prepacking: source weights -> the prepared object a kernel reads, through the
kernel's spec (``PreparedForm``).

``prepack(kernel_id, request, sources, node_attrs, backend=)`` is what the session's
prepack tasks call. Sources are found by the request's lineage, whose order the
kernel's ``match`` fixes. ``kernel_id`` and ``node_attrs`` are the packing node's
(``packing_nodes``): the first consumer whose kernel's layout the key names; equal
layout keys guarantee any such consumer gives the same bytes. (A tied embedding's
gather consumes its LM head's ``int4mm`` object: the matmul's node packs it.)

Backends (spec.py): ``native`` (default), the self-describing ``uint8`` packed buffer
of ``onnx_prep.native``, what the layout key names and the cache persists;
``reference``, the float32 form the numpy ops read, for tests and for machines without
the native module, never persisted.

On a device (the device plan, core/plan/device_recipes.py), ``device_recipes`` says
how the object gets there: packed here and uploaded, or uploaded as sources and packed
on the device, as the kernel's spec offers and prefers (spec.py, ``DevicePacking``).

Sources are numpy arrays as ``ExternalDataReader.read_array`` returns them (int4/uint4
stay packed uint8) or as ``ResolvedModel.inline_values`` holds them.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import numpy as np

from onnx_prep.core.errors import OnnxPrepError, UnsupportedOpError, Where
from onnx_prep.core.kernels.registry import kernel_spec
from onnx_prep.core.kernels.spec import HOST_PREPACK_ONLY, NATIVE, REFERENCE, PreparedForm
from onnx_prep.core.model.prepared_key import PrepackRequest
from onnx_prep.core.ops.attributes import normalize_attributes

__all__ = ["NATIVE", "REFERENCE", "consumer_node", "device_recipes", "packed_size", "packing_nodes", "prepack", "prepack_all",
           "source_loader"]


def _prepared_form(kernel_id: str | None) -> PreparedForm | None:
    try:
        return kernel_spec(kernel_id).prepared
    except UnsupportedOpError:
        return None


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
    form = _prepared_form(kernel_id)
    if form is None:
        raise OnnxPrepError(f"kernel {kernel_id!r} has no prepared form", Where(tensor=request.logical_value))
    return form.prepack(_sources(request, sources), normalize_attributes(node_attrs), backend, out)


def packed_size(kernel_id: str | None, request: PrepackRequest, resolved: Any,
                *, backend: str = NATIVE, node: Any = None) -> int | None:
    """Exact bytes of the prepared object, from descriptors only (no I/O); None if
    the kernel has no prepared form. ``resolved`` supplies the consumer node's
    attributes (``node``, when the caller has it) and the sources' dims (the plan's size
    estimate calls this)."""
    if node is None:
        node = packing_nodes(resolved.nodes).get(request.key)
    form = _prepared_form(kernel_id)
    if node is None or form is None:
        return None
    return form.packed_size(request, normalize_attributes(node.attributes), resolved.weights, backend)


def device_recipes(kernel_id: str | None, device: str, source_bytes: int, packed_bytes: int,
                   node_attrs: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """The recipes that put ``kernel_id``'s prepared object on ``device``, the one the
    kernel prefers for these sizes first (``spec.HOST_PREPACK`` / ``spec.DEVICE_PREPACK``);
    with the packing node's ``node_attrs``, only those that pack that node's object."""
    form = _prepared_form(kernel_id)
    packing = form.device_packing(device) if form is not None else HOST_PREPACK_ONLY
    attrs = None if node_attrs is None else normalize_attributes(node_attrs)
    return packing.recipes(source_bytes, packed_bytes, attrs)


def packing_nodes(nodes: Iterable[Any]) -> dict[str, Any]:
    """Each prepared key's packing node, whose kernel and attributes make its bytes: the
    first consumer whose kernel's layout is the key's (``PreparedForm.layout_name``,
    the layout's first field), else its first consumer."""
    first: dict[str, Any] = {}
    owner: dict[str, Any] = {}
    for node in nodes:
        for key in node.prepared_inputs:
            first.setdefault(key, node)
            if key not in owner:
                form = _prepared_form(node.kernel)
                if form is not None and key.rsplit("|", 2)[1].split(".", 1)[0] == form.layout_name:
                    owner[key] = node
    return {k: owner.get(k, n) for k, n in first.items()}


def consumer_node(resolved: Any, key: str):
    """The node packing prepared ``key`` (``packing_nodes``: its kernel and attributes
    parameterise the prepack)."""
    node = packing_nodes(resolved.nodes).get(key)
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
    packers = packing_nodes(resolved.nodes)
    for key, req in resolved.requests.items():
        node = packers.get(key) or consumer_node(resolved, key)
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
