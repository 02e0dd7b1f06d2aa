"""Crash consistency and concurrent writers of the prepared cache, through real
``onnx-prep build-cache`` processes (core/cache/cache_writer.py, docs/cache-format.md).

Crashes: the writer's test hook ``ONNX_PREP_CRASH_AT=NAME:K`` SIGKILLs the process at the
K-th pass of its crash point NAME. The points are chosen from a fixed seed (``SEED``; each
case's id names the seed, the scenario and the point) in three scenarios, each on its own
copy of the small fixture:

- ``first``: the first build, no cache yet;
- ``update``: a complete uncompressed generation 1 rewritten by ``--compress zstd``
  (every entry replaced: every point passes, compression and the old generation's GC too);
- ``gc``: the same update over the leftovers of two earlier crashes (a payload temporary
  file, a manifest temporary file, a renamed payload file no manifest names), so garbage
  collection has three files to remove and is killed between them.

After each crash the cache on disk is the previous complete generation (the very bytes of
its manifest) or the new one (its entries' digests those of an uninterrupted build), it
has no damaged entry and every payload re-hashes to its digest; a read-only run reads every
entry from it (no fallback, no warning) and decodes the tokens of a run without a cache;
and a following build completes, leaves the new generation and not one temporary or
unreferenced file (the crash's leftovers collected).

Concurrency: two builds released at the same instant (both block on their stdin until the
test writes a line to each) both exit 0 and leave one valid, clean cache.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from onnx_prep.cli.app import app
from onnx_prep.core.cache.manifest import CacheManifest, read_manifest
from onnx_prep.core.cache.payload_digest import payload_digest_of
from test_cli_exit_codes import ONNX_PREP

SEED = 17  # the cases below are a function of it alone: a failure reruns as it failed

# The small fixture's prepared objects (8 projections and the LM head's, which the tied
# embedding reads too); each is under 1 MiB, so each passes ``payload_write`` once (and
# ``compress`` once when compressed). ``reference`` checks it.
N_OBJECTS = 9
COMMIT_POINTS = ("commit_locked", "payload_fsync", "payload_validated", "payload_rename", "payload_renamed",
                 "manifest_write", "manifest_fsync", "manifest_rename", "manifest_renamed", "gc")
# Files each scenario's garbage collection removes: none on a first build, the old
# generation's payload file on an update, and the two crashes' three leftovers besides.
GC_UNLINKS = {"first": 0, "update": 1, "gc": 3}
COMPRESS = {"first": (), "update": ("--compress", "zstd"), "gc": ("--compress", "zstd")}


def crash_passes(scenario: str) -> list[tuple[str, int]]:
    """Every (point, pass) a build in ``scenario`` goes through, in no particular order."""
    per_object = ("compress", "payload_write") if COMPRESS[scenario] else ("payload_write",)
    out = [(p, k) for p in per_object for k in range(1, N_OBJECTS + 1)]
    out += [(p, 1) for p in COMMIT_POINTS]
    return out + [("gc_unlink", k) for k in range(1, GC_UNLINKS[scenario] + 1)]


def crash_cases(seed: int) -> list[tuple[str, str, int]]:
    """The seeded plan: 7 passes of a first build; on an update, every point once (a
    seeded pass of each); on the gc scenario, GC's own points and each of its unlinks."""
    rng = random.Random(seed)
    cases = [("first", p, k) for p, k in rng.sample(crash_passes("first"), 7)]
    update = crash_passes("update")
    for point in sorted({p for p, _ in update}):
        cases.append(("update", point, rng.choice([k for p, k in update if p == point])))
    cases += [("gc", p, k) for p, k in crash_passes("gc") if p in ("gc", "gc_unlink")]
    return cases


CASES = crash_cases(SEED)


# ------------------------------------------------------------------ helpers
def child_env(crash_at: str | None = None) -> dict[str, str]:
    """This environment, with the crash hook set to ``crash_at`` or not at all."""
    env = {k: v for k, v in os.environ.items() if k != "ONNX_PREP_CRASH_AT"}
    if crash_at is not None:
        env["ONNX_PREP_CRASH_AT"] = crash_at
    return env


def onnx_prep(*args, crash_at: str | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*ONNX_PREP, *map(str, args)], capture_output=True, text=True, timeout=120,
                          env=child_env(crash_at), **kw)


def copy_model(model: Path, dst: Path) -> Path:
    """A private copy of ``model``'s folder (and whatever cache it holds): cases stay independent."""
    shutil.copytree(model.parent, dst)
    return dst / model.name


