"""The plan report: what ``onnx-prep plan-dump`` prints, built from the one plan.

``plan_report(plan, cost=, scope=, text=)`` turns a :class:`PreparedExecutionPlan` into
ONE JSON-ready record (``core/schemas/plan.schema.json``, docs/plan-dump.md): a summary
first, then every task of the plan with its dependencies, the key it publishes and
its byte estimates, then the requirements and invocation steps as the plan holds them.
The command renders that record as a table, as JSON, or as Graphviz (``plan_dot``).
Nothing here builds a second plan or a shortcut: the record is the plan the session
executes (``build_prepared_execution_plan``), and ``task_from_json`` rebuilds its task
descriptors exactly (tested against a session's plan and its timeline).

Estimated time (:class:`CostModel`): a read costs its bytes over an I/O bandwidth, a
prepack its source bytes over a prepack rate, a persist its bytes over the same I/O
bandwidth; execution steps are not estimated (0 ms: compute is measured by a run, not
predicted here). The critical path is the longest chain of dependencies under that
model: a lower bound on the load that ignores how many workers there are; the
per-resource totals are the other bound (the same work on one worker per queue).

A plan built for a device (``device="cuda"``: core/plan/device_target.py, no device
queried) adds, to the same record: the device's assumptions and memory (``summary.device``:
the slot granularity, given or assumed, the slots and the bytes they commit, the bytes
a load uploads, the most one step pins, and the budget), the recipe each task serves
(``tasks[].recipes``), and uploads in the cost model (at ``UPLOAD_BYTES_PER_S``; a
prepack on the device is not estimated, like execution: nothing has run on one).

Filters (``scope``, ``text``) choose which tasks the record lists; the summary always
describes the whole plan and says how many tasks the filters left out.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from onnx_prep.core.model.resolved_model import ResolvedModel
from onnx_prep.core.plan.device_recipes import DEVICE_RECIPE_KINDS
from onnx_prep.core.plan.execution_plan import (
    READ_PACKED_PAYLOAD,
    READ_SOURCE,
    READ_SOURCE_AND_PREPACK,
    PackedPayloadIndex,
    PreparedExecutionPlan,
    task_to_json,
)
from onnx_prep.core.plan.task import Arena, ResourceClass, TaskDescriptor, TaskKind, TaskScope

__all__ = ["SCHEMA", "CostModel", "DEFAULT_COST_MODEL", "plan_dump", "plan_report", "plan_dot",
           "task_from_json", "schema_path", "SCOPES"]

SCHEMA = "onnx-prep.plan/1"
SCOPES = tuple(s.value for s in TaskScope)
RECIPE_KINDS = (READ_PACKED_PAYLOAD, READ_SOURCE_AND_PREPACK, READ_SOURCE)  # cheapest first

# A cold read from a local NVMe SSD (sequential, one queue): 2 GB/s. A warm page cache
# reads faster; a network filesystem slower: pass a CostModel of your own figures.
IO_BYTES_PER_S = 2.0e9
# Source bytes one CPU worker prepacks per second: the medium fixture's 563 MB of INT4
# weights were mapped and packed in a median 460 ms by one worker (docs/results.md,
# sequential init, warm page cache, digests off): ~1.2 GB/s.
PREPACK_BYTES_PER_S = 1.2e9
# Host to device from pinned memory over a PCIe 4.0 x16 link: ~25 GB/s (PCIe 5.0 about
# twice that). A textbook figure, not one measured here: no upload has run on a device.
UPLOAD_BYTES_PER_S = 25e9


@dataclass(frozen=True)
class CostModel:
    """How the report turns bytes into time (module docstring)."""

    io_bytes_per_s: float = IO_BYTES_PER_S
    prepack_bytes_per_s: float = PREPACK_BYTES_PER_S
    upload_bytes_per_s: float = UPLOAD_BYTES_PER_S

    def __post_init__(self) -> None:
        if not (self.io_bytes_per_s > 0 and self.prepack_bytes_per_s > 0 and self.upload_bytes_per_s > 0):
            raise ValueError(f"cost model rates must be positive: {self}")

    def bytes_of(self, t: TaskDescriptor) -> int:
        """The bytes a task moves: what a read or persist reads or writes, what a prepack
        packs, what an upload copies to the device."""
        if t.kind in (TaskKind.READ_SOURCE, TaskKind.READ_PACKED, TaskKind.PERSIST):
            return t.estimated_output_bytes
        if t.kind in (TaskKind.PREPACK, TaskKind.UPLOAD):
            return t.estimated_input_bytes
        return 0

    def seconds(self, t: TaskDescriptor) -> float:
        if t.kind is TaskKind.PREPACK:  # on a device: not estimated (0 s), as execution
            return 0.0 if t.resource is ResourceClass.DEVICE else t.estimated_input_bytes / self.prepack_bytes_per_s
        rate = self.upload_bytes_per_s if t.kind is TaskKind.UPLOAD else self.io_bytes_per_s
        return self.bytes_of(t) / rate  # 0 for what moves no bytes (execute)

    def to_json(self, *, device: bool = False) -> dict:
        """The rates; ``device``: with the upload rate and the device prepack's (none)."""
        out: dict = {"io_bytes_per_s": self.io_bytes_per_s, "prepack_bytes_per_s": self.prepack_bytes_per_s,
                     "execute": "not estimated (0 ms)"}
        if device:
            out["upload_bytes_per_s"] = self.upload_bytes_per_s
            out["device_prepack"] = "not estimated (0 ms)"
        return out


