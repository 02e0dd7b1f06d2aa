"""Fuzz `resolve` and `run` with structure-aware mutants of a real model.

Each case copies the small fixture decoder (2 blocks, INT4 MatMulNBits, tied
GatherBlockQuantized embedding, real external data) into a folder, applies one to three
mutations (``onnx_prep.fixtures.mutator``: protobuf fields, dtypes, dims, external-data
entries, attributes, producers, data-file bytes and length), then resolves it and decodes
two tokens with the prepared runtime, in this process, through the same library calls
the commands make. A case passes when it ends normally or with one of the project's typed
errors (``OnnxPrepError``). It fails on any other exception, on a read of a file outside
the model's folder (a sentinel file beside the folder must never be opened), and on a
traced allocation peak over ``--max-mib``.

    .venv/bin/python scripts/fuzz.py --minutes 10 [--seed 0] [--max-mib 512]

prints each failure with its seed and what the mutations were (replay one with
``--seed S --cases 1``), and at the end the cases tried, the outcomes by error type,
and the distinct failures. Exit 1 when any case failed. ``tests/test_fuzz.py`` runs a
fixed number of seeds in CI; every failure this ever finds becomes a seed there.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

SENTINEL = "outside-secret.bin"


def small_fixture(out_dir: Path) -> Path:
    from onnx_prep.fixtures import FixtureConfig, generate

    cfg = FixtureConfig.preset("tiny-llm").replace(layers=2, hidden=128, intermediate=256,
                                                   heads=4, vocab=512)
    return generate(cfg, out_dir)


class _Opens:
    """Audit hook: every path this process opens while armed."""

    def __init__(self) -> None:
        self.armed = False
        self.paths: list[str] = []
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args) -> None:
        if self.armed and event in ("open", "os.open") and args and isinstance(args[0], (str, bytes, os.PathLike)):
            self.paths.append(os.fsdecode(args[0]))


_OPENS: _Opens | None = None


def fuzz_case(source: Path, workdir: Path, seed: int, *, max_bytes: int = 512 << 20) -> tuple[str, str | None]:
    """One case. Returns (outcome, failure): outcome is "ok" or the typed error's class
    name; failure is None, or a one-line description of what went wrong."""
    global _OPENS
    from onnx_prep.core.decode.run_record import RunOptions, record_run
    from onnx_prep.core.errors import OnnxPrepError
    from onnx_prep.fixtures.mutator import mutate

    if _OPENS is None:
        _OPENS = _Opens()
    case = workdir / f"case-{seed}"
    case.mkdir(parents=True)
    (case / SENTINEL).write_bytes(b"secret")
    model, done = mutate(source, case / "model", seed, count=1 + seed % 3)
    what = "; ".join(done)
    outcome, failure = "ok", None
    tracemalloc.start()
    _OPENS.paths.clear()
    _OPENS.armed = True
    try:
        record_run(model, RunOptions(prompt_ids=((1, 2, 3),), tokens=2))
    except OnnxPrepError as exc:
        outcome = type(exc).__name__
    except Exception as exc:  # noqa: BLE001 - the point: anything untyped is a finding
        outcome = type(exc).__name__
        failure = f"untyped {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    finally:
        _OPENS.armed = False
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    outside = [p for p in _OPENS.paths if SENTINEL in p or (Path(p).is_absolute()
               and not Path(p).resolve().is_relative_to(case.resolve()) and p.startswith(str(workdir)))]
    if failure is None and outside:
        failure = f"opened outside the model folder: {outside[0]}"
    if failure is None and peak > max_bytes:
        failure = f"traced allocation peak {peak >> 20} MiB over {max_bytes >> 20} MiB"
    return outcome, (f"seed {seed}: {failure} [{what}]" if failure else None)


def _count_from(start: int):
    while True:
        yield start
        start += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0, help="first seed; cases use seed, seed+1, ...")
    ap.add_argument("--cases", type=int, default=None, help="stop after this many cases")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds to replay (instead of a range)")
    ap.add_argument("--trace", action="store_true", help="name each case on stderr as it starts")
    ap.add_argument("--max-mib", type=int, default=512)
    ap.add_argument("--as-limit-mib", type=int, default=8192,
                    help="address-space limit of this process: a mutant that asks for more gets a "
                         "MemoryError (a finding) instead of taking the machine's memory")
    args = ap.parse_args()
    import resource

    limit = args.as_limit_mib << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    replay = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    outcomes: collections.Counter = collections.Counter()
    failures: dict[str, str] = {}
    deadline = time.monotonic() + args.minutes * 60
    with tempfile.TemporaryDirectory() as tmp:
        source = small_fixture(Path(tmp) / "source")
        seeds = iter(replay) if replay is not None else _count_from(args.seed)
        for n, seed in enumerate(seeds):
            if time.monotonic() >= deadline or (args.cases is not None and n >= args.cases):
                break
            if args.trace:
                print(f"case {seed}", file=sys.stderr, flush=True)
            with tempfile.TemporaryDirectory(dir=tmp) as work:
                outcome, failure = fuzz_case(source, Path(work), seed, max_bytes=args.max_mib << 20)
            outcomes[outcome] += 1
            if failure:
                key = failure.split(":", 2)[1].strip()[:80]
                if key not in failures:
                    failures[key] = failure
                    print(failure, flush=True)
    tried = sum(outcomes.values())
    print(f"cases tried: {tried}" + ("" if replay is not None else f" (seeds {args.seed}..{args.seed + tried - 1})"))
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in outcomes.most_common()))
    print(f"distinct failures: {len(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
