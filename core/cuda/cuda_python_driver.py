"""The real :class:`~onnx_prep.core.cuda.driver.DeviceDriver`: cuda-python's driver API
(``cuda.bindings.driver`` from cuda-python 12.6 on, ``cuda.cuda`` before), imported only
when a CUDA path is asked for (``pip install 'onnx-prep[cuda]'``).

Thin and mechanical on purpose: each method is the driver call its protocol entry names,
its ``CUresult`` checked (``_check``), nothing decided here. No GPU runs this module in
CI; tests/test_cuda_gpu.py runs it where one is present (docs/cuda.md).
"""
from __future__ import annotations

import importlib
from typing import Any

from onnx_prep.core.cuda.driver import DriverCallError, DriverUnavailable, load_driver_library

__all__ = ["CudaPythonDriver", "import_binding", "load_driver"]

# Where cuda-python keeps the driver API, newest first.
BINDING_MODULES = ("cuda.bindings.driver", "cuda.cuda")
NOT_INSTALLED = "cuda-python not installed (pip install 'onnx-prep[cuda]')"


def import_binding() -> tuple[Any, str]:
    """cuda-python's driver module and ``"<module> <version>"``; :class:`DriverUnavailable`
    saying "cuda-python not installed" where neither module imports."""
    for name in BINDING_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        return module, f"{name} {_version()}"
    raise DriverUnavailable(NOT_INSTALLED)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("cuda-bindings", "cuda-python"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "(version unknown)"


def load_driver() -> CudaPythonDriver:
    """The driver, once its package and library are there (else :class:`DriverUnavailable`)."""
    module, binding = import_binding()
    try:
        load_driver_library()
    except DriverUnavailable as exc:
        raise DriverUnavailable(exc.reason, binding) from None
    return CudaPythonDriver(module, binding)


class CudaPythonDriver:
    """Each method: one driver call (or a fixed short sequence), its result checked."""

    def __init__(self, cu: Any, binding: str) -> None:
        self.cu = cu
        self.binding = binding
        self._contexts: dict[int, Any] = {}

    def _check(self, call: str, result: tuple) -> Any:
        err, *values = result
        if int(err) != int(self.cu.CUresult.CUDA_SUCCESS):
            got, name = self.cu.cuGetErrorName(err)
            name = name.decode() if int(got) == 0 and name else f"CUresult {int(err)}"
            raise DriverCallError(call, int(err), name)
        return values[0] if len(values) == 1 else tuple(values)

    def _device(self, ordinal: int) -> Any:
        return self._check("cuDeviceGet", self.cu.cuDeviceGet(ordinal))

    def _attribute(self, names: tuple[str, ...], ordinal: int) -> int:
        attrs = self.cu.CUdevice_attribute
        attr = next(getattr(attrs, n) for n in names if hasattr(attrs, n))
        return int(self._check("cuDeviceGetAttribute", self.cu.cuDeviceGetAttribute(attr, self._device(ordinal))))

    def _location(self, target: Any, ordinal: int) -> None:
        target.type = self.cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        target.id = ordinal

    def _prop(self, ordinal: int) -> Any:
        prop = self.cu.CUmemAllocationProp()
        prop.type = self.cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._location(prop.location, ordinal)
        return prop

    # -- discovery
    def init(self) -> None:
        self._check("cuInit", self.cu.cuInit(0))

    def driver_version(self) -> int:
        return int(self._check("cuDriverGetVersion", self.cu.cuDriverGetVersion()))

    def device_count(self) -> int:
        return int(self._check("cuDeviceGetCount", self.cu.cuDeviceGetCount()))

    def device_name(self, ordinal: int) -> str:
        raw = self._check("cuDeviceGetName", self.cu.cuDeviceGetName(256, self._device(ordinal)))
        return bytes(raw).split(b"\0", 1)[0].decode(errors="replace")

    def compute_capability(self, ordinal: int) -> tuple[int, int]:
        return (self._attribute(("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR",), ordinal),
                self._attribute(("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR",), ordinal))

    def total_memory(self, ordinal: int) -> int:
        return int(self._check("cuDeviceTotalMem", self.cu.cuDeviceTotalMem(self._device(ordinal))))

    def vmm_supported(self, ordinal: int) -> bool:
        # The older name of the same attribute (102) is all some releases have.
        return bool(self._attribute(("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
                                     "CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED"), ordinal))

    def allocation_granularity(self, ordinal: int) -> int:
        flag = self.cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(self._check("cuMemGetAllocationGranularity",
                               self.cu.cuMemGetAllocationGranularity(self._prop(ordinal), flag)))

    def use_device(self, ordinal: int) -> None:
        ctx = self._contexts.get(ordinal)
        if ctx is None:
            ctx = self._contexts[ordinal] = self._check("cuDevicePrimaryCtxRetain",
                                                        self.cu.cuDevicePrimaryCtxRetain(self._device(ordinal)))
        self._check("cuCtxSetCurrent", self.cu.cuCtxSetCurrent(ctx))

    # -- virtual memory
    def address_reserve(self, size: int, alignment: int) -> int:
        ptr = self._check("cuMemAddressReserve",
                          self.cu.cuMemAddressReserve(size, alignment, self.cu.CUdeviceptr(0), 0))
        return int(ptr)

    def address_free(self, address: int, size: int) -> None:
        self._check("cuMemAddressFree", self.cu.cuMemAddressFree(self.cu.CUdeviceptr(address), size))

    def create(self, size: int, ordinal: int) -> Any:
        return self._check("cuMemCreate", self.cu.cuMemCreate(size, self._prop(ordinal), 0))

    def release(self, handle: Any) -> None:
        self._check("cuMemRelease", self.cu.cuMemRelease(handle))

    def map(self, address: int, size: int, handle: Any) -> None:
        self._check("cuMemMap", self.cu.cuMemMap(self.cu.CUdeviceptr(address), size, 0, handle, 0))

    def unmap(self, address: int, size: int) -> None:
        self._check("cuMemUnmap", self.cu.cuMemUnmap(self.cu.CUdeviceptr(address), size))

    def set_access(self, address: int, size: int, ordinal: int) -> None:
        desc = self.cu.CUmemAccessDesc()
        self._location(desc.location, ordinal)
        desc.flags = self.cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._check("cuMemSetAccess", self.cu.cuMemSetAccess(self.cu.CUdeviceptr(address), size, [desc], 1))

    def copy_to_device(self, address: int, data: Any) -> None:
        view = memoryview(data).cast("B")
        self._check("cuMemcpyHtoD", self.cu.cuMemcpyHtoD(self.cu.CUdeviceptr(address), view, view.nbytes))

    def copy_to_host(self, address: int, nbytes: int) -> bytes:
        out = bytearray(nbytes)
        self._check("cuMemcpyDtoH", self.cu.cuMemcpyDtoH(out, self.cu.CUdeviceptr(address), nbytes))
        return bytes(out)

    # -- plain memory and page-locked host buffers
    def mem_alloc(self, nbytes: int) -> int:
        return int(self._check("cuMemAlloc", self.cu.cuMemAlloc(nbytes)))

    def mem_free(self, address: int) -> None:
        self._check("cuMemFree", self.cu.cuMemFree(self.cu.CUdeviceptr(address)))

    def host_alloc(self, nbytes: int) -> Any:
        import ctypes

        import numpy as np

        ptr = int(self._check("cuMemAllocHost", self.cu.cuMemAllocHost(nbytes)))
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))

    def host_free(self, buffer: Any) -> None:
        self._check("cuMemFreeHost", self.cu.cuMemFreeHost(int(buffer.ctypes.data)))

    # -- streams, async copies, events
    def stream_create(self) -> Any:
        return self._check("cuStreamCreate", self.cu.cuStreamCreate(self.cu.CUstream_flags.CU_STREAM_NON_BLOCKING))

    def stream_synchronize(self, stream: Any) -> None:
        self._check("cuStreamSynchronize", self.cu.cuStreamSynchronize(stream))

    def stream_destroy(self, stream: Any) -> None:
        self._check("cuStreamDestroy", self.cu.cuStreamDestroy(stream))

    def copy_to_device_async(self, address: int, host: Any, stream: Any) -> None:
        view = memoryview(host).cast("B")
        self._check("cuMemcpyHtoDAsync",
                    self.cu.cuMemcpyHtoDAsync(self.cu.CUdeviceptr(address), view, view.nbytes, stream))

    def copy_to_host_async(self, host: Any, address: int, stream: Any) -> None:
        view = memoryview(host).cast("B")
        self._check("cuMemcpyDtoHAsync",
                    self.cu.cuMemcpyDtoHAsync(view, self.cu.CUdeviceptr(address), view.nbytes, stream))

    def event_create(self) -> Any:
        return self._check("cuEventCreate", self.cu.cuEventCreate(self.cu.CUevent_flags.CU_EVENT_DEFAULT))

    def event_record(self, event: Any, stream: Any) -> None:
        self._check("cuEventRecord", self.cu.cuEventRecord(event, stream))

    def event_synchronize(self, event: Any) -> None:
        self._check("cuEventSynchronize", self.cu.cuEventSynchronize(event))

    def event_elapsed_ms(self, start: Any, end: Any) -> float:
        return float(self._check("cuEventElapsedTime", self.cu.cuEventElapsedTime(start, end)))

    def event_destroy(self, event: Any) -> None:
        self._check("cuEventDestroy", self.cu.cuEventDestroy(event))

    # -- kernels
    def module_from_source(self, source: str, name: str, ordinal: int) -> Any:
        from onnx_prep.core.cuda.nvrtc_program import compile_program

        program = compile_program(source, name, self.compute_capability(ordinal))
        return self._check("cuModuleLoadData", self.cu.cuModuleLoadData(program.image))

    def module_function(self, module: Any, name: str) -> Any:
        return self._check("cuModuleGetFunction", self.cu.cuModuleGetFunction(module, name.encode()))

    def module_unload(self, module: Any) -> None:
        self._check("cuModuleUnload", self.cu.cuModuleUnload(module))

    def launch(self, function: Any, grid: tuple[int, int, int], block: tuple[int, int, int], shared_bytes: int,
               stream: Any, args) -> None:
        # cuda-python packs ((values...), (ctypes types...)) into the void** array itself
        params = (tuple(value for _, value in args), tuple(ctype for ctype, _ in args))
        self._check("cuLaunchKernel", self.cu.cuLaunchKernel(function, *grid, *block, shared_bytes, stream, params, 0))

    # -- graphs
    def begin_capture(self, stream: Any) -> None:
        mode = self.cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        self._check("cuStreamBeginCapture", self.cu.cuStreamBeginCapture(stream, mode))

    def end_capture(self, stream: Any) -> Any:
        return self._check("cuStreamEndCapture", self.cu.cuStreamEndCapture(stream))

    def graph_instantiate(self, graph: Any) -> Any:
        return self._check("cuGraphInstantiate", self.cu.cuGraphInstantiate(graph, 0))

    def graph_launch(self, graph_exec: Any, stream: Any) -> None:
        self._check("cuGraphLaunch", self.cu.cuGraphLaunch(graph_exec, stream))

    def graph_exec_destroy(self, graph_exec: Any) -> None:
        self._check("cuGraphExecDestroy", self.cu.cuGraphExecDestroy(graph_exec))

    def graph_destroy(self, graph: Any) -> None:
        self._check("cuGraphDestroy", self.cu.cuGraphDestroy(graph))
