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
- where the device packs (``packs_on_device``), runs the device-side prepack
  (``read_source_upload_prepack``) on the same queue: each source read into staging is
  copied into device memory once by ``upload_source`` (a :class:`DeviceSource`; the
  host staging goes back once it returns), ``prepack(key, ...)`` packs the object from
  those into its committed slot, and each source's device memory goes back
  (``free_source``) once every prepack reading it has published;
- closes it with the session (``close``: the slots, the stream, any staging left).

Executing steps on a device is not part of this protocol yet: a session on a device
loads (``prepare``) but refuses ``run`` (session.py).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from onnx_prep.core.errors import DeviceError
from onnx_prep.core.model.prepared_key import PreparedKey
from onnx_prep.core.plan.device_target import DeviceTarget

__all__ = ["DeviceSource", "SessionDevice", "device_prepack_refused"]


@dataclass(frozen=True)
class DeviceSource:
    """A prepack's source tensor copied into device memory (``upload_source``): what it is,
    as the model declares it (the device prepack describes the packed object from the
    element type and dims, as the CPU prepack does from the arrays), where it is
    (``address``: the device's handle), and how long the copy took on the device."""

    name: str
    dtype: str  # the element type's name (core/model/dtypes.py: "uint8", "float16", ...)
    dims: tuple[int, ...]
    length: int  # bytes
    address: Any
    upload_ms: float = 0.0


class SessionDevice(Protocol):
    name: str  # the plan's device name ("cuda")
    slots: Any  # the device slot pool (slot_pool.SlotPool's contract)
    # Whether a session can run the device-side prepack on it (the ``read_source_upload_prepack``
    # recipe: ``upload_source`` and ``prepack`` below); False: the session plans with
    # ``prepack="host"`` and refuses that recipe.
    packs_on_device: bool

    def target(self) -> DeviceTarget: ...  # what to plan for: granularity queried, budget, prepack

    def staging(self, nbytes: int) -> np.ndarray: ...  # page-locked host bytes (uint8) to upload from

    def free_staging(self, buffer: np.ndarray) -> None: ...

    def upload(self, key: PreparedKey, data: np.ndarray) -> float: ...  # copied when it returns; device ms

    def upload_source(self, name: str, data: np.ndarray, *, dtype: str, dims: Sequence[int]) -> DeviceSource:
        """``data`` (staging bytes) copied into device memory of its own; copied when it returns."""

    def prepack(self, key: PreparedKey, kernel: str, attributes: Mapping[str, Any],
                sources: Sequence[DeviceSource]) -> float:
        """``key``'s object packed on the device by ``kernel`` (its node's ``attributes``)
        from ``sources`` (lineage order) into its committed slot; done when it returns,
        device ms."""

    def free_source(self, source: DeviceSource) -> None: ...

    def memory(self) -> tuple[int, int]: ...  # device bytes committed now, and their peak

    def close(self) -> None: ...  # idempotent


def device_prepack_refused(device: str, objects: list[str], why: str | None = None) -> DeviceError:
    """The one line that refuses the device-side prepack recipe on a device that cannot run
    it (``packs_on_device`` False; ``why``: the device's reason, where it has one): naming
    the recipe, the objects the plan selected it for, the fix."""
    from onnx_prep.core.kernels.spec import DEVICE_PREPACK

    some = ", ".join(objects[:3]) + (f" and {len(objects) - 3} more" if len(objects) > 3 else "")
    return DeviceError(f"the plan packs {len(objects)} object(s) on {device} ({DEVICE_PREPACK}: {some}), "
                       f"and this {device} device has no device-side prepack kernel{f': {why}' if why else ''}",
                       hint='plan with DeviceTarget(prepack="host"): pack on a CPU worker, upload the packed bytes')
