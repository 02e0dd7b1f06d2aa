"""SessionDevice: the device a session loads its prepared objects onto, as the runtime
sees it (``SessionOptions(device=...)``).

The runtime never imports a device's code (docs/architecture.md, "Import direction":
``core/cuda`` sits above the runtime). A device path hands the session an object with
this protocol, as a prepared cache is handed over as a ``PackedPayloadIndex``; the CUDA
one is ``core/cuda/session_device.py`` (``CudaSessionDevice``). The session then:

- builds its plan for ``target()`` (the device plan, core/plan/device_recipes.py: every
  prepared object a step pins in a device slot, its steps on the device queue);
- keeps every prepared object in ``slots`` (the second implementation of the slot-pool
  interface, core/runtime/slot_pool.py: views are device addresses, not host arrays);
- runs the plan's uploads on its one device queue: the host side of a recipe (a read, a
  CPU prepack, a packed read) fills page-locked host staging from ``staging(nbytes)``,
  paid for by the task's Preparation reservation; the upload copies it with
  ``upload(key, data)`` and the staging goes back (``free_staging``) once the copy is
  done (materializer.py);
- closes it with the session (``close``: the slots, the stream, any staging left).

Executing steps on a device is not part of this protocol yet: a session on a device
loads (``prepare``) but refuses ``run`` (session.py).
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from onnx_prep.core.errors import DeviceError
from onnx_prep.core.model.prepared_key import PreparedKey
from onnx_prep.core.plan.device_target import DeviceTarget

__all__ = ["SessionDevice", "device_prepack_refused"]


class SessionDevice(Protocol):
    name: str  # the plan's device name ("cuda")
    slots: Any  # the device slot pool (slot_pool.SlotPool's contract)
    # Whether a session can run the device-side prepack on it (the ``read_source_upload_prepack``
    # recipe); False: the session plans with ``prepack="host"`` and refuses that recipe.
    packs_on_device: bool

    def target(self) -> DeviceTarget: ...  # what to plan for: granularity queried, budget, prepack

    def staging(self, nbytes: int) -> np.ndarray: ...  # page-locked host bytes (uint8) to upload from

    def free_staging(self, buffer: np.ndarray) -> None: ...

    def upload(self, key: PreparedKey, data: np.ndarray) -> float: ...  # copied when it returns; device ms

    def memory(self) -> tuple[int, int]: ...  # device bytes committed now, and their peak

    def close(self) -> None: ...  # idempotent


def device_prepack_refused(device: str, objects: list[str]) -> DeviceError:
    """The one line that refuses the device-side prepack recipe where a session cannot run
    it: naming the recipe, the objects the plan selected it for, the fix."""
    from onnx_prep.core.kernels.spec import DEVICE_PREPACK

    some = ", ".join(objects[:3]) + (f" and {len(objects) - 3} more" if len(objects) > 3 else "")
    return DeviceError(f"the plan packs {len(objects)} object(s) on {device} ({DEVICE_PREPACK}: {some}), "
                       "and a session does not run the device-side prepack yet",
                       hint='plan with DeviceTarget(prepack="host"): pack on a CPU worker, upload the packed bytes')
