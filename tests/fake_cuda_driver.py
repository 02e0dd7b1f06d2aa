"""A fake CUDA driver for the tests: the ``DeviceDriver`` protocol (core/cuda/driver.py)
over plain Python state, mirroring the real driver's call sequence and refusing what
the real one refuses, each with the real ``CUresult`` code and name. (One file over
500 lines: it is one device, whose memory, streams, modules and graphs every call
shares; the kernels it runs are in fake_cuda_kernels.py.)

- every call before ``init`` (CUDA_ERROR_NOT_INITIALIZED), memory calls on a thread
  that has not called ``use_device`` (CUDA_ERROR_INVALID_CONTEXT: a context is current
  per thread, as on the driver);
- sizes and addresses that are not whole granules; ``create`` past the device's memory
  (CUDA_ERROR_OUT_OF_MEMORY);
- ``map`` outside a reserved range, over a mapping, or of an unknown or released handle;
- ``set_access`` of a range that is not mapped (access before map);
- ``unmap`` of a range that is not mapped; a double ``release``;
- ``address_free`` of a range that is not exactly a reservation, or with a mapping in it;
- copies outside a mapped range, or to one whose access was never set.

The calls of a device step (driver.py, items 5-10), with the same care:

- ``mem_free`` of what ``mem_alloc`` did not return, copies and kernel reads outside
  every allocation (CUDA_ERROR_INVALID_VALUE at the call; CUDA_ERROR_ILLEGAL_ADDRESS
  when the memory went away before the work ran, reported at the next synchronisation,
  as the device reports its faults);
- work on a destroyed stream, a launch of a function that no loaded module has, an
  event never recorded (CUDA_ERROR_INVALID_HANDLE); a function name the module lacks
  (CUDA_ERROR_NOT_FOUND); a block over 1024 threads or shared memory over 48 KiB;
- capture already begun / not begun (CUDA_ERROR_ILLEGAL_STATE); synchronising a
  capturing stream, or a captured copy from pageable host memory
  (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, and the capture is invalidated: its end says
  CUDA_ERROR_STREAM_CAPTURE_INVALIDATED); launching a destroyed graph
  (CUDA_ERROR_INVALID_VALUE); an event's time before it ran (CUDA_ERROR_NOT_READY).

Work on a stream is queued, not run, until the stream (or an event recorded on it) is
synchronised, as on a device: a result read back before that is not there yet. An
event recorded again stands for its latest record only (cuEventRecord's rule): waiting
on it runs the stream up to that record. A
capture records the stream's launches and copies instead of queueing them; its graph
replays exactly those, with the addresses and host buffers they were captured with,
reading whatever is there at replay. Kernels run for real: a module "compiled" from a
source lists that source's ``extern "C" __global__`` entries, and a launch of one the
fake knows (tests/fake_cuda_kernels.py: the INT4 matmul entries, through this
package's CPU kernel on the fake's device bytes; the INT4 prepack entries, through its
CPU prepack) computes real numbers; one it does
not know is refused (CUDA_ERROR_NOT_SUPPORTED), never skipped.

Physical memory is a ``bytearray`` per allocation, so bytes written through one address
are read back through it, and a new allocation under the same address starts zeroed.
``calls`` logs every call, name first, for tests that check the sequence. No part of
the fake decides anything the pool should decide.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from onnx_prep.core.cuda.driver import DriverCallError

CODES = {"CUDA_ERROR_INVALID_VALUE": 1, "CUDA_ERROR_OUT_OF_MEMORY": 2, "CUDA_ERROR_NOT_INITIALIZED": 3,
         "CUDA_ERROR_NO_DEVICE": 100, "CUDA_ERROR_INVALID_DEVICE": 101, "CUDA_ERROR_INVALID_CONTEXT": 201,
         "CUDA_ERROR_INVALID_HANDLE": 400, "CUDA_ERROR_ILLEGAL_STATE": 401, "CUDA_ERROR_NOT_FOUND": 500,
         "CUDA_ERROR_NOT_READY": 600, "CUDA_ERROR_ILLEGAL_ADDRESS": 700, "CUDA_ERROR_NOT_SUPPORTED": 801,
         "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED": 900, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED": 901}
MiB = 1 << 20
BASE = 0x7F00_0000_0000
ALLOC_BASE = 0x7E00_0000_0000  # cuMemAlloc's buffers, apart from the reserved ranges
MAX_THREADS = 1024  # per block
MAX_SHARED = 48 << 10  # static + dynamic shared memory per block without opting in


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


@dataclass(eq=False)
class FakeStream:
    pending: list = field(default_factory=list)  # queued work, run at a synchronisation
    capture: list | None = None  # the ops recorded while capturing
    invalidated: bool = False  # the capture broke a rule: its end fails
    destroyed: bool = False


@dataclass(eq=False)
class FakeEvent:
    stream: FakeStream | None = None  # where it was last recorded
    time_us: int | None = None  # the fake clock when it ran; None: recorded, not run yet
    recorded: bool = False
    destroyed: bool = False
    records: int = 0  # cuEventRecord calls: an event recorded again stands for its latest record only


@dataclass(eq=False)
class FakeModule:
    name: str
    entries: frozenset
    unloaded: bool = False


@dataclass(eq=False)
class FakeFunction:
    module: FakeModule
    name: str


@dataclass(eq=False)
class FakeGraph:
    ops: tuple
    destroyed: bool = False


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
    allocations: dict[int, bytearray] = field(default_factory=dict)  # cuMemAlloc: address -> bytes
    host_buffers: dict[int, object] = field(default_factory=dict)  # cuMemAllocHost: address -> array
    streams: list[FakeStream] = field(default_factory=list)
    events: list[FakeEvent] = field(default_factory=list)
    modules: list[FakeModule] = field(default_factory=list)
    graphs: list[FakeGraph] = field(default_factory=list)  # graphs and executable graphs
    launched: list[str] = field(default_factory=list)  # kernel names, in the order they RAN
    _initialised: bool = False
    _threads: threading.local = field(default_factory=threading.local, repr=False)  # .current: the context
    _next: int = BASE
    _next_alloc: int = ALLOC_BASE
    _clock_us: int = 0

    # -- discovery
    def _call(self, name: str, *args, needs_context: bool = False) -> None:
        self.calls.append((name, *args))
        if name != "cuInit" and not self._initialised:
            raise fail(name, "CUDA_ERROR_NOT_INITIALIZED", "cuInit was not called")
        if needs_context and getattr(self._threads, "current", None) is None:
            raise fail(name, "CUDA_ERROR_INVALID_CONTEXT", "no current context on this thread (use_device)")

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
        self._threads.current = self._query("cuCtxSetCurrent", ordinal, ordinal)

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

    def _accessible(self, call: str, address: int, nbytes: int,
                    code: str = "CUDA_ERROR_INVALID_VALUE") -> tuple[bytearray, int]:
        """The bytes under ``address .. + nbytes`` (a mapping with access set, or a
        cuMemAlloc buffer) and the offset into them; else ``code`` from ``call``."""
        for a, m in self.mappings.items():
            if a <= address and address + nbytes <= a + m.size:
                if not m.access:
                    raise fail(call, code, "no access was set on the mapping")
                return m.handle.data, address - a
        for a, data in self.allocations.items():
            if a <= address and address + nbytes <= a + len(data):
                return data, address - a
        raise fail(call, code, f"{address:#x}+{nbytes:#x} is not mapped or allocated")

    def copy_to_device(self, address: int, data) -> None:
        src = memoryview(data).cast("B")
        self._call("cuMemcpyHtoD", address, src.nbytes, needs_context=True)
        mem, off = self._accessible("cuMemcpyHtoD", address, src.nbytes)
        mem[off:off + src.nbytes] = src

    def copy_to_host(self, address: int, nbytes: int) -> bytes:
        self._call("cuMemcpyDtoH", address, nbytes, needs_context=True)
        mem, off = self._accessible("cuMemcpyDtoH", address, nbytes)
        return bytes(mem[off:off + nbytes])

    # -- device memory as the kernels see it (tests/fake_cuda_kernels.py)
    def read(self, address: int, nbytes: int) -> bytes:
        mem, off = self._accessible("kernel", address, nbytes, "CUDA_ERROR_ILLEGAL_ADDRESS")
        return bytes(mem[off:off + nbytes])

    def write(self, address: int, data) -> None:
        src = memoryview(data).cast("B")
        mem, off = self._accessible("kernel", address, src.nbytes, "CUDA_ERROR_ILLEGAL_ADDRESS")
        mem[off:off + src.nbytes] = src

    # -- plain memory and page-locked host buffers
    def mem_alloc(self, nbytes: int) -> int:
        self._call("cuMemAlloc", nbytes, needs_context=True)
        if nbytes <= 0:
            raise fail("cuMemAlloc", "CUDA_ERROR_INVALID_VALUE", "empty allocation")
        if self.used + nbytes > self.memory:
            raise fail("cuMemAlloc", "CUDA_ERROR_OUT_OF_MEMORY", f"{self.used:,} of {self.memory:,} bytes in use")
        address = self._next_alloc
        self._next_alloc += -(-nbytes // 512) * 512 + 512  # 512-byte aligned, never touching
        self.allocations[address] = bytearray(nbytes)
        self.used += nbytes
        return address

    def mem_free(self, address: int) -> None:
        self._call("cuMemFree", address, needs_context=True)
        data = self.allocations.pop(address, None)
        if data is None:
            raise fail("cuMemFree", "CUDA_ERROR_INVALID_VALUE", f"{address:#x} is not a cuMemAlloc allocation")
        self.used -= len(data)

    def host_alloc(self, nbytes: int):
        import numpy as np

        self._call("cuMemAllocHost", nbytes, needs_context=True)
        if nbytes <= 0:
            raise fail("cuMemAllocHost", "CUDA_ERROR_INVALID_VALUE", "empty allocation")
        buffer = np.zeros(nbytes, dtype=np.uint8)
        self.host_buffers[buffer.ctypes.data] = buffer
        return buffer

    def host_free(self, buffer) -> None:
        self._call("cuMemFreeHost", needs_context=True)
        if self.host_buffers.pop(buffer.ctypes.data, None) is None:
            raise fail("cuMemFreeHost", "CUDA_ERROR_INVALID_VALUE", "not a cuMemAllocHost buffer")

    def _pinned(self, host) -> bool:
        import numpy as np

        view = np.frombuffer(host, dtype=np.uint8)
        start = view.ctypes.data
        return any(a <= start and start + view.nbytes <= a + b.nbytes for a, b in self.host_buffers.items())

    # -- streams and the work queued on them
    @staticmethod
    def _live(call: str, handle, kind: type, pool: list, code: str = "CUDA_ERROR_INVALID_HANDLE"):
        """``handle`` if it is a live one of ``kind`` from ``pool``, else ``code``."""
        if not isinstance(handle, kind) or handle not in pool or getattr(handle, "destroyed", False) \
                or getattr(handle, "unloaded", False):
            raise fail(call, code, f"not a live {kind.__name__[4:].lower()}")
        return handle

    def _create(self, call: str, handle, pool: list):
        self._call(call, needs_context=True)
        pool.append(handle)
        return handle

    def _stream(self, call: str, stream: FakeStream) -> FakeStream:
        return self._live(call, stream, FakeStream, self.streams)

    def stream_create(self) -> FakeStream:
        return self._create("cuStreamCreate", FakeStream(), self.streams)

    def stream_synchronize(self, stream: FakeStream) -> None:
        self._call("cuStreamSynchronize", needs_context=True)
        self._stream("cuStreamSynchronize", stream)
        if stream.capture is not None:
            stream.invalidated = True
            raise fail("cuStreamSynchronize", "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "the stream is capturing")
        self._run(stream, "cuStreamSynchronize")

    def stream_destroy(self, stream: FakeStream) -> None:
        self._call("cuStreamDestroy", needs_context=True)
        self._stream("cuStreamDestroy", stream)
        stream.destroyed = True  # its queued work still completes, as on a device
        self._run(stream, "cuStreamDestroy")

    def _issue(self, call: str, stream: FakeStream, op: tuple) -> None:
        """Queue ``op`` on ``stream``, or record it if the stream is capturing."""
        self._stream(call, stream)
        if stream.capture is None:
            stream.pending.append(op)
            return
        host = op[2] if op[0] == "htod" else op[1] if op[0] == "dtoh" else None
        if host is not None and not self._pinned(host):
            stream.invalidated = True
            raise fail(call, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "captured copy of pageable host memory")
        stream.capture.append(op)

    def _run(self, stream: FakeStream, call: str, until: FakeEvent | None = None) -> None:
        """Run ``stream``'s queued work in order (up to the op that records ``until``);
        a fault is reported by ``call``, the synchronisation, as a device reports it."""
        while stream.pending:
            op = stream.pending.pop(0)
            try:
                self._execute(op)
            except DriverCallError as exc:
                stream.pending.clear()
                raise DriverCallError(call, exc.code, exc.name, exc.detail) from None
            if op[0] == "event" and op[1] is until and op[2] == until.records:
                return

    def _execute(self, op: tuple) -> None:
        from fake_cuda_kernels import run_kernel

        kind = op[0]
        self._clock_us += 1
        if kind == "htod":
            self.write(op[1], op[2])
        elif kind == "dtoh":
            host = memoryview(op[1]).cast("B")
            host[:] = self.read(op[2], host.nbytes)
        elif kind == "event":
            if op[2] == op[1].records:  # an earlier record of an event recorded again is no longer it
                op[1].time_us = self._clock_us
        elif kind == "launch":
            _, function, grid, block, shared, args = op
            run_kernel(self, function.name, grid, block, shared, args)
            self.launched.append(function.name)
        elif kind == "graph":
            for inner in op[1].ops:
                self._execute(inner)

    def copy_to_device_async(self, address: int, host, stream: FakeStream) -> None:
        n = memoryview(host).nbytes
        self._call("cuMemcpyHtoDAsync", address, n, needs_context=True)
        self._accessible("cuMemcpyHtoDAsync", address, n)
        self._issue("cuMemcpyHtoDAsync", stream, ("htod", address, host))

    def copy_to_host_async(self, host, address: int, stream: FakeStream) -> None:
        n = memoryview(host).nbytes
        self._call("cuMemcpyDtoHAsync", address, n, needs_context=True)
        self._accessible("cuMemcpyDtoHAsync", address, n)
        self._issue("cuMemcpyDtoHAsync", stream, ("dtoh", host, address))

    # -- events
    def _event(self, call: str, event: FakeEvent) -> FakeEvent:
        return self._live(call, event, FakeEvent, self.events)

    def event_create(self) -> FakeEvent:
        return self._create("cuEventCreate", FakeEvent(), self.events)

    def event_record(self, event: FakeEvent, stream: FakeStream) -> None:
        self._call("cuEventRecord", needs_context=True)
        self._event("cuEventRecord", event)
        self._issue("cuEventRecord", stream, ("event", event, event.records + 1))
        event.records += 1
        event.stream, event.time_us, event.recorded = stream, None, True

    def event_synchronize(self, event: FakeEvent) -> None:
        self._call("cuEventSynchronize", needs_context=True)
        self._event("cuEventSynchronize", event)
        if event.recorded and event.time_us is None and event.stream.capture is None:
            self._run(event.stream, "cuEventSynchronize", until=event)

    def event_elapsed_ms(self, start: FakeEvent, end: FakeEvent) -> float:
        self._call("cuEventElapsedTime", needs_context=True)
        for e in (self._event("cuEventElapsedTime", start), self._event("cuEventElapsedTime", end)):
            if not e.recorded:
                raise fail("cuEventElapsedTime", "CUDA_ERROR_INVALID_HANDLE", "the event was never recorded")
            if e.time_us is None:
                raise fail("cuEventElapsedTime", "CUDA_ERROR_NOT_READY", "the event has not run yet")
        return (end.time_us - start.time_us) / 1000.0

    def event_destroy(self, event: FakeEvent) -> None:
        self._call("cuEventDestroy", needs_context=True)
        self._event("cuEventDestroy", event).destroyed = True

    # -- kernels
    def module_from_source(self, source: str, name: str, ordinal: int) -> FakeModule:
        import re

        self._call("cuModuleLoadData", name, ordinal, needs_context=True)
        self._ordinal("cuModuleLoadData", ordinal)
        entries = frozenset(re.findall(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(',
                                       source))
        if not entries:  # what NVRTC then the loader would make of a source with no kernel
            raise fail("cuModuleLoadData", "CUDA_ERROR_INVALID_VALUE", f"{name} has no extern \"C\" kernel")
        module = FakeModule(name, entries)
        self.modules.append(module)
        return module

    def module_function(self, module: FakeModule, name: str) -> FakeFunction:
        self._call("cuModuleGetFunction", name, needs_context=True)
        self._live("cuModuleGetFunction", module, FakeModule, self.modules, "CUDA_ERROR_INVALID_VALUE")
        if name not in module.entries:
            raise fail("cuModuleGetFunction", "CUDA_ERROR_NOT_FOUND", f"{module.name} has no function {name}")
        return FakeFunction(module, name)

    def module_unload(self, module: FakeModule) -> None:
        self._call("cuModuleUnload", needs_context=True)
        self._live("cuModuleUnload", module, FakeModule, self.modules, "CUDA_ERROR_INVALID_VALUE").unloaded = True

    def launch(self, function: FakeFunction, grid, block, shared_bytes: int, stream: FakeStream, args) -> None:
        self._call("cuLaunchKernel", getattr(function, "name", None), tuple(grid), tuple(block), shared_bytes,
                   needs_context=True)
        if not isinstance(function, FakeFunction):
            raise fail("cuLaunchKernel", "CUDA_ERROR_INVALID_HANDLE", "not a function")
        self._live("cuLaunchKernel", function.module, FakeModule, self.modules)
        if len(grid) != 3 or len(block) != 3 or min(*grid, *block) < 1:
            raise fail("cuLaunchKernel", "CUDA_ERROR_INVALID_VALUE", f"grid {grid}, block {block}")
        if block[0] * block[1] * block[2] > MAX_THREADS or not 0 <= shared_bytes <= MAX_SHARED:
            raise fail("cuLaunchKernel", "CUDA_ERROR_INVALID_VALUE",
                       f"block {block} ({MAX_THREADS} threads at most), {shared_bytes} shared bytes")
        from fake_cuda_kernels import KERNELS, check_launch

        if function.name not in KERNELS:
            raise fail("cuLaunchKernel", "CUDA_ERROR_NOT_SUPPORTED", f"the fake cannot run {function.name}")
        check_launch(function.name, tuple(grid), tuple(block), tuple(args))
        self._issue("cuLaunchKernel", stream, ("launch", function, tuple(grid), tuple(block), shared_bytes,
                                                 tuple(args)))

    # -- graphs
    def begin_capture(self, stream: FakeStream) -> None:
        self._call("cuStreamBeginCapture", needs_context=True)
        self._stream("cuStreamBeginCapture", stream)
        if stream.capture is not None:
            raise fail("cuStreamBeginCapture", "CUDA_ERROR_ILLEGAL_STATE", "the stream is already capturing")
        stream.capture, stream.invalidated = [], False

    def end_capture(self, stream: FakeStream) -> FakeGraph:
        self._call("cuStreamEndCapture", needs_context=True)
        self._stream("cuStreamEndCapture", stream)
        if stream.capture is None:
            raise fail("cuStreamEndCapture", "CUDA_ERROR_ILLEGAL_STATE", "the stream is not capturing")
        ops, stream.capture = tuple(stream.capture), None
        if stream.invalidated:
            stream.invalidated = False
            raise fail("cuStreamEndCapture", "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "the capture broke a rule")
        graph = FakeGraph(ops)
        self.graphs.append(graph)
        return graph

    def _graph(self, call: str, graph: FakeGraph) -> FakeGraph:
        return self._live(call, graph, FakeGraph, self.graphs, "CUDA_ERROR_INVALID_VALUE")

    def graph_instantiate(self, graph: FakeGraph) -> FakeGraph:
        self._call("cuGraphInstantiate", needs_context=True)
        graph_exec = FakeGraph(self._graph("cuGraphInstantiate", graph).ops)
        self.graphs.append(graph_exec)
        return graph_exec

    def graph_launch(self, graph_exec: FakeGraph, stream: FakeStream) -> None:
        self._call("cuGraphLaunch", needs_context=True)
        self._issue("cuGraphLaunch", stream, ("graph", self._graph("cuGraphLaunch", graph_exec)))

    def graph_exec_destroy(self, graph_exec: FakeGraph) -> None:
        self._call("cuGraphExecDestroy", needs_context=True)
        self._graph("cuGraphExecDestroy", graph_exec).destroyed = True

    def graph_destroy(self, graph: FakeGraph) -> None:
        self._call("cuGraphDestroy", needs_context=True)
        self._graph("cuGraphDestroy", graph).destroyed = True

    # -- inspection
    def live_handles(self) -> list[FakeHandle]:
        return [h for h in self.handles if not h.released]

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def live(self) -> dict[str, int]:
        """What is still held: allocations, host buffers, streams, events, modules, graphs."""
        return {"allocations": len(self.allocations), "host_buffers": len(self.host_buffers),
                "streams": sum(not x.destroyed for x in self.streams),
                "events": sum(not x.destroyed for x in self.events),
                "modules": sum(not x.unloaded for x in self.modules),
                "graphs": sum(not x.destroyed for x in self.graphs)}


def ready(**kwargs) -> FakeDriver:
    """A fake driver after ``cuInit``, as the pool receives one from discovery."""
    d = FakeDriver(**kwargs)
    d.init()
    return d
