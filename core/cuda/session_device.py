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
  every copy really is from pinned memory. ``close`` frees whatever staging is left;
- the device-side prepack (the ``read_source_upload_prepack`` recipe) with the device
  INT4 prepack kernels (``device_int4_prepack.py``, compiled when the device opens, once
  per process and device): ``upload_source`` copies a source from staging into device
  memory of its own (``cuMemAlloc``) on the stream between the two events, and returns
  once the copy is done (its staging may go back); ``prepack`` launches the kernel from
  those sources straight into the key's committed slot, between the events, and returns
  once it has run; ``free_source`` gives a source's device memory back (the session does
  once every prepack reading it has published; ``close`` frees any left).

``target()`` is what the session plans for: the pool's granularity (queried from the
driver, so "given"), its budget, and where to pack: ``prepack="kernel"`` (the kernel's
choice: the INT4 matmul packs on the device) where the prepack kernels compiled
(``packs_on_device``), else ``"host"`` (packed on a CPU worker, the packed bytes
uploaded), with the reason in ``device_prepack_reason``; a session refuses the device
recipe by name on such a device should a plan select it. ``device_prepack=False`` asks
for the host prepack; ``True`` requires the kernels (their compile error raised).

NOTE: a source's device memory is the device's, outside the slot pool's budget (the
budget bounds the prepared objects' slots): at most the sources of the prepacks in
flight, which on one device queue is one object's, tied sources aside.

Nothing here runs a step: the session refuses ``run`` on a device (session.py).
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from onnx_prep.core.cuda.device_slot_pool import DeviceSlotPool
from onnx_prep.core.cuda.driver import DeviceDriver, DriverUnavailable
from collections.abc import Mapping, Sequence

from onnx_prep.core.errors import DeviceError, Where
from onnx_prep.core.model.prepared_key import PreparedKey
from onnx_prep.core.plan.device_target import DeviceTarget
from onnx_prep.core.runtime.session_device import DeviceSource

__all__ = ["CudaSessionDevice"]


