"""ActionProgram: the compact, immutable action list that executes a resolved model.

One action per node of ``ResolvedModel.nodes``, same order: **action i is node i**, so
the plan's invocation steps (``action_range=(begin, end)``) index it directly. Each
action holds the bound op implementation, its normalised attributes, integer value
slots for its inputs and outputs, its prepared bindings (input position -> key), and
the slots whose last reader it is (freed right after it runs).

A run's state is one Python list of values (``Values``) indexed by slot; nothing is
looked up by name on the hot path. Slot 0 is always None (absent optional inputs and
inputs a prepared object replaces); slot 1 swallows unused outputs. Inline
initializers are bound once, in the template every run's list starts from.

The program holds no mutable state: the caller's feeds (including the KV cache) and
the prepared objects come in per run, and ranges of one run share one ``Values`` list
the caller keeps, so the session can replay its invocation steps one range at a time::

    program = ActionProgram.compile(resolved)
    values = program.new_values(feeds, prepared)     # feeds + raw weights bound
    for begin, end in ranges:                        # the plan's invocation steps
        program.execute(values, prepared, begin, end)
    outputs = program.fetch(values)

``run(feeds, prepared)`` is those three calls. ``prepared`` is a mapping
``PreparedKey -> array`` or a ``PreparedBinding`` made once by ``bind_prepared`` (the
hot path: no per-action dict is built while replaying).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from onnx_prep.core.errors import ModelIOError, OnnxPrepError, TaskFailedError, Where
from onnx_prep.core.model.fusion import FUSED_DOMAIN
from onnx_prep.core.ops.attributes import APPEND_IN_PLACE
from onnx_prep.core.ops.registry import MS_DOMAIN
from onnx_prep.core.kernels.binding import bind_node
from onnx_prep.core.kernels.registry import prepared_position
from onnx_prep.core.model.prepared_key import PreparedKey
from onnx_prep.core.model.resolved_model import ResolvedModel, require_frozen

NONE_SLOT = 0
DISCARD_SLOT = 1
_FIRST_SLOT = 2
_EMPTY: Mapping[int, np.ndarray] = MappingProxyType({})

Values = list  # one run's value slots; index = slot


@dataclass(frozen=True, slots=True)
class Action:
    """One node, compiled. ``prepared`` pairs (input position, key) the op receives as
    its ``prepared`` mapping; ``frees`` are slots this action reads last."""

    node_index: int
    name: str
    op_type: str
    fn: Any
    attrs: Mapping[str, Any]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    prepared: tuple[tuple[int, PreparedKey], ...]
    frees: tuple[int, ...]


class PreparedBinding:
    """Per-action ``prepared`` mappings, built once from a key -> array mapping.

    Valid while the arrays stay what they are (the session's readiness epoch:
    resident objects live at stable addresses, so a binding is rebuilt only when
    residency changes)."""

    __slots__ = ("per_action", "keys")

    def __init__(self, program: ActionProgram, prepared: Mapping[PreparedKey, np.ndarray]) -> None:
        per = []
        for a in program.actions:
            if a.prepared:
                per.append(MappingProxyType({pos: _get_prepared(prepared, key, a) for pos, key in a.prepared}))
            else:
                per.append(_EMPTY)
        self.per_action = tuple(per)
        self.keys = frozenset(program.requirements)


def _get_prepared(prepared: Mapping[PreparedKey, np.ndarray], key: PreparedKey, action: Action) -> np.ndarray:
    try:
        return prepared[key]
    except KeyError:
        raise OnnxPrepError(f"prepared object {key} is not resident", Where(node=action.name),
                            hint="the session must publish every requirement before its consumer runs") from None


class ActionProgram:
    """Compiled, immutable action list of one ResolvedModel (see the module docstring)."""

    def __init__(self, resolved: ResolvedModel, actions: tuple[Action, ...], slot_of: Mapping[str, int],
                 template: tuple, input_names: tuple[str, ...], output_names: tuple[str, ...],
                 weight_names: tuple[str, ...], use_prepared: bool) -> None:
        self.resolved = resolved
        self.actions = actions
        self.slot_of = slot_of
        self._template = template
        self.input_names = input_names
        self.output_names = output_names
        self.weight_names = weight_names
        self.use_prepared = use_prepared
        self._input_slots = frozenset(slot_of[n] for n in input_names)
        self._output_slots = tuple(slot_of[n] for n in output_names)
        self._weight_slots = tuple(slot_of[n] for n in weight_names)
        self.requirements: tuple[PreparedKey, ...] = tuple(dict.fromkeys(
            k for a in actions for _, k in a.prepared))

    # ------------------------------------------------------------------ compile
    @classmethod
    def compile(cls, resolved: ResolvedModel, *, use_prepared: bool = True,
                append_in_place: bool = True, keep_values: bool = False) -> ActionProgram:
        """Compile ``resolved`` (frozen) into an action list.

        ``append_in_place`` marks each ``Concat`` from a graph input to a graph output
        (the KV cache, ``present = Concat(past, new)``), and each GroupQueryAttention
        from past to present KV, so that it appends into room after the past instead
        of copying it (core/ops/append_buffer.py); False keeps plain copies
        (benchmarks compare both).

        ``use_prepared=False`` ignores the prepared requirements: every INT4 / packed
        node reads its raw initializers (supplied as ``weights``) and dequantizes per
        call. That is the slow numpy reference the prepared path is checked against.

        ``keep_values=True`` frees nothing and fetches every named value a node computes
        after the graph outputs (``output_names``, in node order): the intermediate
        values of a run, for comparing them with another runtime's
        (core/decode/node_comparison.py). It changes only what is compiled (no action
        frees, more names fetched): the execute loop is the same, so the default
        program pays nothing for it.
        Raises UnsupportedOpError (naming the node) for a node without a kernel.
        """
        resolved = require_frozen(resolved)
        slot_of: dict[str, int] = {}

        def slot(name: str) -> int:
            s = slot_of.get(name)
            if s is None:
                s = slot_of[name] = _FIRST_SLOT + len(slot_of)
            return s

        input_names = tuple(v.name for v in resolved.inputs)
        output_names = tuple(v.name for v in resolved.outputs)
        for n in input_names:
            slot(n)

        compiled: list[tuple] = []
        raw_weights: dict[str, None] = {}
        outputs_set = frozenset(output_names)
        appends = [i for i, node in enumerate(resolved.nodes)
                   if append_in_place and _appends_kv(node, input_names, outputs_set)]
        append_position = {i: pos for pos, i in enumerate(appends)}
        for i, node in enumerate(resolved.nodes):
            fn, attrs, implicit = bind_node(node, resolved.opsets, resolved.weights)
            if i in append_position:
                # (position, count): each KV buffer gets its own share of room, so that
                # they run out of room on different steps (append_buffer.concat's spread)
                attrs[APPEND_IN_PLACE] = (append_position[i], len(appends))
            replaced: dict[int, PreparedKey] = {}
            if use_prepared:
                for key, names in node.prepared_inputs.items():
                    for pos, name in enumerate(node.inputs):
                        if name and name in names:
                            replaced[pos] = key
            in_slots = []
            for pos, name in enumerate(node.inputs):
                if not name or pos in replaced:
                    in_slots.append(NONE_SLOT)
                    continue
                in_slots.append(slot(name))
                if name in resolved.weights and name not in resolved.inline_values:
                    raw_weights[name] = None
            for name in implicit:  # outer-scope values a subgraph reads: after the inputs
                in_slots.append(slot(name))
                if name in resolved.weights and name not in resolved.inline_values:
                    raw_weights[name] = None
            out_slots = tuple(slot(n) if n else DISCARD_SLOT for n in node.outputs)
            # The prepared object is delivered at the kernel's position (the op reads
            # it there), whichever of the replaced inputs that is.
            bindings: tuple[tuple[int, PreparedKey], ...] = ()
            if replaced:
                pos = prepared_position(node.kernel)
                bindings = tuple(sorted({(pos if pos is not None else p, k) for p, k in replaced.items()}))
            bind = getattr(fn, "bind", None)  # an op that reads its node's attributes once
            compiled.append((node, fn if bind is None else bind(attrs), attrs, tuple(in_slots), out_slots, bindings))

        for n in output_names:
            slot(n)
        if keep_values:  # every computed value, graph outputs first
            output_names += tuple(n for n in dict.fromkeys(
                o for node, *_ in compiled for o in node.outputs if o) if n not in outputs_set)
        n_slots = _FIRST_SLOT + len(slot_of)

        # Last reader of each slot; graph outputs and inputs that are outputs survive.
        last_read: dict[int, int] = {}
        for i, (_, _, _, ins, _, _) in enumerate(compiled):
            for s in ins:
                if s >= _FIRST_SLOT:
                    last_read[s] = i
        keep = set(slot_of[n] for n in output_names) if not keep_values else set(range(n_slots))
        frees: dict[int, list[int]] = {}
        for s, i in last_read.items():
            if s not in keep:
                frees.setdefault(i, []).append(s)
        # An output nobody reads (and not a graph output) is dropped right away.
        for i, (_, _, _, _, outs, _) in enumerate(compiled):
            for s in outs:
                if s >= _FIRST_SLOT and s not in last_read and s not in keep:
                    frees.setdefault(i, []).append(s)

        actions = tuple(
            Action(node_index=node.index, name=node.name, op_type=node.op_type, fn=fn,
                   attrs=MappingProxyType(attrs), inputs=ins, outputs=outs, prepared=bindings,
                   frees=tuple(sorted(frees.get(i, ()))))
            for i, (node, fn, attrs, ins, outs, bindings) in enumerate(compiled))

        template: list = [None] * n_slots
        for name, arr in resolved.inline_values.items():
            if name in slot_of:
                template[slot_of[name]] = arr
        return cls(resolved, actions, MappingProxyType(slot_of), tuple(template), input_names,
                   output_names, tuple(raw_weights), use_prepared)

    # ---------------------------------------------------------------------- run
    def bind_prepared(self, prepared: Mapping[PreparedKey, np.ndarray]) -> PreparedBinding:
        return PreparedBinding(self, prepared)

    def new_values(self, feeds: Mapping[str, np.ndarray], weights: Mapping[str, np.ndarray] | None = None
                   ) -> Values:
        """A fresh value list: inline initializers, ``weights`` (every name in
        ``weight_names``: external initializers read raw) and ``feeds`` (every graph
        input). Raises ModelIOError naming missing or unknown feeds / weights."""
        values = list(self._template)
        missing = [n for n in self.input_names if n not in feeds]
        unknown = [n for n in feeds if n not in self.slot_of or self.slot_of[n] not in self._input_slots]
        if missing or unknown:
            parts = ([f"missing input(s): {', '.join(missing)}"] if missing else []) + \
                    ([f"unknown input(s): {', '.join(unknown)}"] if unknown else [])
            raise ModelIOError("; ".join(parts), Where(model=str(self.resolved.model_path)),
                               hint=f"the model's inputs are: {', '.join(self.input_names)}")
        slot_of = self.slot_of
        for n, v in feeds.items():
            values[slot_of[n]] = v if isinstance(v, np.ndarray) else np.asarray(v)
        if self.weight_names:
            weights = weights or {}
            absent = [n for n in self.weight_names if n not in weights]
            if absent:
                raise OnnxPrepError(f"{len(absent)} raw weight(s) not supplied: {', '.join(absent[:5])}",
                                    Where(model=str(self.resolved.model_path), tensor=absent[0]),
                                    hint="pass them as weights= (program.weight_names lists them)")
            for n, s in zip(self.weight_names, self._weight_slots):
                values[s] = weights[n]
        return values

    def execute(self, values: Values, prepared: Mapping[PreparedKey, np.ndarray] | PreparedBinding | None,
                begin: int = 0, end: int | None = None) -> None:
        """Run actions ``[begin, end)`` against ``values`` (in place).

        The hot loop: per action, one list of input references, one call, output
        stores, and frees. A failing op raises TaskFailedError naming the node, with
        the original exception as ``__cause__``.
        """
        actions = self.actions
        end = len(actions) if end is None else end
        bound = prepared.per_action if isinstance(prepared, PreparedBinding) else None
        i = begin
        try:
            for i in range(begin, end):
                a = actions[i]
                if bound is not None:
                    prep = bound[i]
                elif a.prepared:
                    prep = {pos: _get_prepared(prepared or {}, key, a) for pos, key in a.prepared}
                else:
                    prep = _EMPTY
                outs = a.fn([values[s] for s in a.inputs], a.attrs, prep)
                for s, v in zip(a.outputs, outs):
                    values[s] = v
                for s in a.frees:
                    values[s] = None
        except OnnxPrepError as e:
            if e.where.node is None:
                e.where = Where(model=e.where.model, tensor=e.where.tensor, file=e.where.file,
                                offset=e.where.offset, node=actions[i].name)
            raise
        except Exception as e:  # noqa: BLE001 - any op failure: name the node
            a = actions[i]
            raise TaskFailedError(f"{a.op_type} failed: {type(e).__name__}: {e}",
                                  Where(model=str(self.resolved.model_path), node=a.name)) from e
        finally:
            values[DISCARD_SLOT] = None

    def execute_profiled(self, values: Values, prepared: Mapping[PreparedKey, np.ndarray] | PreparedBinding | None,
                         begin: int = 0, end: int | None = None) -> list[int]:
        """``execute`` one action at a time, returning each action's wall time in ns
        (index ``i - begin``). For profiles; the hot path uses ``execute``."""
        end = len(self.actions) if end is None else end
        times = []
        clock = time.perf_counter_ns
        for i in range(begin, end):
            t0 = clock()
            self.execute(values, prepared, i, i + 1)
            times.append(clock() - t0)
        return times

    def fetch(self, values: Values) -> dict[str, np.ndarray]:
        """The graph outputs present in ``values`` (all of them after a full run)."""
        return {n: values[s] for n, s in zip(self.output_names, self._output_slots) if values[s] is not None}

    def run(self, feeds: Mapping[str, np.ndarray] | None,
            prepared: Mapping[PreparedKey, np.ndarray] | PreparedBinding | None = None, *,
            actions: tuple[int, int] | None = None, values: Values | None = None,
            weights: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Run ``actions=(begin, end)`` (default: all). With ``values`` given, continue
        that run (``feeds`` may be None); otherwise start one from ``feeds``. Returns
        the graph outputs available afterwards."""
        if values is None:
            values = self.new_values(feeds or {}, weights)
        elif feeds:
            for n, v in feeds.items():
                values[self.slot_of[n]] = v
        begin, end = actions if actions is not None else (0, len(self.actions))
        self.execute(values, prepared, begin, end)
        return self.fetch(values)

    def __len__(self) -> int:
        return len(self.actions)


