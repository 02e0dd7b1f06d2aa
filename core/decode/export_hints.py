"""What an export says about its decoder beyond its graph inputs and outputs: the KV
head count and head size when the past KV dims are symbolic, the longest sequence it
was built for, and which past inputs are fixed-size sliding-window caches.

The onnxruntime-genai model builder writes past KV as ``(batch_size, kv_heads,
past_sequence_length, kv_cache_dim)``: the head size is a symbol, so the empty past of
the first step cannot be shaped from the value infos alone. Two sources say it, read in
this order (``ExportHints.for_model``):

1. ``genai_config.json`` beside the model, when its ``model.decoder.filename`` is this
   model (or absent): ``num_key_value_heads``, ``head_size``, ``context_length``, and
   ``sliding_window`` (``window_size``, ``layers``, ``cache_slack``), with the past
   input names of ``inputs.past_key_names`` / ``past_value_names``.
2. The graph's first ``GroupQueryAttention`` node (com.microsoft): ``kv_num_heads``,
   and the head size from the width of the projection feeding it (the packed QKV
   ``MatMulNBits``'s ``N`` or QDQ ``MatMul``'s weight width = (num_heads + 2
   kv_num_heads) x head size, or the key projection's = kv_num_heads x head size), a
   bias ``Add`` in between allowed; and every GroupQueryAttention node with
   ``sliding_window_cache`` 1, whose past inputs are caches of ``local_window_size``.

A sliding-window cache (the builder's default for Gemma 2's local layers) is a past
input of a fixed capacity C: past and present are one buffer of C positions, which the
attention keeps filled with the most recent ones (docs/ops.md). ONNX Runtime refuses a
C below the window, so the first step's past for it is C zeros, not an empty one:
``kv_capacity`` names those inputs and C (window size plus the config's slack).

Neither reads a payload byte: the config is JSON, the graph is the protobuf without
its external data, parsed only when the config is absent. ``DecoderIO.discover``
takes the hints or a function that makes them, called only when the value infos leave
a KV dim symbolic: a run that parses the model once keeps doing so.

``check_request`` refuses, before anything is loaded, a request the model's static
dims cannot take: a batch other than a fixed batch dim, a step length other than a
fixed sequence dim (of the token ids, position ids, attention mask or past KV), or a
prompt plus new tokens beyond the export's context length.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onnx_prep.core.errors import UsageError, Where

GENAI_CONFIG = "genai_config.json"
GENAI_CONFIG_MAX_BYTES = 1 << 20  # the builder writes ~2 KB


@dataclass(frozen=True, slots=True)
class ExportHints:
    """KV geometry and length limit an export states outside its value infos; each
    field None where nothing says it. ``source`` names where they came from."""

    kv_heads: int | None = None
    head_dim: int | None = None
    context_length: int | None = None
    source: str | None = None
    kv_capacity: tuple[tuple[str, int], ...] = ()  # (past input, fixed capacity): sliding-window caches

    @classmethod
    def for_model(cls, model_path: str | Path | None, graph: Any = None) -> "ExportHints":
        """The hints for the ONNX file at ``model_path`` (see the module docstring).
        ``graph``: its already parsed ``GraphProto``, if the caller has one (with no
        path, only the graph is asked)."""
        if model_path is not None:
            hints = _from_genai_config(Path(model_path))
            if hints is not None:
                return hints
        if graph is None:
            if model_path is None:
                return cls()
            path = Path(model_path)
            from onnx_prep.core.model.model_file import find_model_file, parse_model_file

            try:
                graph = parse_model_file(find_model_file(path)).graph
            except Exception:  # noqa: BLE001 - hints are optional; discovery reports the real problem
                return cls()
        return _from_graph(graph)

    @classmethod
    def from_config(cls, model_path: str | Path) -> "ExportHints | None":
        """Only the ``genai_config.json`` beside the model (the model file is not read),
        or None where there is none for it."""
        return _from_genai_config(Path(model_path))

    def to_json(self) -> dict:
        return {"kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "context_length": self.context_length, "source": self.source,
                "kv_capacity": dict(self.kv_capacity)}


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _from_genai_config(model_path: Path) -> ExportHints | None:
    cfg_path = model_path.parent / GENAI_CONFIG
    try:
        if not cfg_path.is_file() or cfg_path.stat().st_size > GENAI_CONFIG_MAX_BYTES:
            return None
        doc = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # not ours to validate: the graph is asked instead
    model = doc.get("model") if isinstance(doc, dict) else None
    decoder = model.get("decoder") if isinstance(model, dict) else None
    if not isinstance(decoder, dict):
        return None
    filename = decoder.get("filename")
    if filename is not None and filename != model_path.name:
        return None  # the config speaks of another file in this folder
    return ExportHints(kv_heads=_positive_int(decoder.get("num_key_value_heads")),
                       head_dim=_positive_int(decoder.get("head_size")),
                       context_length=_positive_int(model.get("context_length")),
                       source=str(cfg_path), kv_capacity=_config_capacities(decoder))


def _config_capacities(decoder: dict) -> tuple[tuple[str, int], ...]:
    """The sliding-window layers' past inputs and their capacity, from the config's
    ``sliding_window`` (nothing where it is absent or malformed)."""
    window = decoder.get("sliding_window")
    if not isinstance(window, dict):
        return ()
    size = _positive_int(window.get("window_size"))
    layers = window.get("layers")
    slack = window.get("cache_slack", 0)
    if size is None or not isinstance(layers, list) or not isinstance(slack, int) or slack < 0:
        return ()
    inputs = decoder.get("inputs") if isinstance(decoder.get("inputs"), dict) else {}
    names = [inputs.get("past_key_names", "past_key_values.%d.key"),
             inputs.get("past_value_names", "past_key_values.%d.value")]
    out = []
    for layer in layers:
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
            return ()
        for pattern in names:
            if not isinstance(pattern, str) or pattern.count("%d") != 1:
                return ()
            out.append((pattern.replace("%d", str(layer)), size + slack))
    return tuple(out)


def _from_graph(graph: Any) -> ExportHints:
    from onnx import helper

    producers = {out: node for node in graph.node for out in node.output}
    gqa = [(node, {a.name: helper.get_attribute_value(a) for a in node.attribute})
           for node in graph.node if node.op_type == "GroupQueryAttention"]
    if not gqa:
        return ExportHints()
    capacity = tuple((node.input[i], attrs["local_window_size"]) for node, attrs in gqa
                     if attrs.get("sliding_window_cache") == 1 and _positive_int(attrs.get("local_window_size"))
                     for i in (3, 4) if len(node.input) > i and node.input[i])
    node, attrs = gqa[0]
    heads, kv_heads = _positive_int(attrs.get("num_heads")), _positive_int(attrs.get("kv_num_heads"))
    if heads is None or kv_heads is None:
        return ExportHints(kv_capacity=capacity)
    packed = len(node.input) < 2 or not node.input[1]
    dims = {t.name: list(t.dims) for t in graph.initializer}
    width = _projection_width(producers, dims, node.input[0] if packed else node.input[1])
    per_head = heads + 2 * kv_heads if packed else kv_heads
    head_dim = width // per_head if width is not None and width % per_head == 0 else None
    return ExportHints(kv_heads=kv_heads, head_dim=head_dim,
                       source=f"graph (GroupQueryAttention {node.name!r})", kv_capacity=capacity)


def _projection_width(producers: dict, dims: dict, tensor: str) -> int | None:
    """The output width ``N`` of the projection that makes ``tensor``, through bias Adds:
    a MatMulNBits' ``N``, or the last dim of a MatMul's weight ``[K, N]`` (an initializer,
    or the DequantizeLinear of one: the QDQ form)."""
    from onnx import helper

    node = producers.get(tensor)
    for _ in range(4):  # MatMulNBits [-> Add bias] is what exporters emit
        if node is None:
            return None
        if node.op_type == "MatMulNBits":
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            return _positive_int(attrs.get("N"))
        if node.op_type == "MatMul" and len(node.input) == 2:
            weight = node.input[1]
            dq = producers.get(weight)
            if dq is not None and dq.op_type == "DequantizeLinear":
                weight = dq.input[0]
            shape = dims.get(weight)
            return _positive_int(shape[-1]) if shape and len(shape) == 2 else None
        if node.op_type != "Add":
            return None
        node = next((producers[i] for i in node.input if i in producers), None)
    return None


def check_request(io: Any, hints: ExportHints, *, batch: int, prompt_len: int, tokens: int,
                  model: str | None = None) -> None:
    """Refuse (``UsageError``, one line naming the input, the dim and its declared size) a
    decode request that a fixed dim of the model's inputs or its context length cannot
    take, before anything is loaded. ``io`` is a ``DecoderIO``.

    The decode loop's feeds (generation.py), step by step: token ids and position ids
    ``[batch, new]`` (new = the prompt, then 1; the whole sequence each step without KV
    inputs), the attention mask ``[batch, past + new]``, each past KV ``[batch, ...]``
    with ``past`` positions on its sequence axis; so a fixed dim 0 of any of them fixes
    the batch, and a fixed sequence dim refuses every step length other than its own."""
    # Each feed's lengths along its sequence dim, step by step, as (first, next): every
    # later step repeats ``next`` or grows past it, so a fixed dim is checked in O(1).
    more = tokens > 1
    if io.kv:
        steps, totals = (prompt_len, 1 if more else None), (prompt_len, prompt_len + 1 if more else None)
    else:  # every step re-feeds the whole sequence
        steps = totals = (prompt_len, prompt_len + 1 if more else None)
    past = (0, prompt_len if more else None)
    slots = [("token ids", io.input_ids, steps), ("position ids", io.position_ids, steps),
             ("attention mask", io.attention_mask, totals)]
    for p in io.kv:
        slots += [(f"past key of layer {p.layer}", p.past_key, past),
                  (f"past value of layer {p.layer}", p.past_value, past)]
    for role, slot, lengths in slots:
        if slot is None or slot.shape is None or len(slot.shape) < 2:
            continue
        where = Where(model=model, tensor=slot.name)
        declared = slot.shape[0]
        if isinstance(declared, int) and declared != batch:
            raise UsageError(f"the model fixes the batch at {declared} (dim 0 of its {role} {slot.name!r}); "
                             f"batch {batch} asked", where, hint=f"decode with --batch {declared}")
        axis = io.seq_axis if role.startswith("past") else 1
        declared = slot.shape[axis] if len(slot.shape) > axis else None
        bad = next((n for n in lengths if n is not None and n != declared), None) \
            if isinstance(declared, int) else None
        if bad is not None:
            if role in ("token ids", "position ids"):
                what = f"a step of {bad} token(s)"
            else:
                what = f"a step with {bad} {'past ' if role.startswith('past') else ''}position(s)"
            raise UsageError(f"the model fixes the sequence length at {declared} (dim {axis} of its {role} "
                             f"{slot.name!r}); {what} asked (a prompt of {prompt_len}, {tokens} new tokens)",
                             where)
    positions = prompt_len + max(tokens - 1, 0)  # the last new token is never fed back
    if hints.context_length is not None and positions > hints.context_length:
        raise UsageError(f"a prompt of {prompt_len} and {tokens} new tokens need {positions} positions, more "
                         f"than the model's context length {hints.context_length} ({hints.source})",
                         Where(model=model))
