"""The record of one run: ``record_run(model, options) -> dict`` decodes and returns
the ``onnx-prep.run/6`` document (docs/run.md, pinned by ``core/schemas/run.schema.json``),
or, for a model that is not a decoder (``model_kind.py``) or with ``--inputs`` /
``--shape``, runs one forward of its graph and returns ``graph_run.py``'s
``onnx-prep.graph-run/2`` document.

``RunOptions`` holds what to decode and how and checks its values on construction,
each before any module of the load path (numpy, onnx) is imported, except the
source-pages policy, checked last against the reader's list. ``record_run`` parses the
model once:

- the prepared runtime (``runtime="prepared"``): ``resolve_model`` parses it, the decoder
  I/O is discovered from the resolved inputs and outputs, and the session is built on
  that same ``ResolvedModel``; ONNX Runtime, when compared, is given the file path (it
  parses the file itself);
- ONNX Runtime alone (``runtime="ort"``, for models the prepared runtime cannot run):
  the decoder I/O comes from the protobuf's inputs and outputs only
  (``value_infos_from_model``), without resolution's checks.

Compared with ONNX Runtime, ONNX Runtime decodes like for like (its QDQ int4 MatMuls at
the prepared runtime's accuracy level, ``ort_runner.like_for_like_config``); where the
model has a DequantizeLinear that setting acts on, the prefill runs once more under
ONNX Runtime's defaults, and both first-step differences are recorded. ``per_node``
compares the first step (or the one forward) value by value (core/decode/node_comparison.py): that parses
the model once more, for ONNX Runtime's copy with every value exposed.
"""
from __future__ import annotations

import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional

from onnx_prep.core.errors import UsageError, Where
from onnx_prep.core.option_ranges import (MAX_BATCH, MAX_MEMORY_BUDGET, MAX_THREADS, MAX_TOKEN_ID, MAX_TOKENS,
                                          MIN_MEMORY_BUDGET, check_range)

SCHEMA = "onnx-prep.run/10"
RUNTIMES = ("prepared", "ort")
COMPARE_WITH = ("ort",)
DEFAULT_PROMPT = (1, 2, 3, 4)

# ``progress(label, total)``: a context manager around one decode that gives the
# ``on_step`` callback of ``greedy_decode`` (or None). The CLI draws a bar with it.
Progress = Callable[[str, int], ContextManager[Optional[Callable[[Any], None]]]]


