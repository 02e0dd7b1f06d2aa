"""The CUDA driver as this package uses it: a small protocol, one method per driver call
(or per short fixed sequence of them), so the stable-VA bookkeeping above it
(``device_slot_pool.py``) and the discovery (``device_probe.py``) run unchanged on the
real driver (``cuda_python_driver.py``, cuda-python) and on a fake that enforces the
same rules (tests/fake_cuda_driver.py).

Every failing call raises :class:`DriverCallError` naming the driver call, its
``CUresult`` code and the code's name (``cuMemMap failed: CUDA_ERROR_INVALID_VALUE
(1)``). Addresses are plain ints (``CUdeviceptr``); an allocation handle is whatever
``create`` returned, passed back as it is.

The call sequence of a stable-VA slot (the rules both implementations hold):

1. ``address_reserve(size, alignment)`` once per slot: ``size`` a multiple of the
   allocation granularity (``allocation_granularity``, never assumed);
2. page-in: ``create(size, device)`` (physical granules) → ``map(address, size, handle)``
   inside the reserved range → ``set_access(address, size, device)`` after EVERY map
   (a fresh mapping has no access) → ``copy_to_device``;
3. eviction: ``unmap(address, size)`` → ``release(handle)``; the range stays reserved;
4. close: ``address_free(address, size)`` of the whole reservation, nothing mapped in it.

The call sequence of a device step (activations, kernels, graphs):

5. plain device buffers for activations and outputs: ``mem_alloc(nbytes)`` →
   ``mem_free(address)`` (cuMemAlloc / cuMemFree); page-locked host buffers that async
   copies (and graphs) read and write: ``host_alloc(nbytes)`` → ``host_free(buffer)``
   (cuMemAllocHost / cuMemFreeHost);
6. a stream: ``stream_create()`` (cuStreamCreate, non-blocking: no implicit wait on the
   legacy stream) → work on it → ``stream_synchronize`` → ``stream_destroy``;
7. async copies on a stream: ``copy_to_device_async(address, host, stream)`` /
   ``copy_to_host_async(host, address, stream)`` (cuMemcpyHtoDAsync / DtoHAsync): the
   host buffer must stay alive, untouched, until the stream is synchronised;
8. timing: ``event_create()`` → ``event_record(event, stream)`` → ``event_synchronize``
   → ``event_elapsed_ms(start, end)`` → ``event_destroy`` (cuEvent*);
9. kernels: ``module_from_source(source, name, ordinal)`` (NVRTC: nvrtcCreateProgram,
   nvrtcCompileProgram for the device's ``sm_XY``, its log in the error on failure,
   nvrtcGetCUBIN; then cuModuleLoadData) → ``module_function(module, name)``
   (cuModuleGetFunction) → ``launch(function, grid, block, shared_bytes, stream, args)``
   (cuLaunchKernel; ``args``: ``(ctypes type, value)`` pairs in the kernel's parameter
   order, ``ctypes.c_void_p`` for a device pointer) → ``module_unload``;
10. graphs: ``begin_capture(stream)`` (cuStreamBeginCapture, thread-local mode: other
    threads may keep paging weights in meanwhile) → the step's launches and copies on
    that stream, recorded, not run → ``end_capture(stream)`` → graph
    (cuStreamEndCapture) → ``graph_instantiate(graph)`` → exec (cuGraphInstantiate) →
    ``graph_launch(exec, stream)`` per replay (cuGraphLaunch: the captured launches with
    the addresses they had, so everything it reads must stay at its address) →
    ``graph_exec_destroy`` and ``graph_destroy``. A capture must not synchronise its
    stream (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, and the capture is invalidated), nor
    copy from pageable host memory: async copies in a captured step use ``host_alloc``'s
    buffers.
"""
from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from typing import Any, Protocol

from onnx_prep.core.errors import DeviceError

__all__ = ["DRIVER_LIBRARY", "DeviceDriver", "DriverCallError", "DriverUnavailable", "KernelArg", "load_driver_library"]

# The driver library cuda-python loads (``nvcuda.dll`` on Windows).
DRIVER_LIBRARY = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"

# One kernel argument: its ctypes type (ctypes.c_void_p for a device pointer,
# ctypes.c_int32, ctypes.c_uint64, ctypes.c_float, ...) and its value.
KernelArg = tuple[type, Any]


class DriverCallError(DeviceError):
    """A driver call returned an error: ``call`` (``cuMemMap``), ``code`` (the
    ``CUresult`` value) and ``name`` (``CUDA_ERROR_INVALID_VALUE``)."""

    def __init__(self, call: str, code: int, name: str, detail: str | None = None) -> None:
        self.call, self.code, self.name, self.detail = call, int(code), name, detail
        super().__init__(f"{call} failed: {name} ({int(code)})" + (f": {detail}" if detail else ""))


