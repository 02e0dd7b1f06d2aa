"""DeviceSlotPool: prepared objects in device memory under stable virtual addresses, the
second implementation of the slot-pool interface (core/runtime/slot_pool.py).

Per prepared key, a device address range is reserved once (``cuMemAddressReserve``,
whole granules of the driver's allocation granularity, queried, never assumed). A
page-in creates physical memory for it (``cuMemCreate``), maps it at the start of the
key's range (``cuMemMap``) and sets read-write access after EVERY map (``cuMemSetAccess``:
a fresh mapping has none); eviction unmaps and releases it (``cuMemUnmap``,
``cuMemRelease``) while the range stays reserved, so the next page-in puts the object at
the SAME address and a captured graph that reads it keeps replaying. ``close`` frees
every range (``cuMemAddressFree``). The calls go through a
:class:`~onnx_prep.core.cuda.driver.DeviceDriver`: cuda-python's, or the fake the tests
use, which enforces the same rules.

Shared ranges: ``reserve(key, capacity, shared=True)`` places a small object (at most one
granule, its size rounded up to ``SHARED_ALIGNMENT``) first fit in a granule it shares
with others, instead of a range of its own: a 2 KiB norm weight would otherwise commit a
whole 2 MiB granule. Each shared granule is a range of its own, reserved as needed, and
an object lies within one, never across two: one mapping holds it. Its address is as
stable as an own range's. The granule is mapped by the first commit of an object in it
and unmapped by the decommit of its last resident object: mapped once, counted once in
the committed bytes and the budget. A share is never given back before ``close`` (its
address is the object's for the pool's life) and a granule stays mapped while any of
its objects is resident, so sharing suits objects that stay resident together: the
session shares raw weights only (read by every step); packed objects are what pages
under a budget, and each keeps granules of its own.

What the materializer and the store rely on is the host pool's contract, with one
difference: ``commit`` and ``view`` return a :class:`DeviceView` (a device address and
a size; kernels take pointers), not a host array, and ``upload`` / ``page_in`` copy the
bytes from the host.

Budget: the bytes committed (each own range's object rounded up to whole granules, each
mapped shared granule once: what the device really holds) never exceed ``budget``. A
page-in that would pass it raises :class:`~onnx_prep.core.errors.DeviceBudgetError`
before any driver call, and the pool is unchanged; as on the host, choosing what to
evict is the session's (its ``EvictionPolicy`` under the budget, evicting through the
store, whose buffers' ``release`` decommits here), not the pool's. ``headroom()`` says
what fits now.

Counters (``counters()``): committed bytes, their peak, page-ins (maps), evictions
(unmaps: a shared object's decommit that leaves its granule mapped is none), and the
bytes copied host to device.

Thread-safe: one lock around each operation, driver calls included, so the budget check
and the commit it admits are one step. A context is current per thread on the driver, so
each operation first makes the device's current on the calling thread (``make_current``,
once per thread): a session commits on its device worker and evicts from whichever
thread runs.
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any

from onnx_prep.core.cuda.driver import DeviceDriver
from onnx_prep.core.errors import DeviceBudgetError, DeviceError, OnnxPrepError, Where
from onnx_prep.core.model.prepared_key import PreparedKey
from onnx_prep.core.plan.device_target import SHARED_ALIGNMENT

__all__ = ["DeviceSlotCounters", "DeviceSlotPool", "DeviceView"]


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class DeviceView:
    """What a kernel is given for a resident object: its device ``address`` (the same
    across evict → page-in) and ``nbytes``; ``typed_as`` the weight descriptor of a raw
    weight (dtype, dims), None for packed bytes."""

    address: int
    nbytes: int
    typed_as: Any = None


@dataclass
class DeviceSlotCounters:
    committed_bytes: int = 0  # granule-rounded, now
    peak_committed_bytes: int = 0
    page_ins: int = 0  # commits that mapped memory
    evictions: int = 0  # decommits that unmapped it
    host_to_device_bytes: int = 0

    def to_json(self) -> dict:
        return asdict(self)


class _Range:
    """A reserved address range (whole granules) and the physical memory mapped at its start."""

    __slots__ = ("address", "size", "handle", "mapped")

    def __init__(self, address: int, size: int) -> None:
        self.address = address
        self.size = size
        self.handle: Any = None  # the physical allocation while mapped
        self.mapped = 0  # bytes mapped (whole granules), 0 when not


class _SharedRange(_Range):
    """One granule small objects share: ``used`` bytes placed (first fit, never given
    back before close), mapped while ``residents`` > 0."""

    __slots__ = ("used", "residents")

    def __init__(self, address: int, size: int) -> None:
        super().__init__(address, size)
        self.used = 0
        self.residents = 0


class _Slot:
    __slots__ = ("range", "address", "size", "shared", "nbytes", "resident", "view")

    def __init__(self, rng: _Range, offset: int, size: int, shared: bool) -> None:
        self.range = rng  # its own range, or the shared granule it was placed in
        self.address = rng.address + offset  # reserved once; never changes
        self.size = size  # bytes it may hold: its range's (whole granules), or its share
        self.shared = shared
        self.nbytes: int | None = None  # the object's size, fixed at its first commit
        self.resident = False
        self.view: DeviceView | None = None


class DeviceSlotPool:
    """Stable-VA device slots on ``device`` through ``driver``, holding at most
    ``budget`` committed bytes (None: whatever the device gives)."""

    def __init__(self, driver: DeviceDriver, device: int = 0, *, budget: int | None = None) -> None:
        self.driver = driver
        self.device = device
        self._threads = threading.local()  # .current: the device's context is current on this thread
        self.make_current()
        if not driver.vmm_supported(device):
            raise DeviceError(f"CUDA device {device} ({driver.device_name(device)}) does not support virtual memory "
                              "management: stable-VA slots need it")
        self.granularity = int(driver.allocation_granularity(device))
        if self.granularity <= 0:
            raise DeviceError(f"cuMemGetAllocationGranularity gave {self.granularity} for device {device}")
        if budget is not None and budget < self.granularity:
            raise DeviceBudgetError(f"device budget of {budget:,} bytes is below one allocation granule "
                                    f"({self.granularity:,} bytes)")
        self.budget = budget
        self._lock = threading.Lock()
        self._slots: dict[PreparedKey, _Slot] = {}
        self._shared: list[_SharedRange] = []  # in reservation order, as first fit scans them
        self._counters = DeviceSlotCounters()
        self._closed = False

    def make_current(self) -> None:
        """Make the device's (primary) context current on the calling thread, once per
        thread: every driver call of the device needs it there."""
        if not getattr(self._threads, "current", False):
            self.driver.use_device(self.device)
            self._threads.current = True

    # -- the slot-pool interface
    def reserve(self, key: PreparedKey, capacity: int, *, shared: bool = False) -> None:
        """Reserve ``key``'s address range: ``capacity`` rounded up to whole granules, or,
        ``shared``, a share of a granule it shares with other small objects (module
        docstring); an object larger than one granule gets a range of its own either way."""
        with self._lock:
            self._open()
            self.make_current()
            if key in self._slots:
                raise ValueError(f"prepared object {key!r} already has a device range")
            share = self._share(capacity) if shared else None
            self._slots[key] = self._place(capacity, share, None if share is None else self._first_fit(share))

    def commit(self, key: PreparedKey, nbytes: int, typed_as: Any = None) -> DeviceView:
        """Map physical memory for ``nbytes`` under ``key``'s range (reserving one now if
        it has none, or a larger one if its reserved range or share was too small: before
        its first commit only) and return its view; nothing to do if resident. A shared
        object's granule is mapped by the first of its objects to commit."""
        own = _round_up(max(int(nbytes), 1), self.granularity)
        with self._lock:
            self._open()
            self.make_current()
            slot = self._slots.get(key)
            if slot is not None and slot.nbytes is not None and slot.nbytes != nbytes:
                raise OnnxPrepError(f"prepared object changed size ({slot.nbytes} -> {nbytes})", Where(tensor=key))
            if slot is not None and slot.resident:
                return slot.view
            need = _round_up(max(int(nbytes), 1), SHARED_ALIGNMENT) if slot is not None and slot.shared else own
            if slot is None or (slot.nbytes is None and slot.size < need):
                # no range yet, or the estimate was too low: a place that fits (a shared
                # object's old share stays unused in its granule until close)
                share = self._share(nbytes) if slot is not None and slot.shared else None
                into = None if share is None else self._first_fit(share)
                maps = own if share is None else 0 if into is not None and into.mapped else self.granularity
                self._admit(key, maps)  # before any driver call
                if slot is not None and not slot.shared:
                    self.driver.address_free(slot.range.address, slot.range.size)
                    del self._slots[key]
                slot = self._slots[key] = self._place(nbytes, share, into)
            else:
                self._admit(key, 0 if slot.range.mapped else self.granularity if slot.shared else own)
            rng = slot.range
            if not rng.mapped:
                self._map(rng, rng.size if slot.shared else own)
            if slot.shared:
                rng.residents += 1
            slot.resident = True
            if slot.nbytes is None:
                slot.nbytes = nbytes
                slot.view = DeviceView(slot.address, nbytes, typed_as)
            return slot.view

    def decommit(self, key: PreparedKey) -> None:
        """Unmap and release ``key``'s memory (a shared object's granule once its last
        resident object goes); its range (and view) keep their address."""
        with self._lock:
            slot = self._slots[key]
            if not slot.resident:
                return
            self.make_current()
            rng = slot.range
            if not slot.shared or rng.residents == 1:
                self._unmap(rng)
                self._counters.evictions += 1
            if slot.shared:
                rng.residents -= 1
            slot.resident = False

    def buffer(self, key: PreparedKey, nbytes: int, reservation: Any):
        from onnx_prep.core.runtime.slot_pool import SlotBuffer

        return SlotBuffer(self, key, nbytes, reservation)

    def view(self, key: PreparedKey) -> DeviceView:
        return self._slots[key].view

    def __contains__(self, key: PreparedKey) -> bool:
        """Whether ``key`` has its address range (resident or not)."""
        with self._lock:
            return key in self._slots

    def nbytes(self, key: PreparedKey) -> int:
        """The object's size, fixed at its first commit (0 before it)."""
        with self._lock:
            slot = self._slots.get(key)
            return 0 if slot is None or slot.nbytes is None else slot.nbytes

    def committed_bytes(self, key: PreparedKey | None = None) -> int:
        """Every mapped granule, each once; or one resident object's: the granules mapped
        in its own range, or its share of a shared granule (``SHARED_ALIGNMENT``
        multiples: the objects' figures add up to at most the pool's); 0 when evicted."""
        with self._lock:
            if key is None:
                return self._counters.committed_bytes
            slot = self._slots.get(key)
            if slot is None or not slot.resident:
                return 0
            return slot.size if slot.shared else slot.range.mapped

    def is_shared(self, key: PreparedKey) -> bool:
        """Whether ``key`` was placed in a shared granule."""
        with self._lock:
            slot = self._slots.get(key)
            return slot is not None and slot.shared

    # -- copies
    def upload(self, key: PreparedKey, data: Any, stream: Any = None) -> None:
        """Copy ``data`` (a host buffer, at most the object's size) to the start of
        ``key``'s resident memory: at once (cuMemcpyHtoD), or queued on ``stream``
        (cuMemcpyHtoDAsync: ``data`` a page-locked buffer, ``driver.host_alloc``'s,
        left untouched until the stream is synchronised)."""
        n = memoryview(data).nbytes
        with self._lock:
            self.make_current()
            slot = self._slots[key]
            if not slot.resident:
                raise DeviceError(f"upload to an evicted slot ({n:,} bytes)", Where(tensor=key))
            if n > slot.nbytes:
                raise DeviceError(f"upload of {n:,} bytes into an object of {slot.nbytes:,}", Where(tensor=key))
            if stream is None:
                self.driver.copy_to_device(slot.address, data)
            else:
                self.driver.copy_to_device_async(slot.address, data, stream)
            self._counters.host_to_device_bytes += n

    def page_in(self, key: PreparedKey, data: Any, typed_as: Any = None) -> DeviceView:
        """``commit`` for ``data``'s size, then ``upload`` it: one object made resident."""
        view = self.commit(key, memoryview(data).nbytes, typed_as)
        self.upload(key, data)
        return view

    def copy_to_host(self, key: PreparedKey) -> bytes:
        """The resident object's bytes, read back (checks and tests)."""
        with self._lock:
            slot = self._slots[key]
            if not slot.resident:
                raise DeviceError("read of an evicted slot", Where(tensor=key))
            self.make_current()
            return self.driver.copy_to_host(slot.address, slot.nbytes)

    # -- accounting
    def counters(self) -> DeviceSlotCounters:
        with self._lock:
            return DeviceSlotCounters(**asdict(self._counters))

    def headroom(self) -> int | None:
        """Bytes a page-in may still commit under the budget (None: no budget)."""
        with self._lock:
            return None if self.budget is None else self.budget - self._counters.committed_bytes

    def address(self, key: PreparedKey) -> int:
        return self._slots[key].address

    def close(self) -> None:
        """Unmap and release what is mapped, free every range, own and shared (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.make_current()
            slots, self._slots = self._slots, {}
            shared, self._shared = self._shared, []
            for rng in [s.range for s in slots.values() if not s.shared] + shared:
                if rng.mapped:
                    self._unmap(rng)
                self.driver.address_free(rng.address, rng.size)

    def __enter__(self) -> DeviceSlotPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- under the lock
    def _open(self) -> None:
        if self._closed:
            raise DeviceError("the device slot pool is closed")

    def _share(self, nbytes: int) -> int | None:
        """A shared object's share of its granule; None where it is larger than one
        granule (a range of its own: an object never straddles two granules)."""
        share = _round_up(max(int(nbytes), 1), SHARED_ALIGNMENT)
        return share if share <= self.granularity else None

    def _first_fit(self, share: int) -> _SharedRange | None:
        """The first shared granule with ``share`` bytes left; None: a new one is needed."""
        return next((r for r in self._shared if r.size - r.used >= share), None)

    def _place(self, capacity: int, share: int | None, into: _SharedRange | None) -> _Slot:
        """A slot of its own range (``share`` None), or ``share`` bytes in ``into`` (None:
        a shared granule reserved now)."""
        if share is None:
            size = _round_up(max(int(capacity), 1), self.granularity)
            rng = _Range(self.driver.address_reserve(size, self.granularity), size)
            return _Slot(rng, 0, size, False)
        if into is None:
            into = _SharedRange(self.driver.address_reserve(self.granularity, self.granularity), self.granularity)
            self._shared.append(into)
        slot = _Slot(into, into.used, share, True)
        into.used += share
        return slot

    def _admit(self, key: PreparedKey, size: int) -> None:
        if self.budget is None or size == 0:
            return
        if size > self.budget:
            raise DeviceBudgetError(f"prepared object needs {size:,} device bytes (whole granules of "
                                    f"{self.granularity:,}), more than the device budget of {self.budget:,}",
                                    Where(tensor=key), hint="raise --budget")
        committed = self._counters.committed_bytes
        if committed + size > self.budget:
            raise DeviceBudgetError(f"paging in {size:,} device bytes would pass the device budget "
                                    f"({committed:,} of {self.budget:,} committed)", Where(tensor=key),
                                    hint="evict a resident object first")

    def _map(self, rng: _Range, size: int) -> None:
        d = self.driver
        handle = d.create(size, self.device)
        try:
            d.map(rng.address, size, handle)
        except BaseException:
            d.release(handle)
            raise
        try:
            d.set_access(rng.address, size, self.device)
        except BaseException:
            d.unmap(rng.address, size)
            d.release(handle)
            raise
        rng.handle, rng.mapped = handle, size
        c = self._counters
        c.committed_bytes += size
        c.peak_committed_bytes = max(c.peak_committed_bytes, c.committed_bytes)
        c.page_ins += 1

    def _unmap(self, rng: _Range) -> None:
        self.driver.unmap(rng.address, rng.mapped)
        self.driver.release(rng.handle)
        self._counters.committed_bytes -= rng.mapped
        rng.handle, rng.mapped = None, 0
