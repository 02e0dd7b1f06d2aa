"""What ``onnx-prep run`` does with a model: decode it (a decoder LLM) or run one
forward of its graph (anything else), decided from the graph's inputs alone (names,
element types, ranks; never the weights), with the reason, before a runtime opens.

A model is a decoder when one of these holds, checked in this order:

1. an io-map is given: it names the decoder's roles (docs/run.md);
2. an input reads as a past KV (``decoder_io.past_kv_slot``: a ``past`` or ``cache``
   word, a layer number and a key/value word);
3. an int32/int64 input of rank 2 (or of unknown rank) has a token-ids name
   (``decoder_io.TOKEN_IDS_NAMES``: ``input_ids``, ``tokens``, ...).

Anything else is a graph: a float input named ``input`` is not token ids, whatever its
name says. A model with a decoder sign whose I/O discovery then fails keeps
discovery's error (an unplaced input is a decoder to describe with ``--io-map``, not a
graph to run once). ``--inputs`` or ``--shape`` ask for one forward of any model,
a decoder too (``run_record.record_run`` decides that before asking here).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from onnx_prep.core.decode.decoder_io import TOKEN_IDS_NAMES, past_kv_slot
from onnx_prep.core.model.dtypes import DTYPES
from onnx_prep.core.model.resolved_model import ValueInfo

DECODER, GRAPH = "decoder", "graph"
_INTEGER_TYPES = (6, 7)  # ONNX INT32, INT64: what token ids are fed as
_LISTED = 4  # inputs named in a graph's reason


@dataclass(frozen=True)
class ModelKind:
    """``kind`` is ``"decoder"`` (greedy decoding) or ``"graph"`` (one forward);
    ``reason`` says why in a few words (printed by ``run``, in its ``--json``)."""

    kind: str
    reason: str

    @property
    def is_decoder(self) -> bool:
        return self.kind == DECODER

    def to_json(self) -> dict:
        return {"kind": self.kind, "reason": self.reason}


def model_kind(inputs: Sequence[ValueInfo], *, io_map: bool = False) -> ModelKind:
    """The kind of a model with these graph inputs (the module docstring's rules);
    ``io_map``: whether the user gave one."""
    if io_map:
        return ModelKind(DECODER, "a decoder by its io-map")
    for vi in inputs:
        if past_kv_slot(vi.name) is not None:
            return ModelKind(DECODER, f"a decoder by its past KV input {vi.name!r}")
    for vi in inputs:
        if _is_token_ids(vi):
            return ModelKind(DECODER, f"a decoder by its token-ids input {vi.name!r}")
    listed = ", ".join(f"{vi.name!r} {_describe(vi)}" for vi in inputs[:_LISTED])
    more = f" and {len(inputs) - _LISTED} more" if len(inputs) > _LISTED else ""
    return ModelKind(GRAPH, "not a decoder: no past KV input and no int32/int64 token-ids input among "
                            f"{listed or 'no inputs'}{more}")


def _is_token_ids(vi: ValueInfo) -> bool:
    return (vi.name.lower() in TOKEN_IDS_NAMES and vi.elem_type in _INTEGER_TYPES
            and (vi.shape is None or len(vi.shape) == 2))


def _describe(vi: ValueInfo) -> str:
    dt = DTYPES.get(vi.elem_type)
    dims = "?" if vi.shape is None else "[" + ", ".join("?" if d is None else str(d) for d in vi.shape) + "]"
    return f"{dt.name if dt is not None else f'type {vi.elem_type}'} {dims}"