DEFAULT_COST_MODEL = CostModel()


def plan_dump(model: str | Path, *, open_cache: Callable[[ResolvedModel], PackedPayloadIndex | None] | None = None,
              trust_symlinks: bool = False, cost: CostModel = DEFAULT_COST_MODEL, scope: str | None = None,
              text: str | None = None, fuse: bool = True, device: str = "cpu", budget: int | None = None,
              granularity: int | None = None) -> dict:
    """``plan-dump``'s one call: resolve ``model``, build its plan as a session does and
    report it. ``open_cache(resolved)`` opens the prepared cache to plan with (a
    ``PackedPayloadIndex``, e.g. ``core/cache``'s ``PreparedCache``; None: no cache):
    the plan then reads packed every object the cache holds a compatible entry for.
    ``fuse``: fuse standard-op patterns at resolve, as a session does by default.
    ``device``: ``cpu``, or a device to plan for without querying it (``cuda``), its
    slots sized at ``granularity`` bytes (None: ``DEFAULT_GRANULARITY``, assumed) and
    held to ``budget`` committed bytes (a step that alone passes it: DeviceBudgetError)."""
    from onnx_prep.core.errors import UnsupportedOpError, UsageError, Where
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.core.plan.device_target import DEFAULT_GRANULARITY, PLAN_DEVICES, DeviceTarget, require_budget
    from onnx_prep.core.plan.execution_plan import build_prepared_execution_plan

    if device not in PLAN_DEVICES:
        raise UsageError(f"--device must be one of {list(PLAN_DEVICES)}, got {device!r}")
    if device == "cpu" and (budget is not None or granularity is not None):
        raise UsageError("--budget and --granularity size a device's slots: give them with --device cuda")
    target = None
    if device != "cpu":
        try:
            target = DeviceTarget(device, granularity or DEFAULT_GRANULARITY, granularity is not None, budget)
        except ValueError as exc:
            raise UsageError(f"--device {device}: {exc}") from None
    resolved = resolve_model(model, trust_symlinks=trust_symlinks, fuse=fuse)
    if resolved.unsupported:  # no plan without a kernel for every node: say which, and where
        ops = "; ".join(f"{u.domain or 'ai.onnx'}::{u.op_type} (nodes {', '.join(u.nodes[:3])}"
                        f"{', ...' if len(u.nodes) > 3 else ''})" for u in resolved.unsupported)
        raise UnsupportedOpError(f"no plan: ops with no kernel: {ops}", Where(model=str(resolved.model_path)),
                                 hint="run `onnx-prep resolve` to see what resolved")
    cache = open_cache(resolved) if open_cache is not None else None
    try:
        plan = build_prepared_execution_plan(resolved, cache=cache, device=target)
    finally:
        close = getattr(cache, "close", None)  # the plan needs only lookups: nothing stays open
        if close is not None:
            close()
    require_budget(plan)
    return plan_report(plan, cost=cost, scope=scope, text=text)


