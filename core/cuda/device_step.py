"""DeviceStep: one run of the device graph runner (core/cuda/device_graph.py), made and
checked on the host, issued by one call.

``ops`` is the step in stream order: ``("htod", device address, page-locked view)``
(a host value a device node reads), ``("launch", function, plan)`` (a kernel: its
plan's grid, block, shared bytes and arguments), ``("dtoh", page-locked view, device
address)`` (a graph output). ``key`` is all of it (addresses, copy sizes, every
launch's arguments): what a StepGraph's captured graph depends on. The copies read and
write page-locked buffers, never pageable memory, so the step can be captured; a
replay copies whatever those buffers hold, which is why ``stage`` fills them before
each run.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from onnx_prep.core.cuda.driver import DeviceDriver

__all__ = ["DeviceStep"]


class DeviceStep:
    """One run's step: ``step(stream)`` issues it; ``key`` is what a captured graph of
    it depends on; ``stage()`` writes the host values it copies in into its page-locked
    buffer (before it is issued), ``outputs()`` reads the results (after the stream is
    synchronised)."""

    def __init__(self, driver: DeviceDriver, ops: list[tuple], key: tuple, staged: list[tuple[np.ndarray, Any]],
                 fetched: list[tuple[str, Any, tuple, np.dtype]], host_outputs: dict[str, np.ndarray],
                 output_names: tuple[str, ...], status: Any = None) -> None:
        self.driver, self.ops, self.key = driver, ops, key
        self._staged, self._fetched, self._host_outputs = staged, fetched, host_outputs
        self._names = output_names
        self._status = status  # page-locked int32: the status word, copied back at the step's end
        self.launches = sum(op[0] == "launch" for op in ops)

    def stage(self) -> None:
        for array, pinned in self._staged:
            pinned[:] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)

    def __call__(self, stream: Any) -> None:
        self.issue(stream)

    def issue(self, stream: Any, start: int = 0, end: int | None = None) -> None:
        """Queue ops ``[start, end)`` on ``stream`` (all of them by default; a part is
        what a segment of a streamed step issues: device_decoder.py)."""
        d = self.driver
        for op in self.ops[start:end]:
            if op[0] == "launch":
                _, function, plan = op
                d.launch(function, plan.grid, plan.block, plan.shared_bytes, stream, plan.args)
            elif op[0] == "htod":
                d.copy_to_device_async(op[1], op[2], stream)
            else:
                d.copy_to_host_async(op[1], op[2], stream)

    def outputs(self) -> dict[str, np.ndarray]:
        """The outputs; first, a DeviceError (one line) if the step's status word says a
        kernel met a value only the device saw (device_decoder_ops.check_status)."""
        if self._status is not None:
            from onnx_prep.core.cuda.device_decoder_ops import check_status

            check_status(int(self._status.view(np.int32)[0]))
        out = dict(self._host_outputs)
        for name, pinned, shape, dtype in self._fetched:
            out[name] = pinned.view(dtype).reshape(shape).copy() if pinned is not None else np.zeros(shape, dtype)
        return {n: out[n] for n in self._names}