@dataclass(frozen=True)
class RunOptions:
    """What to decode and how. ``prompt_ids`` holds the rows (equal lengths); ``io_map``
    is a JSON file naming the decoder I/O (docs/run.md); ``threads`` is ONNX Runtime's
    intra-op threads and the prepared session's CPU workers (None: their defaults);
    ``memory_budget`` the bytes the run may take (None: ``default_memory_budget()``)."""

    prompt_ids: tuple[tuple[int, ...], ...] = (DEFAULT_PROMPT,)
    tokens: int = 16
    runtime: str = "prepared"
    compare: str | None = None
    io_map: Path | None = None
    threads: int | None = None
    source_pages: str = "auto"
    memory_budget: int | None = None
    verify_digests: bool = True  # the prepared runtime checks trusted digests while reading
    trust_symlinks: bool = False  # external data through symlinks or hard links (resolve_model)
    cache_policy: str = "read-only"  # the prepared cache (core/cache/prepared_cache.py, POLICIES)
    prepared: Path | None = None  # the cache's manifest (default: <model stem>.prepared.onnx beside it)
    logits_out: Path | None = None  # a decode's logits, every step, to this .npz
    # One forward of any model (graph_feeds.py, graph_run.py): input files (FILE.npz or
    # NAME=FILE.npy), NAME=N bindings of symbolic dims, the outputs' .npz
    inputs: tuple[str, ...] = ()
    shape: tuple[str, ...] = ()
    outputs_out: Path | None = None
    # the decode-only options the command line gave (--prompt-ids, --batch, --tokens):
    # refused when the model runs one forward, where they would mean nothing
    decode_flags: tuple[str, ...] = ()
    fuse: bool = True  # the prepared runtime fuses standard-op patterns at resolve (core/model/fusion.py)
    per_node: bool = False  # with compare: the first step (or the forward) value by value (node_comparison.py)
    device: str = "cpu"  # --device: cpu, or cuda (the prepared runtime on a CUDA device: docs/cuda.md)
    device_budget: int | None = None  # --device-budget: device bytes the packed weights may commit (None: all)

    @property
    def one_forward(self) -> bool:
        """``--inputs`` or ``--shape``: one forward of the graph, a decoder's too."""
        return bool(self.inputs or self.shape)

    @property
    def distinct_rows(self) -> list[tuple[int, ...]]:
        """The prompt rows, each object once: ``--batch B`` repeats one row B times."""
        return list({id(row): row for row in self.prompt_ids}.values())

    def __post_init__(self) -> None:
        if self.runtime not in RUNTIMES:
            raise UsageError(f"--runtime must be one of {list(RUNTIMES)}, got {self.runtime!r}")
        if self.compare is not None and self.compare not in COMPARE_WITH:
            raise UsageError(f"--compare supports only 'ort', got {self.compare!r}")
        if self.compare == self.runtime:
            raise UsageError("--compare ort with --runtime ort compares ONNX Runtime with itself")
        if self.per_node and self.compare is None:
            raise UsageError("--per-node compares with another runtime: it needs --compare ort")
        check_range("--tokens", self.tokens, 1, MAX_TOKENS)
        if self.threads is not None:
            check_range("--threads", self.threads, 1, MAX_THREADS)
        if self.memory_budget is not None:
            check_range("--memory-budget", self.memory_budget, MIN_MEMORY_BUDGET, MAX_MEMORY_BUDGET)
        rows = self.prompt_ids
        if not rows:
            raise UsageError("prompt ids must be non-empty rows of non-negative integers, got no rows")
        check_range("--batch", len(rows), 1, MAX_BATCH)
        for row in self.distinct_rows:  # a repeated row is checked once (--batch repeats one)
            if not row or any(t < 0 for t in row):
                raise UsageError("prompt ids must be non-empty rows of non-negative integers, "
                                 f"got {row[:8]!r}{'...' if len(row) > 8 else ''}")
            for t in row:
                check_range("a prompt id", t, 0, MAX_TOKEN_ID)  # int64; the vocabulary is record_run's
        if len({len(row) for row in self.distinct_rows}) > 1:
            raise UsageError("all --prompt-ids rows must have the same length, got "
                             f"{[len(r) for r in self.distinct_rows]}",
                             hint="padding is not supported: give prompts of equal length")
        if self.device != "cpu":  # the CPU path imports nothing of CUDA
            from onnx_prep.core.cuda.device_selection import require_device

            require_device(self.device)
            if self.runtime != "prepared":
                raise UsageError(f"--device {self.device} runs the prepared runtime; --runtime {self.runtime} runs "
                                 "on the CPU", hint="drop --device, or --runtime")
            if self.one_forward:
                raise UsageError(f"--device {self.device} decodes; one forward (--inputs / --shape) runs on the CPU")
        elif self.device_budget is not None:
            raise UsageError("--device-budget limits device memory: it needs --device cuda")
        # Last: the policy names live beside the reader, which imports numpy and onnx.
        from onnx_prep.core.runtime.source_pages import SOURCE_PAGES

        if self.source_pages not in SOURCE_PAGES:
            raise UsageError(f"--source-pages must be one of {list(SOURCE_PAGES)}, got {self.source_pages!r}")
        from onnx_prep.core.cache.prepared_cache import POLICIES

        if self.cache_policy not in POLICIES:
            raise UsageError(f"--cache-policy must be one of {list(POLICIES)}, got {self.cache_policy!r}")
        if self.cache_policy == "build-if-missing" and not self.verify_digests:
            raise UsageError("--cache-policy build-if-missing persists only verified bytes: it cannot be "
                             "combined with --no-verify-digests")
        self._check_forward_options()

    def _check_forward_options(self) -> None:
        from onnx_prep.core.decode.graph_feeds import parse_input_files, parse_shape_bindings

        parse_input_files(self.inputs)
        parse_shape_bindings(self.shape)
        if self.one_forward:
            given = "--inputs" if self.inputs else "--shape"
            if self.io_map is not None:
                raise UsageError(f"--io-map names a decoder's roles; {given} runs one forward: give one or the other")
            if self.logits_out is not None:
                raise UsageError(f"--logits-out writes a decode's logits; {given} runs one forward",
                                 hint="write its outputs with --outputs-out FILE.npz")
            if self.decode_flags:
                raise UsageError(f"{_only_decoding(self.decode_flags)}; {given} runs one forward")
        for option, path in (("--logits-out", self.logits_out), ("--outputs-out", self.outputs_out)):
            if path is not None and not Path(path).parent.is_dir():  # refused before the run, not after it
                raise UsageError(f"{option}: no folder {str(Path(path).parent)!r} to write into",
                                 Where(file=str(path)))


