"""A fake CUDA driver for the tests: the ``DeviceDriver`` protocol (core/cuda/driver.py)
over plain Python state, mirroring the real driver's call sequence and refusing what
the real one refuses, each with the real ``CUresult`` code and name:

- every call before ``init`` (CUDA_ERROR_NOT_INITIALIZED), memory calls before
  ``use_device`` (CUDA_ERROR_INVALID_CONTEXT);
- sizes and addresses that are not whole granules; ``create`` past the device's memory
  (CUDA_ERROR_OUT_OF_MEMORY);
- ``map`` outside a reserved range, over a mapping, or of an unknown or released handle;
- ``set_access`` of a range that is not mapped (access before map);
- ``unmap`` of a range that is not mapped; a double ``release``;
- ``address_free`` of a range that is not exactly a reservation, or with a mapping in it;
- copies outside a mapped range, or to one whose access was never set.

Physical memory is a ``bytearray`` per allocation, so bytes written through one address
are read back through it, and a new allocation under the same address starts zeroed.
``calls`` logs every call, name first, for tests that check the sequence. No part of
the fake decides anything the pool should decide.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from onnx_prep.core.cuda.driver import DriverCallError

CODES = {"CUDA_ERROR_INVALID_VALUE": 1, "CUDA_ERROR_OUT_OF_MEMORY": 2, "CUDA_ERROR_NOT_INITIALIZED": 3,
         "CUDA_ERROR_NO_DEVICE": 100, "CUDA_ERROR_INVALID_DEVICE": 101, "CUDA_ERROR_INVALID_CONTEXT": 201,
         "CUDA_ERROR_NOT_SUPPORTED": 801}
MiB = 1 << 20
BASE = 0x7F00_0000_0000


def fail(call: str, name: str, detail: str) -> DriverCallError:
    return DriverCallError(call, CODES[name], name, detail)


@dataclass(eq=False)
class FakeHandle:
    size: int
    data: bytearray
    released: bool = False
    mapped_at: int | None = None


@dataclass
class Mapping:
    size: int
    handle: FakeHandle
    access: bool = False


@dataclass
class FakeDriver:
    devices: int = 1
    memory: int = 64 * MiB  # physical bytes per device
    granularity: int = 2 * MiB
    vmm: bool = True
    name: str = "Fake GPU"
    capability: tuple[int, int] = (9, 0)
    version: int = 12040
    init_error: str | None = None  # a CUresult name cuInit returns
    binding: str = "fake driver"
    calls: list[tuple] = field(default_factory=list)
    used: int = 0  # physical bytes held by live allocations
    reservations: dict[int, int] = field(default_factory=dict)  # address -> size
    mappings: dict[int, Mapping] = field(default_factory=dict)  # address -> mapping
    handles: list[FakeHandle] = field(default_factory=list)
    _initialised: bool = False
    _current: int | None = None
    _next: int = BASE

    # -- discovery
    def _call(self, name: str, *args, needs_context: bool = False) -> None:
        self.calls.append((name, *args))
        if name != "cuInit" and not self._initialised:
            raise fail(name, "CUDA_ERROR_NOT_INITIALIZED", "cuInit was not called")
        if needs_context and self._current is None:
            raise fail(name, "CUDA_ERROR_INVALID_CONTEXT", "no current context (use_device)")

    def _ordinal(self, call: str, ordinal: int) -> None:
        if not 0 <= ordinal < self.devices:
            raise fail(call, "CUDA_ERROR_INVALID_DEVICE", f"device {ordinal}")

    def init(self) -> None:
        self._call("cuInit")
        if self.init_error is not None:
            raise DriverCallError("cuInit", CODES[self.init_error], self.init_error)
        self._initialised = True

    def driver_version(self) -> int:
        self._call("cuDriverGetVersion")
        return self.version

    def device_count(self) -> int:
        self._call("cuDeviceGetCount")
        return self.devices

    def _query(self, call: str, ordinal: int, value):
        self._call(call, ordinal)
        self._ordinal(call, ordinal)
        return value

    def device_name(self, ordinal: int) -> str:
        return self._query("cuDeviceGetName", ordinal, self.name)

    def compute_capability(self, ordinal: int) -> tuple[int, int]:
        return self._query("cuDeviceGetAttribute", ordinal, self.capability)

    def total_memory(self, ordinal: int) -> int:
        return self._query("cuDeviceTotalMem", ordinal, self.memory)

    def vmm_supported(self, ordinal: int) -> bool:
        return self._query("cuDeviceGetAttribute", ordinal, self.vmm)

    def allocation_granularity(self, ordinal: int) -> int:
        self._query("cuMemGetAllocationGranularity", ordinal, None)
        if not self.vmm:
            raise fail("cuMemGetAllocationGranularity", "CUDA_ERROR_NOT_SUPPORTED", "no VMM on this device")
        return self.granularity

    def use_device(self, ordinal: int) -> None:
        self._current = self._query("cuCtxSetCurrent", ordinal, ordinal)

    # -- virtual memory
    def _granules(self, call: str, *values: int) -> None:
        for v in values:
            if v % self.granularity:
                raise fail(call, "CUDA_ERROR_INVALID_VALUE", f"{v:#x} is not a whole number of granules")

    def address_reserve(self, size: int, alignment: int) -> int:
        self._call("cuMemAddressReserve", size, alignment, needs_context=True)
        self._granules("cuMemAddressReserve", size)
        if size <= 0:
            raise fail("cuMemAddressReserve", "CUDA_ERROR_INVALID_VALUE", "empty range")
        align = max(alignment, self.granularity)
        address = -(-self._next // align) * align
        self._next = address + size + self.granularity  # a gap: ranges never touch
        self.reservations[address] = size
        return address

    def _reservation(self, address: int, size: int) -> int | None:
        for start, n in self.reservations.items():
            if start <= address and address + size <= start + n:
                return start
        return None

    def address_free(self, address: int, size: int) -> None:
        self._call("cuMemAddressFree", address, size, needs_context=True)
        if self.reservations.get(address) != size:
            raise fail("cuMemAddressFree", "CUDA_ERROR_INVALID_VALUE", f"{address:#x}+{size:#x} is not a reservation")
        if any(address <= a < address + size for a in self.mappings):
            raise fail("cuMemAddressFree", "CUDA_ERROR_INVALID_VALUE", "range still has a mapping")
        del self.reservations[address]

    def create(self, size: int, ordinal: int) -> FakeHandle:
        self._call("cuMemCreate", size, ordinal, needs_context=True)
        self._ordinal("cuMemCreate", ordinal)
        self._granules("cuMemCreate", size)
        if size <= 0:
            raise fail("cuMemCreate", "CUDA_ERROR_INVALID_VALUE", "empty allocation")
        if self.used + size > self.memory:
            raise fail("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY", f"{self.used:,} of {self.memory:,} bytes in use")
        self.used += size
        handle = FakeHandle(size, bytearray(size))
        self.handles.append(handle)
        return handle

    def release(self, handle: FakeHandle) -> None:
        self._call("cuMemRelease", handle, needs_context=True)
        if handle not in self.handles or handle.released:
            raise fail("cuMemRelease", "CUDA_ERROR_INVALID_VALUE", "unknown or already released handle")
        handle.released = True
        if handle.mapped_at is None:  # a mapped allocation lives until its unmap, as on the driver
            self.used -= handle.size

    def map(self, address: int, size: int, handle: FakeHandle) -> None:
        self._call("cuMemMap", address, size, handle, needs_context=True)
        self._granules("cuMemMap", address, size)
        if handle not in self.handles or handle.released:
            raise fail("cuMemMap", "CUDA_ERROR_INVALID_VALUE", "unknown or released handle")
        if handle.mapped_at is not None or size != handle.size:
            raise fail("cuMemMap", "CUDA_ERROR_INVALID_VALUE", "the handle is mapped, or of another size")
        if self._reservation(address, size) is None:
            raise fail("cuMemMap", "CUDA_ERROR_INVALID_VALUE", f"{address:#x}+{size:#x} is not reserved")
        if any(a < address + size and address < a + m.size for a, m in self.mappings.items()):
            raise fail("cuMemMap", "CUDA_ERROR_INVALID_VALUE", "range already mapped")
        self.mappings[address] = Mapping(size, handle)
        handle.mapped_at = address

    def unmap(self, address: int, size: int) -> None:
        self._call("cuMemUnmap", address, size, needs_context=True)
        m = self.mappings.get(address)
        if m is None or m.size != size:
            raise fail("cuMemUnmap", "CUDA_ERROR_INVALID_VALUE", f"{address:#x}+{size:#x} is not a mapping")
        del self.mappings[address]
        m.handle.mapped_at = None
        if m.handle.released:
            self.used -= m.handle.size

    def set_access(self, address: int, size: int, ordinal: int) -> None:
        self._call("cuMemSetAccess", address, size, ordinal, needs_context=True)
        self._ordinal("cuMemSetAccess", ordinal)
        m = self.mappings.get(address)
        if m is None or m.size != size:
            raise fail("cuMemSetAccess", "CUDA_ERROR_INVALID_VALUE", f"{address:#x}+{size:#x} is not mapped")
        m.access = True

    def _accessible(self, call: str, address: int, nbytes: int) -> tuple[Mapping, int]:
        for a, m in self.mappings.items():
            if a <= address and address + nbytes <= a + m.size:
                if not m.access:
                    raise fail(call, "CUDA_ERROR_INVALID_VALUE", "no access was set on the mapping")
                return m, address - a
        raise fail(call, "CUDA_ERROR_INVALID_VALUE", f"{address:#x}+{nbytes:#x} is not mapped")

    def copy_to_device(self, address: int, data) -> None:
        src = memoryview(data).cast("B")
        self._call("cuMemcpyHtoD", address, src.nbytes, needs_context=True)
        m, off = self._accessible("cuMemcpyHtoD", address, src.nbytes)
        m.handle.data[off:off + src.nbytes] = src

    def copy_to_host(self, address: int, nbytes: int) -> bytes:
        self._call("cuMemcpyDtoH", address, nbytes, needs_context=True)
        m, off = self._accessible("cuMemcpyDtoH", address, nbytes)
        return bytes(m.handle.data[off:off + nbytes])

    # -- inspection
    def live_handles(self) -> list[FakeHandle]:
        return [h for h in self.handles if not h.released]

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


def ready(**kwargs) -> FakeDriver:
    """A fake driver after ``cuInit``, as the pool receives one from discovery."""
    d = FakeDriver(**kwargs)
    d.init()
    return d
