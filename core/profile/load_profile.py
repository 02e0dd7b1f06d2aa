"""``onnx-prep profile [MODEL]``'s record: the load, measured per configuration (mode x
cache policy), each repeat in a fresh process (docs/profile.md).

``profile_load(model_path, LoadProfileOptions(...), progress=, warn=) -> dict`` (schema
``onnx-prep.profile-load/2``, core/schemas/profile-load.schema.json). For each repeat,
every configuration's load runs in its own child process
(``python -m onnx_prep.core.profile.load_sample``: the runtime's ordinary load, nothing
profiler-only), the configurations interleaved and their order rotated from repeat to
repeat so that drift and what one load leaves behind weigh on all alike. Before each:
with ``cold``, the model's files (and the cache's) are dropped from the page cache
(core/profile/page_cache.py; whether the drop took is recorded); with the cache policy
``build-if-missing`` ("first build"), the load gets an empty cache folder of its own,
so every repeat builds the cache from nothing (the model's own cache is never touched).
``trace`` adds one more load of the first configuration (parallel where asked for),
before the measured ones and apart from them, writing its Chrome trace; ``compare="ort"`` runs ONNX
Runtime on the same feeds, as many times, each in a fresh process too. The first
forward is a decoder's fixed prompt, or one forward of any other model (or of any model
given ``inputs`` / ``shape``), as core/profile/load_feeds.py decides.
"""
from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from onnx_prep.core.errors import OnnxPrepError, UsageError, Where
from onnx_prep.core.profile.load_sample import MODES, ORT_DECODE_TOKENS, LoadSpec

SCHEMA = "onnx-prep.profile-load/2"
MAX_REPEAT = 1000

# The figures of a sample, in the order a table shows them: (key, unit). docs/profile.md
# defines each.
FIGURES: tuple[tuple[str, str], ...] = (
    ("resolve_ms", "ms"), ("plan_ms", "ms"), ("session_ms", "ms"),
    ("first_step_ms", "ms"), ("first_output_ms", "ms"), ("all_ready_ms", "ms"),
    ("open_to_first_output_ms", "ms"),
    ("prepack_ms", "ms"), ("prepack_wall_ms", "ms"), ("prepack_kernel_ms", "ms"),
    ("source_bytes", "bytes"), ("packed_bytes", "bytes"), ("packed_bytes_mapped", "bytes"),
    ("packed_bytes_pmd_mapped", "bytes"), ("prepacks", "count"), ("packed_reads", "count"),
    ("peak_preparation_bytes", "bytes"), ("peak_prepared_bytes", "bytes"),
    ("peak_execution_bytes", "bytes"), ("peak_io_bytes", "bytes"), ("max_in_flight_bytes", "bytes"),
    ("overlap", "fraction"), ("cache_commit_ms", "ms"),
    ("session_tasks", "count"), ("executed_tasks", "count"), ("cpu_ms", "ms"),
)
# what the sequential / parallel ratio is printed for
RATIO_FIGURES = ("first_output_ms", "all_ready_ms", "prepack_wall_ms")
ORT_FIGURES: tuple[tuple[str, str], ...] = (
    ("create_ms", "ms"), ("first_run_ms", "ms"), ("first_output_ms", "ms"), ("decode_ms_per_token", "ms"))


def parse_modes(text: str) -> tuple[str, ...]:
    """``--mode``: sequential, parallel, or both (parallel first)."""
    t = text.strip().lower()
    if t == "both":
        return MODES
    if t not in MODES:
        raise UsageError(f"--mode must be sequential, parallel or both, got {text!r}")
    return (t,)


def parse_policies(text: str) -> tuple[str, ...]:
    """``--cache-policy``: one policy, or several separated by commas."""
    items = [p.strip() for p in text.split(",") if p.strip()]
    if not items:
        raise UsageError("--cache-policy is empty", hint="give one policy or several, comma-separated")
    if len(set(items)) != len(items):
        raise UsageError(f"--cache-policy names a policy twice: {text!r}")
    from onnx_prep.core.cache.prepared_cache import POLICIES

    for p in items:
        if p not in POLICIES:
            raise UsageError(f"--cache-policy {p!r} is not a policy", hint=f"choose from {', '.join(POLICIES)}")
    return tuple(items)


