"""Model resolution before weight loading: ``resolve_model(path) -> ResolvedModel``.

Contract: resolution parses the model protobuf WITHOUT its external data and never
opens, maps or reads an external data file (it ``lstat``s them to validate location
and bounds). Everything downstream (plan, runtime, cache) consumes the frozen result.

Steps:
1. parse (``onnx.load(..., load_external_data=False)``) and check structure;
2. a ``WeightDescriptor`` per initializer, digest from (first match):
   ``metadata_props[onnx_prep.sha256] = "sha256:<64 hex>"`` and/or
   ``metadata_props[onnx_prep.xxh3] = "xxh3:<16 hex>"`` (TENSOR_METADATA, fine),
   ``external_data checksum = <40 hex>`` SHA-1 of the whole file, combined with offset
   and length (FILE_CHECKSUM, coarse: any change to the file invalidates every tensor
   in it), else NONE. A digest of the wrong form is a DigestError;
3. ``transforms.run_transforms``: views of an initializer feeding a weight input folded
   (``weight_views``), DequantizeLinear(int4)+MatMul fusion, dead-node and
   unused-initializer pruning;
4. ``kernels_registry.choose_kernel`` per node; a tied embedding's gather takes its LM
   head's request (``tied_embedding``); identical PrepackRequests are one;
5. validate the active external entries (path rules of ``external_data`` and bounds
   from the file size) and freeze the manifest (active external entries, first-use
   order);
6. refuse what ONNX Runtime refuses (``conformance``: the checker and strict inference
   last, after the more precise rules; the contrib ops' rules in their specs' ``match``).
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from onnx_prep.core.kernels import registry as kernels_registry
from onnx_prep.core.kernels.tied_embedding import tie_gathers, unread_initializers
from onnx_prep.core.errors import (
    DigestError,
    ExternalDataError,
    ModelFormatError,
    UsageError,
    Where,
)
from onnx_prep.core.io.external_data import check_bounds, stat_external_file
from onnx_prep.core.model.conformance import (check_onnx_rules, check_single_producers, check_versions,
                                              external_entries)
from onnx_prep.core.model.dtypes import DTYPES
from onnx_prep.core.model.fusion import small_inline_values
from onnx_prep.core.model.model_file import find_model_file, parse_model_file
from onnx_prep.core.model.prepared_key import PrepackRequest, PreparedKey
from onnx_prep.core.model.resolved_model import (
    NodeKernel,
    PayloadManifest,
    ResolutionStats,
    ResolvedModel,
    UnsupportedOp,
    frozen_mapping,
    graph_value_infos,
    readonly_array,
)
from onnx_prep.core.model.transforms import GraphNode, run_transforms
from onnx_prep.core.model.weights import TENSOR_DIGEST_KEY, TENSOR_FAST_DIGEST_KEY, DigestSource, WeightDescriptor

_SHA256 = re.compile(r"^sha256:([0-9a-fA-F]{64})$")
_XXH3 = re.compile(r"^xxh3:([0-9a-fA-F]{16})$")
_SHA1 = re.compile(r"^[0-9a-fA-F]{40}$")


def resolve_model(path: str | os.PathLike, *, trust_symlinks: bool = False,
                  stat_external: bool = True, fuse: bool = True) -> ResolvedModel:
    """Resolve ``path`` (an ``.onnx`` file, or a folder holding exactly one) without
    reading external data. Raises the typed errors of ``core/errors.py``; an op with no
    kernel is not an error here: it is listed in ``ResolvedModel.unsupported``.

    ``stat_external=False`` skips step 5's stat and bounds checks (the preflight's own).
    ``fuse=False`` leaves standard-op patterns as they are (core/model/fusion.py).

    ``trust_symlinks`` accepts external data reached through symlinks or hard links
    (Hugging Face cache snapshots). There is no ISA argument: every ISA reads the same
    packed bytes (``native/layouts.py``), so the result is the same on any machine, and
    the kernel code is chosen where the model runs (``native.active_isa()``).
    """
    t0 = time.perf_counter()
    model_path = find_model_file(Path(path), folder=True)
    # NOTE: abspath, not resolve(): a Hugging Face snapshot's model.onnx is a symlink
    # into blobs/, and its data files must be looked up beside the link, not the blob.
    model_path = Path(os.path.abspath(model_path))
    model_dir = model_path.parent
    ctx = _Context(model=str(model_path))

    proto = parse_model_file(model_path)
    check_versions(proto, ctx.model)
    graph = proto.graph
    opsets = {(o.domain or ""): int(o.version) for o in proto.opset_import}
    if "ai.onnx" in opsets and "" not in opsets:
        opsets[""] = opsets.pop("ai.onnx")

    if len(graph.sparse_initializer):
        # Known gap: sparse initializers (rare in LLM exports) are not resolved.
        raise ModelFormatError("sparse initializers are not supported",
                               Where(model=ctx.model, tensor=graph.sparse_initializer[0].values.name))

    # -- descriptors (no I/O)
    inits = list(graph.initializer)
    descriptors: dict[str, WeightDescriptor] = {}
    by_name: dict[str, TensorProto] = {}
    for t in inits:
        if not t.name:
            raise ModelFormatError("initializer without a name", Where(model=ctx.model))
        if t.name in descriptors:
            raise ModelFormatError("duplicate initializer name", Where(model=ctx.model, tensor=t.name))
        descriptors[t.name] = weight_descriptor(t, ctx.model)
        by_name[t.name] = t

    input_names = [v.name for v in graph.input]
    overridable = set(input_names) & descriptors.keys()
    constants = {n: d for n, d in descriptors.items() if n not in overridable}
    outputs = [v.name for v in graph.output]

    check_single_producers(graph, ctx.model)
    nodes = _graph_nodes(graph, ctx)
    for node in nodes:
        if node.domain not in opsets:
            # The checker's rule; it also catches a file truncated inside opset_import.
            raise ModelFormatError(
                f"node domain {node.domain or 'ai.onnx'!r} has no opset_import (truncated file?)",
                Where(model=ctx.model, node=node.name))
    position = {id(n): i for i, n in enumerate(nodes)}
    nodes = _topological(nodes, set(input_names) | descriptors.keys(), outputs, ctx)
    order = [position[id(n)] for n in nodes]
    nodes_total = len(nodes)

    # -- transforms, kernels
    def inline_value(name: str) -> np.ndarray | None:  # a view's shape: protobuf bytes, never payload
        d = descriptors[name]
        return None if d.file is not None else _inline_value(by_name[name], d, ctx)

    try:
        result = run_transforms(nodes, constants, outputs, descriptors.keys(), inline_value, fuse=fuse,
                                inline_values=small_inline_values(constants, by_name) if fuse else None)
    except ModelFormatError as exc:  # a fold's refusal: the model is named here
        raise ModelFormatError(exc.message, replace(exc.where, model=ctx.model), exc.hint) from None
    local_functions = frozenset((f.domain, f.name) for f in proto.functions)
    requests: dict[PreparedKey, PrepackRequest] = {}
    kernels: list[NodeKernel] = []
    unsupported: dict[tuple[str, str], list[str]] = {}
    choices = []
    for node in result.nodes:
        try:
            choices.append(kernels_registry.choose_kernel(node, constants, opsets=opsets,
                                                          local_functions=local_functions))
        except ModelFormatError as exc:  # a kernel spec's rule: the model is named here
            raise ModelFormatError(exc.message, replace(exc.where, model=ctx.model), exc.hint) from None
    choices = tie_gathers(result.nodes, choices, constants)  # a tied embedding reads its LM head's object
    for index, (node, choice) in enumerate(zip(result.nodes, choices)):
        for req in choice.requirements:
            requests.setdefault(req.key, req)
        if choice.kernel is None:
            unsupported.setdefault((node.op_type, node.domain), []).append(node.name)
        kernels.append(NodeKernel(
            index=index, name=node.name, op_type=node.op_type, domain=node.domain,
            inputs=tuple(node.inputs), outputs=tuple(node.outputs),
            attributes=frozen_mapping(node.attributes), kernel=choice.kernel,
            requirements=choice.requirements, prepared_inputs=choice.prepared_inputs,
            fused_from=node.fused_from, implicit_inputs=tuple(node.implicit_inputs),
        ))

    # -- active weights: validate external entries, collect inline values
    unread = unread_initializers(result.nodes, choices, outputs)
    active = [descriptors[n] for n in result.used_initializers if n not in unread]
    sizes: dict[str, int] = {}
    inline_values: dict[str, np.ndarray] = {}
    for d in active:
        if d.file is None:
            inline_values[d.name] = _inline_value(by_name[d.name], d, ctx)
            continue
        if not stat_external:
            continue
        where = Where(model=ctx.model, tensor=d.name, file=d.file, offset=d.offset)
        if d.file not in sizes:
            sizes[d.file] = stat_external_file(model_dir, d.file, trust_symlinks=trust_symlinks,
                                               where=where).st_size
        check_bounds(d.offset, d.length, sizes[d.file], where)
    check_onnx_rules(proto, order, ctx.model)  # after our own, more precise, messages

    manifest = PayloadManifest(tuple(d for d in active if d.file is not None))
    stats = ResolutionStats(
        nodes_total=nodes_total, nodes_kept=len(kernels),
        initializers_total=len(descriptors), initializers_active=len(active),
        fused_int4_matmuls=result.fused_int4_matmuls,
        resolve_ms=(time.perf_counter() - t0) * 1000.0,
    )
    graph_inputs, graph_outputs = graph_value_infos(graph)
    return ResolvedModel(
        model_path=model_path, model_dir=model_dir, opsets=frozen_mapping(opsets),
        inputs=graph_inputs, outputs=graph_outputs,
        nodes=tuple(kernels),
        weights=frozen_mapping({d.name: d for d in active}),
        inline_values=frozen_mapping(inline_values),
        requests=frozen_mapping(requests),
        manifest=manifest,
        unsupported=tuple(UnsupportedOp(op, dom, tuple(names)) for (op, dom), names in unsupported.items()),
        stats=stats,
        metadata=frozen_mapping({p.key: p.value for p in proto.metadata_props}),
        folded_views=tuple(result.folded_views),
        fusion_enabled=fuse, fusions=tuple(result.fusions), near_misses=tuple(result.near_misses),
    )


class _Context:
    __slots__ = ("model",)

    def __init__(self, model: str) -> None:
        self.model = model


# ------------------------------------------------------------------------- parsing

def weight_descriptor(t: TensorProto, model: str) -> WeightDescriptor:
    """One initializer's descriptor, from its protobuf fields only (no I/O), or the typed
    error of its first problem (the preflight asks tensor by tensor)."""
    name = t.name

    def where(file: str | None = None, offset: int | None = None) -> Where:
        return Where(model=model, tensor=name, file=file, offset=offset)

    dt = DTYPES.get(t.data_type)
    if dt is None:
        raise ModelFormatError(f"initializer has unknown data type {t.data_type}", where())
    dtype = dt.name
    dims = tuple(t.dims)
    numel = 1
    for d in dims:
        if d < 0:
            raise ModelFormatError(f"initializer has negative dims {list(dims)}", where())
        numel *= d
    nbytes = dt.nbytes(numel)

    tensor_digest = fast_digest = None
    for prop in t.metadata_props:
        if prop.key == TENSOR_DIGEST_KEY:
            tensor_digest = _recorded_digest(prop, _SHA256, "sha256:<64 hex>", where)
        elif prop.key == TENSOR_FAST_DIGEST_KEY:
            fast_digest = _recorded_digest(prop, _XXH3, "xxh3:<16 hex>", where)
    tensor_digest = tensor_digest or fast_digest

    if t.data_location != TensorProto.EXTERNAL:
        source = DigestSource.NONE if tensor_digest is None else DigestSource.TENSOR_METADATA
        return WeightDescriptor(name, dtype, t.data_type, dims, None, 0, nbytes, tensor_digest, source, fast_digest)

    ext = external_entries(t, where())
    location = ext.get("location")
    if not location:
        raise ExternalDataError("external data entry has no location", where())
    offset = int(ext.get("offset", "0"))  # external_entries checked the digits
    if offset < 0:
        raise ExternalDataError(f"negative external data offset {offset}", where(location, offset))
    if t.data_type == TensorProto.STRING:
        raise ModelFormatError("string tensors cannot be stored as external data", where(location, offset))
    if "length" in ext:
        length = int(ext["length"])
        if length < 0:
            raise ExternalDataError(f"negative external data length {length}", where(location, offset))
        if length != nbytes:
            raise ExternalDataError(
                f"external data length {length} does not match the tensor's size {nbytes} "
                f"({dtype} {list(dims)})", where(location, offset))
    else:
        # NOTE: ONNX reads to the end of the file when length is absent; we take the exact
        # size the dims and dtype give, and the bounds check still applies.
        length = nbytes

    if tensor_digest is not None:
        digest, source = tensor_digest, DigestSource.TENSOR_METADATA
    elif "checksum" in ext:
        checksum = ext["checksum"]
        if _SHA1.match(checksum) is None:
            raise DigestError(f"external data checksum is not a SHA-1 (40 hex digits): {checksum[:80]!r}",
                              where(location, offset),
                              hint="the ONNX checksum key holds the SHA-1 of the whole data file")
        digest, source = f"sha1:{checksum.lower()}@{offset}+{length}", DigestSource.FILE_CHECKSUM
    else:
        digest, source = None, DigestSource.NONE
    return WeightDescriptor(name, dtype, t.data_type, dims, location, offset, length, digest, source, fast_digest)


def _recorded_digest(prop, form: re.Pattern, spelled: str, where) -> str:
    """A per-tensor digest from ``metadata_props`` in its canonical form (lowercase hex),
    or a DigestError naming the key and what it holds."""
    m = form.match(prop.value)
    if m is None:
        raise DigestError(f"metadata_props {prop.key} is not '{spelled}': {prop.value[:80]!r}", where())
    return f"{prop.value.split(':', 1)[0]}:{m.group(1).lower()}"


def _inline_value(t: TensorProto, d: WeightDescriptor, ctx: _Context) -> np.ndarray:
    """An inline initializer as a read-only array, in the form ``ExternalDataReader.
    read_array`` gives for external tensors (sub-byte types packed uint8)."""
    where = Where(model=ctx.model, tensor=t.name)
    try:
        if DTYPES[d.onnx_type].packed:
            if t.raw_data:
                raw = np.frombuffer(t.raw_data, dtype=np.uint8)
            else:  # int32_data holds one packed byte per element
                raw = np.asarray(t.int32_data, dtype=np.int64).astype(np.uint8)
            if raw.size != d.length:
                raise ValueError(f"{raw.size} packed bytes, expected {d.length}")
            from onnx_prep.core.io.external_data import as_array

            return readonly_array(as_array(d, raw))
        arr = numpy_helper.to_array(t)
    except Exception as exc:  # noqa: BLE001 - inconsistent tensor payload in the protobuf
        raise ModelFormatError(f"inline initializer is malformed ({exc})", where) from None
    return readonly_array(arr)


_ATTR_FAST = {
    AttributeProto.INT: lambda a: a.i,
    AttributeProto.FLOAT: lambda a: a.f,
    AttributeProto.STRING: lambda a: a.s.decode("utf-8", errors="replace"),
    AttributeProto.INTS: lambda a: tuple(a.ints),
    AttributeProto.FLOATS: lambda a: tuple(a.floats),
    AttributeProto.STRINGS: lambda a: tuple(v.decode("utf-8", errors="replace") for v in a.strings),
}


def _plain_attr(a: AttributeProto, node_name: str, ctx: _Context) -> Any:
    """An attribute in the plain form ``core/ops/attributes.py`` documents: int, float,
    str, tuples of those, read-only ``np.ndarray`` for tensors, GraphProto unchanged."""
    fast = _ATTR_FAST.get(a.type)
    if fast is not None:
        return fast(a)
    if a.type == AttributeProto.TENSOR:
        if a.t.data_location == TensorProto.EXTERNAL:
            # Known gap: external data inside node attributes is not resolved.
            raise ModelFormatError("external data in a node attribute is not supported",
                                   Where(model=ctx.model, node=node_name, tensor=a.t.name or None))
        return readonly_array(numpy_helper.to_array(a.t))
    if a.type == AttributeProto.TENSORS:
        return tuple(readonly_array(numpy_helper.to_array(t)) for t in a.tensors)
    value = helper.get_attribute_value(a)
    return tuple(value) if isinstance(value, list) else value


def _outer_names(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads from enclosing scopes."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer} | \
        {t.values.name for t in graph.sparse_initializer}
    used: set[str] = set()
    for node in graph.node:
        for name in node.input:
            if name and name not in defined:
                used.add(name)
        for a in node.attribute:
            for g in ([a.g] if a.type == AttributeProto.GRAPH else list(a.graphs)):
                used |= {n for n in _outer_names(g) if n not in defined}
        defined.update(node.output)
    used |= {v.name for v in graph.output if v.name not in defined}
    return used


def _graph_nodes(graph: onnx.GraphProto, ctx: _Context) -> list[GraphNode]:
    nodes: list[GraphNode] = []
    names: set[str] = set()
    for i, n in enumerate(graph.node):
        # NOTE: node names are optional and need not be unique in ONNX; NodeKernel names
        # identify nodes (fused_from, errors, plans), so they are made unique here.
        name = n.name or f"{n.op_type}_{i}"
        if name in names:
            name = f"{name}#{i}"
        names.add(name)
        implicit: tuple[str, ...] = ()
        attrs = {}
        for a in n.attribute:
            if a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS):
                for g in ([a.g] if a.type == AttributeProto.GRAPH else list(a.graphs)):
                    implicit += tuple(sorted(_outer_names(g) - set(implicit)))
                    if any(t.data_location == TensorProto.EXTERNAL for t in g.initializer):
                        raise ModelFormatError("external data inside a subgraph is not supported",
                                               Where(model=ctx.model, node=name))
            attrs[a.name] = _plain_attr(a, name, ctx)
        domain = "" if n.domain in ("", "ai.onnx") else n.domain
        nodes.append(GraphNode(name, n.op_type, domain, list(n.input), list(n.output), attrs, implicit))
    return nodes


def _topological(nodes: list[GraphNode], defined: set[str], outputs: Iterable[str],
                 ctx: _Context) -> list[GraphNode]:
    """``nodes`` in topological order (ONNX requires it; a stable sort repairs a model
    that is merely out of order). A value no node, input or initializer defines is a
    ModelFormatError naming the node and value (a truncated or hand-edited file)."""
    produced = {o: i for i, n in enumerate(nodes) for o in n.outputs if o}
    known = set(defined)
    in_order = True
    for node in nodes:
        for name in (*node.inputs, *node.implicit_inputs):
            if name and name not in known:
                if name not in produced:
                    raise ModelFormatError(f"node reads undefined value {name!r}",
                                           Where(model=ctx.model, node=node.name))
                in_order = False
        known.update(node.outputs)
    for name in outputs:
        if name not in known:
            raise ModelFormatError(f"graph output {name!r} is not produced by any node",
                                   Where(model=ctx.model))
    if in_order:
        return nodes
    import heapq

    deps = [{produced[x] for x in n.reads() if x in produced and x not in defined} for n in nodes]
    users: dict[int, list[int]] = {}
    for i, ds in enumerate(deps):
        for d in ds:
            users.setdefault(d, []).append(i)
    pending = [len(ds) for ds in deps]
    ready = [i for i, c in enumerate(pending) if c == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users.get(i, ()):
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(nodes):
        stuck = next(n for i, n in enumerate(nodes) if pending[i] > 0)
        raise ModelFormatError("graph has a cycle", Where(model=ctx.model, node=stuck.name))
    return [nodes[i] for i in order]
