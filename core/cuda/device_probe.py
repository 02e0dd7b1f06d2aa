"""Device discovery: whether CUDA is usable here and, if not, exactly why, in one line.

``probe_devices()`` walks the steps a CUDA path would take and stops at the first that
fails, its reason naming it:

1. the package: "cuda-python not installed (pip install 'onnx-prep[cuda]')";
2. the driver library: "the CUDA driver library libcuda.so.1 is missing (<loader error>)";
3. ``cuInit``: "cuInit failed: CUDA_ERROR_NO_DEVICE (100)" (code and name);
4. the devices: "no CUDA device (cuDeviceGetCount found 0)".

When usable, each device is described: name, compute capability, memory, whether it
supports virtual memory management (``CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_
SUPPORTED``, which the stable-VA slots need) and, where it does, its minimum allocation
granularity as the driver reports it (``cuMemGetAllocationGranularity``, never assumed).
A driver call that fails while describing a device makes CUDA unusable too, the call
named. ``devices_record()`` is ``onnx-prep devices``' record (schema
``core/schemas/devices.schema.json``).

Nothing here is imported unless a CUDA path is asked for (``--device cuda``,
``onnx-prep devices``); cuda-python only by ``probe_devices`` itself.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from onnx_prep.core.cuda.driver import DeviceDriver, DriverCallError, DriverUnavailable

__all__ = ["DeviceInfo", "DeviceProbe", "SCHEMA", "describe_device", "devices_record", "probe_devices"]

SCHEMA = "onnx-prep.devices/2"


@dataclass(frozen=True)
class DeviceInfo:
    ordinal: int
    name: str
    compute_capability: tuple[int, int]
    total_memory: int  # bytes
    vmm_supported: bool
    granularity: int | None  # minimum allocation granularity, bytes; None without VMM

    def one_line(self) -> str:
        vmm = (f"VMM yes, granularity {_size(self.granularity)}" if self.vmm_supported and self.granularity
               else "VMM no")
        major, minor = self.compute_capability
        return f"device {self.ordinal}: {self.name}, compute {major}.{minor}, {_size(self.total_memory)}, {vmm}"


@dataclass(frozen=True)
class DeviceProbe:
    """``usable`` with its ``devices``, or not with the ``reason``; ``binding`` is the
    cuda-python module and version the calls went through (None: not imported)."""

    usable: bool
    reason: str | None = None
    binding: str | None = None
    driver_version: int | None = None  # 12040 is CUDA 12.4
    devices: tuple[DeviceInfo, ...] = ()

    def one_line(self) -> str:
        if not self.usable:
            return f"CUDA not usable: {self.reason}"
        return f"CUDA usable ({_driver(self.driver_version)}, {self.binding}): " + "; ".join(
            d.one_line() for d in self.devices)

    def to_json(self) -> dict:
        return {"usable": self.usable, "reason": self.reason, "binding": self.binding,
                "driver_version": self.driver_version,
                "devices": [{**asdict(d), "compute_capability": list(d.compute_capability)} for d in self.devices]}


def _size(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


def _driver(version: int | None) -> str:
    return "driver version unknown" if version is None else f"driver {version // 1000}.{version % 1000 // 10}"


def describe_device(driver: DeviceDriver, ordinal: int) -> DeviceInfo:
    vmm = driver.vmm_supported(ordinal)
    return DeviceInfo(ordinal=ordinal, name=driver.device_name(ordinal),
                      compute_capability=tuple(driver.compute_capability(ordinal)),
                      total_memory=driver.total_memory(ordinal), vmm_supported=vmm,
                      granularity=driver.allocation_granularity(ordinal) if vmm else None)


def probe_devices(load: Callable[[], DeviceDriver] | None = None) -> DeviceProbe:
    """Whether CUDA is usable, through ``load()`` (default: cuda-python's driver)."""
    if load is None:
        from onnx_prep.core.cuda.cuda_python_driver import load_driver as load
    try:
        driver = load()
    except DriverUnavailable as exc:
        return DeviceProbe(usable=False, reason=exc.reason, binding=exc.binding)
    binding = driver.binding
    try:
        driver.init()
        version = driver.driver_version()
        count = driver.device_count()
        if count == 0:
            return DeviceProbe(usable=False, reason="no CUDA device (cuDeviceGetCount found 0)", binding=binding,
                               driver_version=version)
    except DriverCallError as exc:
        return DeviceProbe(usable=False, reason=exc.one_line(), binding=binding)
    devices = []
    for i in range(count):
        try:
            devices.append(describe_device(driver, i))
        except DriverCallError as exc:
            return DeviceProbe(usable=False, reason=f"device {i}: {exc.one_line()}", binding=binding,
                               driver_version=version)
    return DeviceProbe(usable=True, binding=binding, driver_version=version, devices=tuple(devices))


def devices_record(probe: DeviceProbe | None = None) -> dict:
    """``onnx-prep devices``' record: the CPU's kernel ISA (and whether AMX tiles run
    the several-row matmuls) and the CUDA probe."""
    import os

    from onnx_prep.native.isa import active_isa, amx_tiles

    probe = probe_devices() if probe is None else probe
    return {"schema": SCHEMA, "cpu": {"isa": active_isa(), "amx_tiles": amx_tiles(), "logical_cpus": os.cpu_count()},
            "cuda": probe.to_json(), "summary": probe.one_line()}
