"""Decoder I/O discovery: which graph input carries the token ids, the attention
mask, the position ids and each layer's past KV, and which output carries the logits
and each layer's present KV.

``DecoderIO.discover(inputs, outputs, io_map=None)`` works on ``ValueInfo``s only, so
it serves a resolved model, a bare ONNX file (``value_infos_from_model``) or an ONNX
Runtime session (``value_infos_from_ort``) alike; it never reads payload bytes.

Discovery, in order:

1. An explicit io-map (io_map.py's ``load_io_map``; format in docs/run.md) places the names it
   gives; discovery fills in only what it leaves out.
2. Past/present KV: an input whose name has a ``past`` or ``cache`` word, one layer
   number and a key/value word (``past_key_values.N.key``, ``past_key_N``,
   ``past.N.value``, ``past_key_values_N_value``, ...) pairs with the output of the
   same layer and kind (``present.N.key``, ``present_key_N``, ...).
3. Token ids, attention mask, position ids by their common names; the token ids
   fall back to the one integer input left when no name matches.
4. GroupQueryAttention-style bookkeeping inputs (``seqlens_k``,
   ``total_sequence_length``), ``cache_position`` and the merged-decoder flag
   ``use_cache_branch``: computed per step from the sequence lengths.
5. Any input still unplaced -> ``ModelIOError`` naming it (one line).

KV layout: the past tensor is rank 4, ``bhsd`` (batch, heads, seq, head_dim: the
common exporter layout) or ``bshd``; the sequence dim is the symbolic one among dims
1 and 2 (the other is the static head count). When both are symbolic, the dim whose
symbol names a sequence, or whose symbol differs between past and present, wins.

KV heads and head dims must be known because the first step feeds an empty past of
shape (batch, heads, 0, dim): the io-map's ``kv_heads``/``head_dim`` win, then the
static dims of the past input, then ``ExportHints`` (export_hints.py: the builder's
``genai_config.json`` or the graph's GroupQueryAttention), which the callers that know
the model file pass as ``hints``.
Known gaps: fused 5-D KV (``past_N`` = stack(key, value)), shared-buffer KV whose
past has a static max length, and left-padded batches are not supported.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from onnx_prep.core.decode.export_hints import ExportHints
from onnx_prep.core.decode.io_map import EXTRA_ROLES, KV_LAYOUTS, validate_io_map
from onnx_prep.core.errors import ModelIOError, UsageError, Where
from onnx_prep.core.model.dtypes import DTYPES, dtype_of_type_string
from onnx_prep.core.model.model_file import find_model_file, parse_model_file
from onnx_prep.core.model.resolved_model import ValueInfo, graph_value_infos

# Names an exporter gives each role, most common first (compared case-insensitively).
TOKEN_IDS_NAMES = ("input_ids", "tokens", "token_ids", "input_tokens", "ids", "input")
ATTENTION_MASK_NAMES = ("attention_mask", "attn_mask", "mask")
POSITION_IDS_NAMES = ("position_ids", "positions", "pos_ids", "position")
LOGITS_NAMES = ("logits", "lm_logits", "output_logits", "scores", "output")

_WORD = re.compile(r"[A-Za-z]+|\d+")
_KIND_WORDS = {"key": "key", "keys": "key", "k": "key",
               "value": "value", "values": "value", "v": "value"}
_SEQ_HINT = re.compile(r"seq|len|past|total|cache|pos|step|time", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """One named model input or output with the dtype to feed or expect."""

    name: str
    dtype: np.dtype
    shape: tuple[int | str | None, ...] | None

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": str(self.dtype),
                "shape": None if self.shape is None else list(self.shape)}


@dataclass(frozen=True, slots=True)
class KVPair:
    """One layer's past inputs and present outputs.

    ``present`` must equal ``concat(past, new, axis=seq)`` for the decode loop to
    feed it back as the next step's past, except for a sliding-window cache:
    ``capacity`` C (None: a growing cache) says past and present are one buffer of C
    positions the attention keeps filled with the most recent ones (export_hints.py),
    fed from the first step as C zeros.
    """

    layer: int
    past_key: TensorSlot
    past_value: TensorSlot
    present_key: str
    present_value: str
    kv_heads: int
    key_head_dim: int
    value_head_dim: int
    capacity: int | None = None

    def to_json(self) -> dict:
        return {"layer": self.layer, "past_key": self.past_key.name,
                "past_value": self.past_value.name, "present_key": self.present_key,
                "present_value": self.present_value, "kv_heads": self.kv_heads,
                "key_head_dim": self.key_head_dim, "value_head_dim": self.value_head_dim,
                "dtype": str(self.past_key.dtype), "capacity": self.capacity}


@dataclass(frozen=True)
class DecoderIO:
    """How to feed a decoder-only model one step at a time (see the module docstring)."""

    input_ids: TensorSlot
    logits: str
    attention_mask: TensorSlot | None
    position_ids: TensorSlot | None
    kv: tuple[KVPair, ...]
    kv_layout: str  # "bhsd" | "bshd"
    extras: Mapping[str, TensorSlot] = field(default_factory=lambda: MappingProxyType({}))
    vocab_size: int | None = None  # the logits' last dim when static
    source: str = "discovered"  # "discovered" | "io-map" (some or all roles from the map)

    @property
    def seq_axis(self) -> int:
        """Axis of the sequence dim in past/present KV tensors."""
        return 2 if self.kv_layout == "bhsd" else 1

    @property
    def input_names(self) -> tuple[str, ...]:
        names = [self.input_ids.name]
        names += [s.name for s in (self.attention_mask, self.position_ids) if s is not None]
        for p in self.kv:
            names += [p.past_key.name, p.past_value.name]
        names += [s.name for s in self.extras.values()]
        return tuple(names)

    def empty_past(self, batch: int) -> dict[str, np.ndarray]:
        """Past feeds for the first (prefill) step: sequence length 0, or a
        sliding-window cache's capacity of zeros."""
        feeds = {}
        for p in self.kv:
            seq = p.capacity or 0
            for slot, dim in ((p.past_key, p.key_head_dim), (p.past_value, p.value_head_dim)):
                shape = ((batch, p.kv_heads, seq, dim) if self.kv_layout == "bhsd"
                         else (batch, seq, p.kv_heads, dim))
                feeds[slot.name] = np.zeros(shape, dtype=slot.dtype)
        return feeds

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "input_ids": self.input_ids.name,
            "attention_mask": None if self.attention_mask is None else self.attention_mask.name,
            "position_ids": None if self.position_ids is None else self.position_ids.name,
            "logits": self.logits,
            "kv_layout": self.kv_layout,
            "kv": [p.to_json() for p in self.kv],
            "extras": {role: s.name for role, s in self.extras.items()},
            "vocab_size": self.vocab_size,
        }

    @classmethod
    def discover(cls, inputs: Sequence[ValueInfo], outputs: Sequence[ValueInfo],
                 io_map: Mapping[str, Any] | None = None, *, model: str | None = None,
                 hints: ExportHints | Callable[[], ExportHints] | None = None) -> "DecoderIO":
        """Place every graph input in a role, or raise ``ModelIOError`` naming the
        inputs that fit none. ``io_map`` (already parsed, see ``load_io_map``) wins
        over discovery for every role it names; ``hints`` fill KV dims the value infos
        leave symbolic (a function is called only then). ``model`` is only for error messages."""
        return _Discovery(inputs, outputs, io_map or {}, model, hints).run()

    @classmethod
    def for_resolved(cls, resolved: Any) -> "DecoderIO":
        """Discover a ``ResolvedModel``'s roles; hints (asked only where the value infos
        leave a KV dim symbolic) from its file's exporter (``ExportHints.for_model``)."""
        path = resolved.model_path
        return cls.discover(resolved.inputs, resolved.outputs, model=str(path),
                            hints=lambda: ExportHints.for_model(path))

    @classmethod
    def from_model(cls, model: Any, io_map: Mapping[str, Any] | None = None) -> "DecoderIO":
        """Discover from an ONNX file path or ``onnx.ModelProto`` (no payload read)."""
        inputs, outputs = value_infos_from_model(model)
        if isinstance(model, (str, Path)):
            return cls.discover(inputs, outputs, io_map, model=str(model),
                                hints=lambda: ExportHints.for_model(model))
        return cls.discover(inputs, outputs, io_map, hints=lambda: ExportHints.for_model(None, graph=model.graph))