class DriverUnavailable(Exception):
    """No driver to talk to: ``reason`` says why in one line (the package or the library
    is missing). Discovery turns it into its answer; it never reaches a user as such."""

    def __init__(self, reason: str, binding: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.binding = binding  # the cuda-python module found, when the driver library is what is missing


def load_driver_library(name: str = DRIVER_LIBRARY) -> None:
    """Load the driver library the bindings will call into, or raise
    :class:`DriverUnavailable` naming it and the loader's error (cuda-python installs
    without a driver; its first call would fail with a less direct message)."""
    try:
        ctypes.CDLL(name)
    except OSError as exc:
        raise DriverUnavailable(f"the CUDA driver library {name} is missing ({exc})") from None


class DeviceDriver(Protocol):
    """The driver calls this package makes; device ``ordinal`` is an int."""

    binding: str  # where the calls go: "cuda.bindings.driver 12.6.0", "fake"

    def init(self) -> None: ...  # cuInit(0)

    def driver_version(self) -> int: ...  # cuDriverGetVersion: 12040 is 12.4

    def device_count(self) -> int: ...  # cuDeviceGetCount

    def device_name(self, ordinal: int) -> str: ...  # cuDeviceGet, cuDeviceGetName

    def compute_capability(self, ordinal: int) -> tuple[int, int]: ...  # cuDeviceGetAttribute (major, minor)

    def total_memory(self, ordinal: int) -> int: ...  # cuDeviceTotalMem

    def vmm_supported(self, ordinal: int) -> bool: ...  # ..._VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED

    def allocation_granularity(self, ordinal: int) -> int: ...  # cuMemGetAllocationGranularity (minimum)

    def use_device(self, ordinal: int) -> None: ...  # cuDevicePrimaryCtxRetain, cuCtxSetCurrent

    def address_reserve(self, size: int, alignment: int) -> int: ...  # cuMemAddressReserve

    def address_free(self, address: int, size: int) -> None: ...  # cuMemAddressFree

    def create(self, size: int, ordinal: int) -> Any: ...  # cuMemCreate (pinned device memory)

    def release(self, handle: Any) -> None: ...  # cuMemRelease

    def map(self, address: int, size: int, handle: Any) -> None: ...  # cuMemMap (offset 0)

    def unmap(self, address: int, size: int) -> None: ...  # cuMemUnmap

    def set_access(self, address: int, size: int, ordinal: int) -> None: ...  # cuMemSetAccess (read-write)

    def copy_to_device(self, address: int, data: Any) -> None: ...  # cuMemcpyHtoD (a buffer's bytes)

    def copy_to_host(self, address: int, nbytes: int) -> bytes: ...  # cuMemcpyDtoH

    # -- plain memory (activations, outputs) and page-locked host buffers
    def mem_alloc(self, nbytes: int) -> int: ...  # cuMemAlloc

    def mem_free(self, address: int) -> None: ...  # cuMemFree

    def host_alloc(self, nbytes: int) -> Any: ...  # cuMemAllocHost: a writable uint8 numpy array over it

    def host_free(self, buffer: Any) -> None: ...  # cuMemFreeHost (a buffer host_alloc returned)

    # -- streams, async copies, events
    def stream_create(self) -> Any: ...  # cuStreamCreate(CU_STREAM_NON_BLOCKING)

    def stream_synchronize(self, stream: Any) -> None: ...  # cuStreamSynchronize

    def stream_destroy(self, stream: Any) -> None: ...  # cuStreamDestroy

    def copy_to_device_async(self, address: int, host: Any, stream: Any) -> None: ...  # cuMemcpyHtoDAsync

    def copy_to_host_async(self, host: Any, address: int, stream: Any) -> None: ...  # cuMemcpyDtoHAsync (host's size)

    def event_create(self) -> Any: ...  # cuEventCreate (timing on)

    def event_record(self, event: Any, stream: Any) -> None: ...  # cuEventRecord

    def event_synchronize(self, event: Any) -> None: ...  # cuEventSynchronize

    def event_elapsed_ms(self, start: Any, end: Any) -> float: ...  # cuEventElapsedTime

    def event_destroy(self, event: Any) -> None: ...  # cuEventDestroy

    # -- kernels
    def module_from_source(self, source: str, name: str, ordinal: int) -> Any: ...  # NVRTC, then cuModuleLoadData

    def module_function(self, module: Any, name: str) -> Any: ...  # cuModuleGetFunction

    def module_unload(self, module: Any) -> None: ...  # cuModuleUnload

    def launch(self, function: Any, grid: tuple[int, int, int], block: tuple[int, int, int], shared_bytes: int,
               stream: Any, args: Sequence[KernelArg]) -> None: ...  # cuLaunchKernel

    # -- graphs
    def begin_capture(self, stream: Any) -> None: ...  # cuStreamBeginCapture (thread-local mode)

    def end_capture(self, stream: Any) -> Any: ...  # cuStreamEndCapture: the graph

    def graph_instantiate(self, graph: Any) -> Any: ...  # cuGraphInstantiate (flags 0): the executable graph

    def graph_launch(self, graph_exec: Any, stream: Any) -> None: ...  # cuGraphLaunch

    def graph_exec_destroy(self, graph_exec: Any) -> None: ...  # cuGraphExecDestroy

    def graph_destroy(self, graph: Any) -> None: ...  # cuGraphDestroy