def build(model: Path, *args: str, crash_at: str | None = None) -> subprocess.CompletedProcess:
    p = onnx_prep("build-cache", model, *args, "--json", crash_at=crash_at)
    if crash_at is not None:
        point = crash_at.rpartition(":")[0]
        assert p.returncode == -9, f"ONNX_PREP_CRASH_AT={crash_at} did not kill the build: {p.returncode} {p.stderr}"
        assert f"crash point {point}" in p.stderr
    else:
        assert p.returncode == 0, p.stderr
    return p


def run_tokens(model: Path, policy: str) -> dict:
    """``onnx-prep run MODEL --tokens 4 --json --cache-policy POLICY``'s record, through the
    CLI's entry point in this process (a fresh session and cache each time; a process
    would add only its interpreter's start, some 0.4 s a case)."""
    result = CliRunner().invoke(app, ["run", str(model), "--tokens", "4", "--json", "--cache-policy", policy])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def manifest_path(model: Path) -> Path:
    return model.with_name(model.stem + ".prepared.onnx")


def digests(m: CacheManifest) -> dict[str, str]:
    return {e.key: e.payload_digest for e in m.entries}


def assert_entries_intact(folder: Path, m: CacheManifest) -> None:
    """No damaged entry, and each entry's stored bytes hash to its digest."""
    assert m.damaged == ()
    for e in m.entries:
        with open(folder / e.file, "rb") as f:
            f.seek(e.offset)
            data = f.read(e.length)
        assert len(data) == e.length and payload_digest_of(data) == e.payload_digest, e.key


def leftovers(model: Path) -> set[str]:
    """Files in the model's folder besides the model, the cache's manifest, lock and the
    payload files the manifest names."""
    m = read_manifest(manifest_path(model))
    expected = {model.name, model.name + ".data", manifest_path(model).name, f"{model.stem}.prepared.lock"}
    return set(os.listdir(model.parent)) - expected - (m.files if m is not None else set())


def assert_reads_cache(doc: dict, m: CacheManifest | None, tokens: list) -> None:
    """A read-only run: the reference tokens, every entry of ``m`` read and none refused."""
    assert doc["tokens"] == tokens
    c = doc["cache"]
    assert c["warnings"] == [] and c["fallbacks"] == 0
    if m is None:
        assert c["exists"] is False and c["packed_reads"] == 0
    else:
        assert c["generation"] == m.generation
        assert c["entries"]["hit"] == c["packed_reads"] == len(m.entries) == N_OBJECTS


# ------------------------------------------------------------------ references
@pytest.fixture(scope="module")
def reference(small_llm_path, tmp_path_factory) -> dict:
    """Uninterrupted builds of each scenario's before and after, and the tokens of a run
    without a cache: what every crash case is held to."""
    root = tmp_path_factory.mktemp("cache-crash-reference")
    ref = {"tokens": run_tokens(small_llm_path, "disabled")["tokens"]}
    # scenario 'first' starts from no cache; 'update' from generation 1 uncompressed
    ref["before"] = {"first": copy_model(small_llm_path, root / "first"),
                     "update": copy_model(small_llm_path, root / "update")}
    build(ref["before"]["update"])
    g1 = read_manifest(manifest_path(ref["before"]["update"]))
    assert len(g1.entries) == N_OBJECTS and all(e.length < 1 << 20 for e in g1.entries), \
        "the crash plan assumes N_OBJECTS objects under 1 MiB each (one write pass each)"
    # 'gc': the update's starting point plus two crashed updates' leftovers: a payload
    # temporary file (killed while writing), a payload file renamed but never published
    # and a manifest temporary file (killed before the manifest was written)
    gc = ref["before"]["gc"] = copy_model(ref["before"]["update"], root / "gc")
    build(gc, "--compress", "zstd", crash_at="payload_write:3")
    build(gc, "--compress", "zstd", crash_at="manifest_write:1")
    names = sorted(os.listdir(gc.parent))
    assert sum(n.startswith(f".{gc.stem}.prepared.tmp-") for n in names) == 1, names
    assert sum(n.startswith(f".{gc.stem}.prepared.onnx.tmp-") for n in names) == 1, names
    assert f"{gc.stem}.prepared.g2.data" in names and read_manifest(manifest_path(gc)).generation == 1
    # after: a first build's generation 1, an update's generation 2 (all entries zstd)
    zstd = copy_model(ref["before"]["update"], root / "zstd")
    build(zstd, "--compress", "zstd")
    g2 = read_manifest(manifest_path(zstd))
    assert g2.generation == 2 and {e.encoding for e in g2.entries} == {"zstd"} and digests(g2).keys() == digests(g1).keys()
    ref["old"] = {"first": None, "update": manifest_path(ref["before"]["update"]).read_bytes(),
                  "gc": manifest_path(gc).read_bytes()}
    ref["new"] = {"first": (1, digests(g1)), "update": (2, digests(g2)), "gc": (2, digests(g2))}
    return ref