# ---------------------------------------------------------------- value infos

def value_infos_from_model(model: Any) -> tuple[tuple[ValueInfo, ...], tuple[ValueInfo, ...]]:
    """Graph inputs (initializers excluded) and outputs of an ONNX file path or
    ``ModelProto``. Loads the protobuf only: external data is never read. A missing
    file is a ``UsageError``, an unparsable one a ``ModelFormatError``."""
    if isinstance(model, (str, Path)):
        model = parse_model_file(find_model_file(Path(model)))
    return graph_value_infos(model.graph)


def value_infos_from_ort(session: Any) -> tuple[tuple[ValueInfo, ...], tuple[ValueInfo, ...]]:
    """Inputs and outputs of an ``onnxruntime.InferenceSession`` as ``ValueInfo``s."""
    def info(arg) -> ValueInfo:
        shape = None if arg.shape is None else tuple(
            d if isinstance(d, int) else (d or None) for d in arg.shape)
        dt = dtype_of_type_string(arg.type)
        return ValueInfo(arg.name, 0 if dt is None else dt.code, shape)

    return (tuple(info(a) for a in session.get_inputs()),
            tuple(info(a) for a in session.get_outputs()))


# ---------------------------------------------------------------- discovery

def _np_dtype(vi: ValueInfo, model: str | None) -> np.dtype:
    dt = DTYPES.get(vi.elem_type)
    if dt is None:
        raise ModelIOError(f"unsupported element type {vi.elem_type}", Where(model=model, tensor=vi.name))
    return dt.numpy


