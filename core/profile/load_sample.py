"""One load, measured: a fresh Session over the model, its first output (a decoder's
fixed prompt, or one forward of any other model: core/profile/load_feeds.py), and the
figures of docs/profile.md taken from the runtime's own record
(``Session.stats()``, ``Session.timeline()``, the run's context). This module is also
the child process ``onnx-prep profile`` starts for each repeat, so that every load
meets a process with nothing loaded, mapped or allocated before it:

    python -m onnx_prep.core.profile.load_sample SPEC_JSON OUT_JSON

``SPEC_JSON`` is a :class:`LoadSpec` as JSON; the child writes ``{"sample": {...}}``,
or ``{"error": line, "exit_code": n}`` for an error the library raised on purpose, to
``OUT_JSON``. The load is the runtime's ordinary one: ``run_async`` of the first
forward, ``prepare_async`` of every session task right behind it (what a caller that
wants its first output soonest does), on the scheduler ``mode`` asks for.

With ``runtime="ort"`` the same feeds go through ONNX Runtime instead
(:func:`measure_ort`: session creation, first run, and for a decoder a few decode steps).
"""
from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from onnx_prep.core.profile.load_feeds import load_feeds

MODES = ("parallel", "sequential")
ORT_DECODE_TOKENS = 4  # decode steps ONNX Runtime runs after its first output (--compare ort)


@dataclass(frozen=True)
class LoadSpec:
    """What one load measures (the child's argument)."""

    model: str
    mode: str = "parallel"  # MODES
    cache_policy: str = "disabled"  # core/cache/prepared_cache.POLICIES
    prepared: str | None = None  # the cache's manifest (None: beside the model)
    verify_digests: bool = True
    trust_symlinks: bool = False
    trace: str | None = None  # write a Chrome trace of this load here (core/profile/chrome_trace.py)
    runtime: str = "prepared"  # or "ort" (measure_ort)
    inputs: tuple[str, ...] = ()  # --inputs: one forward on these files (load_feeds.py)
    shape: tuple[str, ...] = ()  # --shape: symbolic dims of generated inputs
    fuse: bool = True  # fuse standard-op patterns at resolve (core/model/fusion.py)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LoadSpec:
        doc = json.loads(text)
        return cls(**{**doc, "inputs": tuple(doc.get("inputs", ())), "shape": tuple(doc.get("shape", ()))})

    def feeds(self, graph_inputs, graph_outputs):
        """The first forward's feeds for a model with this graph I/O
        (``load_feeds.LoadFeeds``)."""
        return load_feeds(graph_inputs, graph_outputs, self.model, self.inputs, self.shape)


@dataclass
class LoadMeasurement:
    """One load: its figures (``sample``) and what a trace is drawn from."""

    sample: dict[str, Any]
    plan: Any  # the session's PreparedExecutionPlan
    events: list  # Session.timeline(): the session's scheduler tasks, completion order
    step_log: list  # RuntimeContext.step_log: (step index, start ns, end ns, worker)
    arena_samples: list  # LiveTrace.samples(): (ns, {arena: bytes}) after every change
    base_ns: int  # when Session construction began (the trace's time 0)
    t0_ns: int  # when the load began: the first submission
    marks: dict[str, int]  # first_step / first_output / all_ready, in ns


@dataclass
class FirstOutput:
    """A load to the first output (:func:`load_to_first_output`): times from ``t0_ns``,
    the first submission."""

    t0_ns: int
    ctx: Any  # the run's RuntimeContext (first_step_ns, done_ns, step_log)
    first_step_ms: float  # the first invocation step starts
    first_output_ms: float  # the forward's outputs are there
    all_ready_ns: int  # the last session task ended
    cpu_ms: float  # process CPU (user + system) over the load

    @property
    def all_ready_ms(self) -> float:
        return (self.all_ready_ns - self.t0_ns) / 1e6