def open_prepared_runner(resolved, *, threads: int | None, source_pages: str, verify_digests: bool = True,
                         cache=None, keep_values: bool = False, trust_symlinks: bool = False):
    """The prepared runtime on a resolved model, as a ``Runner`` with ``close()``.

    NOTE: the one place a run obtains our runtime. ``threads`` maps to the session's CPU
    workers (the pool that runs kernels) and bounds the threads that compute one op, the
    caller included (``intra_op_threads``); I/O workers keep their default. ``keep_values``:
    each run returns every value computed (``SessionOptions.keep_values``)."""
    try:
        from onnx_prep.core.runtime.session import Session
    except ModuleNotFoundError as exc:
        if exc.name != "onnx_prep.core.runtime.session":
            raise
        raise UsageError("the prepared runtime (onnx_prep.core.runtime.session) is not in this build",
                         hint="decode with --runtime ort") from exc
    kw = {} if threads is None else {"cpu_workers": threads, "intra_op_threads": threads}
    return Session(resolved, source_pages=source_pages, verify_digests=verify_digests, cache=cache,
                   keep_values=keep_values, trust_symlinks=trust_symlinks, **kw)


def record_run(model: str | Path, options: RunOptions, *, progress: Progress | None = None,
               warn: Callable[[str], None] | None = None) -> dict:
    """Decode with ``options.runtime`` (and again with ``options.compare``, compared) and
    return the ``onnx-prep.run/10`` record. ``compare.agrees`` false is a finding, not an
    error. Raises the typed errors of ``core/errors.py`` for unusable input."""
    import numpy as np

    from onnx_prep.core.decode.decoder_io import DecoderIO, value_infos_from_model
    from onnx_prep.core.decode.export_hints import ExportHints, check_request
    from onnx_prep.core.decode.generation import compare_generations
    from onnx_prep.core.decode.io_map import load_io_map
    from onnx_prep.core.decode.run_memory import admit, estimate_run_memory
    from onnx_prep.core.runtime.memory_size import default_memory_budget

    path = Path(model)
    mapping = load_io_map(options.io_map) if options.io_map is not None else None
    opened: dict[str, Callable[[], Any]] = {}
    cache = None
    if options.runtime == "prepared":
        from onnx_prep.core.model.resolution import resolve_model

        t0 = time.perf_counter()
        resolved = resolve_model(path, trust_symlinks=options.trust_symlinks, fuse=options.fuse)
        resolve_ms = (time.perf_counter() - t0) * 1e3
        inputs, outputs = resolved.inputs, resolved.outputs
        # open_ms of the prepared runtime counts its parse too, as ONNX Runtime's does
        def open_prepared():
            nonlocal cache
            cache = _open_cache(resolved, options, warn)
            if options.device == "cuda":
                return resolve_ms, _open_device(resolved, options, cache)
            return resolve_ms, open_prepared_runner(
                resolved, threads=options.threads, source_pages=options.source_pages,
                verify_digests=options.verify_digests, cache=cache, trust_symlinks=options.trust_symlinks)

        opened["prepared"] = open_prepared
    else:
        inputs, outputs = value_infos_from_model(path)
    # compared: like for like; decoding with ONNX Runtime alone: its defaults
    ort_config = _like_for_like() if options.compare == "ort" else None
    opened["ort"] = lambda: (0.0, _open_ort(path, options.threads, ort_config))
    kind = _kind(options, inputs, mapping)
    if not kind.is_decoder:
        per_node = None
        if options.per_node:  # --per-node needs --compare ort, which needs the prepared runtime
            def per_node(feeds):
                return _per_node_record(resolved, feeds, options, ort_config)
        return _record_forward(path, options, kind, inputs, outputs, opened, lambda: cache, per_node)
    if options.outputs_out is not None:
        raise UsageError(f"--outputs-out writes one forward's outputs; this model is decoded ({kind.reason})",
                         Where(model=str(path)),
                         hint="write its logits with --logits-out FILE.npz, or run one forward with --inputs or --shape")
    # the config only here: the graph is parsed again only if discovery needs it
    hints = ExportHints.from_config(path)
    io = DecoderIO.discover(inputs, outputs, mapping, model=str(path),
                            hints=hints or (lambda: ExportHints.for_model(path)))
    check_request(io, hints or ExportHints(), batch=len(options.prompt_ids), prompt_len=len(options.prompt_ids[0]),
                  tokens=options.tokens, model=str(path))
    top = max(max(row) for row in options.distinct_rows)
    if io.vocab_size is not None and top >= io.vocab_size:
        raise UsageError(f"prompt id {top} is outside the vocabulary (size {io.vocab_size})", Where(model=str(path)),
                         hint=("give ids below it with --prompt-ids" if io.kv else
                               "give ids below it with --prompt-ids; a model that is not a decoder "
                               "runs one forward with --inputs or --shape"))
    # Before either runtime opens and before the prompt array: what cannot fit is refused
    # before it is allocated.
    admit(estimate_run_memory(io, len(options.prompt_ids), len(options.prompt_ids[0]), options.tokens,
                              compare=options.compare is not None, keep_logits=options.logits_out is not None),
          options.memory_budget or default_memory_budget())
    prompt = np.array(options.prompt_ids, dtype=np.int64)

    def decode(kind: str, keep_logits: bool = False, tokens: int = options.tokens):
        """(open ms, the GenerationResult, the prepared runtime's source-pages choice or None)."""
        from onnx_prep.core.decode.generation import greedy_decode

        with ExitStack() as stack:
            t0 = time.perf_counter()
            parsed_ms, runner = opened[kind]()
            if hasattr(runner, "close"):
                stack.callback(runner.close)
            open_ms = parsed_ms + (time.perf_counter() - t0) * 1e3
            on_step = stack.enter_context(progress(f"{kind} decode", tokens) if progress
                                          else nullcontext())
            result = greedy_decode(runner, io, prompt, tokens, on_step=on_step, keep_logits=keep_logits,
                                   model=str(path))
            if kind == options.runtime and hasattr(runner, "reader") and hasattr(runner, "stats"):
                loads.append(_load_record(runner, resolved))
            if hasattr(runner, "device_record"):
                device_runs.append(runner.device_record())
                if runner.cache_commit is not None:  # a device load completes a build-if-missing cache first
                    early_commits.append(runner.cache_commit)
        return open_ms, result, getattr(runner, "source_pages", None)

    device_runs: list[dict] = []
    early_commits: list[dict] = []
    loads: list[dict] = []
    try:
        open_ms, result, pages = decode(options.runtime, keep_logits=options.logits_out is not None)
        device_counters = device_runs[0] if device_runs else None
        # build-if-missing: what the run built was written meanwhile, at idle priority;
        # published now, once the output is in hand (a device run published it before loading)
        committed = cache.commit() if cache is not None and cache.policy.value == "build-if-missing" else None
        if early_commits:
            committed = early_commits[0]
    finally:
        if cache is not None:
            cache.close()
    doc = {"schema": SCHEMA, "model": str(path), "runtime": options.runtime,
           "prompt_ids": prompt.tolist(), "batch": int(prompt.shape[0]), "tokens_requested": options.tokens,
           "io": io.to_json(), "tokens": result.tokens.tolist(),
           "timings": {"open_ms": open_ms, **result.timings_json()},
           "counters": result.counters_json(), "source_pages": pages, "device": device_counters,
           "load": loads[0] if loads else None,
           "cache": None if cache is None else {**cache.summary(), "committed": committed},
           "compare": None}
    if options.runtime == "prepared":  # what its decode GEMVs did with their weights here
        from onnx_prep.core.ops.weight_streaming import choice

        doc["weight_streaming"] = choice().as_dict()
    if options.logits_out is not None:
        _write_logits(options.logits_out, result)
        doc["logits_file"] = str(options.logits_out)
    if options.compare is not None:
        ref_open_ms, ref, _ = decode(options.compare)
        cmp = compare_generations(result, ref)
        doc["compare"] = {"runtime": options.compare, "tokens": ref.tokens.tolist(), **cmp.to_json(),
                          "timings": {"open_ms": ref_open_ms, **ref.timings_json()},
                          "session_config": ort_config, "ort_default": None, "per_node": None}
        from onnx_prep.core.model.transforms import is_fused_dequantize_matmul

        if any(is_fused_dequantize_matmul(n) or n.op_type == "DequantizeLinear" for n in resolved.nodes):
            # what ONNX Runtime's defaults compute there (the prefill alone)
            opened["ort-default"] = lambda: (0.0, _open_ort(path, options.threads, None))
            _, default, _ = decode("ort-default", tokens=1)
            doc["compare"]["ort_default"] = {"first_step_max_abs_logit_diff": float(
                np.abs(result.first_logits.astype(np.float64) - default.first_logits).max())}
        if options.per_node:
            doc["compare"]["per_node"] = _compare_per_node(resolved, io, prompt, options, ort_config)
    return doc