# ------------------------------------------------------------------ crash consistency
def test_the_plan_covers_every_crash_point():
    """The plan passes every point the writer has (a new point gets cases), and keeps its
    promises: 20+ cases, compression and GC's unlinks among them, no case twice."""
    source = (Path(__file__).resolve().parent.parent / "core" / "cache" / "cache_writer.py").read_text()
    points = set(re.findall(r'crash_point\("(\w+)"\)', source))
    assert {p for _, p, _ in CASES} == points
    assert len(CASES) >= 20 and len(set(CASES)) == len(CASES)
    for scenario, point in (("update", "compress"), ("update", "gc_unlink"), ("gc", "gc_unlink")):
        assert any(s == scenario and p == point for s, p, _ in CASES)
    assert crash_cases(SEED) == CASES  # reproducible


@pytest.mark.parametrize("scenario,point,k", CASES, ids=[f"seed{SEED}-{s}-{p}:{k}" for s, p, k in CASES])
def test_a_crash_leaves_the_old_generation_or_the_new(reference, tmp_path, scenario, point, k):
    model = copy_model(reference["before"][scenario], tmp_path / "m")
    args = COMPRESS[scenario]
    build(model, *args, crash_at=f"{point}:{k}")

    # on disk: the old generation, byte for byte, or the complete new one
    m = read_manifest(manifest_path(model))
    old = reference["old"][scenario]
    new_generation, new_digests = reference["new"][scenario]
    if old is None and m is None:
        pass  # a first build killed before its manifest: no cache at all
    elif old is not None and manifest_path(model).read_bytes() == old:
        assert m.generation == new_generation - 1
    else:
        assert m is not None and m.generation == new_generation and digests(m) == new_digests
    if m is not None:
        assert_entries_intact(model.parent, m)

    # a read-only run uses it whole (or there is none) and decodes the same tokens
    assert_reads_cache(run_tokens(model, "read-only"), m, reference["tokens"])

    # the next build completes to the new generation and collects what the crash left
    doc = json.loads(build(model, *args).stdout)
    after = read_manifest(manifest_path(model))
    assert after.generation == doc["generation"] == new_generation and digests(after) == new_digests
    assert_entries_intact(model.parent, after)
    assert leftovers(model) == set()


# ------------------------------------------------------------------ concurrency
def released_together(*commands: list[str]) -> list[subprocess.CompletedProcess]:
    """Start every command blocked on a line from its stdin, then release them all at
    once: each starts its interpreter at the same instant as the others."""
    procs = [subprocess.Popen(["sh", "-c", 'read _ && exec "$@"', "sh", *map(str, c)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
             for c in commands]
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


@pytest.mark.parametrize("second", [(), ("--compress", "zstd")], ids=["both-uncompressed", "one-zstd"])
def test_two_builds_at_once_both_finish_and_leave_a_valid_cache(tiny_llm_path, tmp_path, second):
    model = copy_model(tiny_llm_path, tmp_path / "m")
    tokens = run_tokens(tiny_llm_path, "disabled")["tokens"]
    a, b = released_together([*ONNX_PREP, "build-cache", model, "--json"],
                             [*ONNX_PREP, "build-cache", model, *second, "--json"])
    assert (a.returncode, b.returncode) == (0, 0), a.stderr + b.stderr
    docs = [json.loads(p.stdout) for p in (a, b)]
    m = read_manifest(manifest_path(model))
    # the live generation is the last commit's; every object has its entry, intact
    assert m.generation == max(d["generation"] for d in docs)
    assert len(m.entries) == docs[0]["objects"] == docs[1]["objects"] > 0
    assert_entries_intact(model.parent, m)
    assert leftovers(model) == set()  # the loser's temporary file went too
    if all(d["previous_generation"] is None for d in docs):  # both opened before either committed
        # both built every object; the later commit found them all in the cache: no second generation
        assert m.generation == 1 and sorted(d["written"] for d in docs) == [0, len(m.entries)]
    doc = run_tokens(model, "read-only")
    assert doc["tokens"] == tokens
    assert doc["cache"]["entries"]["hit"] == doc["cache"]["packed_reads"] == len(m.entries)
    assert doc["cache"]["fallbacks"] == 0 and doc["cache"]["warnings"] == []
