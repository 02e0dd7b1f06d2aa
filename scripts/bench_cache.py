"""Prepared-cache benchmark: what a cache buys at load time, against no cache and against
ONNX Runtime (the prepared-cache issue's performance protocol).

    .venv/bin/python scripts/bench_cache.py [--model PATH | --preset medium] [--repeats 5]
                                            [--prompt-len 8] [--warm-only] [--no-ort]
                                            [--json FILE] [--quick]

The model (default: the ``medium`` fixture, generated once into the fixture cache) is
never written to: every cache lives in a private temporary folder (``--cache-dir`` /
``--prepared``), so other benchmarks and runs of the cached model are unaffected.

Per page-cache state (warm: the files the measurement reads are read whole just before it,
the share already resident reported, since at scale the run's files outgrow memory; then
cold: posix_fadvise DONTNEED on the model's data file and the caches' files before each
measurement, where the OS has it; --warm-only skips it), and per repeat with the
configurations' order rotated, min / median / max of:

  in-process loads (a fresh Session each; the clock starts after resolution, so it counts
  opening the cache, constructing the session, the load and the first prefill):
    none        no cache
    build       build-if-missing, the cache deleted first: first_output_ms must not wait
                for persistence; persisted_ms is when its generation was committed
    cache       read-only, the cache complete
    cache-zstd  the same from a cache stored with --compress zstd
    first_output_ms (the prefill's outputs, from the cache's and session's open) and
    all_ready_ms (from the first run's start, the session open, to the last session
    task's end: every object in its slot; `profile`'s all_ready_ms); open_ms before it
  packed bytes read alone: the cache's payload files read in 1 MiB steps (``cat`` to
    /dev/null), the floor for a load from the cache; warm, and cold (dropped before each
    read: the disk's rate for those bytes)
  whole processes, spawn to exit (``onnx-prep run --tokens 1``: spawn to first logits),
  with peak RSS (the child's ru_maxrss):
    none / build / cache    ``onnx-prep run --tokens 1 --cache-policy ...``
    none-unverified         no cache, ``--no-verify-digests``: what checking the weights'
                            SHA-256 digests costs a load without a cache (no target)
    ort                     python + numpy + onnxruntime: session creation and the same
                            prefill on the original model
    ort-prepacked           the same on a copy ONNX Runtime saved with its own pre-packed
                            weights (session.save_external_prepacked_constant_initializers)

Then the zstd variant (ratio, decode GB/s, load time), bytes on disk (allocated,
st_blocks x 512: the holes before 2 MiB-aligned payloads take none), and the issue's
targets as ratios of medians with pass/fail. --quick: the tiny model, one repeat (the smoke
test in tests/test_scripts.py; its timings mean nothing).

Before the first spawn, onnx_prep's modules are byte-compiled into their __pycache__, as
``pip install`` of the wheel does (scripts/bytecode.py: an editable install under
PYTHONDONTWRITEBYTECODE=1 would otherwise compile them from source in every process);
the run prints which share of each package the processes import has bytecode, ONNX
Runtime's included.

Every figure is an upper bound on a shared machine: the run ends with how much other work
ran meanwhile.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_load import drop_files  # noqa: E402 - the load benchmark's page-cache drop
from bytecode import describe_bytecode, ensure_bytecode  # noqa: E402 - compiled as pip install does

CHUNK = 1 << 20
IN_PROCESS = ("none", "build", "cache", "cache-zstd")
PROCESSES = ("none", "none-unverified", "build", "cache", "ort", "ort-prepacked")
POLICY = {"none": "disabled", "none-unverified": "disabled", "build": "build-if-missing", "cache": "read-only",
          "cache-zstd": "read-only"}

# One ONNX Runtime process as lean as ONNX Runtime allows: numpy and onnxruntime, the
# session, the prefill (feeds prepared by the parent in an .npz), its first token.
ORT_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np, onnxruntime as ort
feeds = dict(np.load(sys.argv[2]))
opts = ort.SessionOptions()
opts.log_severity_level = 3
t1 = time.perf_counter()
s = ort.InferenceSession(sys.argv[1], opts, providers=["CPUExecutionProvider"])
t2 = time.perf_counter()
logits = s.run([sys.argv[3]], feeds)[0]
t3 = time.perf_counter()
print(json.dumps({"import_ms": (t1 - t0) * 1e3, "open_ms": (t2 - t1) * 1e3, "first_run_ms": (t3 - t2) * 1e3,
                  "token": int(np.argmax(logits[0, -1]))}))
"""