def plan_report(plan: PreparedExecutionPlan, *, cost: CostModel = DEFAULT_COST_MODEL,
                scope: str | None = None, text: str | None = None) -> dict:
    """The record of ``plan`` (module docstring); ``scope`` ("session" / "invocation")
    and ``text`` (a substring of a task's id or label) filter the listed tasks."""
    if scope is not None and scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}")
    finish, on_path, path = _critical_path(plan, cost)
    kept = [t for t in plan.tasks
            if (scope is None or t.scope.value == scope)
            and (not text or text in t.id or text in t.label)]
    index = {t.id: i for i, t in enumerate(plan.tasks)}
    served = _recipes_served(plan) if plan.device is not None else None
    tasks = []
    for t in kept:
        row = task_to_json(t)
        row["index"] = index[t.id]
        row["dependency_indices"] = [index[d] for d in t.dependencies]
        row["estimated_bytes"] = cost.bytes_of(t)
        row["estimated_ms"] = round(cost.seconds(t) * 1e3, 6)
        row["finish_ms"] = round(finish[t.id] * 1e3, 6)
        row["critical"] = t.id in on_path
        if served is not None:
            row["recipes"] = served.get(t.id, [])
        tasks.append(row)
    return {
        "schema": SCHEMA,
        "model": str(plan.resolved.model_path),
        "summary": _summary(plan, cost, path, finish, shown=len(kept), scope=scope, text=text),
        "cost_model": cost.to_json(device=plan.device is not None),
        "tasks": tasks,
        "requirements": [r.to_json() for r in plan.requirements],
        "steps": [s.to_json() for s in plan.steps],
    }


def _recipes_served(plan: PreparedExecutionPlan) -> dict[str, list[str]]:
    """Per session task, the recipes of the objects it helps make (a shared source read
    serves every object made from it), in the order of the requirements."""
    served: dict[str, list[str]] = {}
    for r in plan.requirements:
        for t in plan.session_closure([r.key]):
            kinds = served.setdefault(t.id, [])
            if r.selected.kind not in kinds:
                kinds.append(r.selected.kind)
    return served