@dataclass(frozen=True)
class LoadProfileOptions:
    """What ``onnx-prep profile`` measures (checked at construction: UsageError)."""

    modes: tuple[str, ...] = ("parallel",)
    cache_policies: tuple[str, ...] = ("read-only",)
    repeat: int = 5
    cold: bool = False
    trace: Path | None = None
    compare: str | None = None
    prepared: Path | None = None  # the cache's manifest (default: beside the model)
    verify_digests: bool = True
    trust_symlinks: bool = False
    inputs: tuple[str, ...] = ()  # --inputs: one forward on these files (core/profile/load_feeds.py)
    shape: tuple[str, ...] = ()  # --shape: symbolic dims of the generated inputs
    fuse: bool = True  # fuse standard-op patterns at resolve (core/model/fusion.py)
    device: str = "cpu"  # --device: cuda is refused, saying why (core/cuda/device_selection.py)

    def __post_init__(self) -> None:
        from onnx_prep.core.option_ranges import check_range

        check_range("--repeat", self.repeat, 1, MAX_REPEAT)
        if not self.modes or any(m not in MODES for m in self.modes):
            raise UsageError(f"modes must be among {', '.join(MODES)}, got {self.modes!r}")
        if self.compare not in (None, "ort"):
            raise UsageError(f"--compare must be ort, got {self.compare!r}")
        if "build-if-missing" in self.cache_policies and not self.verify_digests:
            raise UsageError("a prepared cache persists only verified bytes: digest verification cannot be off "
                             "while it is built", hint="drop --no-verify-digests, or the build-if-missing policy")
        if self.trace is not None:
            folder = Path(self.trace).parent
            if not folder.is_dir():
                raise UsageError(f"--trace: folder {folder} does not exist", Where(file=str(self.trace)))
            if Path(self.trace).is_dir():
                raise UsageError("--trace names a folder, not a file", Where(file=str(self.trace)))
        if self.device != "cpu":  # the CPU path imports nothing of CUDA
            from onnx_prep.core.cuda.device_selection import refuse_on_device, require_device

            refuse_on_device("the load profile (profile without --batch-sweep)", require_device(self.device))
        # Last: the policy names live beside the cache reader, which imports numpy and onnx.
        object.__setattr__(self, "cache_policies", parse_policies(",".join(self.cache_policies)))

    @property
    def configurations(self) -> list[tuple[str, str]]:
        return [(m, p) for p in self.cache_policies for m in self.modes]