def _load_record(session, resolved) -> dict:
    """What the prepared runtime's load and decode read, from the session's counters:
    objects packed here and objects read from the cache; source bytes read or mapped, and
    of them those of weights that have a prepared form (0 when the cache held every
    object: the rest are the weights used as they are, norms and embeddings)."""
    stats = session.stats()
    counters = session.reader.counters.snapshot()
    packed = {n for r in resolved.requests.values() for n in r.source_lineage}
    touched = (*counters["per_tensor"].items(), *counters["mapped_per_tensor"].items())
    return {"prepacks": stats.prepacks, "packed_reads": stats.packed_reads, "source_bytes": stats.source_bytes,
            "packed_source_bytes": sum(n for name, n in touched if name in packed)}


def _kind(options: RunOptions, inputs, mapping):
    """Decode, or run one forward (model_kind.py); ``--inputs`` / ``--shape`` ask for one forward."""
    from onnx_prep.core.decode.model_kind import GRAPH, ModelKind, model_kind

    kind = model_kind(inputs, io_map=mapping is not None)
    if options.one_forward and kind.is_decoder:
        return ModelKind(GRAPH, f"{'--inputs' if options.inputs else '--shape'} given; {kind.reason}")
    return kind


def _record_forward(path: Path, options: RunOptions, kind, inputs, outputs, opened, cache, per_node) -> dict:
    """One forward of the graph (graph_run.py) on the runners ``record_run`` opens;
    ``per_node(feeds)``: the forward value by value (None: not asked for)."""
    from onnx_prep.core.decode.graph_run import record_graph_run
    from onnx_prep.core.runtime.memory_size import default_memory_budget

    if options.decode_flags:
        raise UsageError(f"{_only_decoding(options.decode_flags)}; this model runs one forward ({kind.reason})",
                         Where(model=str(path)), hint="give its inputs with --inputs or --shape")
    if options.logits_out is not None:
        raise UsageError(f"--logits-out writes a decode's logits; this model runs one forward ({kind.reason})",
                         Where(model=str(path)), hint="write its outputs with --outputs-out FILE.npz")
    return record_graph_run(path, options, kind, inputs, outputs, open_runner=lambda runtime: opened[runtime](),
                            cache=cache, budget=options.memory_budget or default_memory_budget(), per_node=per_node)