def direct_replay(program: ActionProgram | ResolvedModel, feeds: Mapping[str, np.ndarray],
                  prepared: Mapping[PreparedKey, np.ndarray] | PreparedBinding | None = None,
                  weights: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The benchmark baseline: the same kernels replayed in one loop with no scheduler.

    Given a ResolvedModel it compiles first (counted in the call: pass a compiled
    program to time the replay alone)."""
    if not isinstance(program, ActionProgram):
        program = ActionProgram.compile(program)
    return program.run(feeds, prepared, weights=weights)


def _appends_kv(node, input_names, outputs) -> bool:
    """A node that extends a graph input into a graph output (the KV cache): ``present =
    Concat(past, new)``, or GroupQueryAttention's (or the fused Attention's) past_key /
    past_value (inputs 3, 4) into present_key / present_value (outputs 1, 2)."""
    if node.op_type == "Concat" and node.domain in ("", "ai.onnx"):
        return bool(node.inputs) and node.inputs[0] in input_names and bool(node.outputs) \
            and node.outputs[0] in outputs
    if (node.domain, node.op_type) in ((MS_DOMAIN, "GroupQueryAttention"), (FUSED_DOMAIN, "Attention")):
        ins, outs = list(node.inputs) + [""] * 5, list(node.outputs) + [""] * 3
        return all(ins[i] in input_names for i in (3, 4)) and all(outs[i] in outputs for i in (1, 2))
    return False
