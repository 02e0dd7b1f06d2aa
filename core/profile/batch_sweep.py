"""The batch sweep: decode throughput and weight streaming across batch sizes under a
budget for prepared weights (``onnx-prep profile --batch-sweep``; docs/profile.md,
"Batch sweep"). One record, schema ``onnx-prep.batch-sweep/2``.

For each batch size N, in a fresh :class:`Session` each repeat (nothing resident at the
start): greedy decoding of ``tokens`` steps over N rows, one fused forward per step (the
rows are one [N, len] batch, never N forwards), with the PREPARED arena limited to the
budget. Below the packed size, weights are evicted and paged back in every step — from
the prepared cache when it has them, else re-read and re-packed — by the runtime's one
eviction policy. Nothing here is a profiler-only path: it is ``greedy_decode`` over a
``Session``, observed through the session's counters after each step.

Counters lead each row, over the decode steps (the prefill, step 0, loads the model and
is reported apart): bytes paged in per emitted token, page-ins per token, hit rate and
byte hit rate (of the prepared objects the steps consumed, the fraction already
resident), evictions; then tokens/s and ms per step, min / median / max over repeats;
peak resident prepared bytes; whether the counters were identical across repeats; and
row identity (row 0 of batch N decoded the same tokens as batch 1, every step).

When the budget forces streaming, each row also carries the ample-budget step time (the
same N with no limit) and the time to read that step's paged bytes alone, at a read
rate measured in the same run; ``pipelining`` is step time / max(the two): 1.0 means
page reads fully overlapped with compute.

With ``--device cuda`` each row also carries ``device``: the same decode on the CUDA
device (core/cuda/device_decoder.py), a fresh decoder each repeat, its packed weights
committed under the budget as the device counts it (a percentage of the device's
committed size: packed objects in whole granules, raw weights sharing; a size as given), streamed between the
step's segments past it. Its counters over the decode steps: bytes copied host to
device and page-ins per token, evictions, byte hit rate, the graphs' captures,
replays, fallbacks and invalidations; tokens/s; and whether its tokens are the CPU's
(row identity against the CPU run of the same N).
"""
from __future__ import annotations

import os
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from onnx_prep.core.errors import UsageError, Where

__all__ = ["SCHEMA", "SweepOptions", "parse_budget", "record_batch_sweep"]

SCHEMA = "onnx-prep.batch-sweep/2"
MAX_BATCH_SIZES = 16

# progress(phase label, done, total)
SweepProgress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class SweepOptions:
    batches: tuple[int, ...] = (1, 2, 4, 8)
    tokens: int = 16
    budget: str | None = None  # "512MiB", "1.5GB", "50%" of the packed size; None: no limit
    repeat: int = 3
    cache_policy: str = "read-only"
    prepared: Path | None = None
    prompt: tuple[int, ...] = (1, 2, 3, 4)
    compare_ort: bool = False
    threads: int | None = None
    trust_symlinks: bool = False
    fuse: bool = True  # fuse standard-op patterns at resolve (core/model/fusion.py)
    device: str = "cpu"  # --device cuda: each row also runs on the device (docs/profile.md, "On a device")

    def __post_init__(self) -> None:
        from onnx_prep.core.option_ranges import MAX_BATCH, MAX_TOKENS, check_range

        if not self.batches or len(self.batches) > MAX_BATCH_SIZES:
            raise UsageError(f"--batch-sweep takes 1 to {MAX_BATCH_SIZES} batch sizes, got {len(self.batches)}")
        for n in self.batches:
            check_range("a --batch-sweep size", n, 1, MAX_BATCH)
        if len(set(self.batches)) != len(self.batches):
            raise UsageError(f"--batch-sweep sizes repeat: {list(self.batches)}")
        check_range("--tokens", self.tokens, 2, MAX_TOKENS)  # a decode step after the prefill
        check_range("--repeat", self.repeat, 1, 100)
        if self.cache_policy not in ("disabled", "read-only", "require-complete"):
            raise UsageError(f"--cache-policy {self.cache_policy!r}: a sweep reads the cache or not "
                             "(disabled, read-only, require-complete); build it with onnx-prep build-cache")
        if self.device != "cpu":  # the CPU path imports nothing of CUDA
            from onnx_prep.core.cuda.device_selection import require_device

            require_device(self.device)


