"""What the first forward of a profiled load is fed (``onnx-prep profile``): the fixed
prompt for a decoder LLM, or, for any other model, one forward's inputs by the rules of
``onnx-prep run`` (core/decode/graph_feeds.py: ``--inputs`` files, or arrays generated
from the declared shapes with the symbolic dims ``--shape`` binds).

Which of the two is decided as ``run`` decides it (core/decode/model_kind.py, from the
graph's inputs alone), and ``--inputs`` / ``--shape`` ask for one forward of any model,
a decoder too. The parent process builds the feeds once to refuse what cannot run
before any child starts; each child builds them again from the same options (generated
arrays are deterministic: seeded by input name), so every load and ONNX Runtime's get
the same bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

PROMPT_LEN = 8  # a decoder's fixed prompt: token ids 1..8, one row


@dataclass(frozen=True)
class LoadFeeds:
    """The first forward's feeds and how the record describes them: the model's kind
    (``model_kind.ModelKind``), the prompt a decoder gets (None for one forward) and
    each fed input (``GraphFeeds.to_json()``; None for a decoder's prompt)."""

    arrays: dict
    kind: Any
    prompt_ids: list[int] | None
    inputs: list[dict] | None

    @property
    def decodes(self) -> bool:
        return self.prompt_ids is not None

    def describe(self) -> dict:
        return {"kind": self.kind.to_json(), "prompt_ids": self.prompt_ids, "inputs": self.inputs}


def load_feeds(graph_inputs: Sequence, graph_outputs: Sequence, model_path, inputs: Sequence[str] = (),
               shape: Sequence[str] = (), *, budget: int | None = None) -> LoadFeeds:
    """The first forward's feeds for a model with these graph inputs and outputs
    (``ValueInfo``s: a resolution's, or ONNX Runtime's session's) at ``model_path`` (the
    module docstring's rules). ``inputs`` / ``shape``: the ``--inputs`` and ``--shape``
    values; ``budget``: the bytes generated inputs may take (default: run's default
    budget). Raises the typed errors of ``core/errors.py`` for a model or an option that
    cannot run."""
    from onnx_prep.core.decode.model_kind import GRAPH, ModelKind, model_kind

    kind = model_kind(graph_inputs)
    if inputs or shape:
        if kind.is_decoder:
            kind = ModelKind(GRAPH, f"{'--inputs' if inputs else '--shape'} given; {kind.reason}")
    if kind.is_decoder:
        return LoadFeeds(decoder_prompt_feeds(graph_inputs, graph_outputs, model_path), kind,
                         list(range(1, PROMPT_LEN + 1)), None)
    from onnx_prep.core.decode.graph_feeds import graph_feeds, parse_input_files, parse_shape_bindings
    from onnx_prep.core.runtime.memory_size import default_memory_budget

    feeds = graph_feeds(graph_inputs, parse_input_files(inputs), parse_shape_bindings(shape),
                        model=str(model_path), budget=budget or default_memory_budget())
    return LoadFeeds(dict(feeds.arrays), kind, None, feeds.to_json())


def decoder_prompt_feeds(graph_inputs: Sequence, graph_outputs: Sequence, model_path,
                         prompt_len: int = PROMPT_LEN) -> dict:
    """A decoder's first forward: ids 1..prompt_len (one row), empty past."""
    import numpy as np

    from onnx_prep.core.decode.decoder_io import DecoderIO
    from onnx_prep.core.decode.export_hints import ExportHints
    from onnx_prep.core.decode.generation import step_feeds

    io = DecoderIO.discover(graph_inputs, graph_outputs, model=str(model_path),
                            hints=lambda: ExportHints.for_model(model_path))
    ids = np.arange(1, prompt_len + 1, dtype=np.int64)[None, :]
    return step_feeds(io, ids, io.empty_past(1), 0)
