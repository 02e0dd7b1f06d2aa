"""Decode speed against ONNX Runtime (the real-exports issue's protocol): tokens/s at
batch 1, 2, 4, 8 and accuracy levels 0 and 4, on the ``medium`` fixture and on an
onnxruntime-genai builder export of a Llama of the same shape, in one run.

    .venv/bin/python scripts/bench_decode_speed.py [--batches 1,2,4,8] [--tokens 32]
        [--repeats 3] [--models medium-acc0,medium-acc4,builder-acc1,builder-acc4] [--from-cache]
        [--json FILE]

Models (generated locally, cached, never committed):
  medium-acc0   the ``medium`` fixture (16 blocks, hidden 2048, MatMulNBits accuracy level 0)
  medium-acc4   the same weights with ``accuracy_level=4`` on every MatMulNBits (a copy of
                the .onnx beside a copy of the data file, in a temporary folder)
  builder-acc1  ``python -m onnxruntime_genai.models.builder -p int4 -e cpu`` on a random
                Llama checkpoint of the medium shape (32 heads, 8 KV heads, vocab 32000),
                ``accuracy_level=1`` (fp32 compute: what level 0 is for MatMulNBits)
  builder-acc4  the same checkpoint, ``accuracy_level=4`` (int8 activations)
The builder's models need the ``exports`` extra; the checkpoint (4.5 GB of fp32) and
each export are made once into the fixture cache (several minutes).

Per model and batch N, each repeat runs ``onnx-prep run MODEL --batch N --tokens T --json``
with ``--runtime prepared`` and ``--runtime ort`` (the order alternates between
repeats), each a fresh process, and takes the decode tokens/s the run reports (after the
prefill). Prints min / median / max per cell, the ratio of medians, and whether the
greedy tokens were identical (else the step at which they part: ``run --compare ort``
there says whether ONNX Runtime's top-2 margin was a near tie). For medium-acc4 at
batch 1 it also runs
``scripts/profile_ops.py`` to give the step's INT4 GEMV (MatMulNBits) time against the
whole step (the issue's "within 1.5x of the GEMV time alone").

``--from-cache`` first builds each model's prepared cache (``onnx-prep build-cache``, into
the scratch folder) and runs ours from it (``--prepared``, ``--cache-policy
require-complete``; a builder export is copied and given its weights' digests first, ``digest --write``, as a cache reuses no entry of a source without one): the weights are then the cache's payloads mapped into their slots,
with 2 MiB page-table entries where the page cache allows (docs/runtime.md), instead of
packed into 4 KiB pages at load. ONNX Runtime runs as without it.
Run it alone: other work on the machine changes every figure.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXE = Path(sys.executable).with_name("onnx-prep")
MODELS = ("medium-acc0", "medium-acc4", "builder-acc1", "builder-acc4")


def parting_step(ours: list, theirs: list) -> int | None:
    """The first step (0: the prefill's token) at which any row's greedy token differs
    between the two runs' token rows, or None when all are equal. ``run --compare ort``
    says whether ONNX Runtime's top-2 margin there was a near tie."""
    if ours == theirs:
        return None
    longest = max(len(r) for r in [*ours, *theirs])
    return next(s for s in range(longest + 1)
                if len(ours) != len(theirs) or any(a[s:s + 1] != b[s:s + 1] for a, b in zip(ours, theirs)))


def medium(level: int, scratch: Path) -> Path:
    from onnx_prep.fixtures import PRESETS, ensure_cached

    base = ensure_cached(PRESETS["medium"])
    if level == 0:
        return base
    import onnx

    m = onnx.load(base, load_external_data=False)
    for n in m.graph.node:
        if n.op_type == "MatMulNBits":
            for a in list(n.attribute):
                if a.name == "accuracy_level":
                    n.attribute.remove(a)
            n.attribute.append(onnx.helper.make_attribute("accuracy_level", level))
    out = scratch / f"medium-acc{level}"
    out.mkdir(exist_ok=True)
    for f in base.parent.iterdir():
        if f.suffix != ".onnx" and not (out / f.name).exists():
            # NOTE: a copy, not a hard link: a second link to the fixture's data file makes
            # every other reader of the fixture refuse it (it may alias a file elsewhere)
            shutil.copyfile(f, out / f.name)
    onnx.save(m, out / base.name)
    return out / base.name


def builder(level: int) -> Path:
    from types import MappingProxyType

    from onnx_prep.fixtures import real_exports as rx
    from onnx_prep.fixtures.cache import ensure_folder

    ckpt = rx.Checkpoint("llama", layers=16, hidden=2048, intermediate=5632, heads=32, kv_heads=8,
                         vocab=32000, context=2048)
    spec = rx.ExportSpec(ckpt, "builder", MappingProxyType({"accuracy_level": level, "block_size": 32}))
    folder = rx.cache_root() / "real-exports" / f"bench-builder-llama-medium-acc{level}-{rx._key(spec.to_json())}"
    ensure_folder(folder, lambda tmp: rx._export(spec, tmp), complete=rx.MODEL_FILE)
    return folder / rx.MODEL_FILE


def run(model: Path, runtime: str, batch: int, tokens: int, cache: Path | None = None) -> dict:
    cmd = [str(EXE), "run", str(model), "--runtime", runtime, "--batch", str(batch), "--tokens", str(tokens),
           "--json", "--memory-budget", "16GiB"]
    if cache is not None and runtime == "prepared":
        cmd += ["--prepared", str(cache), "--cache-policy", "require-complete"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()[-400:]}")
    r = json.loads(p.stdout)
    return {"tokens_per_s": r["timings"]["decode_tokens_per_s"], "tokens": r["tokens"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--from-cache", action="store_true",
                    help="build each model's prepared cache first and run ours from it")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from onnx_prep.core.profile.machine import describe_machine
    from onnx_prep.core.profile.machine_activity import MachineActivity, describe, distorted

    batches = [int(b) for b in args.batches.split(",")]
    names = [m for m in args.models.split(",") if m]
    scratch = Path(tempfile.mkdtemp(prefix="bench-decode-"))
    paths = {}
    for name in names:
        kind, level = name.rsplit("-acc", 1)
        paths[name] = medium(int(level), scratch) if kind == "medium" else builder(int(level))
    caches: dict[str, Path | None] = {name: None for name in names}
    if args.from_cache:
        for name in names:
            if name.startswith("builder"):
                # a real export declares no weight digests, and the cache reuses no entry of a source
                # without one (docs/cache-format.md): a copy gets them (digest --write) first
                copy = scratch / name
                shutil.copytree(paths[name].parent, copy)
                paths[name] = copy / paths[name].name
                subprocess.run([str(EXE), "digest", str(paths[name]), "--write"], check=True, capture_output=True,
                               timeout=1800)
            folder = scratch / f"cache-{name}"
            folder.mkdir()
            p = subprocess.run([str(EXE), "build-cache", str(paths[name]), "--cache-dir", str(folder)],
                               capture_output=True, text=True, timeout=1800)
            if p.returncode != 0:
                raise SystemExit(f"build-cache {paths[name]} failed ({p.returncode}): {p.stderr.strip()[-400:]}")
            caches[name] = next(folder.glob("*.prepared.onnx"))
    facts = describe_machine()
    print(f"{facts}; {args.tokens} tokens, {args.repeats} repeats, tokens/s min/median/max"
          + ("; ours from each model's prepared cache" if args.from_cache else ""))
    record = {"machine": facts, "tokens": args.tokens, "repeats": args.repeats, "from_cache": args.from_cache,
              "rows": []}
    print(f"{'model':14s} {'N':>2s}  {'ours tok/s':>22s}  {'ORT tok/s':>22s}  {'ours/ORT':>8s}  tokens")
    whole = MachineActivity.now()
    for name in names:
        for n in batches:
            started = MachineActivity.now()
            got = {"prepared": [], "ort": []}
            toks = {}
            for r in range(args.repeats):
                for rt in (("prepared", "ort") if r % 2 == 0 else ("ort", "prepared")):
                    out = run(paths[name], rt, n, args.tokens, caches[name])
                    got[rt].append(out["tokens_per_s"])
                    toks[rt] = out["tokens"]
            med = {k: statistics.median(v) for k, v in got.items()}
            activity = MachineActivity.now().since(started)
            row = {"model": name, "batch": n, **{f"{k}_tokens_per_s": v for k, v in got.items()},
                   "ratio": med["prepared"] / med["ort"], "tokens_identical": toks["prepared"] == toks["ort"],
                   "tokens_part_at": parting_step(toks["prepared"], toks["ort"]),
                   "machine_activity": activity, "distorted": distorted(activity)}
            record["rows"].append(row)
            cell = lambda v: f"{min(v):6.1f}/{statistics.median(v):6.1f}/{max(v):6.1f}"  # noqa: E731
            verdict = "identical" if row["tokens_identical"] else f"part at step {row['tokens_part_at']}"
            print(f"{name:14s} {n:2d}  {cell(got['prepared']):>22s}  {cell(got['ort']):>22s}  "
                  f"{row['ratio']:7.2f}x  {verdict}"
                  + (f"  DISTORTED (other work {activity['foreign_cores']:.2f} cores, host steal "
                     f"{activity['steal_s']:.2f} s)" if row["distorted"] else ""), flush=True)
    record["machine_activity"] = MachineActivity.now().since(whole)
    print(describe(record["machine_activity"]))
    if "medium-acc4" in paths:
        p = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_ops.py"), "--model",
                            str(paths["medium-acc4"]), "--batch", "1", "--json"],
                           capture_output=True, text=True, timeout=1800)
        if p.returncode == 0:
            prof = json.loads(p.stdout)
            gemv = sum(o["ms"] for o in prof["per_op"] if o["op"].startswith("MatMulNBits"))
            record["gemv"] = {"step_ms": prof["step_ms"], "profiled_ms": prof["profiled_ms"], "gemv_ms": gemv}
            print(f"medium-acc4 batch 1, one thread: step {prof['step_ms']:.2f} ms, INT4 GEMV (MatMulNBits) "
                  f"{gemv:.2f} ms: step / GEMV = {prof['step_ms'] / gemv:.2f}x (target <= 1.5x)")
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