_PERCENT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*%\s*$")


def parse_budget(text: str | None, packed_bytes: int) -> int | None:
    """Bytes of a ``--budget``: a size (``512MiB``, ``1.5GB``) or a percentage of the
    packed size (``50%``); None for no limit."""
    if text is None:
        return None
    m = _PERCENT.match(text)
    if m is not None:
        pct = float(m.group(1))
        if not 0 < pct <= 1000:
            raise UsageError(f"--budget {text!r}: a percentage in (0, 1000]")
        return int(packed_bytes * pct / 100)
    from onnx_prep.core.runtime.memory_size import parse_size

    try:
        return parse_size(text)
    except UsageError:
        raise UsageError(f"--budget must be a size like 512MiB or 1.5GB, or a percentage of the packed "
                         f"size like 50%, got {text!r}") from None


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _prompts(base: tuple[int, ...], n: int, vocab: int | None) -> list[list[int]]:
    """Row 0 is ``base``; the others differ from it (each id shifted by the row), so row
    identity compares a row that shares the batch with different neighbours."""
    top = vocab or (max(base) + n + 1)
    return [[(t + r) % top for t in base] for r in range(n)]


def record_batch_sweep(model: Path, options: SweepOptions, *, progress: SweepProgress | None = None,
                       warn: Callable[[str], None] | None = None) -> dict:
    import numpy as np

    from onnx_prep.core.decode.decoder_io import DecoderIO
    from onnx_prep.core.decode.export_hints import ExportHints, check_request
    from onnx_prep.core.decode.model_kind import model_kind
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.core.plan.execution_plan import build_prepared_execution_plan
    from onnx_prep.core.profile.machine import describe_machine

    resolved = resolve_model(Path(model), trust_symlinks=options.trust_symlinks, fuse=options.fuse)
    kind = model_kind(resolved.inputs)
    if not kind.is_decoder:
        raise UsageError(f"--batch-sweep decodes a decoder LLM; this model is {kind.reason}",
                         Where(model=str(resolved.model_path)),
                         hint="profile its load without --batch-sweep (one forward: --shape / --inputs)")
    io = DecoderIO.discover(resolved.inputs, resolved.outputs, None, model=str(resolved.model_path),
                            hints=lambda: ExportHints.for_model(resolved.model_path))
    for n in sorted({1, *options.batches}):  # batch 1 is the reference: a fixed dim refuses before loading
        check_request(io, ExportHints.from_config(resolved.model_path) or ExportHints(), batch=n,
                      prompt_len=len(options.prompt), tokens=options.tokens, model=str(resolved.model_path))
    plan = build_prepared_execution_plan(resolved)
    packed = sum(r.packed_bytes for r in plan.requirements)
    budget = parse_budget(options.budget, packed)
    step_bytes = [sum(plan.by_key[k].packed_bytes for k in plan.by_id[s.task_id].prepared_requirements)
                  for s in plan.steps]
    if budget is not None and budget < max(step_bytes):
        raise UsageError(f"--budget {options.budget} ({budget:,} bytes) is below the largest step's prepared "
                         f"objects ({max(step_bytes):,} bytes): no step could run",
                         hint=f"give at least {max(step_bytes) / 2**20:,.1f} MiB")
    # what one forward consumes: every step's objects (the accesses hit rates are over)
    accesses = sum(len(plan.by_id[s.task_id].prepared_requirements) for s in plan.steps)
    access_bytes = sum(step_bytes)
    streaming = budget is not None and budget < packed
    batches = tuple(sorted(options.batches))
    ref_batches = batches if 1 in batches else (1, *batches)
    total = len(ref_batches) * options.repeat * (2 if streaming else 1) + (len(ref_batches) if options.compare_ort else 0)
    total += len(ref_batches) * options.repeat if options.device == "cuda" else 0
    done = 0

    def tick(label: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(label, done, total)

    if progress is not None:
        progress("batch sweep", 0, total)
    runs: dict[tuple[int, bool], list[dict]] = {}
    for n in ref_batches:
        prompts = np.array(_prompts(options.prompt, n, io.vocab_size), dtype=np.int64)
        for limited in ((True, False) if streaming else (budget is not None,)):
            for _ in range(options.repeat):
                runs.setdefault((n, limited), []).append(
                    _one_run(resolved, io, prompts, options, budget if limited else None, warn))
                tick(f"batch {n}{'' if limited else ' (ample)'}")
    read_rate = _read_rate(resolved, options) if streaming else None
    ort = {}
    if options.compare_ort:
        for n in ref_batches:
            ort[n] = _ort_run(resolved.model_path, io, np.array(_prompts(options.prompt, n, io.vocab_size)),
                              options)
            tick(f"ort batch {n}")
    device = None
    if options.device == "cuda":
        device = _device_runs(resolved, io, ref_batches, options, tick)
    base_tokens = runs[(1, budget is not None)][0]["tokens"][0]
    rows = []
    for n in batches:
        rs = runs[(n, budget is not None)]
        first = rs[0]
        emitted = n * (options.tokens - 1)
        c = first["counters"]
        identical_counters = all(r["counters"] == c for r in rs)
        step_med = [statistics.median(r["step_ms"][1:]) for r in rs]
        row = {
            "batch": n,
            "tokens_emitted": emitted,
            "bytes_paged_per_token": c["page_in_bytes"] / emitted,
            "page_ins_per_token": c["page_ins"] / emitted,
            "hit_rate": 1 - c["page_ins"] / (accesses * (options.tokens - 1)),
            "byte_hit_rate": 1 - c["page_in_bytes"] / (access_bytes * (options.tokens - 1)),
            "evictions": c["evictions"],
            "page_ins": c["page_ins"],
            "page_in_bytes": c["page_in_bytes"],
            "prefill_page_ins": first["prefill_page_ins"],
            "counters_identical": identical_counters,
            "tokens_per_s": _spread([emitted / (sum(r["step_ms"][1:]) / 1e3) for r in rs]),
            "step_ms": _spread(step_med),
            "first_output_ms": _spread([r["step_ms"][0] for r in rs]),
            "peak_prepared_bytes": max(r["peak_prepared"] for r in rs),
            "row_identity": _identity(first["tokens"][0], base_tokens),
            "ample_step_ms": None, "read_ms": None, "pipelining": None,
            "ort_tokens_per_s": ort.get(n),
            "device": None if device is None else _device_row(device["runs"][n], first["tokens"], n, options),
        }
        if streaming:
            ample = statistics.median(statistics.median(r["step_ms"][1:]) for r in runs[(n, False)])
            per_step = c["page_in_bytes"] / (options.tokens - 1)
            read_ms = per_step / read_rate * 1e3
            row.update(ample_step_ms=ample, read_ms=read_ms,
                       pipelining=row["step_ms"]["median"] / max(ample, read_ms))
        rows.append(row)
    return {
        "schema": SCHEMA,
        "model": str(resolved.model_path),
        "machine": describe_machine(),
        "tokens": options.tokens,
        "repeat": options.repeat,
        "prompt": list(options.prompt),
        "packed_bytes": packed,
        "largest_step_bytes": max(step_bytes),
        "budget": options.budget,
        "budget_bytes": budget,
        "streaming": streaming,
        "cache_policy": options.cache_policy,
        "fuse": options.fuse,
        "read_rate_bytes_per_s": read_rate,
        "ort": "no budget: ONNX Runtime holds every weight" if options.compare_ort else None,
        "device": None if device is None else device["summary"],
        "rows": rows,
    }


def _identity(tokens, base) -> dict:
    diverged = next((i for i, (a, b) in enumerate(zip(tokens, base)) if a != b), None)
    return {"identical": diverged is None, "first_divergence_step": diverged}


def _one_run(resolved, io, prompts, options: SweepOptions, budget: int | None, warn) -> dict:
    """One fresh session decoding ``prompts``; its tokens, step times and the counters
    over the decode steps (after the prefill)."""
    from onnx_prep.core.decode.generation import greedy_decode
    from onnx_prep.core.runtime.arenas import Arena, MemoryBudget
    from onnx_prep.core.runtime.session import Session

    cache = None
    if options.cache_policy != "disabled":
        from onnx_prep.core.cache.prepared_cache import PreparedCache

        cache = PreparedCache(resolved, options.prepared, policy=options.cache_policy, warn=warn,
                              trust_symlinks=options.trust_symlinks)
    mem = MemoryBudget(limits={Arena.PREPARED: budget} if budget is not None else None)
    kw = {} if options.threads is None else {"cpu_workers": options.threads, "intra_op_threads": options.threads}
    marks = []
    try:
        with Session(resolved, budget=mem, cache=cache, **kw) as s:
            def on_step(ev) -> None:
                st = s.stats()
                marks.append((st.page_ins, st.page_in_bytes, st.evictions))

            result = greedy_decode(s, io, prompts, options.tokens, on_step=on_step)
            peak = mem.peak(Arena.PREPARED)
    finally:
        if cache is not None:
            cache.close()
    (p0, b0, e0), (p1, b1, e1) = marks[0], marks[-1]
    return {"tokens": result.tokens.tolist(), "step_ms": list(result.step_ms),
            "counters": {"page_ins": p1 - p0, "page_in_bytes": b1 - b0, "evictions": e1 - e0},
            "prefill_page_ins": p0, "peak_prepared": peak}


def _read_rate(resolved, options: SweepOptions) -> float:
    """Bytes per second of reading what page-ins read (the cache's payload files, or
    the model's data files without one), warm, into one reused buffer: the "read
    alone" time of the pipelining figure: into a 64 MiB buffer, larger than the CPU's
    caches, as page-ins write to memory. At most 512 MiB is read."""
    import numpy as np

    files: list[Path] = []
    if options.cache_policy != "disabled":
        from onnx_prep.core.cache.manifest import read_manifest
        from onnx_prep.core.cache.prepared_cache import default_cache_path

        path = options.prepared or default_cache_path(resolved.model_path)
        m = read_manifest(path)
        if m is not None and m.entries:
            files = [path.parent / f for f in sorted({e.file for e in m.entries})]
    if not files:
        files = [resolved.model_dir / f for f in sorted({w.file for w in resolved.manifest})]
    buf = np.empty(64 << 20, dtype=np.uint8)
    mv = memoryview(buf)
    cap, got = 512 << 20, 0
    t0 = time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            pos = 0
            while got < cap:
                n = os.preadv(fd, [mv], pos)
                if n == 0:
                    break
                pos += n
                got += n
        finally:
            os.close(fd)
    return got / max(time.perf_counter() - t0, 1e-9)


def _ort_run(path: Path, io, prompts, options: SweepOptions) -> dict | None:
    from onnx_prep.core.decode.generation import greedy_decode
    from onnx_prep.core.decode.ort_runner import OrtRunner

    try:
        runner = OrtRunner(path, threads=options.threads)
    except Exception as exc:  # noqa: BLE001 - absent or refusing: the column says so
        return {"error": f"{type(exc).__name__}: {exc}"}
    rates = []
    for _ in range(options.repeat):
        r = greedy_decode(runner, io, prompts, options.tokens)
        rates.append(prompts.shape[0] * (options.tokens - 1) / (sum(r.step_ms[1:]) / 1e3))
    return _spread(rates)


def _device_runs(resolved, io, batches, options: SweepOptions, tick) -> dict:
    """Per batch size, ``options.repeat`` decodes on the CUDA device (a fresh decoder
    each): tokens, step times and the decoder's counters over the decode steps."""
    import numpy as np

    from onnx_prep.core.cuda.device_decoder import open_device_decoder
    from onnx_prep.core.cuda.device_selection import open_driver
    from onnx_prep.core.decode.generation import greedy_decode

    driver = open_driver()
    g = driver.allocation_granularity(0)
    committed = _device_committed(resolved, g)  # what every object commits on the device, all resident
    budget = parse_budget(options.budget, committed)  # sized against what the device commits
    runs: dict[int, list[dict]] = {}
    summary = None
    for n in batches:
        prompts = np.array(_prompts(options.prompt, n, io.vocab_size), dtype=np.int64)
        for _ in range(options.repeat):
            marks: list[dict] = []
            # loaded as the CPU's columns are: from the prepared cache where it has the objects
            cache = None
            if options.cache_policy != "disabled":
                from onnx_prep.core.cache.prepared_cache import PreparedCache

                cache = PreparedCache(resolved, options.prepared, policy=options.cache_policy,
                                      trust_symlinks=options.trust_symlinks)
            try:
                dec = open_device_decoder(resolved, driver, budget=budget, trust_symlinks=options.trust_symlinks,
                                          cache=cache)
            except BaseException:
                if cache is not None:
                    cache.close()
                raise
            if cache is not None:
                dec.own(cache)  # its page-ins read the cache again: closed with the decoder
            with dec:
                result = greedy_decode(dec, io, prompts, options.tokens,
                                       on_step=lambda ev, dec=dec: marks.append(dec.counters()))
                if summary is None:
                    summary = {"name": driver.device_name(0), "granularity": g, "committed_bytes": committed,
                               "budget_bytes": budget,
                               "segments_per_step": marks[-1]["segments_per_step"],
                               "capture_reason": marks[-1]["capture_reason"]}
            first, last = marks[0], marks[-1]
            runs.setdefault(n, []).append({
                "tokens": result.tokens.tolist(), "step_ms": list(result.step_ms),
                "counters": {k: last[k] - first[k] for k in ("page_ins", "page_in_bytes", "evictions", "captures",
                                                            "replays", "fallbacks", "invalidations", "uses",
                                                            "hits", "hit_bytes")},
                "peak_committed_bytes": last["peak_committed_bytes"]})
            tick(f"device batch {n}")
    return {"runs": runs, "summary": summary}


def _device_committed(resolved, granularity: int) -> int:
    """The device bytes every object of ``resolved`` commits all resident (the device
    plan's figure: packed objects in whole granules each, raw weights sharing theirs)."""
    from onnx_prep.core.plan.device_target import DeviceTarget, device_memory
    from onnx_prep.core.plan.execution_plan import build_prepared_execution_plan

    target = DeviceTarget("cuda", granularity=granularity, granularity_given=True)
    return device_memory(build_prepared_execution_plan(resolved, device=target))["committed_bytes"]


def _device_row(rs: list[dict], cpu_tokens, n: int, options: SweepOptions) -> dict:
    first = rs[0]
    c = first["counters"]
    emitted = n * (options.tokens - 1)
    total = c["hit_bytes"] + c["page_in_bytes"]
    return {
        "bytes_to_device_per_token": c["page_in_bytes"] / emitted,
        "page_ins_per_token": c["page_ins"] / emitted,
        "evictions": c["evictions"],
        "byte_hit_rate": c["hit_bytes"] / total if total else 1.0,
        "captures": c["captures"], "replays": c["replays"], "fallbacks": c["fallbacks"],
        "invalidations": c["invalidations"],
        "counters_identical": all(r["counters"] == c for r in rs),
        "tokens_per_s": _spread([emitted / (sum(r["step_ms"][1:]) / 1e3) for r in rs]),
        "peak_committed_bytes": max(r["peak_committed_bytes"] for r in rs),
        "tokens_identical_to_cpu": all(r["tokens"] == cpu_tokens for r in rs),
    }
