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
"""
from __future__ import annotations

import ctypes
import sys
from typing import Any, Protocol

from onnx_prep.core.errors import DeviceError

__all__ = ["DRIVER_LIBRARY", "DeviceDriver", "DriverCallError", "DriverUnavailable", "load_driver_library"]

# The driver library cuda-python loads (``nvcuda.dll`` on Windows).
DRIVER_LIBRARY = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"


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