def _write_logits(path: Path, result) -> None:
    """The decode's logits as ``logits`` float32 [steps, batch, vocab] (each step's last
    position) and its ``tokens`` int64 [batch, steps], to an .npz written atomically."""
    import numpy as np

    from onnx_prep.core.io.atomic_file import write_arrays_atomically

    try:
        write_arrays_atomically(path, {"logits": np.stack(result.logits), "tokens": result.tokens})
    except OSError as exc:
        raise UsageError(f"cannot write the logits: {exc.strerror or exc}", Where(file=str(path))) from exc


def _only_decoding(flags) -> str:
    return f"{', '.join(flags)} {'applies' if len(flags) == 1 else 'apply'} only to decoding"


def _like_for_like() -> dict[str, str]:
    from onnx_prep.core.decode.ort_runner import like_for_like_config

    return like_for_like_config()


def _compare_per_node(resolved, io, prompt, options: RunOptions, ort_config) -> dict:
    """A decode's first step, value by value (``_per_node_record``)."""
    from onnx_prep.core.decode.generation import step_feeds

    return _per_node_record(resolved, step_feeds(io, prompt, io.empty_past(prompt.shape[0]), 0), options, ort_config)


def _per_node_record(resolved, feeds, options: RunOptions, ort_config) -> dict:
    """``feeds`` run value by value: a session of our runtime that keeps every value
    (read from sources: no cache) against ONNX Runtime exposing them."""
    from onnx_prep.core.decode.node_comparison import compare_first_step

    return compare_first_step(
        resolved, feeds, lambda: open_prepared_runner(resolved, threads=options.threads,
                                                      source_pages=options.source_pages,
                                                      verify_digests=options.verify_digests, keep_values=True,
                                                      trust_symlinks=options.trust_symlinks),
        threads=options.threads, session_config=ort_config).to_json()


def _open_device(resolved, options: RunOptions, cache):
    """The prepared runtime on the CUDA device (core/cuda/device_decoder.py), its
    objects loaded and paged by a device session: from ``cache`` where it has them."""
    from onnx_prep.core.cuda.device_decoder import open_device_decoder
    from onnx_prep.core.cuda.device_selection import open_driver

    return open_device_decoder(resolved, open_driver(), budget=options.device_budget,
                               verify_digests=options.verify_digests, trust_symlinks=options.trust_symlinks,
                               cache=cache)


def _open_cache(resolved, options: RunOptions, warn):
    """The model's prepared cache under ``options.cache_policy``, or None (disabled)."""
    if options.cache_policy == "disabled":
        return None
    from onnx_prep.core.cache.prepared_cache import PreparedCache

    return PreparedCache(resolved, options.prepared, policy=options.cache_policy,
                         verify_payloads=options.verify_digests, warn=warn, trust_symlinks=options.trust_symlinks)


def _open_ort(path: Path, threads: int | None, session_config: dict[str, str] | None):
    from onnx_prep.core.decode.ort_runner import OrtRunner

    return OrtRunner(path, threads=threads, session_config=session_config)