def _stats(xs: list) -> dict | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def _run_child(spec: LoadSpec, warn: Callable[[str], None] | None) -> dict:
    """One load in a fresh process; its sample, or the error it raised, raised here."""
    with tempfile.TemporaryDirectory(prefix="onnx-prep-profile-") as tmp:
        out = Path(tmp) / "sample.json"
        proc = subprocess.run([sys.executable, "-m", "onnx_prep.core.profile.load_sample", spec.to_json(), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if proc.returncode == 130:
            raise KeyboardInterrupt
        doc = json.loads(out.read_text()) if out.is_file() else None
    if doc is None or "traceback" in doc:
        detail = (doc or {}).get("traceback") or proc.stderr.strip() or f"exit status {proc.returncode}"
        raise RuntimeError(f"the profile's child process failed ({spec.runtime} {spec.mode}/{spec.cache_policy}):\n"
                           f"{detail}")
    if "error" in doc:
        raise OnnxPrepError(doc["error"], exit_code=doc["exit_code"])
    for note in doc.get("notes", ()):
        if warn is not None:
            warn(note)
    return doc["sample"]


def _cache_files(resolved, policy: str, prepared: Path | None, warn, *,
                 trust_symlinks: bool = False) -> tuple[list[Path], dict | None]:
    """The cache's files a load under ``policy`` reads (for --cold), and its summary;
    opening it here also refuses what the load would refuse (require-complete, say)."""
    if policy in ("disabled", "build-if-missing"):
        return [], None
    from onnx_prep.core.cache.prepared_cache import PreparedCache

    cache = PreparedCache(resolved, prepared, policy=policy, warn=warn, trust_symlinks=trust_symlinks)
    try:
        files = [] if cache.manifest is None else \
            [cache.path] + [cache.folder / f for f in sorted(cache.manifest.files) if (cache.folder / f).is_file()]
        s = cache.summary()
        return files, {"path": s["path"], "exists": s["exists"], "generation": s["generation"],
                       "entries": s["entries"]}
    finally:
        cache.close()


def profile_load(model_path: Path, options: LoadProfileOptions, *,
                 progress: Callable[[int, int, str], None] | None = None,
                 warn: Callable[[str], None] | None = None) -> dict:
    """See the module docstring. ``progress(done, total, label)`` after each load."""
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.core.profile.machine import describe_machine
    from onnx_prep.core.profile.machine_activity import MachineActivity
    from onnx_prep.core.profile.page_cache import drop_files

    model_path = Path(model_path)
    # metadata only; what cannot load is refused here, before any child starts
    resolved = resolve_model(model_path, trust_symlinks=options.trust_symlinks, fuse=options.fuse)
    spec0 = LoadSpec(model=str(model_path), inputs=tuple(options.inputs), shape=tuple(options.shape),
                     trust_symlinks=options.trust_symlinks, fuse=options.fuse)
    first = spec0.feeds(resolved.inputs, resolved.outputs)  # feeds that cannot be made fail here, in one line
    if options.compare == "ort":
        from onnx_prep.core.decode.ort_runner import import_onnxruntime

        import_onnxruntime()
    model_files = [model_path] + sorted({resolved.model_dir / d.file for d in resolved.manifest if d.file})
    caches = {p: _cache_files(resolved, p, options.prepared, warn, trust_symlinks=options.trust_symlinks)
              for p in options.cache_policies}
    configs = options.configurations
    total = options.repeat * (len(configs) + (1 if options.compare else 0)) + (1 if options.trace else 0)
    done = 0

    def spec(mode: str, policy: str, **kw) -> LoadSpec:
        return replace(spec0, mode=mode, cache_policy=policy,
                       prepared=None if options.prepared is None else str(options.prepared),
                       verify_digests=options.verify_digests, **kw)

    def load(s: LoadSpec, drops: list) -> dict:
        nonlocal done
        tmp = None
        try:
            if s.cache_policy == "build-if-missing":  # a first build: an empty cache folder of its own
                try:
                    tmp = Path(tempfile.mkdtemp(prefix=".onnx-prep-profile-", dir=model_path.parent))
                except OSError as exc:
                    raise UsageError(f"a first build (build-if-missing) needs a folder it can write beside the "
                                     f"model: {exc.strerror}", Where(file=str(model_path.parent)),
                                     hint="copy the model somewhere writable") from exc
                s = replace(s, prepared=str(tmp / f"{model_path.stem}.prepared.onnx"))
            if options.cold:
                drops.append(drop_files(model_files + caches.get(s.cache_policy, ([], None))[0]))
            sample = _run_child(s, warn)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        done += 1
        if progress is not None:
            progress(done, total, f"{s.runtime if s.runtime == 'ort' else s.mode + '/' + s.cache_policy}")
        return sample

    activity0 = MachineActivity.now()
    trace_of = None
    if options.trace is not None:  # first: a trace that cannot be written fails before the repeats
        trace_of = next(c for c in configs if c[0] == "parallel") if "parallel" in options.modes else configs[0]
        load(spec(*trace_of, trace=str(Path(options.trace).resolve())), [])
    samples: dict[tuple[str, str], list[dict]] = {c: [] for c in configs}
    drops: dict[tuple[str, str], list[dict]] = {c: [] for c in configs}
    ort_samples: list[dict] = []
    ort_drops: list[dict] = []
    units = configs + ([("ort", "")] if options.compare else [])
    for r in range(options.repeat):
        for c in units[r % len(units):] + units[:r % len(units)]:
            if c[0] == "ort":
                ort_samples.append(load(spec("parallel", "disabled", runtime="ort"), ort_drops))
            else:
                samples[c].append(load(spec(*c), drops[c]))
    activity = MachineActivity.now().since(activity0)

    rows = []
    for (mode, policy) in configs:
        xs = samples[(mode, policy)]
        rows.append({"name": f"{mode}/{policy}", "mode": mode, "cache_policy": policy,
                     "cache": caches[policy][1], "samples": xs,
                     "summary": {k: _stats([x.get(k) for x in xs]) for k, _ in FIGURES},
                     "page_cache": _drop_summary(drops[(mode, policy)], options.cold)})
    by = {(r["mode"], r["cache_policy"]): r for r in rows}
    ratios = []
    for policy in options.cache_policies:
        if ("sequential", policy) in by and ("parallel", policy) in by:
            seq, par = by[("sequential", policy)]["summary"], by[("parallel", policy)]["summary"]
            for f in RATIO_FIGURES:
                if seq.get(f) and par.get(f) and par[f]["median"] > 0:
                    ratios.append({"cache_policy": policy, "figure": f,
                                   "sequential_over_parallel": seq[f]["median"] / par[f]["median"]})
    compare = None
    if options.compare:
        ort_summary = {k: _stats([x.get(k) for x in ort_samples]) for k, _ in ORT_FIGURES}
        ours_over = {}
        for row in rows:
            ours, theirs = row["summary"]["open_to_first_output_ms"], ort_summary["first_output_ms"]
            if ours and theirs and theirs["median"] > 0:
                ours_over[row["name"]] = ours["median"] / theirs["median"]
        compare = {"runtime": "ort", "decode_tokens": ORT_DECODE_TOKENS if first.decodes else 0,
                   "samples": ort_samples,
                   "summary": ort_summary, "page_cache": _drop_summary(ort_drops, options.cold),
                   "open_to_first_output_over_ort": ours_over}
    return {"schema": SCHEMA, "model": str(model_path), **first.describe(),
            "repeat": options.repeat, "cold": options.cold, "verify_digests": options.verify_digests,
            "fuse": options.fuse,
            "machine": describe_machine(), "configurations": rows, "ratios": ratios, "compare": compare,
            "trace": None if trace_of is None else {"path": str(options.trace),
                                                     "configuration": f"{trace_of[0]}/{trace_of[1]}"},
            "machine_activity": activity}


def _drop_summary(drops: list[dict], cold: bool) -> dict:
    """What --cold did before this configuration's loads: requested, and whether every
    drop took (None: not measurable here), with the most bytes that stayed resident."""
    if not cold:
        return {"cold": False, "drops": 0, "all_dropped": None, "max_resident_after": None}
    known = [d["resident_after"] for d in drops if d["resident_after"] is not None]
    return {"cold": True, "drops": len(drops),
            "all_dropped": None if len(known) < len(drops) else all(n == 0 for n in known),
            "max_resident_after": max(known) if known else None}