class CudaSessionDevice:
    """Device ``ordinal`` through ``driver`` (None: cuda-python's, initialised here), at
    most ``budget`` committed slot bytes (None: whatever the device gives);
    ``device_prepack``: None packs on the device where its kernels compile, False never,
    True requires it (the module docstring)."""

    name = "cuda"

    def __init__(self, driver: DeviceDriver | None = None, ordinal: int = 0, *, budget: int | None = None,
                 device_prepack: bool | None = None) -> None:
        if driver is None:
            driver = _load_driver()
        self.driver = driver
        self.ordinal = ordinal
        self.budget = budget
        self._lock = threading.Lock()
        self._staging: dict[int, np.ndarray] = {}  # address -> the buffer host_alloc returned
        self._sources: dict[int, int] = {}  # device address -> bytes: sources for the device prepack
        self._closed = False
        self._stream = self._events = None
        self._prepack = None
        self.packs_on_device = False
        self.device_prepack_reason: str | None = "not asked for (device_prepack=False)"
        self.slots = DeviceSlotPool(driver, ordinal, budget=budget)  # makes the device's context current
        try:
            self._stream = driver.stream_create()
            self._events = (driver.event_create(), driver.event_create())
            if device_prepack is not False:
                self._open_prepack(required=bool(device_prepack))
        except BaseException:
            self.close()
            raise

    def _open_prepack(self, required: bool) -> None:
        """The device INT4 prepack's kernels, compiled now (once per process and device):
        available, or why not in one line."""
        from onnx_prep.core.cuda.device_int4_prepack import DeviceInt4Prepack

        try:
            self._prepack = DeviceInt4Prepack(self.driver, self.ordinal)
        except DeviceError as exc:  # NVRTC missing, the source refused, the module not loaded
            if required:
                raise
            self.device_prepack_reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return
        self.packs_on_device, self.device_prepack_reason = True, None

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

    def _check_copy(self, what: str, tensor: str, data: np.ndarray) -> None:
        """A copy to the device may start: the device open, ``data`` page-locked staging."""
        if self._closed:
            raise DeviceError(f"{what} on a closed device", Where(tensor=tensor))
        if not self._is_staging(data):
            raise DeviceError(f"{what} of {data.nbytes:,} bytes that are not page-locked staging",
                              Where(tensor=tensor), hint="this is a bug in onnx-prep; please report it")

    # -- uploads
    def upload(self, key: PreparedKey, data: np.ndarray) -> float:
        """Copy ``data`` (staging bytes) into ``key``'s resident slot on the stream, timed by
        events; returns the device milliseconds once the copy is done."""
        d = self.driver
        # NOTE: one stream and one pair of events: the uploads are copied one at a time,
        # in the order the device queue runs them (a single worker: Session).
        with self._lock:
            self._check_copy("upload", key, data)
            start, end = self._events
            self.slots.make_current()
            d.event_record(start, self._stream)
            self.slots.upload(key, data, self._stream)
            d.event_record(end, self._stream)
            d.event_synchronize(end)
            return float(d.event_elapsed_ms(start, end))

    # -- the device-side prepack
    def upload_source(self, name: str, data: np.ndarray, *, dtype: str, dims: Sequence[int]) -> DeviceSource:
        """Copy ``data`` (staging bytes) into device memory of its own on the stream, timed
        by events; returns once the copy is done, until ``free_source``."""
        d = self.driver
        n = int(data.nbytes)
        with self._lock:
            self._check_copy("source upload", name, data)
            self.slots.make_current()
            address = None
            try:
                address = d.mem_alloc(max(n, 1))
                start, end = self._events
                d.event_record(start, self._stream)
                d.copy_to_device_async(address, data, self._stream)
                d.event_record(end, self._stream)
                d.event_synchronize(end)
                ms = float(d.event_elapsed_ms(start, end))
            except DeviceError as exc:
                if address is not None:
                    d.mem_free(address)
                raise DeviceError(f"upload of a source to the device ({n:,} bytes): {exc.message}",
                                  Where(tensor=name), hint=exc.hint) from None
            except BaseException:
                if address is not None:
                    d.mem_free(address)
                raise
            self._sources[address] = n
        return DeviceSource(name, dtype, tuple(int(x) for x in dims), n, address, ms)

    def prepack(self, key: PreparedKey, kernel: str, attributes: Mapping[str, object],
                sources: Sequence[DeviceSource]) -> float:
        """Pack ``key``'s object from ``sources`` (lineage order, ``upload_source``'s) into
        its committed slot with the device prepack kernel of ``kernel``, on the stream
        between the events; returns the device milliseconds once it has run. A source
        or an object the kernel cannot pack is refused by name before any launch."""
        from onnx_prep.core.cuda.device_int4_prepack import Int4Source
        from onnx_prep.core.cuda.device_slot_pool import DeviceView

        if self._prepack is None:
            raise DeviceError(f"no device prepack on this device: {self.device_prepack_reason}", Where(tensor=key))
        d = self.driver
        with self._lock:
            if self._closed:
                raise DeviceError("device prepack on a closed device", Where(tensor=key))
            if any(s.address not in self._sources for s in sources):
                raise DeviceError("device prepack from a source that is not in device memory",
                                  Where(tensor=key), hint="this is a bug in onnx-prep; please report it")
            try:
                source = Int4Source.of_node(kernel, attributes, sources)
                views = [DeviceView(s.address, s.length) for s in sources]
                self.slots.make_current()
                start, end = self._events
                d.event_record(start, self._stream)
                self._prepack.launch(self._stream, views, self.slots.view(key), source)
                d.event_record(end, self._stream)
                d.event_synchronize(end)
                return float(d.event_elapsed_ms(start, end))
            except DeviceError as exc:
                raise DeviceError(f"device prepack: {exc.message}", Where(tensor=key), hint=exc.hint) from None

    def free_source(self, source: DeviceSource) -> None:
        with self._lock:
            n = self._sources.pop(source.address, None)
            if n is None:  # (close freed it already)
                return
            self.slots.make_current()
            self.driver.mem_free(source.address)

    def live_sources(self) -> int:
        """Sources in device memory not given back (tests: none after a load)."""
        with self._lock:
            return len(self._sources)

    def memory(self) -> tuple[int, int]:
        c = self.slots.counters()
        return c.committed_bytes, c.peak_committed_bytes

    def close(self) -> None:
        """The slots (unmapped, ranges freed), the staging and device sources left, the
        events, the stream."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            staging, self._staging = list(self._staging.values()), {}
            sources, self._sources = list(self._sources), {}
        d = self.driver
        self.slots.make_current()
        try:
            if self._stream is not None:
                d.stream_synchronize(self._stream)  # nothing queued may read staging freed below
            self.slots.close()
            for buf in staging:
                d.host_free(buf)
            for address in sources:
                d.mem_free(address)
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
