"""PreparedExecutionPlan: ONE immutable, scope-aware task graph built from a frozen
ResolvedModel (docs/design.md, "One scoped execution plan").

Session-scoped tasks materialize prepared objects (read source -> prepack, or read a
packed payload from a cache: on the MAPPED resource when the cache maps it into the
slot, which reads no storage a source read waits for; else on IO); invocation-scoped tasks replay contiguous ranges of the
model's action list. Every invocation step depends on the previous step and on the
tasks that publish the prepared objects it consumes -- nothing else, so a run never
waits for an initialization barrier.

Invocation steps: a new step begins at every node that consumes a prepared object
(nodes before the first such node form a leading step). For a transformer with fused
qkv / gate_up that gives: embedding, then per block qkv, attn_out,
gate_up, down, then the LM head.

Precomputed here, once: invocation order, one bit per prepared requirement and the
bitset each step needs, the last step that pins each requirement, the last action that
reads each activation, and per requirement its prefetch distance (the first step that
needs it) and bytes (read + packed).

A plan built for a device (``device=DeviceTarget(...)``, core/plan/device_target.py)
puts every prepared object a step pins on that device: the same reads, then uploads
and, where the kernel prefers it, a prepack on the device, by the recipes of
``core/plan/device_recipes.py``; its steps run on the device queue and depend on the
tasks that publish the device objects. Without a target (the default) the plan is the
CPU plan, as it has always been.

The plan holds no mutable state. ``build_prepared_execution_plan`` accepts only a frozen
``ResolvedModel`` and creates read tasks only for entries of its payload manifest.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping, Protocol

from onnx_prep.core.plan.task import Arena
from onnx_prep.core.errors import OnnxPrepError, Where
from onnx_prep.core.model.prepared_key import PrepackRequest, PreparedKey
from onnx_prep.core.model.resolved_model import NodeKernel, ResolvedModel, require_frozen
from onnx_prep.core.plan.task import ResourceClass, TaskDescriptor, TaskId, TaskKind, TaskScope
from onnx_prep.core.model.weights import WeightDescriptor

if TYPE_CHECKING:
    from onnx_prep.core.plan.device_target import DeviceTarget

# Recipe kinds, cheapest first.
READ_PACKED_PAYLOAD = "read_packed_payload"
READ_SOURCE_AND_PREPACK = "read_source_and_prepack"
READ_SOURCE = "read_source"  # RAW requirements: the source bytes are the prepared object

# Layout of a RAW requirement: an external weight a node reads unpacked (norm weights,
# tables). Its read task publishes it; it lives in the Prepared arena like packed objects.
RAW_LAYOUT = "raw"


def raw_request(weight: str, device: str = "cpu") -> PrepackRequest:
    return PrepackRequest(logical_value=weight, source_lineage=(weight,), layout=RAW_LAYOUT,
                          device=device)


@dataclass(frozen=True, slots=True)
class PackedPayloadEntry:
    """A compatible persisted payload for one prepared key (from a prepared cache).
    ``mapped``: its stored bytes are to be mapped into the key's slot, not read (the
    plan then runs its read on the MAPPED resource: no storage read to queue behind)."""

    key: PreparedKey
    file: str
    offset: int
    length: int
    mapped: bool = False


class PackedPayloadIndex(Protocol):
    """What the plan and the runtime need from a prepared cache
    (``core/cache/prepared_cache.py`` is the implementation).

    ``lookup``: a compatible entry per request, or None. Compatibility (lineage digest,
    layout, device, ABI, format, size) is the cache's job; the plan only selects the
    cheapest eligible recipe. ``read_into``: the entry's packed bytes into the key's
    slot view, checked; False when the entry proves unusable (the caller then builds the
    object from its sources). ``mapping``: ``(fd, offset)`` where the entry's bytes can be
    mapped into the slot instead of read (None: read them); ``accept_mapped``: the check
    of a mapped entry, as ``read_into``'s; ``mapped_damaged``: a mapped entry whose file
    shrank under it, recorded (False: rebuild it). ``persists``/``persist``: whether a packed object the
    session builds is to be written back, and handing it over (a pinned view; ``done()``
    unpins it once written); ``flush``: wait until every object handed over is written
    and unpinned (a session's close calls it before releasing its objects)."""

    def lookup(self, request: PrepackRequest) -> PackedPayloadEntry | None: ...

    def read_into(self, entry: PackedPayloadEntry, out: Any) -> bool: ...

    def mapping(self, entry: PackedPayloadEntry) -> tuple[int, int] | None: ...

    def accept_mapped(self, entry: PackedPayloadEntry, view: Any) -> bool: ...

    def mapped_damaged(self, entry: PackedPayloadEntry) -> bool: ...

    def persists(self, request: PrepackRequest) -> bool: ...

    def persist(self, request: PrepackRequest, packed: Any, source_digests: Mapping[str, str | None],
                done: Any) -> None: ...

    def flush(self) -> None: ...


@dataclass(frozen=True, slots=True)
class MaterializationRecipe:
    """One way to produce a prepared key. Every recipe publishes the same key."""

    kind: str  # READ_PACKED_PAYLOAD | READ_SOURCE_AND_PREPACK | READ_SOURCE (raw)
    sources: tuple[str, ...] = ()  # external source weights read (READ_SOURCE_AND_PREPACK)
    payload: PackedPayloadEntry | None = None  # READ_PACKED_PAYLOAD

    def to_json(self) -> dict:
        out: dict[str, Any] = {"kind": self.kind}
        if self.sources:
            out["sources"] = list(self.sources)
        if self.payload is not None:
            out["payload"] = {"file": self.payload.file, "offset": self.payload.offset,
                              "length": self.payload.length, "mapped": self.payload.mapped}
        return out


@dataclass(frozen=True, slots=True)
class PreparedRequirement:
    key: PreparedKey
    request: PrepackRequest
    bit: int
    recipes: tuple[MaterializationRecipe, ...]  # eligible recipes, cheapest first
    selected: MaterializationRecipe
    publisher: TaskId  # the session task that publishes the key under the selected recipe
    kernel: str
    node: str  # the packing node (prepack.packing_nodes: its kernel and attributes make the bytes)
    packed_bytes: int  # estimate
    read_bytes: int  # bytes the selected recipe reads
    first_step: int  # prefetch distance, in invocation steps from the start of a run
    last_step: int  # last step that pins it

    def to_json(self) -> dict:
        return {
            "key": self.key, "bit": self.bit, "kernel": self.kernel, "node": self.node,
            "request": self.request.to_json(),
            "recipes": [r.to_json() for r in self.recipes],
            "selected": self.selected.kind, "publisher": self.publisher,
            "packed_bytes": self.packed_bytes, "read_bytes": self.read_bytes,
            "first_step": self.first_step, "last_step": self.last_step,
        }


@dataclass(frozen=True, slots=True)
class InvocationStep:
    index: int
    task_id: TaskId
    action_range: tuple[int, int]
    requirement_bits: int  # bitset over PreparedRequirement.bit
    label: str

    def to_json(self) -> dict:
        return {"index": self.index, "task": self.task_id, "actions": list(self.action_range),
                "requirement_bits": self.requirement_bits, "label": self.label}


@dataclass(frozen=True, slots=True)
class LookaheadWindow:
    """Bounded look-ahead: prefetch requirements at most ``steps`` steps ahead of the
    running step and at most ``bytes`` of reads+packs in flight ahead of it."""

    steps: int
    bytes: int

    def to_json(self) -> dict:
        return {"steps": self.steps, "bytes": self.bytes}


@dataclass(frozen=True)
class PreparedExecutionPlan:
    resolved: ResolvedModel
    tasks: tuple[TaskDescriptor, ...]  # session tasks first (dependency order), then invocation steps
    requirements: tuple[PreparedRequirement, ...]  # ordered by bit index
    steps: tuple[InvocationStep, ...]  # invocation order
    activation_last_use: Mapping[str, int]  # value name -> last action index reading it
    lookahead: LookaheadWindow
    build_ms: float = 0.0
    cache: PackedPayloadIndex | None = field(default=None, compare=False)  # the index the recipes came from
    device: DeviceTarget | None = None  # the device the plan is for; None: the CPU plan
    by_id: Mapping[TaskId, TaskDescriptor] = field(init=False, repr=False)
    by_key: Mapping[PreparedKey, PreparedRequirement] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_id", MappingProxyType({t.id: t for t in self.tasks}))
        object.__setattr__(self, "by_key", MappingProxyType({r.key: r for r in self.requirements}))

    @property
    def session_tasks(self) -> tuple[TaskDescriptor, ...]:
        return tuple(t for t in self.tasks if t.scope is TaskScope.SESSION)

    @property
    def invocation_tasks(self) -> tuple[TaskDescriptor, ...]:
        return tuple(t for t in self.tasks if t.scope is TaskScope.INVOCATION)

    @property
    def all_requirement_bits(self) -> int:
        return (1 << len(self.requirements)) - 1

    def session_closure(self, keys) -> tuple[TaskDescriptor, ...]:
        """The session tasks (in plan order) needed to publish ``keys``."""
        need: set[TaskId] = set()
        stack = [self.by_key[k].publisher for k in keys]
        while stack:
            tid = stack.pop()
            if tid in need:
                continue
            need.add(tid)
            stack.extend(self.by_id[tid].dependencies)
        return tuple(t for t in self.session_tasks if t.id in need)

    def bytes_to_read(self) -> int:
        """Distinct bytes the session tasks read (a source shared by two prepacks counts once)."""
        return sum(t.estimated_output_bytes for t in self.session_tasks
                   if t.kind in (TaskKind.READ_SOURCE, TaskKind.READ_PACKED))

    def summary(self) -> dict:
        by: dict[str, int] = {}
        for t in self.tasks:
            k = f"{t.scope.value}/{t.kind.value}/{t.resource.value}"
            by[k] = by.get(k, 0) + 1
        return {
            "tasks": len(self.tasks),
            "session_tasks": len(self.session_tasks),
            "invocation_steps": len(self.steps),
            "requirements": len(self.requirements),
            "tasks_by_scope_kind_resource": by,
            "bytes_to_read": self.bytes_to_read(),
            "prepared_bytes": sum(r.packed_bytes for r in self.requirements),
            "lookahead": self.lookahead.to_json(),
            "build_ms": round(self.build_ms, 3),
        }

    def to_json(self) -> dict:
        return {
            "schema_version": 1,
            "model": str(self.resolved.model_path),
            "summary": self.summary(),
            "tasks": [task_to_json(t) for t in self.tasks],
            "requirements": [r.to_json() for r in self.requirements],
            "steps": [s.to_json() for s in self.steps],
        }


def task_to_json(t: TaskDescriptor) -> dict:
    return {
        "id": t.id, "scope": t.scope.value, "kind": t.kind.value, "resource": t.resource.value,
        "dependencies": list(t.dependencies),
        "prepared_requirements": list(t.prepared_requirements),
        "publishes": t.publishes,
        "estimated_input_bytes": t.estimated_input_bytes,
        "estimated_output_bytes": t.estimated_output_bytes,
        "peak_temporary_bytes": t.peak_temporary_bytes,
        "arena": t.arena.value if t.arena is not None else None,
        "action_range": list(t.action_range) if t.action_range is not None else None,
        "label": t.label,
    }


DEFAULT_LOOKAHEAD_STEPS = 8  # two transformer blocks at four prepared projections each
DEFAULT_LOOKAHEAD_BYTES = 256 << 20


def _packed_size_estimate(req: PrepackRequest, node: NodeKernel, resolved: ResolvedModel) -> int:
    """Packed bytes of a request. Uses the op registry's exact size where it has one;
    otherwise the source bytes (INT4 packs to about its source size)."""
    from onnx_prep.core.kernels.prepack import packed_size

    size = packed_size(node.kernel, req, resolved, node=node)
    if size is not None:
        return int(size)
    return sum(resolved.weights[n].length for n in req.source_lineage if n in resolved.weights)


def build_prepared_execution_plan(
    resolved: ResolvedModel,
    *,
    cache: PackedPayloadIndex | None = None,
    lookahead: LookaheadWindow | None = None,
    device: DeviceTarget | None = None,
) -> PreparedExecutionPlan:
    """Build the one immutable plan. Rejects anything but a frozen ResolvedModel.
    ``device``: the plan for that device (module docstring); None, the CPU plan."""
    import time

    t0 = time.perf_counter()
    resolved = require_frozen(resolved)
    if resolved.unsupported:
        ops = ", ".join(f"{u.domain or 'ai.onnx'}::{u.op_type} ({', '.join(u.nodes[:3])})"
                        for u in resolved.unsupported)
        path = resolved.model_path
        raise OnnxPrepError(f"model has ops with no kernel: {ops}", Where(model=str(path) if path else None),
                            hint=f"run `onnx-prep resolve{f' {path}' if path else ''}` to list them")
    manifest = resolved.manifest

    # --- invocation steps: a step starts at each node that consumes a prepared object
    step_bounds: list[int] = []
    for node in resolved.nodes:
        if node.requirements or not step_bounds:
            step_bounds.append(node.index)
    n_actions = len(resolved.nodes)
    ranges = [(b, step_bounds[i + 1] if i + 1 < len(step_bounds) else n_actions)
              for i, b in enumerate(step_bounds)]

    # --- requirements in first-use order; bit = position. A node's requirements are its
    # packed ones (NodeKernel.requirements) plus one RAW requirement per external weight
    # it reads unpacked (norm weights, tables): published by the read task itself.
    node_reqs: list[list[PrepackRequest]] = []
    for node in resolved.nodes:
        replaced = {n for names in node.prepared_inputs.values() for n in names}
        reqs = list(node.requirements)
        for name in node.inputs:
            desc = resolved.weights.get(name) if name else None
            if desc is not None and desc.external and name not in replaced:
                reqs.append(raw_request(name))
        node_reqs.append(reqs)
    first_node: dict[PreparedKey, NodeKernel] = {}
    first_step: dict[PreparedKey, int] = {}
    last_step: dict[PreparedKey, int] = {}
    req_of: dict[PreparedKey, PrepackRequest] = {}
    step_keys: list[list[PreparedKey]] = [[] for _ in ranges]
    for si, (b, e) in enumerate(ranges):
        for node in resolved.nodes[b:e]:
            for req in node_reqs[node.index]:
                k = req.key
                if k not in first_node:
                    first_node[k] = node
                    first_step[k] = si
                    req_of[k] = req
                last_step[k] = si
                if k not in step_keys[si]:
                    step_keys[si].append(k)
    keys = list(first_node)
    bit_of = {k: i for i, k in enumerate(keys)}

    # --- session tasks: one read per external source (shared), one publisher per key
    tasks: list[TaskDescriptor] = []
    read_task: dict[str, int] = {}  # weight name -> index in tasks

    def source_read(desc: WeightDescriptor, publishes: PreparedKey | None = None) -> TaskId:
        if desc.name not in manifest:  # the plan reads only what the manifest names
            raise OnnxPrepError(f"source {desc.name!r} is not in the payload manifest")
        idx = read_task.get(desc.name)
        if idx is None:
            read_task[desc.name] = len(tasks)
            tasks.append(TaskDescriptor(
                id=f"S.read_source:{desc.name}", scope=TaskScope.SESSION,
                kind=TaskKind.READ_SOURCE, resource=ResourceClass.IO, publishes=publishes,
                estimated_output_bytes=desc.length,
                arena=Arena.PREPARED if publishes else Arena.PREPARATION,
                label=f"read {desc.name}"))
        elif publishes is not None:  # a raw-consumed source that also feeds a prepack
            t = tasks[idx]
            tasks[idx] = TaskDescriptor(
                id=t.id, scope=t.scope, kind=t.kind, resource=t.resource, publishes=publishes,
                estimated_output_bytes=t.estimated_output_bytes, arena=Arena.PREPARED, label=t.label)
        return tasks[read_task[desc.name]].id

    from onnx_prep.core.kernels.prepack import packing_nodes

    packers = packing_nodes(resolved.nodes)  # a tied embedding's object: the LM head packs it
    requirements: list[PreparedRequirement] = []
    on_device = None
    if device is not None:
        from onnx_prep.core.plan.device_recipes import DeviceTasks

        on_device = DeviceTasks(device, resolved, tasks, source_read, cache)
    for k in keys:
        node = packers.get(k, first_node[k])
        req = req_of[k]
        if on_device is not None:
            packed = 0 if req.layout == RAW_LAYOUT else _packed_size_estimate(req, node, resolved)
            requirements.append(on_device.requirement(req, node=node, packed=packed, bit=bit_of[k],
                                                      first_step=first_step[k], last_step=last_step[k]))
            continue
        if req.layout == RAW_LAYOUT:
            desc = resolved.weights[req.logical_value]
            recipe = MaterializationRecipe(READ_SOURCE, sources=(desc.name,))
            requirements.append(PreparedRequirement(
                key=k, request=req, bit=bit_of[k], recipes=(recipe,), selected=recipe,
                publisher=source_read(desc, publishes=k), kernel=RAW_LAYOUT, node=node.name,
                packed_bytes=desc.length, read_bytes=desc.length,
                first_step=first_step[k], last_step=last_step[k]))
            continue
        packed = _packed_size_estimate(req, node, resolved)
        external = tuple(n for n in req.source_lineage
                         if n in resolved.weights and resolved.weights[n].external)
        recipes: list[MaterializationRecipe] = []
        entry = cache.lookup(req) if cache is not None else None
        if entry is not None:
            recipes.append(MaterializationRecipe(READ_PACKED_PAYLOAD, payload=entry))
        recipes.append(MaterializationRecipe(READ_SOURCE_AND_PREPACK, sources=external))
        selected = recipes[0]
        if selected.kind == READ_PACKED_PAYLOAD:
            publisher = f"S.read_packed:{k}"
            read_bytes = entry.length
            tasks.append(TaskDescriptor(
                id=publisher, scope=TaskScope.SESSION, kind=TaskKind.READ_PACKED,
                resource=ResourceClass.MAPPED if entry.mapped else ResourceClass.IO, publishes=k,
                estimated_output_bytes=entry.length,
                arena=Arena.PREPARED, label=f"read packed {req.logical_value}"))
        else:
            deps = tuple(source_read(resolved.weights[n]) for n in external)
            src_bytes = sum(resolved.weights[n].length for n in req.source_lineage
                            if n in resolved.weights)
            read_bytes = sum(resolved.weights[n].length for n in external)
            publisher = f"S.prepack:{k}"
            tasks.append(TaskDescriptor(
                id=publisher, scope=TaskScope.SESSION, kind=TaskKind.PREPACK,
                resource=ResourceClass.CPU, dependencies=deps, publishes=k,
                estimated_input_bytes=src_bytes, estimated_output_bytes=packed,
                arena=Arena.PREPARED, label=f"prepack {req.logical_value} [{req.layout}]"))
        requirements.append(PreparedRequirement(
            key=k, request=req, bit=bit_of[k], recipes=tuple(recipes), selected=selected,
            publisher=publisher, kernel=node.kernel or "", node=node.name, packed_bytes=packed,
            read_bytes=read_bytes, first_step=first_step[k], last_step=last_step[k]))

    # --- invocation tasks (on a device plan: on its queue, pinning the device objects)
    steps: list[InvocationStep] = []
    prev: TaskId | None = None
    runs_on = ResourceClass.CPU if device is None else ResourceClass.DEVICE
    for si, (b, e) in enumerate(ranges):
        consuming = next((n for n in resolved.nodes[b:e] if n.requirements), resolved.nodes[b])
        tid = f"I.{si}:{consuming.name}"
        pinned = [requirements[bit_of[k]] for k in step_keys[si]]
        deps = ([prev] if prev else []) + [r.publisher for r in pinned]
        out_bytes = 0
        tasks.append(TaskDescriptor(
            id=tid, scope=TaskScope.INVOCATION, kind=TaskKind.EXECUTE, resource=runs_on,
            dependencies=tuple(dict.fromkeys(deps)), prepared_requirements=tuple(r.key for r in pinned),
            estimated_output_bytes=out_bytes, arena=Arena.EXECUTION, action_range=(b, e),
            label=consuming.name))
        bits = 0
        for k in step_keys[si]:
            bits |= 1 << bit_of[k]
        steps.append(InvocationStep(index=si, task_id=tid, action_range=(b, e),
                                    requirement_bits=bits, label=consuming.name))
        prev = tid

    # --- activation last use
    last_use: dict[str, int] = {}
    for node in resolved.nodes:
        for name in node.inputs:
            if name:
                last_use[name] = node.index
    graph_outputs = {o.name for o in resolved.outputs}
    for name in graph_outputs:
        last_use[name] = n_actions  # outputs outlive the action list

    plan = PreparedExecutionPlan(
        resolved=resolved, tasks=tuple(tasks), requirements=tuple(requirements),
        steps=tuple(steps), activation_last_use=MappingProxyType(last_use),
        lookahead=lookahead or LookaheadWindow(DEFAULT_LOOKAHEAD_STEPS, DEFAULT_LOOKAHEAD_BYTES),
        build_ms=(time.perf_counter() - t0) * 1e3, cache=cache, device=device,
    )
    _check_acyclic(plan)
    return plan


def _check_acyclic(plan: PreparedExecutionPlan) -> None:
    """Dependencies point only to earlier tasks in ``plan.tasks`` (construction order is
    a topological order); anything else is a builder bug."""
    seen: set[TaskId] = set()
    for t in plan.tasks:
        for d in t.dependencies:
            if d not in seen:
                raise AssertionError(f"plan task {t.id} depends on later/unknown task {d}")
        seen.add(t.id)
