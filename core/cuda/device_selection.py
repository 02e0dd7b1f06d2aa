"""``--device cpu|cuda``: what a command may run on, checked before any model is read.

``cpu`` is the default and never reaches this module (the options that take a device
import it only for another value, so the CPU path imports nothing of CUDA). For
``cuda``, ``require_device`` refuses with one line, exit 2, when CUDA is not usable here
(the probe's reason: core/cuda/device_probe.py), and returns the probe when it is;
``refuse_on_device`` is the one line of a command (or an option of one) that has no
device path yet, naming the device found. ``open_driver`` is the driver a device run
uses, initialised (one function, so a test process can point it at the fake driver).

Never a silent fall back to the CPU: a user who asked for the GPU gets the GPU or an
error.
"""
from __future__ import annotations

from onnx_prep.core.cuda.device_probe import DeviceProbe, probe_devices
from onnx_prep.core.errors import DeviceError, UsageError

__all__ = ["DEVICES", "open_driver", "refuse_on_device", "require_device"]

DEVICES = ("cpu", "cuda")


def require_device(device: str, probe: DeviceProbe | None = None) -> DeviceProbe | None:
    """None for ``cpu``; for ``cuda`` the probe of a usable device, else DeviceError
    (exit 2) with the probe's reason; UsageError for an unknown name (``probe``:
    default, :func:`probe_devices`)."""
    if device not in DEVICES:
        raise UsageError(f"--device must be one of {list(DEVICES)}, got {device!r}")
    if device == "cpu":
        return None
    probe = probe_devices() if probe is None else probe
    if not probe.usable:
        raise DeviceError(f"--device cuda: CUDA is not usable: {probe.reason}", hint="use --device cpu")
    return probe


def refuse_on_device(what: str, probe: DeviceProbe) -> None:
    """Raise the one line (exit 2) for ``what`` (e.g. "the load profile"), which has no
    device path yet, on the usable device ``probe`` found."""
    found = probe.devices[0]
    raise DeviceError(f"--device cuda: {what} does not run on a device yet; found {found.name} "
                      f"(device {found.ordinal})",
                      hint="use --device cpu; docs/cuda.md says what runs on a device")


def open_driver():
    """cuda-python's driver, initialised (``cuInit``)."""
    from onnx_prep.core.cuda.cuda_python_driver import load_driver

    driver = load_driver()
    driver.init()
    return driver
