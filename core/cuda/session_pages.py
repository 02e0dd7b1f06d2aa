"""A device decode's weights from a device session's plan: the objects ``DeviceDecoder``
(device_decoder.py) reads, and the pager its ``WeightResidency`` pages them with.

One load path: the session (core/runtime/session.py, on a ``CudaSessionDevice``, with
``device_pages=True``) puts every object in its device slot with its plan's own tasks
(a prepared-cache payload read and uploaded, or the sources uploaded and packed on
the device, or packed on a CPU worker and uploaded; raw weights read and uploaded),
under the device's budget. The decoder's launches are built over those slots'
addresses, which are stable (stable-VA slots), so it needs nothing resident to build
them:

- the raw weights (norm weights, rotary tables) are made resident once, when the
  decoder opens, and stay so; they are read where they are (``DeviceTensor`` s over
  their slots), and what they commit is taken off the budget the step's packed weights
  page under;
- each packed object's header (what a launch reads its shape from) is described on the
  host from its node and its sources' declared types and shapes
  (``Int4Source.header``), the same 64 bytes the prepack writes, so nothing is read back;
  an object the device prepack does not describe (a fused DequantizeLinear + MatMul
  weight, packed on a CPU worker) is made resident once and its header read back;
- :class:`SessionPages` pages for the residency: a page-in is ``session.prepare(keys)``
  (the plan's recipes again: read, pack or upload; each upload and device prepack is
  synchronised before it publishes, so the weight is there when ``prepare`` returns,
  before the decoder queues the segment that reads it), an eviction is
  ``session.evict(key)`` (the store decommits the slot; its address stays reserved).

So no packed byte of the model is kept in host memory: a weight paged out is read
again from the prepared cache or its sources (the page cache, typically) when it is
paged back in, at the cost of that read beside the host-to-device copy.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from onnx_prep.core.errors import DeviceError, Where
from onnx_prep.core.model.prepared_key import PreparedKey

__all__ = ["SessionObjects", "SessionPages", "session_objects"]


class SessionPages:
    """The ``WeightPager`` of a device session (``device_pages=True``): ``nbytes`` of each
    packed object by its device key."""

    def __init__(self, session: Any, nbytes: Mapping[PreparedKey, int]) -> None:
        self.session, self._nbytes = session, dict(nbytes)

    def nbytes(self, key: PreparedKey) -> int:
        return self._nbytes[key]

    def page_in(self, keys: Sequence[PreparedKey], stream: Any) -> None:
        self.session.prepare(list(keys))  # resident when it returns (the module docstring)

    def evict(self, key: PreparedKey) -> None:
        if not self.session.evict(key):
            raise DeviceError("a weight the decode pages is pinned by its session", Where(tensor=key),
                              hint="this is a bug in onnx-prep; please report it")


@dataclasses.dataclass
class SessionObjects:
    """What a device session gives a ``DeviceDecoder``: ``prepared`` (DeviceObjects keyed by
    the CPU keys the step's actions bind), ``weights`` (the raw weights as DeviceTensors,
    by name), ``nbytes`` (each packed object's size by device key), ``ranges`` (each
    packed object's device address range and device key, sorted), ``raw_committed``
    (device bytes the raw weights commit)."""

    prepared: dict
    weights: dict
    nbytes: dict
    ranges: list
    raw_committed: int


def session_objects(session: Any) -> SessionObjects:
    """The decoder's view of ``session``'s device objects (the module docstring); makes
    the raw weights resident."""
    from onnx_prep.core.cuda.device_graph import DeviceObject
    from onnx_prep.core.cuda.device_launchers import DeviceTensor
    from onnx_prep.core.cuda.device_slot_pool import DeviceView
    from onnx_prep.core.plan.execution_plan import RAW_LAYOUT

    pool = session.device.slots
    resolved = session.resolved
    raw = [r for r in session.plan.requirements if r.request.layout == RAW_LAYOUT]
    packed = [r for r in session.plan.requirements if r.request.layout != RAW_LAYOUT]
    before = pool.counters().committed_bytes
    if raw:
        session.prepare([r.key for r in raw])
    raw_committed = pool.counters().committed_bytes - before
    weights = {}
    for r in raw:
        desc = resolved.weights[r.request.logical_value]
        weights[desc.name] = DeviceTensor(pool.address(r.key), tuple(desc.dims), np.dtype(desc.dtype))
    nodes = {n.name: n for n in resolved.nodes}
    prepared, nbytes, ranges = {}, {}, []
    for r in packed:
        header = _described(nodes[r.node], r, resolved) or _read_back(session, r.key)
        cpu_key = dataclasses.replace(r.request, device="cpu").key  # what the actions bind
        address = pool.address(r.key)
        prepared[cpu_key] = DeviceObject(DeviceView(address, header.total_size), header)
        nbytes[r.key] = header.total_size
        ranges.append((address, address + header.total_size, r.key))
    return SessionObjects(prepared, weights, nbytes, sorted(ranges), raw_committed)


def _described(node: Any, r: Any, resolved: Any) -> Any:
    """The object's header described on the host, or None where the device prepack does
    not describe it."""
    from onnx_prep.core.cuda.device_int4_prepack import Int4Source
    from onnx_prep.core.ops.attributes import normalize_attributes

    try:
        sources = [resolved.weights[n] for n in r.request.source_lineage]
        return Int4Source.of_node(node.kernel, normalize_attributes(node.attributes), sources).header()
    except (DeviceError, KeyError, IndexError, ValueError):
        return None


def _read_back(session: Any, key: PreparedKey) -> Any:
    """The header of ``key``'s object as made on the device: resident once, its 64 bytes
    read back, then evicted (the residency pages it in when a step needs it)."""
    from onnx_prep.native.packed import HEADER_SIZE, read_header

    pool = session.device.slots
    session.prepare([key])
    head = np.frombuffer(pool.driver.copy_to_host(pool.address(key), HEADER_SIZE), np.uint8)
    session.evict(key)
    return read_header(head, header_only=True)[1]