def _stats(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def _fmt(st: dict) -> str:
    return f"{st['min']:10.1f} {st['median']:10.1f} {st['max']:10.1f}"


# ------------------------------------------------------------------ files
def _allocated(path: Path) -> int:
    """Bytes the file system allocated to ``path`` (a hole takes none)."""
    return path.stat().st_blocks * 512


class Files:
    """The model, its caches (raw, zstd, and the one ``build`` recreates) and the ONNX
    Runtime pre-packed copy, all but the model in one temporary folder."""

    def __init__(self, model: Path, work: Path) -> None:
        from onnx_prep.core.cache.prepared_cache import default_cache_path

        self.model, self.work = model, work
        self.dirs = {name: work / name for name in ("cache", "cache-zstd", "build", "ort")}
        for d in self.dirs.values():
            d.mkdir()
        self.cache = {name: default_cache_path(model, self.dirs[name]) for name in ("cache", "cache-zstd", "build")}
        self.ort_copy = self.dirs["ort"] / "prepacked.onnx"
        self.feeds = work / "feeds.npz"

    def clear_build(self) -> None:
        shutil.rmtree(self.dirs["build"])
        self.dirs["build"].mkdir()

    def data_files(self, resolved) -> list[Path]:
        files = {resolved.model_dir / d.file for d in resolved.manifest if d.file}
        for d in self.dirs.values():
            files |= {p for p in d.iterdir() if p.is_file()}
        return sorted(files | {self.model})

    def reads_of(self, resolved, config: str) -> list[Path]:
        """The files a load of ``config`` reads: what a warm load must find in the page cache."""
        sources = {resolved.model_dir / d.file for d in resolved.manifest if d.file} | {self.model}
        if config == "ort-prepacked":
            return sorted(p for p in self.dirs["ort"].iterdir() if p.is_file())
        if config in ("cache", "cache-zstd"):
            sources |= {p for p in self.dirs[config].iterdir() if p.is_file()}
        return sorted(sources)

    def payload_bytes(self, name: str) -> tuple[int, int, int]:
        """(stored bytes, decoded bytes, bytes on disk: payload files and manifest) of a cache.
        On disk is what the file system allocated (st_blocks x 512), not st_size: the
        writer leaves holes before 2 MiB-aligned payloads, which take no disk."""
        from onnx_prep.core.cache.manifest import read_manifest

        m = read_manifest(self.cache[name])
        disk = sum(_allocated(self.dirs[name] / f) for f in m.files) + _allocated(self.cache[name])
        return sum(e.length for e in m.entries), sum(e.decoded_length for e in m.entries), disk


# ------------------------------------------------------------------ measurements
def warm_files(paths: list[Path]) -> float | None:
    """Read each file whole (1 MiB at a time) so that a warm load finds it in the page
    cache; the share of its bytes that was resident before (None: not measurable). At
    scale the run's files (sources, three caches, ONNX Runtime's copy: ~23 GB for the
    7B-shaped model) do not all fit in memory, so a load's files are read again before
    each warm load rather than assumed to be still there."""
    from onnx_prep.core.profile.page_cache import resident_bytes

    total = sum(p.stat().st_size for p in paths)
    resident = [resident_bytes(p) for p in paths]
    read_whole(paths)
    return None if None in resident or total == 0 else sum(resident) / total


def read_whole(paths: list[Path]) -> None:
    """Read each file to its end, 1 MiB at a time, into one buffer (``cat`` to /dev/null)."""
    buf = bytearray(CHUNK)
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def in_process_load(resolved, feeds, files: Files, config: str, *, warm: bool) -> dict:
    from onnx_prep.core.cache.prepared_cache import PreparedCache
    from onnx_prep.core.plan.task import TaskKind
    from onnx_prep.core.runtime.session import RuntimeContext, Session

    if config == "build":
        files.clear_build()
    resident = None if not warm else warm_files(files.reads_of(resolved, config))
    if not warm:
        drop_files(files.data_files(resolved))
    t0 = time.perf_counter_ns()
    cache = None if config == "none" else PreparedCache(
        resolved, files.cache["build" if config == "build" else config], policy=POLICY[config])
    s = Session(resolved, cache=cache, source_pages="keep" if warm else "auto")
    try:
        ctx = RuntimeContext(feeds)
        t_run = time.perf_counter_ns()
        run = s.run_async(ctx)
        prep = s.prepare_async()
        run.wait()
        prep.wait()
        tasks = [e for e in s.timeline() if e.kind is not TaskKind.EXECUTE and e.end_ns is not None]
        st = s.stats()
        # all-ready as `profile` measures it: from the run's start (the session open) to
        # the last session task's end, every object in its slot (docs/profile.md)
        out = {"first_output_ms": (ctx.done_ns - t0) / 1e6, "open_ms": (t_run - t0) / 1e6,
               "all_ready_ms": (max([t_run, *(e.end_ns for e in tasks)]) - t_run) / 1e6,
               "source_bytes": st.source_bytes_read + st.source_bytes_mapped, "packed_bytes": 0,
               "resident_before_warming": resident}
    finally:
        s.close()  # waits for the objects handed to the cache to be written
    if cache is not None:
        if config == "build":
            committed = cache.commit()
            out["persisted_ms"] = (time.perf_counter_ns() - t0) / 1e6
            assert committed["error"] is None and committed["written"] > 0, committed
        out["packed_bytes"] = cache.counters["packed_bytes"]
        cache.close()
    return out


def read_packed_alone(files: Files, name: str = "cache") -> float:
    """ms to read every payload file of the cache, 1 MiB at a time, into one buffer."""
    from onnx_prep.core.cache.manifest import read_manifest

    paths = [files.dirs[name] / f for f in sorted(read_manifest(files.cache[name]).files)]
    t = time.perf_counter()
    read_whole(paths)
    return (time.perf_counter() - t) * 1e3


# Linux counts the memory a process had before exec in its ru_maxrss: a child forked from
# this (large) process would report at least this process's RSS. So the measured command
# is forked by a small launcher, which times it (fork to exit) and reports its rusage.
LAUNCHER = r"""
import json, os, sys, time
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    json.dump({"wall_ms": (time.perf_counter() - t0) * 1e3, "maxrss_kib": usage.ru_maxrss,
               "exit": os.waitstatus_to_exitcode(status)}, f)
"""


def spawn(cmd: list[str]) -> tuple[float, float, dict]:
    """(spawn-to-exit ms, peak RSS MiB, the JSON it printed) of one child process."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, \
            tempfile.NamedTemporaryFile("r", suffix=".json") as rec:
        subprocess.run([sys.executable, "-S", "-c", LAUNCHER, rec.name, *cmd], stdout=out, stderr=err, check=True)
        r = json.load(rec)
        out.seek(0), err.seek(0)
        if r["exit"] != 0:
            sys.exit(f"{' '.join(map(str, cmd))} failed: {err.read().strip()}")
        return r["wall_ms"], r["maxrss_kib"] / 1024, json.loads(out.read())


def whole_process(files: Files, config: str, prompt: str, logits_name: str, *, warm: bool,
                  resolved) -> dict:
    if config == "build":
        files.clear_build()
    resident = None if not warm else warm_files(files.reads_of(resolved, config))
    if not warm:
        drop_files(files.data_files(resolved))
    if config.startswith("ort"):
        model = files.ort_copy if config == "ort-prepacked" else files.model
        wall, rss, doc = spawn([sys.executable, "-c", ORT_CHILD, str(model), str(files.feeds), logits_name])
        return {"spawn_to_exit_ms": wall, "peak_rss_mib": rss, "open_ms": doc["open_ms"],
                "first_output_ms": doc["first_run_ms"], "token": doc["token"], "resident_before_warming": resident}
    cmd = [str(Path(sys.executable).with_name("onnx-prep")), "run", str(files.model), "--tokens", "1",
           "--prompt-ids", prompt, "--json", "--cache-policy", POLICY[config],
           "--source-pages", "keep" if warm else "auto"]
    if config == "none-unverified":
        cmd += ["--no-verify-digests"]  # what the weights' SHA-256 checks cost (not a target)
    elif config != "none":
        cmd += ["--prepared", str(files.cache[config])]
    wall, rss, doc = spawn(cmd)
    return {"spawn_to_exit_ms": wall, "peak_rss_mib": rss, "open_ms": doc["timings"]["open_ms"],
            "first_output_ms": doc["timings"]["first_output_ms"], "token": doc["tokens"][0][-1],
            "resident_before_warming": resident}


# ------------------------------------------------------------------ set-up
def prepare(files: Files, resolved, prompt_ids: list[int], with_ort: bool) -> tuple[dict, str]:
    """Build the raw and zstd caches, the feeds file and the ORT pre-packed copy.
    Returns (the feeds, the logits output's name)."""
    from onnx_prep.core.cache.cache_build import build_prepared_cache
    from onnx_prep.core.decode.decoder_io import DecoderIO
    from onnx_prep.core.decode.generation import step_feeds

    for name, compress in (("cache", None), ("cache-zstd", "zstd")):
        build_prepared_cache(files.model, cache_dir=files.dirs[name], compress=compress)
    io = DecoderIO.discover(resolved.inputs, resolved.outputs)
    feeds = step_feeds(io, np.array([prompt_ids], dtype=np.int64), io.empty_past(1), 0)
    np.savez(files.feeds, **feeds)
    if with_ort:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.optimized_model_filepath = str(files.ort_copy)
        opts.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                      files.ort_copy.name + ".data")
        opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        opts.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
        ort.InferenceSession(str(files.model), opts, providers=["CPUExecutionProvider"])
    return feeds, io.logits


def _zstd_decode_gbps(files: Files) -> float:
    """Decoded GB/s of the zstd cache's entries, their stored bytes in memory."""
    import zstandard

    from onnx_prep.core.cache.manifest import read_manifest

    m = read_manifest(files.cache["cache-zstd"])
    blobs = []
    for e in m.entries:
        with open(files.dirs["cache-zstd"] / e.file, "rb") as f:
            f.seek(e.offset)
            blobs.append((f.read(e.length), e.decoded_length))
    d = zstandard.ZstdDecompressor()
    t = time.perf_counter()
    for blob, n in blobs:
        d.decompress(blob, max_output_size=n)
    return sum(n for _, n in blobs) / (time.perf_counter() - t) / 1e9


# ------------------------------------------------------------------ report
def targets(res: dict, sizes: dict, states: list[str], with_ort: bool) -> list[dict]:
    """The issue's targets, as ratios of medians in this run."""
    def med(group, state, config, figure):
        return statistics.median(x[figure] for x in res[group][state][config])

    out = []

    def target(name, value, limit):
        out.append({"target": name, "ratio": value, "limit": limit, "pass": value <= limit})

    for state in states:
        none = med("in_process", state, "none", "first_output_ms")
        target(f"{state}: cache first output / no cache", med("in_process", state, "cache", "first_output_ms") / none, 0.5)
        target(f"{state}: build-if-missing first output / no cache",
               med("in_process", state, "build", "first_output_ms") / none, 1.1)
    target("warm: cache all-ready / packed bytes read alone",
           med("in_process", "warm", "cache", "all_ready_ms") / statistics.median(res["read_packed_ms"]), 1.2)
    if with_ort:
        for config, base, limit in (("cache", "ort", 0.5), ("cache", "ort-prepacked", 0.7), ("none", "ort", 0.65)):
            target(f"warm: whole process {config} / {base}", med("processes", "warm", config, "spawn_to_exit_ms")
                   / med("processes", "warm", base, "spawn_to_exit_ms"), limit)
    rss = med("processes", "warm", "cache", "peak_rss_mib")
    target("warm: peak RSS from the cache / (1.1 x packed bytes + 150 MiB)", rss / (1.1 * sizes["packed"] / 2**20 + 150), 1.0)
    target("cache bytes on disk / source payload", sizes["cache_disk"] / sizes["source"], 1.05)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="an INT4 ONNX decoder (default: the --preset fixture)")
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--warm-only", action="store_true", help="skip the cold page-cache measurements")
    ap.add_argument("--no-ort", action="store_true", help="skip ONNX Runtime")
    ap.add_argument("--json", type=Path, help="write every sample and the targets here")
    ap.add_argument("--quick", action="store_true", help="smoke run: the tiny model, one repeat")
    args = ap.parse_args()
    if args.quick:
        args.preset, args.repeats = "tiny-llm", 1

    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.core.profile.machine import describe_machine
    from onnx_prep.core.profile.machine_activity import MachineActivity, describe
    from onnx_prep.fixtures import FixtureConfig, ensure_cached

    with_ort = not args.no_ort
    if with_ort:
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            print("onnxruntime is not installed: its figures and targets are skipped")
            with_ort = False
    model = args.model or ensure_cached(FixtureConfig.preset(args.preset))
    resolved = resolve_model(model)
    states = ["warm"] + ([] if args.warm_only or not hasattr(os, "posix_fadvise") else ["cold"])
    prompt_ids = list(range(1, args.prompt_len + 1))
    print(describe_machine())
    bytecode = ensure_bytecode()
    print(describe_bytecode(bytecode))
    print(f"model {model} ({resolved.manifest.total_bytes / 2**20:,.1f} MiB of weights), prompt {args.prompt_len} "
          f"tokens, {args.repeats} repeats, page cache {' and '.join(states)}")
    activity = MachineActivity.now()
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
        files = Files(Path(model), Path(tmp))
        feeds, logits_name = prepare(files, resolved, prompt_ids, with_ort)
        processes = PROCESSES if with_ort else PROCESSES[:4]
        res = {"in_process": {s: {c: [] for c in IN_PROCESS} for s in states},
               "processes": {s: {c: [] for c in processes} for s in states}, "read_packed_ms": []}
        for state in states:
            for r in range(args.repeats):
                for c in IN_PROCESS[r % 4:] + IN_PROCESS[:r % 4]:
                    res["in_process"][state][c].append(
                        in_process_load(resolved, feeds, files, c, warm=state == "warm"))
                for c in processes[r % len(processes):] + processes[:r % len(processes)]:
                    res["processes"][state][c].append(whole_process(
                        files, c, ",".join(map(str, prompt_ids)), logits_name, warm=state == "warm",
                        resolved=resolved))
        read_packed_alone(files)  # warm it
        res["read_packed_ms"] = [read_packed_alone(files) for _ in range(args.repeats)]
        if "cold" in states:  # the device's rate for these bytes: the floor of a cold load from the cache
            res["read_packed_cold_ms"] = []
            for _ in range(args.repeats):
                drop_files(files.data_files(resolved))
                res["read_packed_cold_ms"].append(read_packed_alone(files))
        stored, packed, disk = files.payload_bytes("cache")
        zstored, zpacked, zdisk = files.payload_bytes("cache-zstd")
        sizes = {"source": resolved.manifest.total_bytes, "packed": packed, "cache_disk": disk,
                 "zstd_stored": zstored, "zstd_disk": zdisk}
        if with_ort:
            sources = {resolved.model_dir / d.file for d in resolved.manifest if d.file}
            sizes["model_disk"] = sum(_allocated(p) for p in sources | {files.model})
            sizes["ort_prepacked_disk"] = sum(_allocated(p) for p in files.dirs["ort"].iterdir())
        res["zstd"] = {"ratio": zstored / zpacked, "decode_gbps": _zstd_decode_gbps(files)}
    tokens = {c: {x["token"] for s in states for x in res["processes"][s][c]} for c in processes}

    print(f"\n{'in-process load (ms)':34} {'state':5} {'min':>10} {'median':>10} {'max':>10}")
    for state in states:
        for c in IN_PROCESS:
            for fig in ("first_output_ms", "open_ms", "all_ready_ms") + (("persisted_ms",) if c == "build" else ()):
                print(f"{c + ' ' + fig:34} {state:5} {_fmt(_stats([x[fig] for x in res['in_process'][state][c]]))}")
    print(f"{'packed bytes read alone':34} {'warm':5} {_fmt(_stats(res['read_packed_ms']))}")
    if "read_packed_cold_ms" in res:
        print(f"{'packed bytes read alone':34} {'cold':5} {_fmt(_stats(res['read_packed_cold_ms']))}")
        cold_read = statistics.median(res["read_packed_cold_ms"])
        ready = statistics.median(x["all_ready_ms"] for x in res["in_process"]["cold"]["cache"])
        print(f"cold: from the cache all ready at {ready:.1f} ms, {ready / cold_read:.2f}x the packed bytes read alone "
              f"(the disk: {stored / cold_read / 1e6:.2f} GB/s)")
    print("bytes per load: " + "; ".join(
        f"{c} {statistics.median(x['source_bytes'] for x in res['in_process']['warm'][c]) / 2**20:,.1f} MiB of "
        f"source, {statistics.median(x['packed_bytes'] for x in res['in_process']['warm'][c]) / 2**20:,.1f} MiB "
        "from the cache" for c in IN_PROCESS))
    before = [x["resident_before_warming"] for g in ("in_process", "processes") for xs in res[g]["warm"].values()
              for x in xs if x["resident_before_warming"] is not None]
    if before:
        print(f"warm loads: {100 * min(before):.1f}-{100 * max(before):.1f}% of the files each reads were in the "
              "page cache before it; each read them whole first")
    print(f"\n{'whole process':34} {'state':5} {'min':>10} {'median':>10} {'max':>10}")
    for state in states:
        for c in processes:
            for fig in ("spawn_to_exit_ms", "open_ms", "first_output_ms", "peak_rss_mib"):
                print(f"{c + ' ' + fig:34} {state:5} {_fmt(_stats([x[fig] for x in res['processes'][state][c]]))}")
    ours = set().union(*(tokens[c] for c in ("none", "build", "cache")))
    print(f"\nfirst token: {sorted(ours)} from every onnx-prep run"
          + (f"; ONNX Runtime {sorted(tokens['ort'] | tokens['ort-prepacked'])}" if with_ort else ""))
    if len(ours) != 1:
        sys.exit("onnx-prep's first token differs between cache configurations")
    print(f"zstd: {res['zstd']['ratio']:.3f} of the raw bytes, decode {res['zstd']['decode_gbps']:.2f} GB/s; "
          f"load from it: warm first output {statistics.median(x['first_output_ms'] for x in res['in_process']['warm']['cache-zstd']):.1f} ms, "
          f"all ready {statistics.median(x['all_ready_ms'] for x in res['in_process']['warm']['cache-zstd']):.1f} ms "
          f"(raw: {statistics.median(x['all_ready_ms'] for x in res['in_process']['warm']['cache']):.1f} ms)")
    print(f"bytes on disk (allocated: st_blocks x 512): source payload {sizes['source'] / 2**20:,.1f} MiB, cache {sizes['cache_disk'] / 2**20:,.1f} MiB "
          f"(packed {sizes['packed'] / 2**20:,.1f} MiB), zstd cache {sizes['zstd_disk'] / 2**20:,.1f} MiB"
          + (f"; ONNX Runtime: model {sizes['model_disk'] / 2**20:,.1f} MiB, its pre-packed copy "
             f"{sizes['ort_prepacked_disk'] / 2**20:,.1f} MiB" if with_ort else ""))
    res["targets"] = targets(res, sizes, states, with_ort)
    print("\ntargets (ratios of medians in this run):")
    for t in res["targets"]:
        print(f"  {'PASS' if t['pass'] else 'FAIL'}  {t['target']}: {t['ratio']:.3f} (<= {t['limit']})")
    act = MachineActivity.now().since(activity)
    print(describe(act))
    if args.json:
        args.json.write_text(json.dumps({"model": str(model), "repeats": args.repeats, "states": states,
                                         "sizes": sizes, "bytecode": bytecode, "machine_activity": act, **res},
                                        indent=1))


if __name__ == "__main__":
    main()
