"""Materializer: what each session task of the plan does, by the recipe it serves.

The plan selects one :class:`MaterializationRecipe` per prepared key
(``core/plan/execution_plan.py``); this module turns the session task that publishes
the key into the function the scheduler runs, through ONE table keyed by the recipe
kind (:attr:`Materializer.recipes`): a raw read straight into the key's slot, a
prepack of sources already read, and a read of a persisted packed payload from the
plan's prepared cache (``PackedPayloadIndex``) straight into the slot. A packed object
the session builds is handed to the cache to persist when the cache asks for it
(``build-if-missing``), pinned until written.
Source reads that publish nothing feed prepacks (one read serves every prepack of a
tied source) and return a :class:`Source`.

Publishing goes through the store's load protocol (``begin_load`` ... ``publish``) into
the slot pool: the bytes are written once, in place, at the key's stable address.

A session on a device (``SessionOptions(device=...)``, session_device.py) runs a device
plan (core/plan/device_recipes.py) through the same table: its uploads publish, and
their host side publishes nothing but returns page-locked staging (a :class:`Source`
with ``pinned`` set, holding the task's Preparation reservation): a CPU prepack packs
straight into it, a packed read reads the cache payload into it, a source read that
feeds an upload reads into it. The upload commits the key's device slot, copies the
staging on the device queue's stream between two events, and the staging goes back
once the copy is done (``sources_used``, as a source after its prepacks).

The device-side prepack (``read_source_upload_prepack``, on a device that
``packs_on_device``): each source is read into page-locked staging (io), copied into
device memory of its own by its ``S.upload_source`` task (device queue; one per source,
shared by every prepack reading it; an inline source is copied into staging first), and
the host staging goes back once that copy is done; ``S.prepack:<device key>`` (device
queue) commits the key's slot, packs into it on the device, and publishes it. A source's
device memory goes back once every prepack reading it has published (``sources_used``),
so an evicted object packed again reads and uploads its sources again. On a device
without the kernel the recipe has no body here: refused by name.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np

from onnx_prep.core.errors import OnnxPrepError, Where
from onnx_prep.core.io.external_data import ExternalDataReader, as_array
from onnx_prep.core.kernels.spec import DEVICE_PREPACK
from onnx_prep.core.model.prepared_key import PreparedKey
from onnx_prep.core.model.resolved_model import ResolvedModel
from onnx_prep.core.plan.execution_plan import (
    RAW_LAYOUT,
    READ_PACKED_PAYLOAD,
    READ_SOURCE,
    READ_SOURCE_AND_PREPACK,
    PreparedExecutionPlan,
    PreparedRequirement,
)
from onnx_prep.core.plan.task import TaskDescriptor, TaskId, TaskKind
from onnx_prep.core.runtime.arenas import Arena
from onnx_prep.core.runtime.prepared_store import PreparedObjectStore
from onnx_prep.core.runtime.scheduler import TaskContext, TaskHandle, TaskState
from onnx_prep.core.runtime.slot_pool import SlotPool

if TYPE_CHECKING:
    from onnx_prep.core.runtime.session_device import DeviceSource, SessionDevice

__all__ = ["Materializer", "Source", "release_source", "SOURCE_IO"]

# How prepack sources are read: "map" (zero-copy file mapping, prefaulted by the I/O
# worker; the default) or "read" (pread into a fresh buffer, e.g. for network filesystems).
SOURCE_IO = ("map", "read")


class Materializer:
    """Task functions for a plan's session tasks. ``count(name, n=1)`` bumps a session
    counter; ``published(key)`` runs after each publish; ``sources_used(read_ids)`` after
    each prepack, published or not (its source reads may be released)."""

    def __init__(self, resolved: ResolvedModel, plan: PreparedExecutionPlan, reader: ExternalDataReader,
                 store: PreparedObjectStore, slots: SlotPool, *, source_io: str, drop_sources: bool,
                 count: Callable[..., None], published: Callable[[PreparedKey], None],
                 sources_used: Callable[[Iterable[TaskId]], None], device: SessionDevice | None = None) -> None:
        self.resolved, self.plan, self.reader = resolved, plan, reader
        self.store, self.slots = store, slots
        self.source_io, self.drop_sources = source_io, drop_sources
        self._count, self._published, self._sources_used = count, published, sources_used
        self._nodes_by_name = {n.name: n for n in resolved.nodes}
        # The one dispatch: recipe kind -> the publishing task's body.
        self.recipes: dict[str, Callable[[TaskDescriptor, TaskContext], None]] = {
            READ_SOURCE: self._read_raw,
            READ_SOURCE_AND_PREPACK: self._prepack,
            READ_PACKED_PAYLOAD: self._read_packed,
        }
        self.cache = plan.cache
        self.device = device
        # a device plan: the requirement each host-side task stages for, and the source
        # reads an upload copies (read into staging, not mapped)
        self._staged_for: dict[TaskId, PreparedRequirement] = {}
        self._staged_reads: set[TaskId] = set()
        self._source_uploads: set[TaskId] = set()  # a device prepack's S.upload_source tasks
        if device is not None:
            self._device_recipes()

    def _device_recipes(self) -> None:
        from onnx_prep.core.plan.device_recipes import (
            READ_PACKED_PAYLOAD_UPLOAD,
            READ_SOURCE_PREPACK_UPLOAD,
            READ_SOURCE_UPLOAD,
        )

        for kind in (READ_PACKED_PAYLOAD_UPLOAD, READ_SOURCE_PREPACK_UPLOAD, READ_SOURCE_UPLOAD):
            self.recipes[kind] = self._upload
        if self.device.packs_on_device:
            self.recipes[DEVICE_PREPACK] = self._device_prepack
        for r in self.plan.requirements:
            desc = self.plan.by_id[r.publisher]
            if r.selected.kind == DEVICE_PREPACK:
                # its sources' uploads copy them from staging: read into it, not mapped
                for up in desc.dependencies:
                    self._source_uploads.add(up)
                    self._staged_reads.update(self.plan.by_id[up].dependencies)
                continue
            if desc.kind is not TaskKind.UPLOAD:
                continue
            for dep in desc.dependencies:
                if self.plan.by_id[dep].kind is TaskKind.READ_SOURCE:
                    self._staged_reads.add(dep)
                else:
                    self._staged_for[dep] = r

    def task_fn(self, desc: TaskDescriptor) -> Callable[[TaskContext], object]:
        if desc.publishes is None:
            if desc.kind is TaskKind.READ_SOURCE:
                return lambda tctx: self._read_source(desc, tctx)  # feeds prepacks (or an upload)
            if desc.id in self._staged_for and desc.kind is TaskKind.PREPACK:
                return lambda tctx: self._stage_prepack(desc, tctx)
            if desc.id in self._staged_for and desc.kind is TaskKind.READ_PACKED:
                return lambda tctx: self._stage_packed(desc, tctx)
            if desc.id in self._source_uploads and self.device.packs_on_device:
                return lambda tctx: self._upload_source(desc, tctx)
            self._unsupported(desc.kind.value)
        kind = self.plan.by_key[desc.publishes].selected.kind
        body = self.recipes.get(kind)
        if body is None:
            self._unsupported(kind if self.device is not None else desc.kind.value)
        return lambda tctx: body(desc, tctx)

    def _unsupported(self, what: str) -> None:
        if self.device is not None and what == DEVICE_PREPACK:
            from onnx_prep.core.runtime.session_device import device_prepack_refused

            raise device_prepack_refused(self.device.name, [r.request.logical_value for r in self.plan.requirements
                                                            if r.selected.kind == DEVICE_PREPACK],
                                         getattr(self.device, "device_prepack_reason", None))
        raise OnnxPrepError(f"task kind {what} is not supported by this runtime yet",
                            Where(model=str(self.resolved.model_path)),
                            hint="this is a bug in onnx-prep; please report it")

    # ------------------------------------------------------------------ recipes
    def _read_raw(self, desc: TaskDescriptor, tctx: TaskContext) -> None:
        """READ_SOURCE: the source bytes are the prepared object; read them straight
        into the key's stable slot through the one reader."""
        wd = self.resolved.weights[desc.id.split(":", 1)[1]]
        tctx.raise_if_cancelled()
        self._count("source_reads")

        def fill(nbytes: int, view: np.ndarray) -> None:
            self.reader.read_into(wd, view)
            if self.drop_sources:
                self.reader.drop_cached(wd)

        self._materialize(desc.publishes, tctx, wd.length, fill, typed_as=wd)

    def _read_source(self, desc: TaskDescriptor, tctx: TaskContext) -> Source:
        """A source weight for prepacks, through the one reader."""
        wd = self.resolved.weights[desc.id.split(":", 1)[1]]
        tctx.raise_if_cancelled()
        self._count("source_reads")
        pinned = desc.id in self._staged_reads
        if pinned:
            # an upload copies it: read straight into page-locked staging (no mapping,
            # no second copy into staging)
            buf = self.device.staging(wd.length)
            try:
                self.reader.read_into(wd, buf)
            except BaseException:
                self.device.free_staging(buf)
                raise
            on_release = lambda: self.device.free_staging(buf)  # noqa: E731
            if self.drop_sources:
                self.reader.drop_cached(wd)
        elif self.source_io == "map":
            # NOTE: zero copy: the source is the page cache itself, prefaulted here on the
            # I/O worker through the reader's one mapping of the data file; releasing it
            # drops its pages from the mapping. A pread into a fresh buffer costs a
            # zeroing and a copy of every source byte (memory-bound on small machines).
            buf = self.reader.map_shared(wd, populate=True)
            on_release = lambda: self.reader.release_shared(wd, drop=self.drop_sources)  # noqa: E731
        else:
            buf = np.empty(wd.length, dtype=np.uint8)
            self.reader.read_into(wd, buf)
            on_release = None
            if self.drop_sources:  # the bytes are in the buffer now
                self.reader.drop_cached(wd)
        reservation = tctx.detach(Arena.PREPARATION) if tctx.reservation is not None else None
        return Source(as_array(wd, buf), reservation, on_release, pinned=pinned)

    def _prepack_sources(self, desc: TaskDescriptor, tctx: TaskContext, req) -> dict[str, np.ndarray]:
        """A prepack's sources by name: what its read tasks returned, then the inline
        values of its lineage (no read task: held in the model itself)."""
        sources: dict[str, np.ndarray] = {}
        for dep_id, src in zip(desc.dependencies, tctx.inputs):
            sources[dep_id.split(":", 1)[1]] = src.array
        for n in req.request.source_lineage:
            if n not in sources and n in self.resolved.inline_values:
                sources[n] = self.resolved.inline_values[n]
        return sources

    def _prepack(self, desc: TaskDescriptor, tctx: TaskContext) -> None:
        """READ_SOURCE_AND_PREPACK: prepack straight into the key's stable slot: the
        packed bytes are written once, in place (no temporary packed buffer, no copy)."""
        from onnx_prep.core.kernels.prepack import packed_size, prepack

        key = desc.publishes
        req = self.plan.by_key[key]
        node = self._nodes_by_name[req.node]
        sources = self._prepack_sources(desc, tctx, req)
        try:
            tctx.raise_if_cancelled()
            size = packed_size(node.kernel, req.request, self.resolved, node=node)
            if size is None:  # no exact size query for this kernel: pack, then copy
                t0 = time.perf_counter_ns()
                packed = np.ascontiguousarray(
                    prepack(node.kernel, req.request, sources, node.attributes)).view(np.uint8).reshape(-1)
                self._count_prepack(t0)
                self._sources_unchanged(desc)

                def fill(nbytes: int, view: np.ndarray) -> None:
                    view[:] = packed

                size = packed.nbytes
            else:
                def fill(nbytes: int, view: np.ndarray) -> None:
                    t0 = time.perf_counter_ns()
                    prepack(node.kernel, req.request, sources, node.attributes, out=view)
                    self._count_prepack(t0)
                    self._sources_unchanged(desc)  # before publish: nothing built from zeros

            view = self._materialize(key, tctx, size, fill)
            if view is not None:
                self._persist(req, view)
        finally:
            self._sources_used(desc.dependencies)

    def _read_packed(self, desc: TaskDescriptor, tctx: TaskContext) -> None:
        """READ_PACKED_PAYLOAD: the persisted packed bytes straight into the key's slot
        (no source read, no prepack). An entry the cache finds unusable while reading
        (its digest does not match) is rebuilt from its sources in this same task."""
        key = desc.publishes
        req = self.plan.by_key[key]
        tctx.raise_if_cancelled()
        self._count("packed_reads")

        payload = req.selected.payload
        mapping = self.cache.mapping(payload) if hasattr(self.slots, "map_file") else None
        commit = None
        seen = []
        if mapping is not None:
            # NOTE: the payload is mapped, not read: its slot IS the page cache (no fresh
            # page, no copy). Reading it into committed pages cost as much as building
            # it from its sources (page population runs at ~1 GB/s here). Its checksum
            # is read in the same native call (StableSlot.map_file says why).
            def commit(nbytes: int) -> np.ndarray:
                view, mapped = self.slots.map_file(key, nbytes, *mapping,
                                                   checksum_bytes=self.cache.mapped_checksum_bytes(payload))
                seen.append(mapped)
                return view

        def fill(nbytes: int, view: np.ndarray) -> None:
            if mapping is not None:
                mapped = seen[-1]
                # a file cut under the mapping first: its checksum then fails too, for that reason
                ok = not mapped.shrunk and self.cache.accept_mapped(payload, view, xxh3=mapped.xxh3)
                if mapped.shrunk:
                    ok = self.cache.mapped_damaged(payload)
                if ok:
                    self._count("packed_bytes_read", payload.length)
                    self._count("packed_bytes_mapped", payload.length)
                    # exact, from the page tables: 2 MiB-aligned payloads in 2 MiB folios
                    # are mapped by PMD entries (docs/runtime.md, "Page-ins")
                    pmd = mapped.pmd_bytes
                    self._count("packed_pmd_unknown" if pmd is None else "packed_bytes_pmd_mapped",
                                1 if pmd is None else pmd)
                    self.cache.count_pmd_mapped(pmd)
                    return
                self.slots.commit(key, nbytes)  # fresh pages at the same address
            elif self.cache.read_into(payload, view):
                self._count("packed_bytes_read", payload.length)
                return
            self._count("cache_fallbacks")
            self._prepack_from_source(req, view)

        view = self._materialize(key, tctx, req.packed_bytes, fill, commit=commit)
        if view is not None:
            self._persist(req, view)

    # ------------------------------------------------------- device recipes (uploads)
    def _staged(self, tctx: TaskContext, buf: np.ndarray) -> Source:
        """``buf`` (staging) as the task's result, holding its Preparation reservation
        until the upload that reads it is done."""
        reservation = tctx.detach(Arena.PREPARATION) if tctx.reservation is not None else None
        return Source(buf, reservation, lambda: self.device.free_staging(buf), pinned=True)

    def _stage_prepack(self, desc: TaskDescriptor, tctx: TaskContext) -> Source:
        """The CPU prepack of ``read_source_prepack_upload``: packed straight into
        page-locked staging for its upload (written once; no packed copy in between)."""
        from onnx_prep.core.kernels.prepack import packed_size, prepack

        req = self._staged_for[desc.id]
        node = self._nodes_by_name[req.node]
        sources = self._prepack_sources(desc, tctx, req)
        tctx.raise_if_cancelled()
        size = packed_size(node.kernel, req.request, self.resolved, node=node)
        packed = None
        if size is None:  # no exact size query for this kernel: pack, then copy
            t0 = time.perf_counter_ns()
            packed = np.ascontiguousarray(
                prepack(node.kernel, req.request, sources, node.attributes)).view(np.uint8).reshape(-1)
            self._count_prepack(t0)
            size = packed.nbytes
        buf = self.device.staging(size)
        try:
            if packed is None:
                t0 = time.perf_counter_ns()
                prepack(node.kernel, req.request, sources, node.attributes, out=buf)
                self._count_prepack(t0)
            else:
                buf[:] = packed
            self._sources_unchanged(desc)  # before the upload: nothing built from zeros
        except BaseException:
            self.device.free_staging(buf)
            raise
        return self._staged(tctx, buf)

    def _stage_packed(self, desc: TaskDescriptor, tctx: TaskContext) -> Source:
        """The packed read of ``read_packed_payload_upload``: the cache payload read (and
        its digest checked) into page-locked staging; an entry found unusable is rebuilt
        from its sources into the same staging, as on the CPU."""
        req = self._staged_for[desc.id]
        payload = req.selected.payload
        tctx.raise_if_cancelled()
        self._count("packed_reads")
        buf = self.device.staging(req.packed_bytes)
        try:
            if self.cache.read_into(payload, buf):
                self._count("packed_bytes_read", payload.length)
            else:
                self._count("cache_fallbacks")
                self._prepack_from_source(req, buf)
        except BaseException:
            self.device.free_staging(buf)
            raise
        return self._staged(tctx, buf)

    def _upload(self, desc: TaskDescriptor, tctx: TaskContext) -> None:
        """An UPLOAD that publishes a device object: commit its device slot, copy the
        staged bytes on the device queue's stream, timed by device events; the staging
        goes back once the copy is done."""
        key = desc.publishes
        req = self.plan.by_key[key]
        src: Source = tctx.inputs[0]
        data = src.array.reshape(-1).view(np.uint8)
        typed_as = self.resolved.weights.get(req.request.logical_value) if req.kernel == RAW_LAYOUT else None
        tctx.raise_if_cancelled()
        if not src.pinned:  # never in a plan this runtime builds: every upload's input is staged
            raise OnnxPrepError(f"upload {desc.id}: its bytes are not in page-locked staging", Where(tensor=key),
                                hint="this is a bug in onnx-prep; please report it")

        def fill(nbytes: int, view) -> None:
            ms = self.device.upload(key, data)
            self._count("uploads")
            self._count("host_to_device_bytes", data.nbytes)
            self._count("upload_ns", round(ms * 1e6))

        try:
            self._materialize(key, tctx, data.nbytes, fill, typed_as=typed_as)
        finally:
            self._sources_used(desc.dependencies)  # the copy is done (or failed): staging back

    # ------------------------------------------- device recipe (the device-side prepack)
    def _upload_source(self, desc: TaskDescriptor, tctx: TaskContext) -> Source:
        """``S.upload_source:<source>``: the source's bytes, read into staging by its read
        task (or an inline value copied into staging here), copied into device memory of
        its own; the result holds it until every prepack reading it has published. The
        read's staging goes back when this task ends (SessionTasks)."""
        name = desc.id.split(":", 1)[1]
        tctx.raise_if_cancelled()
        wd = self.resolved.weights.get(name)
        if desc.dependencies:  # read into page-locked staging by S.read_source
            src: Source = tctx.inputs[0]
            data, staging = src.array.reshape(-1).view(np.uint8), None
            dtype, dims = wd.dtype, tuple(wd.dims)
        else:  # held in the model itself
            value = np.ascontiguousarray(self.resolved.inline_values[name])
            staging = self.device.staging(value.nbytes)
            staging[:] = value.reshape(-1).view(np.uint8)
            data, dtype, dims = staging, str(value.dtype), tuple(value.shape)
        try:
            staged = self.device.upload_source(name, data, dtype=dtype, dims=dims)
        finally:
            if staging is not None:
                self.device.free_staging(staging)
        self._count("source_uploads")
        self._count("host_to_device_bytes", staged.length)
        self._count("upload_ns", round(staged.upload_ms * 1e6))
        return Source(None, None, lambda: self.device.free_source(staged), on_device=staged)

    def _device_prepack(self, desc: TaskDescriptor, tctx: TaskContext) -> None:
        """``read_source_upload_prepack``'s publisher: commit the key's device slot and pack
        into it on the device from the sources its source uploads staged there."""
        from onnx_prep.core.kernels.prepack import packed_size
        from onnx_prep.core.ops.attributes import normalize_attributes

        key = desc.publishes
        req = self.plan.by_key[key]
        node = self._nodes_by_name[req.node]
        try:
            staged: dict[str, DeviceSource] = {
                dep.split(":", 1)[1]: src.on_device for dep, src in zip(desc.dependencies, tctx.inputs)}
            sources = [staged[n] for n in req.request.source_lineage]
            tctx.raise_if_cancelled()
            size = packed_size(node.kernel, req.request, self.resolved, node=node)
            if size is None:  # never for a kernel that offers the recipe: its size is exact
                raise OnnxPrepError(f"device prepack of {req.request.logical_value}: kernel {node.kernel} has no "
                                    "exact packed size", Where(tensor=key),
                                    hint="this is a bug in onnx-prep; please report it")
            attributes = normalize_attributes(node.attributes)

            def fill(nbytes: int, view) -> None:
                ms = self.device.prepack(key, node.kernel, attributes, sources)
                self._count("device_prepacks")
                self._count("device_prepack_ns", round(ms * 1e6))

            self._materialize(key, tctx, size, fill)
        finally:
            self._sources_used(desc.dependencies)  # its sources' device memory, once every reader published

    def _prepack_from_source(self, req, view: np.ndarray) -> None:
        """Build ``req``'s packed object into ``view`` reading its sources here, through
        the one reader (the repair path of an unusable cache entry)."""
        from onnx_prep.core.kernels.prepack import prepack

        node = self._nodes_by_name[req.node]
        sources = {}
        for n in req.request.source_lineage:
            if n in self.resolved.inline_values:
                sources[n] = self.resolved.inline_values[n]
            else:
                self._count("source_reads")
                sources[n] = self.reader.read_array(self.resolved.weights[n])
        t0 = time.perf_counter_ns()
        packed = prepack(node.kernel, req.request, sources, node.attributes)
        self._count_prepack(t0)
        view[:] = np.ascontiguousarray(packed).view(np.uint8).reshape(-1)

    def _persist(self, req, view: np.ndarray) -> None:
        """Hand a just-published packed object to the cache to persist, pinned until it
        is written, when the cache wants it (build-if-missing and not already cached)."""
        cache = self.cache
        if cache is None or not cache.persists(req.request):
            return
        pins = self.store.pin_many([req.key])
        if pins is None:  # evicted already: the next build persists it
            return
        digests = {n: self.reader.content_digest(self.resolved.weights[n])
                   for n in req.request.source_lineage
                   if n in self.resolved.weights and self.resolved.weights[n].external}
        self._count("persist_requests")
        cache.persist(req.request, view, digests, pins.release)

    def _sources_unchanged(self, desc: TaskDescriptor) -> None:
        """Mapped sources: their data file did not shrink under the prepack that read
        them (a page past its new end reads as zeros; ``ExternalDataReader.check_unchanged``)."""
        if self.source_io == "map":
            for dep_id in desc.dependencies:
                self.reader.check_unchanged(self.resolved.weights[dep_id.split(":", 1)[1]])

    def _count_prepack(self, t0: int) -> None:
        self._count("prepacks")
        self._count("prepack_ns", time.perf_counter_ns() - t0)

    # ----------------------------------------------------------------- publishing
    def _materialize(self, key: PreparedKey, tctx: TaskContext, nbytes: int, fill,
                     typed_as=None, commit=None) -> np.ndarray | None:
        """Publish ``key``: commit its stable slot (or ``commit(nbytes)``, e.g. a file
        mapping), fill it, hand the store the buffer. Returns the slot's byte view, or
        None when another load published the key."""
        store = self.store
        mat, owner = store.begin_load(key)
        if not owner:  # another generation is loading it: share that one
            mat.wait()
            return None
        gen = mat.generation
        try:
            # This thread owns the key's load (begin_load): nothing else creates, fills
            # or evicts the key's slot until publish.
            raw_view = commit(nbytes) if commit is not None else self.slots.commit(key, nbytes, typed_as)
            store.mark_preparing(key, gen)
            fill(nbytes, raw_view)
            reservation = None
            if tctx.reservation is not None and Arena.PREPARED in tctx.reservation.amounts:
                reservation = tctx.detach(Arena.PREPARED)
            first = store.generation(key) <= 1
            store.publish(key, gen, self.slots.buffer(key, nbytes, reservation))
            self._count("materializations")
            if not first:
                self._count("rematerializations")
                self._count("rematerialized_bytes", nbytes)
            self._published(key)
        except BaseException as e:
            store.fail(key, gen, e)
            raise
        return raw_view


class Source:
    """A source buffer read for prepacking (or staged bytes for an upload), with its
    PREPARATION reservation; or a source copied into device memory for the device-side
    prepack (``on_device``, no host array)."""

    __slots__ = ("array", "reservation", "on_release", "pinned", "on_device")

    def __init__(self, array: np.ndarray | None, reservation, on_release=None, *, pinned: bool = False,
                 on_device: DeviceSource | None = None) -> None:
        self.array = array
        self.reservation = reservation
        self.on_release = on_release
        self.pinned = pinned  # page-locked staging an upload copies from (a device plan)
        self.on_device = on_device  # in device memory, for the device-side prepack

    def release(self) -> None:
        self.array = self.on_device = None
        if self.on_release is not None:
            self.on_release()
            self.on_release = None
        if self.reservation is not None:
            self.reservation.release()
        self.reservation = None


def release_source(h: TaskHandle) -> None:
    """Free what a finished source read holds (its buffer and reservation)."""
    if h.state is TaskState.DONE:
        src = h.result()
        if isinstance(src, Source):
            src.release()
        h.discard_result()