def _summary(plan: PreparedExecutionPlan, cost: CostModel, path: list[TaskDescriptor],
             finish: dict[str, float], *, shown: int, scope: str | None, text: str | None) -> dict:
    def count(attr: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in plan.tasks:
            v = getattr(t, attr).value
            out[v] = out.get(v, 0) + 1
        return out

    def read_bytes(kind: TaskKind) -> int:
        return sum(t.estimated_output_bytes for t in plan.tasks if t.kind is kind)

    per_resource: dict[str, dict] = {}
    for t in plan.tasks:
        acc = per_resource.setdefault(t.resource.value, {"tasks": 0, "bytes": 0, "serial_ms": 0.0})
        acc["tasks"] += 1
        acc["bytes"] += cost.bytes_of(t)
        acc["serial_ms"] += cost.seconds(t) * 1e3
    for acc in per_resource.values():
        acc["serial_ms"] = round(acc["serial_ms"], 3)
    recipes = {kind: 0 for kind in (RECIPE_KINDS if plan.device is None else DEVICE_RECIPE_KINDS)}
    for r in plan.requirements:
        recipes[r.selected.kind] += 1
    consumers: dict[str, list[str]] = {}
    for t in plan.tasks:
        if t.kind is TaskKind.PREPACK:
            for d in t.dependencies:
                consumers.setdefault(d, []).append(t.id)
    out = {
        "tasks": len(plan.tasks),
        "by_scope": count("scope"),
        "by_kind": count("kind"),
        "by_resource": count("resource"),
        "serial_by_resource": per_resource,
        "requirements": len(plan.requirements),
        "invocation_steps": len(plan.steps),
        "bytes_to_read": {"source": read_bytes(TaskKind.READ_SOURCE), "packed": read_bytes(TaskKind.READ_PACKED)},
        "prepared_bytes": sum(r.packed_bytes for r in plan.requirements),
        "recipes": recipes,
        "critical_path": {
            "tasks": [t.id for t in path],
            "read_bytes": sum(cost.bytes_of(t) for t in path if t.kind in (TaskKind.READ_SOURCE, TaskKind.READ_PACKED)),
            "prepack_bytes": sum(cost.bytes_of(t) for t in path if t.kind is TaskKind.PREPACK),
            "bytes": sum(cost.bytes_of(t) for t in path),
            "estimated_ms": round(finish[path[-1].id] * 1e3, 3) if path else 0.0,
        },
        "fan_out": [{"task": d, "consumers": cs} for d, cs in consumers.items() if len(cs) > 1],
        "lookahead": plan.lookahead.to_json(),
        "build_ms": round(plan.build_ms, 3),
        "filter": {"scope": scope, "text": text or None, "shown": shown,
                   "filtered_out": len(plan.tasks) - shown},
    }
    if plan.device is not None:
        from onnx_prep.core.plan.device_target import device_memory

        out["critical_path"]["upload_bytes"] = sum(cost.bytes_of(t) for t in path if t.kind is TaskKind.UPLOAD)
        out["device"] = device_memory(plan)
    return out


def _critical_path(plan: PreparedExecutionPlan, cost: CostModel):
    """Earliest finish of every task under ``cost`` with unlimited workers, and the
    longest chain (ties go to the later task, so the chain runs to the last step)."""
    finish: dict[str, float] = {}
    via: dict[str, str | None] = {}
    for t in plan.tasks:  # plan order is a topological order (execution_plan._check_acyclic)
        before = max(t.dependencies, key=lambda d: finish[d], default=None)
        finish[t.id] = cost.seconds(t) + (finish[before] if before is not None else 0.0)
        via[t.id] = before
    if not plan.tasks:
        return finish, set(), []
    end = max(reversed(plan.tasks), key=lambda t: finish[t.id]).id
    chain: list[str] = []
    node: str | None = end
    while node is not None:
        chain.append(node)
        node = via[node]
    chain.reverse()
    return finish, set(chain), [plan.by_id[i] for i in chain]


def schema_path() -> Path:
    """The JSON Schema (draft 2020-12) of the record."""
    return Path(__file__).parents[1] / "schemas" / "plan.schema.json"


def task_from_json(row: dict) -> TaskDescriptor:
    """The :class:`TaskDescriptor` a record's task row describes (the inverse of
    ``task_to_json``; the report's own columns are ignored)."""
    return TaskDescriptor(
        id=row["id"], scope=TaskScope(row["scope"]), kind=TaskKind(row["kind"]),
        resource=ResourceClass(row["resource"]), dependencies=tuple(row["dependencies"]),
        prepared_requirements=tuple(row["prepared_requirements"]), publishes=row["publishes"],
        estimated_input_bytes=row["estimated_input_bytes"],
        estimated_output_bytes=row["estimated_output_bytes"],
        peak_temporary_bytes=row["peak_temporary_bytes"],
        arena=Arena(row["arena"]) if row["arena"] is not None else None,
        action_range=tuple(row["action_range"]) if row["action_range"] is not None else None,
        label=row["label"])


# ------------------------------------------------------------------------- Graphviz

# Fill colour per resource queue (the legend of docs/plan-dump.md).
RESOURCE_COLOURS = {"io": "#9ecae1", "mapped": "#c6dbef", "cpu": "#fdae6b", "device": "#a1d99b",
                    "inline": "#d9d9d9"}


def plan_dot(doc: dict) -> str:
    """The record's tasks as a Graphviz digraph: one cluster per scope, nodes filled by
    resource, an edge per dependency between listed tasks, the critical path in bold."""
    listed = {t["id"] for t in doc["tasks"]}
    lines = ["digraph plan {", "  rankdir=LR;", '  node [shape=box, style="filled,rounded", fontsize=10];',
             f"  label={_q('plan of ' + doc['model'])};"]
    for scope in SCOPES:
        rows = [t for t in doc["tasks"] if t["scope"] == scope]
        if not rows:
            continue
        lines.append(f"  subgraph cluster_{scope} {{")
        lines.append(f"    label={_q(scope)};")
        for t in rows:
            name = t["label"] or t["id"]
            if not name.startswith(t["kind"].split("_")[0]):  # "read ...", "prepack ..." say it already
                name = f"{t['kind']} {name}"
            label = _esc(name)
            if t["estimated_bytes"]:
                label += f"\\n{t['estimated_bytes']:,} B"
            pen = ", penwidth=2.5" if t["critical"] else ""
            lines.append(f"    {_q(t['id'])} [label=\"{label}\", fillcolor=\"{RESOURCE_COLOURS[t['resource']]}\""
                         f", tooltip={_q(t['resource'])}{pen}];")
        lines.append("  }")
    for t in doc["tasks"]:
        for d in t["dependencies"]:
            if d in listed:
                lines.append(f"  {_q(d)} -> {_q(t['id'])};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _q(s: str) -> str:
    return f'"{_esc(s)}"'
