"""DeviceKVCache: a decoder's past / present KV kept in device buffers of a fixed
capacity between steps, so that a decode step's launches and copies are the same every
step and its graph is captured once and replayed (issue #20).

The decode loop (core/decode/generation.py) owns the KV cache: it feeds each step's
presents back as the next step's past, and the past grows by one row a step. Fed so, a
device step copies the whole past in and the presents out, and every step's shapes
and launches differ. Here instead:

- **which models**: those whose every past input is read by one com.microsoft
  GroupQueryAttention node (inputs 3 and 4) and by nothing else, its presents being
  graph outputs (the builder's exports), the input ids being the input an embedding
  gathers by. The device GQA keeps its past and present in one buffer (``same buffer,
  only the new rows written``: device_decoder_ops.plan_gqa) and reads each row's
  length from ``seqlens_k`` in device memory (the builder computes it from the
  attention mask on the host; the runner copies it in from a page-locked buffer within
  the step), never from a launch argument. Any other model (the fused
  Attention of the tiny fixture, which concatenates its past) is declined with the
  reason, and its KV goes through the host as before;
- **the buffers**: one ``[batch, kv heads, capacity, head size]`` fp32 buffer per past
  input, allocated at a generation's first step (the prefill: a past of 0 rows) and kept
  while the batch and capacity hold (a new batch or capacity: new buffers, new keys, the
  graphs captured again). The capacity is the run's prompt plus tokens, which the
  decode loop announces through ``append_buffer.room_for`` (as it does for the CPU's
  append buffers), or given;
- **each step** feeds the buffers as the past at the full capacity, so GroupQueryAttention's
  ``total_sequence_length`` is at most the past and its present is the past's buffer
  (the launcher's Alias): the prefill (``S == total``: the device kernel ignores the past)
  and every decode step after it have one shape each. The presents stay on the device;
  the loop gets a placeholder of the right shape (read-only, NaN: reading it is a
  mistake that shows) and feeds it back as the next past, which is how a step knows the
  past is the one held here. A past that is not the placeholder (a caller's own) is run
  as fed, through the host, and ends the held generation.

Not thread-safe, as the decoder it belongs to.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from onnx_prep.core.cuda.device_launchers import DeviceTensor
from onnx_prep.core.cuda.driver import DeviceDriver
from onnx_prep.core.errors import DeviceError

__all__ = ["DeviceKVCache", "kv_pairs"]

_F32 = np.dtype(np.float32)


def kv_pairs(resolved: Any) -> tuple[tuple[tuple[str, str], ...], str, str]:
    """``((past input, present output), ...)`` of every GroupQueryAttention node whose
    KV can be kept on the device, the input ids' input and ``""``; or ``()``, ``""`` and
    why the model's cannot. The input ids are the input an embedding gathers rows by
    (a Gather's or GatherBlockQuantized's indices): their rows are a step's new rows."""
    inputs = {v.name for v in resolved.inputs}
    ids = [n.inputs[1] for n in resolved.nodes
           if n.op_type in ("Gather", "GatherBlockQuantized") and len(n.inputs) > 1 and n.inputs[1] in inputs]
    if len(set(ids)) != 1:
        return (), "", (f"{len(set(ids))} inputs are gathered by as indices; the input ids must be the one "
                        "(their rows are a step's new rows)")
    pairs, why = _gqa_pairs(resolved)
    return pairs, ids[0] if pairs else "", why


def _gqa_pairs(resolved: Any) -> tuple[tuple[tuple[str, str], ...], str]:
    inputs = {v.name: v for v in resolved.inputs}
    outputs = {v.name for v in resolved.outputs}
    readers: dict[str, list] = {}
    for node in resolved.nodes:
        for name in node.inputs:
            if name:
                readers.setdefault(name, []).append(node)
    pairs = []
    for node in resolved.nodes:
        if node.op_type != "GroupQueryAttention" or node.kernel != "gqa":
            continue
        for i, o in ((3, 1), (4, 2)):
            past = node.inputs[i] if len(node.inputs) > i else ""
            present = node.outputs[o] if len(node.outputs) > o else ""
            if not past or past not in inputs:
                return (), f"GroupQueryAttention node {node.name} reads no past input {i} (its past is not fed)"
            if present not in outputs:
                return (), f"GroupQueryAttention node {node.name}'s present output {o} is not a graph output"
            others = [n.name for n in readers.get(past, []) if n is not node]
            if others:
                return (), f"the past input {past} is read by node {others[0]} beside GroupQueryAttention node " \
                           f"{node.name}"
            pairs.append((past, present))
    if not pairs:
        attention = [n for n in resolved.nodes if n.kernel == "gqa"]
        what = f"its attention is {attention[0].op_type} node {attention[0].name}" if attention else \
            "it has no attention node"
        return (), f"only GroupQueryAttention's past is kept on the device; {what}"
    fed = {n for n, v in inputs.items() if len(getattr(v, "shape", ()) or ()) == 4} - {p for p, _ in pairs}
    if fed:
        return (), f"the 4-D input {sorted(fed)[0]} is not a GroupQueryAttention past"
    return tuple(pairs), ""


