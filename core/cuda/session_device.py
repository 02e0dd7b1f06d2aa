"""CudaSessionDevice: a CUDA device as a session loads onto it, the runtime's
``SessionDevice`` (core/runtime/session_device.py): ``Session(resolved,
SessionOptions(device=CudaSessionDevice(driver, budget=...)))``.

It holds what a session's device load needs, made once and freed by ``close``:

- the device slot pool (``DeviceSlotPool``: stable-VA slots, the budget enforced), the
  PREPARED store's slots for the device plan's keys;
- ONE stream, the device queue's: every upload is queued on it
  (``cuMemcpyHtoDAsync``) between two events (``cuEventRecord``), and the upload returns
  once the end event is synchronised, with the events' elapsed milliseconds: the copy
  is done, so the staging it read may go back;
- page-locked host staging (``cuMemAllocHost``) that the host side of an upload fills
  (a read, a CPU prepack, a packed read); an upload from anything else is refused, so
  every copy really is from pinned memory. ``close`` frees whatever staging is left.

``target()`` is what the session plans for: the pool's granularity (queried from the
driver, so "given"), its budget, and ``prepack="host"``: the device-side prepack (the
``read_source_upload_prepack`` recipe) has its kernel (``device_int4_prepack.py``) but
no session task runs it yet (``packs_on_device`` is False), so the plan packs on a CPU
worker wherever the kernel offers that, and the session refuses the recipe by name
should a plan select it.

Nothing here runs a step: the session refuses ``run`` on a device (session.py).
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from onnx_prep.core.cuda.device_slot_pool import DeviceSlotPool
from onnx_prep.core.cuda.driver import DeviceDriver, DriverUnavailable
from onnx_prep.core.errors import DeviceError, Where
from onnx_prep.core.model.prepared_key import PreparedKey
from onnx_prep.core.plan.device_target import DeviceTarget

__all__ = ["CudaSessionDevice"]


class CudaSessionDevice:
    """Device ``ordinal`` through ``driver`` (None: cuda-python's, initialised here), at
    most ``budget`` committed slot bytes (None: whatever the device gives)."""

    name = "cuda"
    packs_on_device = False  # the device INT4 prepack is not wired into a session's tasks yet

    def __init__(self, driver: DeviceDriver | None = None, ordinal: int = 0, *, budget: int | None = None) -> None:
        if driver is None:
            driver = _load_driver()
        self.driver = driver
        self.ordinal = ordinal
        self.budget = budget
        self._lock = threading.Lock()
        self._staging: dict[int, np.ndarray] = {}  # address -> the buffer host_alloc returned
        self._closed = False
        self._stream = self._events = None
        self.slots = DeviceSlotPool(driver, ordinal, budget=budget)  # makes the device's context current
        try:
            self._stream = driver.stream_create()
            self._events = (driver.event_create(), driver.event_create())
        except BaseException:
            self.close()
            raise

    def target(self) -> DeviceTarget:
        return DeviceTarget(self.name, granularity=self.slots.granularity, granularity_given=True,
                            budget=self.budget, prepack="kernel" if self.packs_on_device else "host")

    # -- staging
    def staging(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of page-locked host memory (uint8), until ``free_staging``."""
        self.slots.make_current()  # an I/O or CPU worker: the context is per thread
        buf = self.driver.host_alloc(max(int(nbytes), 1))
        with self._lock:
            self._staging[buf.ctypes.data] = buf
        return buf[:nbytes]

    def free_staging(self, buffer: np.ndarray) -> None:
        with self._lock:
            buf = self._staging.pop(buffer.ctypes.data, None)
        if buf is not None:  # (close freed it already)
            self.slots.make_current()
            self.driver.host_free(buf)

    def live_staging(self) -> int:
        """Staging buffers not given back (tests: none after a load)."""
        with self._lock:
            return len(self._staging)

    def _is_staging(self, data: np.ndarray) -> bool:
        start, n = data.ctypes.data, data.nbytes
        return any(a <= start and start + n <= a + b.nbytes for a, b in self._staging.items())

    # -- uploads
    def upload(self, key: PreparedKey, data: np.ndarray) -> float:
        """Copy ``data`` (staging bytes) into ``key``'s resident slot on the stream, timed by
        events; returns the device milliseconds once the copy is done."""
        d = self.driver
        # NOTE: one stream and one pair of events: the uploads are copied one at a time,
        # in the order the device queue runs them (a single worker: Session).
        with self._lock:
            if self._closed:
                raise DeviceError("upload on a closed device", Where(tensor=key))
            if not self._is_staging(data):
                raise DeviceError(f"upload of {data.nbytes:,} bytes that are not page-locked staging",
                                  Where(tensor=key), hint="this is a bug in onnx-prep; please report it")
            start, end = self._events
            self.slots.make_current()
            d.event_record(start, self._stream)
            self.slots.upload(key, data, self._stream)
            d.event_record(end, self._stream)
            d.event_synchronize(end)
            return float(d.event_elapsed_ms(start, end))

    def memory(self) -> tuple[int, int]:
        c = self.slots.counters()
        return c.committed_bytes, c.peak_committed_bytes

    def close(self) -> None:
        """The slots (unmapped, ranges freed), the staging left, the events, the stream."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            staging, self._staging = list(self._staging.values()), {}
        d = self.driver
        self.slots.make_current()
        try:
            if self._stream is not None:
                d.stream_synchronize(self._stream)  # nothing queued may read staging freed below
            self.slots.close()
            for buf in staging:
                d.host_free(buf)
        finally:
            for e in self._events or ():
                d.event_destroy(e)
            if self._stream is not None:
                d.stream_destroy(self._stream)

    def __enter__(self) -> CudaSessionDevice:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _load_driver() -> DeviceDriver:
    from onnx_prep.core.cuda.cuda_python_driver import load_driver

    try:
        driver = load_driver()
    except DriverUnavailable as exc:
        raise DeviceError(f"CUDA is not usable: {exc.reason}", hint="onnx-prep devices says why") from None
    driver.init()
    return driver
