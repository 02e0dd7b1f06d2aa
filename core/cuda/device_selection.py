"""``--device cpu|cuda``: what a command may run on, checked before any model is read.

``cpu`` is the default and never reaches this module (the options that take a device
import it only for another value, so the CPU path imports nothing of CUDA). ``cuda``
is refused with one line, exit 2, in both cases there are today:

- CUDA is not usable here: the probe's reason (core/cuda/device_probe.py);
- CUDA is usable, but this build has no device decode path yet (the device plan, the
  device INT4 matmul and step graphs exist, and a session loads a device plan's weights,
  but none runs its steps: docs/cuda.md): said so, naming the device.

Never a silent fall back to the CPU: a user who asked for the GPU gets the GPU or an
error.
"""
from __future__ import annotations

from onnx_prep.core.cuda.device_probe import DeviceProbe, probe_devices
from onnx_prep.core.errors import DeviceError, UsageError

__all__ = ["DEVICES", "MISSING_DEVICE_PATH", "require_device"]

DEVICES = ("cpu", "cuda")

# What a device decode needs that this build does not have (docs/cuda.md, "Not built").
MISSING_DEVICE_PATH = ("the device graph runner has no launcher for the fused decoder ops, and no "
                       "session runs a step on the device (one loads the weights into device slots)")


def require_device(device: str, probe: DeviceProbe | None = None) -> None:
    """Return if ``device`` can run; raise UsageError for an unknown name and
    DeviceError (exit 2) for ``cuda`` (``probe``: default, :func:`probe_devices`)."""
    if device not in DEVICES:
        raise UsageError(f"--device must be one of {list(DEVICES)}, got {device!r}")
    if device == "cpu":
        return
    probe = probe_devices() if probe is None else probe
    if not probe.usable:
        raise DeviceError(f"--device cuda: CUDA is not usable: {probe.reason}", hint="use --device cpu")
    found = probe.devices[0]
    raise DeviceError(f"--device cuda: the CUDA decode path is not built yet ({MISSING_DEVICE_PATH}); "
                      f"found {found.name} (device {found.ordinal})",
                      hint="use --device cpu; docs/cuda.md says what exists")
