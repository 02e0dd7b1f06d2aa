"""DeviceGraphRunner: a resolved model's node list run on a CUDA device for one set of
feeds, issued as ONE step on a stream, so a StepGraph (step_graph.py) can capture it
once and replay it.

The node list is the CPU runtime's compiled one (core/runtime/action_program.py: the
same order, normalised attributes, prepared bindings, and each value's last reader),
and each node goes one of two ways, decided once when the runner is built:

- **on the host**, with numpy (the CPU op itself): the shape values. A node runs here
  when it is Shape or Constant, or one of ``HOST_OPS`` whose inputs are all host values
  and whose outputs are integers (int64 Concat / Unsqueeze / Squeeze / Gather / Cast /
  ReduceSum / Sub ... on shapes and on the integer feeds, e.g. the builder's sequence
  lengths from its attention mask). Host values are the feeds, the inline initializers
  and what host nodes make; Shape reads only a device value's shape, which the host
  knows;
- **on the device**, through the launcher registered for its ``(op_type, kernel)``
  (device_launchers.py: this package's tensor ops, views and the INT4 matmul, with
  its packed weights in a DeviceSlotPool). A host value a device node reads as data is
  copied in within the step (from a page-locked buffer, as a captured graph requires);
  an inline initializer or raw weight read as data is uploaded once, when the runner
  is built. Reshape, Squeeze, Unsqueeze (and Flatten, Identity) are views: the same
  buffer under another shape, no copy.

**The plan check**: a node that would run on the device without a launcher, whose
launcher says what it lacks (a dtype, a Cast), or whose prepared object or raw weight
was not given, raises DeviceError naming each such node, its op and what is missing
(``refused``: the same as (node, text) pairs), when the runner is built: before
anything is uploaded or run.

**One run** (``run(feeds)``): the host walks the node list once (``prepare``): host
nodes compute their values; device nodes get their outputs' shapes from their
launchers and a place in one device arena (first fit, 256-byte aligned), a value's
place given back once its last reader ran (the CPU runtime's liveness; a view keeps
its buffer alive), so the arena is the step's peak, not its sum. Then the launches are
made with the arena's addresses, every one checked before the step is issued: the step
(:class:`DeviceStep`) is the ordered list of host-to-device copies, launches and the
graph outputs' copies back, issued on the runner's stream by one call. Its ``key`` is
that whole list (addresses, shapes as the launches' arguments, copy sizes): a run with
the same shapes reuses the arena and the page-locked buffers, so the key is the same and
a StepGraph replays; other shapes change the key and the graph is captured again. The
outputs are copied to the host at the end of the step and read once the stream is
synchronised.

**What only the device sees** (the fused decoder ops: decoder_launchers.py): a launcher
with ``uses_status`` reports a bad position id, index or seqlens_k in the runner's status
word, an int32 in device memory that the step zeroes first (a copy from a page-locked
zero, so a replay zeroes it too) and copies back last; ``DeviceStep.outputs`` reads it
after the synchronisation and raises one DeviceError line naming what was flagged. A
launcher's ``staged`` host arrays (position ids, seqlens_k it derives from shapes) are
copied into the arena within the step before its node, like a host feed.

Not thread-safe: one thread issues a runner's steps (as StepGraph requires).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Mapping

import numpy as np

from onnx_prep.core.cuda import decoder_launchers  # noqa: F401 - registers the fused decoder ops' launchers
from onnx_prep.core.cuda.arena_layout import ARENA_ALIGN, ArenaLayout, Region
from onnx_prep.core.cuda.device_launchers import (DEVICE_LAUNCHERS, Alias, DeviceLauncher, DeviceTensor, LaunchCall,
                                                  phantom)
from onnx_prep.core.cuda.device_slot_pool import DeviceView
from onnx_prep.core.cuda.device_step import DeviceStep
from onnx_prep.core.cuda.driver import DeviceDriver
from onnx_prep.core.errors import DeviceError, OnnxPrepError, TaskFailedError, Where

__all__ = ["DeviceGraphRunner", "DeviceObject", "HOST_OPS"]

HOST_OPS = frozenset({"Shape", "Size", "Constant", "Concat", "Unsqueeze", "Squeeze", "Gather", "Cast", "Reshape",
                      "Slice", "ReduceSum", "Add", "Sub", "Mul", "Div", "Range", "Identity"})
_ALWAYS_HOST = frozenset({"Shape", "Size", "Constant"})
# ops whose output has their first input's element type
_SAME_TYPE = frozenset({"Concat", "Unsqueeze", "Squeeze", "Gather", "Reshape", "Slice", "ReduceSum", "Add", "Sub",
                        "Mul", "Div", "Identity", "Transpose", "Split", "Flatten", "Sigmoid", "Cos", "Sin",
                        "QuickGelu"})
_NONE_SLOT, _DISCARD_SLOT = 0, 1  # action_program.py's
_SHOWN = 3  # problems a refusal names in full (every one is in DeviceError.refused)


@dataclass(frozen=True)
class DeviceObject:
    """A prepared object on the device: its view in a DeviceSlotPool and its packed
    header (what the launch reads its shape from; nothing is read back)."""

    view: DeviceView
    header: Any


def _numpy_dtype(elem_type: int) -> np.dtype | None:
    from onnx_prep.core.model.dtypes import DTYPES

    t = DTYPES.get(int(elem_type))
    try:
        return None if t is None else np.dtype(t.numpy)
    except Exception:  # noqa: BLE001 - a type numpy lacks (bfloat16, int4): unknown here
        return None


def _integer(dt: np.dtype | None) -> bool:
    return dt is not None and dt.kind in "iub"


class DeviceGraphRunner:
    """``resolved`` run on the device of ``driver`` (see the module docstring).

    ``prepared``: every prepared object the model's device nodes read, as
    :class:`DeviceObject` (paged in by the caller: a DeviceSlotPool's views);
    ``weights``: the raw external weights a device node reads as data (host arrays,
    uploaded once, or :class:`DeviceTensor` s already on the device, read where they are); ``stream``: the stream steps are issued on (one is made, and
    destroyed by ``close``, if None); ``launchers``: the registry (DEVICE_LAUNCHERS)."""

    def __init__(self, resolved: Any, driver: DeviceDriver, *, prepared: Mapping[Any, DeviceObject] | None = None,
                 weights: Mapping[str, np.ndarray] | None = None, stream: Any = None, ordinal: int = 0,
                 launchers: Mapping[tuple[str, str], DeviceLauncher] | None = None) -> None:
        from onnx_prep.core.runtime.action_program import ActionProgram

        self.resolved = resolved
        self.driver = driver
        self.ordinal = ordinal
        self.prepared = dict(prepared or {})
        self._weights = dict(weights or {})
        self._launchers = DEVICE_LAUNCHERS if launchers is None else launchers
        self.program = ActionProgram.compile(resolved, append_in_place=False)  # no KV appends here
        self.nodes = resolved.nodes
        self._dtypes = self._static_dtypes()
        self._host = self._classify()
        self.host_nodes = tuple(n.name for n, h in zip(self.nodes, self._host) if h)
        self._check()  # raises before anything touches the device

        from onnx_prep.core.cuda.device_int4_matmul import DeviceInt4Matmul
        from onnx_prep.core.cuda.device_tensor_ops import DeviceTensorOps

        driver.use_device(ordinal)
        self.tensor_ops = DeviceTensorOps(driver, ordinal)
        self.int4 = DeviceInt4Matmul(driver, ordinal)
        self._decoder_ops = None
        self._own_stream = stream is None
        self.stream = driver.stream_create() if stream is None else stream
        self._constants: dict[int, DeviceTensor] = {}
        self._uploaded: list[int] = []  # the constants' device memory this runner allocated (not a session's slots)
        self._arena, self._arena_size = 0, 0
        self._pinned: dict[str, Any] = {"in": None, "out": None}
        self.status = 0  # the status word's device address (0: no launcher reports one)
        self._status_pinned = None  # [0:4] a zero the step copies in, [32:36] the word copied back
        self._closed = False
        self.last_mode: str | None = None  # how the last run's step ran: eager, captured, replayed
        try:
            if any(getattr(self._launchers[(n.op_type, n.kernel)], "uses_status", False)
                   for n, h in zip(self.nodes, self._host) if not h):
                self.status = driver.mem_alloc(ARENA_ALIGN)
                self._status_pinned = driver.host_alloc(64)
                self._status_pinned[:] = 0
            self._upload_constants()
        except BaseException:
            self.close()
            raise

    @property
    def decoder_ops(self) -> Any:
        """DeviceDecoderOps, its module compiled on first use (a model without the fused
        decoder ops never compiles it)."""
        if self._decoder_ops is None:
            from onnx_prep.core.cuda.device_decoder_ops import DeviceDecoderOps

            self._decoder_ops = DeviceDecoderOps(self.driver, self.ordinal)
        return self._decoder_ops

    # ------------------------------------------------------------------ built once
    def _static_dtypes(self) -> dict[int, np.dtype | None]:
        """Each value slot's element type where it is known before a run."""
        from onnx_prep.core.ops.shape import constant_value

        p = self.program
        dt: dict[int, np.dtype | None] = {}
        for v in self.resolved.inputs:
            dt[p.slot_of[v.name]] = _numpy_dtype(v.elem_type)
        for name, array in self.resolved.inline_values.items():
            if name in p.slot_of:
                dt[p.slot_of[name]] = array.dtype
        for name in p.weight_names:
            dt[p.slot_of[name]] = _numpy_dtype(self.resolved.weights[name].onnx_type)
        for a, node in zip(p.actions, self.nodes):
            first = dt.get(a.inputs[0]) if a.inputs else None
            op = node.op_type
            if op in ("Shape", "Size"):
                out = np.dtype(np.int64)
            elif op == "Constant":
                try:
                    out = constant_value(a.attrs).dtype
                except ValueError:
                    out = None
            elif op == "Cast":
                out = _numpy_dtype(node.attributes["to"])
            elif op == "MatMulNBits":
                out = np.dtype(np.float32)
            else:
                out = first if op in _SAME_TYPE else None
            for s in a.outputs:
                if s > _DISCARD_SLOT:
                    dt[s] = out
        return dt

    def _classify(self) -> tuple[bool, ...]:
        p = self.program
        host_slots = {p.slot_of[v.name] for v in self.resolved.inputs}
        host_slots |= {p.slot_of[n] for n in self.resolved.inline_values if n in p.slot_of}
        host = []
        for a, node in zip(p.actions, self.nodes):
            ins = [s for s in a.inputs if s > _DISCARD_SLOT]
            on_host = node.op_type in _ALWAYS_HOST or (
                node.op_type in HOST_OPS and not a.prepared and all(s in host_slots for s in ins)
                and all(_integer(self._dtypes.get(s)) for s in a.outputs if s > _DISCARD_SLOT))
            if on_host:
                host_slots.update(s for s in a.outputs if s > _DISCARD_SLOT)
            host.append(on_host)
        return tuple(host)

    def _check(self) -> None:
        p = self.program
        weight_slots = {p.slot_of[n]: n for n in p.weight_names}
        read = {name for n in self.nodes for name in n.inputs if name} | set(p.output_names)
        problems: list[tuple[str, str]] = []
        for a, node, on_host in zip(p.actions, self.nodes, self._host):
            if on_host:
                continue
            what = f"{node.op_type} node {node.name}"
            launcher = self._launchers.get((node.op_type, node.kernel))
            if launcher is None:
                problems.append((node.name, f"{what}: no device launcher for {node.op_type} (kernel "
                                            f"{node.kernel})"))
                continue
            why = launcher.check(node, [self._dtypes.get(s) if s > _DISCARD_SLOT else None for s in a.inputs])
            if why:
                problems.append((node.name, f"{what}: {why}"))
            for pos in sorted(getattr(launcher, "unwritten", ())):
                if pos < len(node.outputs) and node.outputs[pos] in read:
                    problems.append((node.name, f"{what}: its device kernel does not write output {pos} "
                                                f"({node.outputs[pos]}), which the graph reads"))
            for _, key in a.prepared:
                if key not in self.prepared:
                    problems.append((node.name, f"{what}: its prepared object {key} is not on the device "
                                                "(give it in prepared=)"))
            for pos, s in enumerate(a.inputs):
                if s in weight_slots and pos not in launcher.host_inputs and weight_slots[s] not in self._weights:
                    problems.append((node.name, f"{what}: its raw weight {weight_slots[s]} was not given "
                                                "(weights=)"))
        if problems:
            # NOTE: one line: the first few in full, the rest counted by op (a model with no
            # launcher for one op would otherwise list every layer's node)
            shown = problems[:_SHOWN]
            listed = "; ".join(text for _, text in shown)
            if len(problems) > _SHOWN:
                ops = Counter(text.split(" node ", 1)[0] for _, text in problems[_SHOWN:])
                listed += f"; and {len(problems) - _SHOWN} more ({', '.join(f'{n} {op}' for op, n in ops.items())})"
            error = DeviceError(f"{len(problems)} node(s) cannot run on the device: {listed}",
                                Where(model=str(self.resolved.model_path), node=problems[0][0]),
                                hint="run it on the CPU, or register a device launcher for the op "
                                     "(core/cuda/device_launchers.py; there are launchers for "
                                     f"{', '.join(sorted({op for op, _ in self._launchers}))})")
            error.refused = tuple(problems)  # (node name, what is missing), in node order
            raise error

    def _upload_constants(self) -> None:
        """Inline initializers and raw weights device nodes read as data: uploaded once."""
        p = self.program
        for a, node, on_host in zip(p.actions, self.nodes, self._host):
            if on_host:
                continue
            launcher = self._launchers[(node.op_type, node.kernel)]
            for pos, s in enumerate(a.inputs):
                if s <= _DISCARD_SLOT or pos in launcher.host_inputs or s in self._constants:
                    continue
                name = node.inputs[pos]
                array = self.resolved.inline_values.get(name)
                if array is None:
                    array = self._weights.get(name)
                if array is None:
                    continue  # a value of the run
                if isinstance(array, DeviceTensor):  # already on the device (a device session's slot)
                    self._constants[s] = array
                    continue
                array = np.ascontiguousarray(array)
                address = self.driver.mem_alloc(max(array.nbytes, ARENA_ALIGN))
                self._uploaded.append(address)
                self._constants[s] = DeviceTensor(address, tuple(array.shape), array.dtype)
                if array.nbytes:
                    self.driver.copy_to_device(address, array.reshape(-1).view(np.uint8))

    # ------------------------------------------------------------------ one run
    def prepare(self, feeds: Mapping[str, np.ndarray], *, resident: Mapping[str, DeviceTensor] | None = None,
                keep: frozenset[str] | set[str] = frozenset()) -> DeviceStep:
        """The step for ``feeds`` (see the module docstring): host values computed, the
        arena laid out and held, every launch made and checked; nothing issued.

        ``resident``: inputs already in device memory the caller owns (a KV cache kept
        on the device: device_kv_cache.py), read where they are instead of copied in
        (their entries in ``feeds`` are ignored); ``keep``: outputs left on the device
        (not copied back, absent from the step's outputs): a present that is its past's
        buffer."""
        if self._closed:
            raise DeviceError("the device graph runner is closed")
        p = self.program
        values = p.new_values(feeds, self._weights)
        layout = ArenaLayout()
        regions: dict[int, Region] = {}  # slot -> its region (views share one)
        shapes: dict[int, tuple[tuple, np.dtype]] = {}  # device slot -> (shape, dtype)
        pending: list[tuple] = []  # ("htod", region, slot, array) | ("call", index, in refs, out refs, placed)
        consts = dict(self._constants)  # uploaded once, and views of them
        for name, tensor in (resident or {}).items():
            consts[p.slot_of[name]] = tensor
            values[p.slot_of[name]] = None  # the host never sees it (Shape reads the tensor's shape)
        staged_bytes = 0

        def place(slot: int, shape: tuple, dtype: np.dtype, region: Region | None = None) -> None:
            if region is None:
                nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                region = Region(layout.alloc(nbytes), nbytes)
            region.refs += 1
            regions[slot], shapes[slot] = region, (tuple(shape), dtype)

        def drop(slot: int) -> None:
            region = regions.pop(slot, None)
            shapes.pop(slot, None)
            if region is not None:
                region.refs -= 1
                if region.refs == 0:
                    layout.release(region.offset, region.nbytes)

        for i, (a, node, on_host) in enumerate(zip(p.actions, self.nodes, self._host)):
            try:
                if on_host:
                    ins = [phantom(*shapes[s]) if s in shapes else
                           phantom(consts[s].shape, consts[s].dtype) if s in consts and values[s] is None else
                           values[s] for s in a.inputs]
                    for s, v in zip(a.outputs, a.fn(ins, a.attrs, {})):
                        values[s] = v
                else:
                    staged_bytes += self._plan_device(i, a, node, values, shapes, regions, consts, place, pending,
                                                       layout)
            except OnnxPrepError as e:
                if e.where.node is None:
                    e.where = replace(e.where, node=node.name)
                raise
            except Exception as e:  # noqa: BLE001 - name the node, as the CPU runtime does
                raise TaskFailedError(f"{node.op_type} failed while planning its device step: "
                                      f"{type(e).__name__}: {e}",
                                      Where(model=str(self.resolved.model_path), node=node.name)) from e
            if _DISCARD_SLOT in regions:
                drop(_DISCARD_SLOT)
            for s in a.frees:
                drop(s)
                values[s] = None
        outputs = [(n, p.slot_of[n]) for n in p.output_names if n not in keep]
        fetched_bytes = sum(-(-regions[s].nbytes // 64) * 64 for _, s in outputs if s in regions)
        return self._issue(layout, pending, values, regions, shapes, outputs, staged_bytes, fetched_bytes)

    def _plan_device(self, i, a, node, values, shapes, regions, consts, place, pending, layout) -> int:
        """Lay out one device node: its host data inputs staged, its outputs placed."""
        launcher = self._launchers[(node.op_type, node.kernel)]
        staged = 0
        refs: list = []
        for pos, s in enumerate(a.inputs):
            if s <= _DISCARD_SLOT:
                refs.append(None)
            elif pos in launcher.host_inputs:
                if s in shapes:
                    raise DeviceError(f"{node.op_type} reads input {pos} ({node.inputs[pos]}) on the host, but it "
                                      "is a device value")
                refs.append(values[s])
            elif s in shapes:
                refs.append(("slot", s))
            elif s in consts:
                refs.append(consts[s])
            else:  # a host value read as data: copied in within the step
                array = np.ascontiguousarray(values[s])
                place(s, array.shape, array.dtype)
                pending.append(("htod", regions[s], s, array))
                staged += -(-array.nbytes // 64) * 64
                refs.append(("slot", s))
        probe = [DeviceTensor(0, *shapes[r[1]]) if isinstance(r, tuple) else r for r in refs]
        call = LaunchCall(node, a, probe, self)
        specs = launcher.outputs(call)
        extra = []  # the launcher's own host data: copied in within the step, placed until the node ran
        for array in (launcher.staged(call) if hasattr(launcher, "staged") else ()):
            array = np.ascontiguousarray(array)
            region = Region(layout.alloc(array.nbytes), array.nbytes)
            pending.append(("htod", region, None, array))
            staged += -(-array.nbytes // 64) * 64
            extra.append((region, array.shape, array.dtype))
        if len(specs) != len(a.outputs):
            raise DeviceError(f"the {node.op_type} launcher gave {len(specs)} outputs for {len(a.outputs)}")
        outs = []
        for s, spec in zip(a.outputs, specs):
            if isinstance(spec, Alias):
                src = refs[spec.input]
                if not (isinstance(src, tuple) and src[0] == "slot"):  # an uploaded constant: its own address
                    consts[s] = DeviceTensor(src.address, tuple(spec.shape), src.dtype)
                    outs.append(("const", consts[s]))
                    continue
                dtype = shapes[src[1]][1]
                size = int(np.prod(spec.shape, dtype=np.int64))
                if size * dtype.itemsize != regions[src[1]].nbytes:
                    raise DeviceError(f"{node.op_type} view of {list(shapes[src[1]][0])} as {list(spec.shape)}: "
                                      "the sizes differ")
                place(s, spec.shape, dtype, regions[src[1]])
            else:
                place(s, spec.shape, np.dtype(spec.dtype))
            outs.append(("slot", s))
        pending.append(("call", i, refs, outs, {s: (regions[s], shapes[s]) for s in
                                                 {r[1] for r in refs + outs if isinstance(r, tuple)
                                                  and r[0] == "slot"}}, extra))
        for region, _, _ in extra:  # after the outputs were placed: never one of their places
            layout.release(region.offset, region.nbytes)
        return staged

    def _issue(self, layout, pending, values, regions, shapes, outputs, staged_bytes, fetched_bytes) -> DeviceStep:
        base = self._ensure_arena(layout.end)
        pin_in = self._ensure_pinned("in", staged_bytes)
        pin_out = self._ensure_pinned("out", fetched_bytes)
        ops: list[tuple] = []
        key: list[tuple] = []
        staged: list[tuple[np.ndarray, Any]] = []
        at = 0
        if self.status:  # zeroed first, from the page-locked zero (a replay zeroes it too)
            ops.append(("htod", self.status, self._status_pinned[0:4]))
            key.append(("htod", self.status, self._status_pinned.ctypes.data, 4))
        for item in pending:
            if item[0] == "htod":
                _, region, _, array = item
                if array.nbytes:
                    view = pin_in[at:at + array.nbytes]
                    at += -(-array.nbytes // 64) * 64
                    staged.append((array, view))
                    ops.append(("htod", base + region.offset, view))
                    key.append(("htod", base + region.offset, view.ctypes.data, array.nbytes))
                continue
            _, i, refs, outs, placed, extra = item
            a, node = self.program.actions[i], self.nodes[i]

            def tensor(ref):
                if isinstance(ref, tuple):
                    if ref[0] == "const":
                        return ref[1]
                    region, (shape, dtype) = placed[ref[1]]
                    return DeviceTensor(base + region.offset, shape, dtype)
                return ref

            call = LaunchCall(node, a, [tensor(r) for r in refs], self, [tensor(r) for r in outs],
                              [DeviceTensor(base + r.offset, tuple(shape), dtype) for r, shape, dtype in extra])
            try:
                launches = self._launchers[(node.op_type, node.kernel)].launches(call)
            except OnnxPrepError as e:
                if e.where.node is None:
                    e.where = replace(e.where, node=node.name)
                raise
            for function, plan in launches:
                ops.append(("launch", function, plan))
                key.append((plan.name, plan.grid, plan.block, plan.shared_bytes, plan.args))
        fetched, host_outputs, at = [], {}, 0
        for name, s in outputs:
            if s in regions:
                region, (shape, dtype) = regions[s], shapes[s]
                view = None
                if region.nbytes:
                    view = pin_out[at:at + region.nbytes]
                    at += -(-region.nbytes // 64) * 64
                    ops.append(("dtoh", view, base + region.offset))
                    key.append(("dtoh", view.ctypes.data, base + region.offset, region.nbytes))
                fetched.append((name, view, shape, dtype))
            else:
                host_outputs[name] = np.array(values[s], copy=True)
        status = None
        if self.status:  # copied back last: read after the synchronisation
            status = self._status_pinned[32:36]
            ops.append(("dtoh", status, self.status))
            key.append(("dtoh", status.ctypes.data, self.status, 4))
        return DeviceStep(self.driver, ops, tuple(key), staged, fetched, host_outputs, tuple(n for n, _ in outputs),
                          status=status)

    def _ensure_arena(self, nbytes: int) -> int:
        """The arena's address, at least ``nbytes``: kept while it is large enough, so a
        run of the same shapes finds its buffers where the last one left them."""
        if nbytes > self._arena_size or not self._arena:
            if self._arena:
                self.driver.mem_free(self._arena)
                self._arena, self._arena_size = 0, 0
            size = max(nbytes, ARENA_ALIGN)
            self._arena, self._arena_size = self.driver.mem_alloc(size), size
        return self._arena

    def _ensure_pinned(self, which: str, nbytes: int) -> Any:
        held = self._pinned[which]
        if held is None or held.nbytes < nbytes:
            if held is not None:
                self.driver.host_free(held)
                self._pinned[which] = None
            self._pinned[which] = self.driver.host_alloc(max(nbytes, 64))
        return self._pinned[which]

    def run(self, feeds: Mapping[str, np.ndarray], graph: Any = None) -> dict[str, np.ndarray]:
        """The graph outputs for ``feeds``: the step issued on the runner's stream (through
        ``graph``, a StepGraph on that stream, if given: captured once, replayed while
        the key holds), the stream synchronised, the outputs read back."""
        step = self.prepare(feeds)
        step.stage()
        if graph is None:
            step(self.stream)
            self.last_mode = "eager"
        else:
            if graph.stream is not self.stream:
                raise DeviceError("the StepGraph must be on the runner's stream (DeviceGraphRunner.stream)")
            self.last_mode = graph.run(step, step.key)
        self.driver.stream_synchronize(self.stream)
        return step.outputs()

    def close(self) -> None:
        """Free the arena, the page-locked buffers, the uploaded constants and the
        runner's own stream (idempotent)."""
        if self._closed:
            return
        self._closed = True
        d = self.driver
        if self._own_stream:
            d.stream_destroy(self.stream)  # its queued work completes first
        else:
            d.stream_synchronize(self.stream)
        if self._arena:
            d.mem_free(self._arena)
            self._arena = 0
        for which, held in self._pinned.items():
            if held is not None:
                d.host_free(held)
            self._pinned[which] = None
        for address in self._uploaded:
            d.mem_free(address)
        self._uploaded.clear()
        self._constants.clear()
        if self.status:
            d.mem_free(self.status)
            self.status = 0
        if self._status_pinned is not None:
            d.host_free(self._status_pinned)
            self._status_pinned = None

    def __enter__(self) -> DeviceGraphRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