def load_to_first_output(session, feeds) -> FirstOutput:
    """The load the profile measures, on an opened session: ``run_async`` of one forward
    first, ``prepare_async`` of every session task right behind it, both waited for."""
    from onnx_prep.core.plan.task import TaskKind
    from onnx_prep.core.runtime.session import RuntimeContext

    cpu0 = _cpu_ms()
    ctx = RuntimeContext(feeds)
    t0 = time.perf_counter_ns()
    run = session.run_async(ctx)
    prep = session.prepare_async()
    run.wait()
    prep.wait()
    cpu_ms = _cpu_ms() - cpu0
    ctx.release()
    ends = [e.end_ns for e in session.timeline() if e.start_ns is not None and e.kind is not TaskKind.EXECUTE]
    return FirstOutput(t0, ctx, (ctx.first_step_ns - t0) / 1e6, (ctx.done_ns - t0) / 1e6,
                       max(ends, default=t0), cpu_ms)


def union_ns(intervals) -> list[tuple[int, int]]:
    """The union of ``(start, end)`` intervals, as disjoint sorted intervals."""
    out: list[list[int]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(intervals) -> int:
    return sum(e - s for s, e in intervals)


def _intersection(a, b) -> int:
    """Length of the intersection of two unions (each disjoint and sorted)."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap(events) -> float | None:
    """The fraction of I/O time hidden under CPU work (docs/profile.md, "overlap"): the
    union of the read tasks' intervals (read_source, read_packed) that CPU tasks'
    intervals (prepack, constant, execute: the CPU queue) cover, over that union. None
    without reads."""
    from onnx_prep.core.plan.task import ResourceClass, TaskKind

    ran = [e for e in events if e.start_ns is not None]
    io = union_ns((e.start_ns, e.end_ns) for e in ran if e.kind in (TaskKind.READ_SOURCE, TaskKind.READ_PACKED))
    cpu = union_ns((e.start_ns, e.end_ns) for e in ran if e.resource is ResourceClass.CPU)
    total = _length(io)
    return None if total == 0 else _intersection(io, cpu) / total


def _cpu_ms() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return (ru.ru_utime + ru.ru_stime) * 1e3


def measure_load(spec: LoadSpec, *, warn=None) -> LoadMeasurement:
    """Resolve, open the cache under the spec's policy, construct a Session, and load
    (first output and every session task); the figures of docs/profile.md."""
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.core.plan.task import TaskKind, TaskScope
    from onnx_prep.core.runtime.arenas import MemoryBudget
    from onnx_prep.core.runtime.session import Session, SessionOptions

    t = time.perf_counter_ns()
    resolved = resolve_model(Path(spec.model), trust_symlinks=spec.trust_symlinks, fuse=spec.fuse)
    resolve_ms = (time.perf_counter_ns() - t) / 1e6
    feeds = spec.feeds(resolved.inputs, resolved.outputs).arrays
    cache = None
    if spec.cache_policy != "disabled":
        from onnx_prep.core.cache.prepared_cache import PreparedCache

        cache = PreparedCache(resolved, None if spec.prepared is None else Path(spec.prepared),
                              policy=spec.cache_policy, verify_payloads=spec.verify_digests, warn=warn,
                              trust_symlinks=spec.trust_symlinks)
    budget = MemoryBudget()
    try:
        base = time.perf_counter_ns()
        s = Session(resolved, SessionOptions(sequential=spec.mode == "sequential", budget=budget, cache=cache,
                                             verify_digests=spec.verify_digests,
                                             trust_symlinks=spec.trust_symlinks))
        try:
            session_ms = (time.perf_counter_ns() - base) / 1e6
            live = budget.trace_live()
            load = load_to_first_output(s, feeds)
            live.close()
            events = s.timeline()
            st = s.stats()
        finally:
            t_close = time.perf_counter_ns()
            s.close()  # a first build's objects are written before it returns
        commit_ms = None
        if cache is not None and spec.cache_policy == "build-if-missing":
            cache.commit()
            commit_ms = (time.perf_counter_ns() - t_close) / 1e6
    finally:
        if cache is not None:
            cache.close()
    ran = [e for e in events if e.start_ns is not None]
    plan, ctx, t0 = s.plan, load.ctx, load.t0_ns
    prepacks = union_ns((e.start_ns, e.end_ns) for e in ran if e.kind is TaskKind.PREPACK)
    sample = {
        "resolve_ms": resolve_ms,
        "plan_ms": plan.build_ms,
        "session_ms": session_ms,
        "first_step_ms": load.first_step_ms,
        "first_output_ms": load.first_output_ms,
        "all_ready_ms": load.all_ready_ms,
        "open_to_first_output_ms": (ctx.done_ns - t) / 1e6,
        "prepack_ms": (st.tasks["prepack"].run_ns if "prepack" in st.tasks else 0) / 1e6,
        "prepack_wall_ms": _length(prepacks) / 1e6,
        "prepack_kernel_ms": st.prepack_ns / 1e6,
        "source_bytes": st.source_bytes,
        "packed_bytes": st.packed_bytes_read,
        "packed_bytes_mapped": st.packed_bytes_mapped,
        "packed_bytes_pmd_mapped": st.pmd_mapped,
        "prepacks": st.prepacks,
        "packed_reads": st.packed_reads,
        **{f"peak_{a}_bytes": int(st.arena_peaks.get(a, 0)) for a in ("preparation", "prepared", "execution", "io")},
        "max_in_flight_bytes": st.global_peak,
        "overlap": overlap(ran),
        "cache_commit_ms": commit_ms,
        "session_tasks": sum(1 for t in plan.tasks if t.scope is TaskScope.SESSION),
        "executed_tasks": len(ran),
        "cpu_ms": load.cpu_ms,
    }
    marks = {"first_step": ctx.first_step_ns, "first_output": ctx.done_ns,
             "all_ready": load.all_ready_ns}
    m = LoadMeasurement(sample=sample, plan=plan, events=events, step_log=list(ctx.step_log),
                        arena_samples=live.samples(), base_ns=base, t0_ns=t0, marks=marks)
    if spec.trace is not None:
        from onnx_prep.core.profile.chrome_trace import trace_document, write_trace

        write_trace(Path(spec.trace), trace_document(m, label=f"{spec.mode}/{spec.cache_policy}"))
    return m


def measure_ort(spec: LoadSpec) -> dict[str, Any]:
    """ONNX Runtime on the same feeds: session creation (its parse included), the first
    run, then for a decoder ORT_DECODE_TOKENS greedy decode steps (ms per token)."""
    from onnx_prep.core.decode.decoder_io import DecoderIO
    from onnx_prep.core.decode.export_hints import ExportHints
    from onnx_prep.core.decode.generation import greedy_decode
    from onnx_prep.core.decode.ort_runner import OrtRunner

    import numpy as np

    t = time.perf_counter_ns()
    runner = OrtRunner(spec.model)
    create_ms = (time.perf_counter_ns() - t) / 1e6
    try:
        inputs, outputs = runner.value_infos()
        first = spec.feeds(inputs, outputs)  # from ONNX Runtime's own view of the graph's I/O
        if not first.decodes:
            t = time.perf_counter_ns()
            runner.run(first.arrays)
            run_ms = (time.perf_counter_ns() - t) / 1e6
            return {"create_ms": create_ms, "first_run_ms": run_ms, "first_output_ms": create_ms + run_ms,
                    "decode_ms_per_token": None}
        io = DecoderIO.discover(inputs, outputs, model=spec.model,
                                hints=lambda: ExportHints.for_model(spec.model))
        prompt = np.asarray([first.prompt_ids], dtype=np.int64)
        result = greedy_decode(runner, io, prompt, 1 + ORT_DECODE_TOKENS, model=spec.model)
    finally:
        runner.close()
    rate = result.decode_steps_per_s
    return {"create_ms": create_ms, "first_run_ms": result.first_output_ms,
            "first_output_ms": create_ms + result.first_output_ms,
            "decode_ms_per_token": None if not rate else 1e3 / rate}


def main(argv: list[str] | None = None) -> int:
    """The child: measure the spec, write the sample (or the error) as JSON."""
    from onnx_prep.core.errors import EXIT_INTERNAL, OnnxPrepError

    spec_json, out_path = (argv if argv is not None else sys.argv[1:])
    spec = LoadSpec.from_json(spec_json)
    notes: list[str] = []
    try:
        sample = measure_ort(spec) if spec.runtime == "ort" else measure_load(spec, warn=notes.append).sample
        doc, code = {"sample": sample, "notes": notes}, 0
    except OnnxPrepError as exc:
        doc, code = {"error": exc.one_line(), "exit_code": exc.exit_code}, exc.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - a bug in the child: the parent reports it as one
        import traceback

        doc, code = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
                     "exit_code": EXIT_INTERNAL}, EXIT_INTERNAL
    tmp = Path(out_path + ".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(out_path)
    return code


if __name__ == "__main__":
    sys.exit(main())