class DeviceKVCache:
    """The KV of ``pairs`` (from :func:`kv_pairs`) in device buffers on ``driver``;
    ``ids``: the input ids' input; ``capacity``: rows per buffer (None: the decode
    loop's ``room_for``)."""

    def __init__(self, driver: DeviceDriver, pairs: tuple[tuple[str, str], ...], ids: str,
                 capacity: int | None = None) -> None:
        self.driver = driver
        self.pairs = pairs
        self.ids = ids  # the input ids' input: its rows are the step's new rows
        self.rows = 0  # the new rows of the step take() gave buffers for
        self.presents = frozenset(present for _, present in pairs)
        self.capacity = capacity
        self.buffers: dict[str, DeviceTensor] = {}  # past input -> its buffer at the full capacity
        self.length = 0  # rows held (0: no generation held)
        self._returned: dict[str, np.ndarray] = {}  # past input -> the placeholder fed back as it
        self.generations = 0
        self.allocations = 0  # buffer sets allocated (a new batch or capacity)

    def take(self, feeds: Mapping[str, np.ndarray]) -> tuple[dict[str, DeviceTensor] | None, str]:
        """The device buffers to read as the past for ``feeds``, and the step's phase
        (``"prefill"`` or ``"decode"``); ``(None, why)`` where the step must be fed from
        the host (no capacity holds the prompt, a past this cache did not return)."""
        past = {p: feeds[p] for p, _ in self.pairs}
        rows = int(np.shape(feeds[self.ids])[1])
        if next(iter(past.values())).shape[2] == 0:
            return self._begin(feeds, rows)
        if not (self.length and all(past[p] is self._returned.get(p) for p in past)):
            self.length = 0
            return None, "a past this decoder did not return was fed (run through the host)"
        capacity = next(iter(self.buffers.values())).shape[2]
        if self.length + rows > capacity:
            held, self.length = self.length, 0
            raise DeviceError(f"the device KV cache holds {capacity} rows: {held} held and {rows} new do not fit",
                              hint="give a larger kv_capacity= (the prompt plus the tokens)")
        self.rows = rows
        return dict(self.buffers), "decode"

    def _begin(self, feeds: Mapping[str, np.ndarray], rows: int) -> tuple[dict[str, DeviceTensor] | None, str]:
        """A generation's first step (a past of 0 rows) of ``rows`` new rows: its
        buffers, allocated if the batch or capacity changed; ``(None, why)`` when no
        capacity holds the prompt."""
        from onnx_prep.core.ops import append_buffer

        capacity = self.capacity or append_buffer.room_hint()
        if capacity < rows:
            self.length = 0
            return None, (f"no KV capacity for the prompt's {rows} rows (capacity {capacity}: give kv_capacity= "
                          "or decode in append_buffer.room_for)")
        shapes = {p: feeds[p].shape[:2] + (capacity,) + feeds[p].shape[3:] for p, _ in self.pairs}
        if not self.buffers or any(self.buffers[p].shape != s for p, s in shapes.items()):
            self._free()
            for p, shape in shapes.items():
                nbytes = int(np.prod(shape, dtype=np.int64)) * _F32.itemsize
                self.buffers[p] = DeviceTensor(self.driver.mem_alloc(max(nbytes, 256)), tuple(shape), _F32)
            self.allocations += 1
        self.generations += 1
        self.length, self.rows, self._returned = 0, rows, {}
        return dict(self.buffers), "prefill"

    def advance(self) -> dict[str, np.ndarray]:
        """After the step :meth:`take` gave buffers for: the placeholders the loop gets
        as the presents (each ``[batch, kv heads, length, head size]``, read-only NaN)."""
        self.length += self.rows
        out, self._returned = {}, {}
        nan = np.full((), np.nan, _F32)
        for past, present in self.pairs:
            b, kn, _, h = self.buffers[past].shape
            out[present] = self._returned[past] = np.broadcast_to(nan, (b, kn, self.length, h))
        return out

    def _free(self) -> None:
        for t in self.buffers.values():
            self.driver.mem_free(t.address)
        self.buffers = {}

    def close(self) -> None:
        """Free the buffers (idempotent)."""
        self._free()
        self.length = 0
        self._returned = {}