def _kv_slot(name: str) -> tuple[int, str] | None:
    """(layer, "key"|"value") for a KV-like name, else None. The kind is the LAST
    key/value word so ``past_key_values.0.value`` reads as a value."""
    words = [w.lower() for w in _WORD.findall(name)]
    layers = [int(w) for w in words if w.isdigit()]
    kinds = [_KIND_WORDS[w] for w in words if w in _KIND_WORDS]
    if not layers or not kinds:
        return None
    # NOTE: several numbers (``model.layers.3.attn.past_key.0``?) are rare; the first
    # is taken as the layer and an io-map covers anything else.
    return layers[0], kinds[-1]


def _has_word(name: str, *words: str) -> bool:
    ws = {w.lower() for w in _WORD.findall(name)}
    return any(w in ws for w in words)


def past_kv_slot(name: str) -> tuple[int, str] | None:
    """(layer, "key"|"value") when an input named ``name`` reads as a past KV (a ``past``
    or ``cache`` word, one layer number, a key/value word; not an extra role), else None:
    the rule KV discovery pairs inputs by, and one sign of a decoder (model_kind.py)."""
    if not _has_word(name, "past", "cache") or name.lower() in EXTRA_ROLES:
        return None
    return _kv_slot(name)


class _Discovery:
    def __init__(self, inputs: Sequence[ValueInfo], outputs: Sequence[ValueInfo],
                 io_map: Mapping[str, Any], model: str | None,
                 hints: ExportHints | Callable[[], ExportHints] | None) -> None:
        self._hints = hints
        self.inputs = {vi.name: vi for vi in inputs}
        self.outputs = {vi.name: vi for vi in outputs}
        self.map = validate_io_map(dict(io_map))
        self.model = model
        self.placed: set[str] = set()

    @property
    def hints(self) -> ExportHints:
        if callable(self._hints):
            self._hints = self._hints()
        return self._hints or ExportHints()

    def where(self, tensor: str | None = None) -> Where:
        return Where(model=self.model, tensor=tensor)

    def slot(self, name: str) -> TensorSlot:
        vi = self.inputs[name]
        if name in self.placed:  # only an io-map can name one input twice
            raise ModelIOError("io-map gives one input two roles", self.where(name))
        self.placed.add(name)
        return TensorSlot(name, _np_dtype(vi, self.model), vi.shape)

    def mapped_input(self, role: str) -> str | None:
        name = self.map.get(role)
        if name is not None and name not in self.inputs:
            raise ModelIOError(f"io-map {role!r} names {name!r}, which is not a model input",
                               self.where(), hint=f"inputs: {', '.join(self.inputs)}")
        return name

    def by_names(self, candidates: Iterable[str]) -> str | None:
        free = {n.lower(): n for n in self.inputs if n not in self.placed}
        for c in candidates:
            if c in free:
                return free[c]
        return None

    def run(self) -> DecoderIO:
        kv, layout = self.discover_kv()
        ids = self.find_role("input_ids", TOKEN_IDS_NAMES)
        mask = self.find_role("attention_mask", ATTENTION_MASK_NAMES)
        pos = self.find_role("position_ids", POSITION_IDS_NAMES)
        extras = {}
        for role in EXTRA_ROLES:
            name = self.mapped_input(role) if role in self.map else self.by_names((role,))
            if name is not None:
                extras[role] = self.slot(name)
        if ids is None:
            ids = self.fallback_token_ids()
        logits = self.find_logits(kv)
        unplaced = [n for n in self.inputs if n not in self.placed]
        if unplaced or ids is None:
            missing = "" if ids is not None else "no token-ids input found; "
            raise ModelIOError(
                f"cannot interpret decoder inputs: {missing}"
                f"unplaced inputs {', '.join(repr(n) for n in unplaced) or '(none)'}",
                self.where(), hint="give their roles with --io-map FILE (format: docs/run.md)")
        lshape = self.outputs[logits].shape
        vocab = lshape[-1] if lshape and isinstance(lshape[-1], int) else None
        # hints already asked for (symbolic KV dims: every builder export) or given: a
        # sliding-window cache's capacity (a model whose KV dims are static is not parsed
        # again for it)
        known = self._hints if not callable(self._hints) else None
        capacity = dict(known.kv_capacity) if known is not None else {}
        kv = [replace(p, capacity=capacity[p.past_key.name]) if p.past_key.name in capacity else p for p in kv]
        return DecoderIO(
            input_ids=ids, logits=logits, vocab_size=vocab, attention_mask=mask, position_ids=pos,
            kv=tuple(kv), kv_layout=layout, extras=MappingProxyType(extras),
            source="io-map" if self.map else "discovered")

    def find_role(self, role: str, names: Sequence[str]) -> TensorSlot | None:
        if role in self.map:  # an explicit null means "the model has none"
            name = self.mapped_input(role)
        else:
            name = self.by_names(names)
        return None if name is None else self.slot(name)

    def fallback_token_ids(self) -> TensorSlot | None:
        ints = [vi for n, vi in self.inputs.items() if n not in self.placed
                and vi.elem_type in (6, 7) and (vi.shape is None or len(vi.shape) == 2)]
        return self.slot(ints[0].name) if len(ints) == 1 else None

    def find_logits(self, kv: Sequence[KVPair]) -> str:
        if "logits" in self.map:
            name = self.map["logits"]
            if name not in self.outputs:
                raise ModelIOError(f"io-map 'logits' names {name!r}, which is not a model output",
                                   self.where(), hint=f"outputs: {', '.join(self.outputs)}")
            return name
        presents = {n for p in kv for n in (p.present_key, p.present_value)}
        rest = {n.lower(): n for n in self.outputs if n not in presents}
        for c in LOGITS_NAMES:
            if c in rest:
                return rest[c]
        if len(rest) == 1:
            return next(iter(rest.values()))
        raise ModelIOError(
            f"cannot find the logits output among {sorted(rest.values()) or '(no outputs)'}",
            self.where(), hint="name it with --io-map FILE (format: docs/run.md)")

    # -- KV

    def discover_kv(self) -> tuple[list[KVPair], str]:
        if "kv" in self.map:
            quads = []
            for i, e in enumerate(self.map["kv"]):
                for key in ("past_key", "past_value"):
                    if e[key] not in self.inputs:
                        raise ModelIOError(f"io-map kv[{i}].{key} names {e[key]!r}, which is not "
                                           "a model input", self.where())
                for key in ("present_key", "present_value"):
                    if e[key] not in self.outputs:
                        raise ModelIOError(f"io-map kv[{i}].{key} names {e[key]!r}, which is not "
                                           "a model output", self.where())
                quads.append((i, e["past_key"], e["past_value"], e["present_key"], e["present_value"]))
        else:
            quads = self.pair_kv_by_name()
        if not quads:
            # NOTE: a decoder without KV inputs still decodes (each step recomputes the
            # prefix); the loop handles an empty kv tuple.
            return [], self.map.get("kv_layout", "bhsd")
        layout = self.map.get("kv_layout") or self.detect_layout(quads[0][1], quads[0][3])
        pairs = [self.make_pair(layer, pk, pv, ok, ov, layout) for layer, pk, pv, ok, ov in quads]
        return pairs, layout

    def pair_kv_by_name(self) -> list[tuple[int, str, str, str, str]]:
        past: dict[tuple[int, str], str] = {}
        for name in self.inputs:
            slot = past_kv_slot(name)
            if slot is not None and slot not in past:
                past[slot] = name
        present: dict[tuple[int, str], str] = {}
        for name in self.outputs:
            slot = _kv_slot(name)
            if slot is not None and (slot not in present or _has_word(name, "present")):
                present[slot] = name
        layers = sorted({layer for layer, _ in past})
        quads = []
        for layer in layers:
            names = []
            for table, kind, what in ((past, "key", "past key"), (past, "value", "past value"),
                                      (present, "key", "present key"), (present, "value", "present value")):
                name = table.get((layer, kind))
                if name is None:
                    have = past.get((layer, "key")) or past.get((layer, "value"))
                    raise ModelIOError(f"layer {layer} has no {what} to pair with {have!r}",
                                       self.where(have),
                                       hint="give the KV pairs with --io-map FILE (format: docs/run.md)")
                names.append(name)
            quads.append((layer, *names))
        return quads

    def detect_layout(self, past_key: str, present_key: str) -> str:
        shape = self.inputs[past_key].shape
        if shape is None or len(shape) != 4:
            raise ModelIOError(f"past KV input has shape {shape}; only rank-4 KV is supported",
                               self.where(past_key),
                               hint="fused or 3-D KV layouts are a known gap (docs/run.md)")
        d1, d2 = shape[1], shape[2]
        if isinstance(d1, int) and not isinstance(d2, int):
            return "bhsd"
        if isinstance(d2, int) and not isinstance(d1, int):
            return "bshd"
        if isinstance(d1, int) and isinstance(d2, int):
            raise ModelIOError(f"past KV input has a static shape {list(shape)}: no growing "
                               "sequence dim (shared-buffer KV is not supported)",
                               self.where(past_key),
                               hint="give kv_layout in --io-map FILE if the model accepts any past length")
        # Both symbolic: the symbol that names a sequence, or that changes from past
        # to present, is the sequence dim.
        hint1 = isinstance(d1, str) and bool(_SEQ_HINT.search(d1))
        hint2 = isinstance(d2, str) and bool(_SEQ_HINT.search(d2))
        if hint1 != hint2:
            return "bshd" if hint1 else "bhsd"
        pshape = self.outputs[present_key].shape
        if pshape is not None and len(pshape) == 4:
            diff1, diff2 = pshape[1] != d1, pshape[2] != d2
            if diff1 != diff2:
                return "bshd" if diff1 else "bhsd"
        raise ModelIOError(f"cannot tell the KV layout from shape {list(shape)}",
                           self.where(past_key), hint="give kv_layout (bhsd|bshd) in --io-map FILE")

    def make_pair(self, layer: int, pk: str, pv: str, ok: str, ov: str, layout: str) -> KVPair:
        k, v = self.slot(pk), self.slot(pv)
        heads_axis = 1 if layout == "bhsd" else 2
        dims = {}
        for s in (k, v):
            if s.rank != 4:
                raise ModelIOError(f"past KV input has shape {s.shape}; only rank-4 KV is supported",
                                   self.where(s.name))
            heads = self.map.get("kv_heads", s.shape[heads_axis])
            if not isinstance(heads, int):
                heads = self.hints.kv_heads
            dim = s.shape[3] if isinstance(s.shape[3], int) else self.map.get("head_dim")
            if not isinstance(dim, int):
                dim = self.hints.head_dim
            if not isinstance(heads, int) or not isinstance(dim, int):
                raise ModelIOError(
                    f"past KV input shape {list(s.shape)} ({layout}) has no static heads/head_dim",
                    self.where(s.name), hint="give kv_heads and head_dim in --io-map FILE")
            dims[s.name] = (heads, dim)
        if dims[k.name][0] != dims[v.name][0]:
            raise ModelIOError(f"key and value of layer {layer} disagree on KV heads "
                               f"({dims[k.name][0]} vs {dims[v.name][0]})", self.where(pv))
        return KVPair(layer=layer, past_key=k, past_value=v, present_key=ok, present_value=ov,
                      kv_heads=dims[k.name][0], key_head_dim=dims[k.name][1],
                      value_head_dim=dims[v.name][1])
