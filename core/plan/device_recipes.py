"""The session tasks that put prepared objects on a device: the recipes of a plan built
for one (``build_prepared_execution_plan(..., device=DeviceTarget(...))``).

The model is resolved as for the CPU: a packed object's bytes are the same on every
device, so its request is the CPU one. The device plan publishes the request's device
twin instead (the same lineage and layout for the device: ``P:...|int4mm...|cuda``),
filled into the object's device slot by the first recipe that applies:

==============================  ============================================================
``read_packed_payload_upload``  a compatible prepared-cache entry: ``S.read_packed:<key>``
                                (io, or mapped) then ``S.upload:<device key>``
``read_source_upload_prepack``  ``S.read_source:<source>`` (io), ``S.upload_source:<source>``
                                (device), then ``S.prepack:<device key>`` on the device
``read_source_prepack_upload``  ``S.read_source:<source>`` (io), ``S.prepack:<key>`` (cpu),
                                then ``S.upload:<device key>``
``read_source_upload``          a weight read as stored (a norm weight):
                                ``S.read_source:<weight>`` then ``S.upload:<device key>``
==============================  ============================================================

A cache entry comes first (nothing to pack); otherwise the packing kernel's spec says
which of the two prepack recipes it offers and prefers for the device
(``core/kernels/prepack.device_recipes``), and the plan takes its preference, unless
the target says ``prepack="host"`` (``DeviceTarget``): then it packs on a CPU worker
wherever the kernel offers that (a session on a device without a device-side prepack
kernel plans so).

Every ``upload`` and device ``prepack`` runs on the ``device`` resource (the device's
queue). Its ``estimated_input_bytes`` are the bytes it copies host to device (an
upload) or packs (a prepack); its ``estimated_output_bytes`` what it commits on the
device: the slot it fills, whole granules (``DeviceTarget.slot_bytes``) for a packed
object, its share of a granule it shares with other raw weights for a raw weight of at
most one granule (``DeviceTarget.share_bytes``, as ``slot_placement`` places it), or for
a source upload the staging bytes the device prepack reads. Device memory is the device
slot pool's, not a host arena's: those tasks' ``arena`` is None. The host side of a
recipe (a prepack on a CPU worker, a packed read) publishes nothing: its bytes are
pinned host staging (Preparation arena) for the upload, and the device object is what
the steps pin. Sources held inline in the model are uploaded without a read.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from onnx_prep.core.kernels.spec import DEVICE_PREPACK, HOST_PREPACK
from onnx_prep.core.model.prepared_key import PrepackRequest, PreparedKey
from onnx_prep.core.model.resolved_model import ResolvedModel
from onnx_prep.core.plan.device_target import DeviceTarget
from onnx_prep.core.plan.execution_plan import (
    RAW_LAYOUT,
    MaterializationRecipe,
    PackedPayloadIndex,
    PreparedRequirement,
)
from onnx_prep.core.plan.task import Arena, ResourceClass, TaskDescriptor, TaskId, TaskKind, TaskScope

__all__ = ["READ_PACKED_PAYLOAD_UPLOAD", "READ_SOURCE_UPLOAD_PREPACK", "READ_SOURCE_PREPACK_UPLOAD",
           "READ_SOURCE_UPLOAD", "DEVICE_RECIPE_KINDS", "DeviceTasks"]

READ_PACKED_PAYLOAD_UPLOAD = "read_packed_payload_upload"
READ_SOURCE_UPLOAD_PREPACK = DEVICE_PREPACK  # "read_source_upload_prepack"
READ_SOURCE_PREPACK_UPLOAD = HOST_PREPACK  # "read_source_prepack_upload"
READ_SOURCE_UPLOAD = "read_source_upload"
DEVICE_RECIPE_KINDS = (READ_PACKED_PAYLOAD_UPLOAD, READ_SOURCE_UPLOAD_PREPACK, READ_SOURCE_PREPACK_UPLOAD,
                       READ_SOURCE_UPLOAD)


@dataclasses.dataclass
class DeviceTasks:
    """The device recipes' session tasks of one plan build: ``tasks`` is the plan's
    list (appended to), ``source_read(descriptor)`` the plan's shared source read."""

    target: DeviceTarget
    resolved: ResolvedModel
    tasks: list[TaskDescriptor]
    source_read: Callable[..., TaskId]
    cache: PackedPayloadIndex | None = None
    _source_uploads: dict[str, TaskId] = dataclasses.field(default_factory=dict, init=False)

    def requirement(self, req: PrepackRequest, *, node: Any, packed: int, bit: int, first_step: int,
                    last_step: int) -> PreparedRequirement:
        """The tasks publishing ``req``'s device twin, and its requirement record."""
        weights = self.resolved.weights
        device_req = dataclasses.replace(req, device=self.target.name)
        key = device_req.key
        if req.layout == RAW_LAYOUT:
            desc = weights[req.logical_value]
            read = self.source_read(desc)
            recipe = MaterializationRecipe(READ_SOURCE_UPLOAD, sources=(desc.name,))
            publisher = self._upload(key, read, desc.length, f"upload {desc.name}", shared=True)
            return PreparedRequirement(
                key=key, request=device_req, bit=bit, recipes=(recipe,), selected=recipe, publisher=publisher,
                kernel=RAW_LAYOUT, node=node.name, packed_bytes=desc.length, read_bytes=desc.length,
                first_step=first_step, last_step=last_step)

        from onnx_prep.core.kernels.prepack import device_recipes

        external = tuple(n for n in req.source_lineage if n in weights and weights[n].external)
        source = sum(weights[n].length for n in req.source_lineage if n in weights)
        kinds = list(device_recipes(node.kernel, self.target.name, source, packed, node.attributes))
        if self.target.prepack == "host" and READ_SOURCE_PREPACK_UPLOAD in kinds:
            kinds.remove(READ_SOURCE_PREPACK_UPLOAD)
            kinds.insert(0, READ_SOURCE_PREPACK_UPLOAD)
        recipes = [MaterializationRecipe(kind, sources=external) for kind in kinds]
        entry = self.cache.lookup(req) if self.cache is not None else None
        if entry is not None:
            recipes.insert(0, MaterializationRecipe(READ_PACKED_PAYLOAD_UPLOAD, payload=entry))
        selected = recipes[0]
        name = req.logical_value
        if selected.kind == READ_PACKED_PAYLOAD_UPLOAD:
            read = f"S.read_packed:{req.key}"
            self.tasks.append(TaskDescriptor(
                id=read, scope=TaskScope.SESSION, kind=TaskKind.READ_PACKED,
                resource=ResourceClass.MAPPED if entry.mapped else ResourceClass.IO,
                estimated_output_bytes=entry.length, arena=Arena.PREPARATION, label=f"read packed {name}"))
            publisher = self._upload(key, read, entry.length, f"upload packed {name}")
            read_bytes = entry.length
        elif selected.kind == READ_SOURCE_PREPACK_UPLOAD:
            pack = f"S.prepack:{req.key}"
            self.tasks.append(TaskDescriptor(
                id=pack, scope=TaskScope.SESSION, kind=TaskKind.PREPACK, resource=ResourceClass.CPU,
                dependencies=tuple(self.source_read(weights[n]) for n in external),
                estimated_input_bytes=source, estimated_output_bytes=packed, arena=Arena.PREPARATION,
                label=f"prepack {name} [{req.layout}]"))
            publisher = self._upload(key, pack, packed, f"upload packed {name}")
            read_bytes = sum(weights[n].length for n in external)
        else:  # READ_SOURCE_UPLOAD_PREPACK
            uploads = tuple(dict.fromkeys(self._source_upload(n) for n in req.source_lineage))
            publisher = f"S.prepack:{key}"
            self.tasks.append(TaskDescriptor(
                id=publisher, scope=TaskScope.SESSION, kind=TaskKind.PREPACK, resource=ResourceClass.DEVICE,
                dependencies=uploads, publishes=key, estimated_input_bytes=source,
                estimated_output_bytes=self.target.slot_bytes(packed),
                label=f"prepack {name} [{req.layout}] on {self.target.name}"))
            read_bytes = sum(weights[n].length for n in external)
        return PreparedRequirement(
            key=key, request=device_req, bit=bit, recipes=tuple(recipes), selected=selected, publisher=publisher,
            kernel=node.kernel or "", node=node.name, packed_bytes=packed, read_bytes=read_bytes,
            first_step=first_step, last_step=last_step)

    def _upload(self, key: PreparedKey, after: TaskId, nbytes: int, label: str, *, shared: bool = False) -> TaskId:
        """Copy ``nbytes`` host to device into ``key``'s slot, after ``after``; publishes ``key``.
        ``shared``: a raw weight, which commits its share of a shared granule where it fits
        in one (``slot_placement``), else whole granules like a packed object."""
        tid = f"S.upload:{key}"
        share = self.target.share_bytes(nbytes) if shared and nbytes > 0 else None
        self.tasks.append(TaskDescriptor(
            id=tid, scope=TaskScope.SESSION, kind=TaskKind.UPLOAD, resource=ResourceClass.DEVICE,
            dependencies=(after,), publishes=key, estimated_input_bytes=nbytes,
            estimated_output_bytes=self.target.slot_bytes(nbytes) if share is None else share, label=label))
        return tid

    def _source_upload(self, name: str) -> TaskId:
        """One upload of a source's bytes to device staging (shared by every device
        prepack that reads it), after its read; an inline source has no read."""
        tid = self._source_uploads.get(name)
        if tid is not None:
            return tid
        desc = self.resolved.weights.get(name)
        if desc is not None and desc.external:
            deps, nbytes = (self.source_read(desc),), desc.length
        else:
            inline = self.resolved.inline_values[name]
            deps, nbytes = (), int(inline.nbytes)
        tid = self._source_uploads[name] = f"S.upload_source:{name}"
        self.tasks.append(TaskDescriptor(
            id=tid, scope=TaskScope.SESSION, kind=TaskKind.UPLOAD, resource=ResourceClass.DEVICE,
            dependencies=deps, estimated_input_bytes=nbytes, estimated_output_bytes=nbytes,
            label=f"upload source {name}"))
        return tid
