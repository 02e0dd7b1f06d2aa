"""``onnx-prep build-cache`` and ``run --cache-policy`` as users run them (real
subprocesses): records that validate against their schemas, an up-to-date cache left
alone, one-line errors with exit 2."""
from __future__ import annotations

import json
import os
import subprocess
from importlib import resources
from pathlib import Path

import pytest

from conftest import strip_digests
from test_cli_exit_codes import ONNX_PREP


@pytest.fixture
def model(small_llm_copy) -> Path:
    return small_llm_copy


def cli(*args, ok=True):
    p = subprocess.run([*ONNX_PREP, *map(str, args)], capture_output=True, text=True, timeout=120)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def schema(name: str) -> dict:
    return json.loads(resources.files("onnx_prep.core").joinpath(f"schemas/{name}.schema.json").read_text())


def test_build_then_rebuild_nothing_records_validate(model):
    jsonschema = pytest.importorskip("jsonschema")
    first = json.loads(cli("build-cache", model, "--json").stdout)
    jsonschema.validate(first, schema("build-cache"))
    assert first["generation"] == 1 and first["previous_generation"] is None
    assert first["written"] == first["objects"] > 0 and first["reused"] == 0
    manifest = Path(first["cache"])
    assert manifest == model.parent / f"{model.stem}.prepared.onnx"
    files = sorted(p.name for p in model.parent.iterdir())
    data = manifest.read_bytes()
    again = json.loads(cli("build-cache", model, "--json").stdout)
    jsonschema.validate(again, schema("build-cache"))
    assert again["written"] == 0 and again["reused"] == first["objects"] and again["source_bytes_read"] == 0
    assert manifest.read_bytes() == data and sorted(p.name for p in model.parent.iterdir()) == files
    text = cli("build-cache", model).stdout
    assert "up to date" in text and "nothing written" in text


def test_build_cache_writes_xxh3_payload_digests(model):
    from onnx_prep.core.cache.manifest import read_manifest

    try:
        import xxhash  # the reference, where present
    except ImportError:
        xxhash = None
    built = json.loads(cli("build-cache", model, "--json").stdout)
    m = read_manifest(Path(built["cache"]))
    assert m.format_version == 3 and len(m.entries) == built["objects"] > 0
    for e in m.entries:
        with open(model.parent / e.file, "rb") as f:
            f.seek(e.offset)
            stored = f.read(e.length)
        algorithm, hexdigits = e.payload_digest.split(":")
        assert algorithm == "xxh3" and len(hexdigits) == 16, e.key
        if xxhash is not None:
            assert int(hexdigits, 16) == xxhash.xxh3_64_intdigest(stored), e.key


def test_run_records_the_cache_it_used(model):
    jsonschema = pytest.importorskip("jsonschema")
    built = json.loads(cli("run", model, "--tokens", "3", "--json", "--cache-policy", "build-if-missing").stdout)
    used = json.loads(cli("run", model, "--tokens", "3", "--json").stdout)  # read-only: the default
    for doc in (built, used):
        jsonschema.validate(doc, schema("run"))
    assert built["cache"]["committed"]["written"] > 0 and used["cache"]["committed"] is None
    assert used["cache"]["packed_reads"] == built["cache"]["committed"]["written"]
    assert "prepared cache: " in cli("run", model, "--tokens", "3").stdout


def test_cache_dir_and_output_place_the_cache(model, tmp_path):
    elsewhere = tmp_path / "caches"
    elsewhere.mkdir()
    doc = json.loads(cli("build-cache", model, "--cache-dir", elsewhere, "--json").stdout)
    assert Path(doc["cache"]).parent == elsewhere and all((elsewhere / f).is_file() for f in doc["files"])
    out = tmp_path / "caches" / "named.prepared.onnx"
    doc = json.loads(cli("build-cache", model, "-o", out, "--json").stdout)
    assert doc["cache"] == str(out)
    used = json.loads(cli("run", model, "--tokens", "2", "--json", "--prepared", out,
                          "--cache-policy", "require-complete").stdout)
    assert used["cache"]["entries"]["hit"] == doc["objects"]


@pytest.mark.parametrize("args,needle", [
    (["--compress", "lz4"], "unknown compression"),
    (["--device", "cuda"], "device 'cuda'"),
    (["-o", "x.onnx"], "ends in .prepared.onnx"),
    (["--cache-dir", "/nonexistent-folder"], "does not exist"),
])
def test_bad_options_are_one_line_and_exit_2(model, args, needle):
    p = cli("build-cache", model, *args, ok=False)
    assert p.returncode == 2 and needle in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


def test_a_malformed_cache_is_exit_2_until_rebuilt(model):
    cli("build-cache", model)
    manifest = model.parent / f"{model.stem}.prepared.onnx"
    manifest.write_bytes(b"not a protobuf at all")
    for args in (["build-cache", model], ["run", model, "--tokens", "2"]):
        p = cli(*args, ok=False)
        assert p.returncode == 2 and "prepared cache is invalid (unparseable)" in p.stderr
        assert len(p.stderr.strip().splitlines()) == 1
    doc = json.loads(cli("build-cache", model, "--rebuild", "--json").stdout)
    assert doc["written"] == doc["objects"]
    assert cli("run", model, "--tokens", "2", "--cache-policy", "disabled").returncode == 0
    assert cli("run", model, "--tokens", "2", "--cache-policy", "require-complete").returncode == 0


def test_require_complete_without_a_cache_says_there_is_none(model):
    p = cli("run", model, "--tokens", "2", "--cache-policy", "require-complete", ok=False)
    cache = model.parent / f"{model.stem}.prepared.onnx"
    assert p.returncode == 2 and f"no prepared cache there (file {cache})" in p.stderr, p.stderr
    assert f"build it: onnx-prep build-cache {model}" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_build_if_missing_refuses_unverified_reads(model):
    p = cli("run", model, "--cache-policy", "build-if-missing", "--no-verify-digests", ok=False)
    assert p.returncode == 2 and "verified" in p.stderr


def test_a_folder_with_its_cache_still_names_one_model(model):
    cli("build-cache", model)
    assert (model.parent / f"{model.stem}.prepared.onnx").is_file()
    doc = json.loads(cli("run", model.parent, "--tokens", "2", "--json").stdout)
    assert doc["model"].endswith(model.name) and doc["cache"]["packed_reads"] > 0
    assert json.loads(cli("build-cache", model.parent, "--json").stdout)["written"] == 0


def test_weights_without_digests_are_said_and_write_digests_makes_the_cache_usable(model):
    """A cache built from weights without digests is one no load uses: build-cache says
    so (one warning naming the fix), and --write-digests gives them digests first, after
    which a load under require-complete reads every object from the cache and a second
    build writes nothing."""
    jsonschema = pytest.importorskip("jsonschema")
    strip_digests(model)
    p = cli("build-cache", model)
    warning = [line for line in p.stderr.splitlines() if "without a digest" in line]
    assert len(warning) == 1 and f"build-cache --write-digests {model}" in warning[0]
    doc = json.loads(cli("build-cache", model, "--json").stdout)
    jsonschema.validate(doc, schema("build-cache"))
    assert doc["unverifiable"] == doc["objects"] > 0 and any("without a digest" in w for w in doc["warnings"])
    # built again (nothing proves the entries current without reading the sources), and
    # found to hold what the sources pack to: not written again
    assert doc["written"] == doc["rebuilt"] == 0 and doc["reused"] == doc["objects"]
    assert {o["was"] for o in doc["outcomes"]} == {"unverified"} and doc["source_bytes_read"] > 0
    r = cli("run", model, "--tokens", "2", "--cache-policy", "require-complete", ok=False)
    assert r.returncode == 2 and f"onnx-prep digest --write {model}" in r.stderr  # the fix, not build-cache alone
    fixed = json.loads(cli("build-cache", model, "--write-digests", "--json").stdout)
    jsonschema.validate(fixed, schema("build-cache"))
    assert fixed["digests_added"] > 0 and fixed["unverifiable"] == 0 and fixed["warnings"] == []
    assert cli("run", model, "--tokens", "2", "--cache-policy", "require-complete").returncode == 0
    again = json.loads(cli("build-cache", model, "--json").stdout)
    assert again["written"] == 0 and again["verified"] == again["objects"] and again["digests_added"] == 0


def test_a_damaged_payload_is_found_and_rebuilt_by_build_cache(model):
    """The fix a load names for a damaged entry works: build-cache reads every entry it
    keeps against its payload digest, so it rebuilds the damaged one (and only it)."""
    from onnx_prep.core.cache.manifest import read_manifest

    built = json.loads(cli("build-cache", model, "--json").stdout)
    e = max(read_manifest(Path(built["cache"])).entries, key=lambda e: e.length)
    data = model.parent / e.file
    with open(data, "r+b") as f:  # one payload byte flipped
        f.seek(e.offset + e.length // 2)
        b = f.read(1)
        f.seek(e.offset + e.length // 2)
        f.write(bytes([b[0] ^ 0x40]))
    r = cli("run", model, "--tokens", "2", "--cache-policy", "require-complete", ok=False)
    assert r.returncode == 2 and "does not match its digest" in r.stderr
    assert f"rebuild it: onnx-prep build-cache {model}" in r.stderr
    skipped = json.loads(cli("build-cache", model, "--no-verify", "--json").stdout)
    assert skipped["written"] == 0 and skipped["verified"] == 0  # not read: not found
    doc = json.loads(cli("build-cache", model, "--json").stdout)
    assert doc["written"] == doc["rebuilt"] == 1 and doc["verified"] == doc["objects"]
    assert [o["was"] for o in doc["outcomes"] if o["action"] == "written"] == ["damaged"]
    assert cli("run", model, "--tokens", "2", "--cache-policy", "require-complete").returncode == 0


def test_a_folder_at_the_manifest_path_is_refused_in_one_line_and_nothing_is_left(model):
    """A folder where the manifest goes is not a manifest --rebuild may replace: every
    command that would write the cache refuses it, naming it, before writing a byte."""
    manifest = model.parent / f"{model.stem}.prepared.onnx"
    manifest.mkdir()
    before = sorted(p.name for p in model.parent.iterdir())
    for args in (["build-cache", model, "--rebuild"], ["build-cache", model],
                 ["run", model, "--tokens", "2", "--cache-policy", "build-if-missing"]):
        p = cli(*args, ok=False)
        assert p.returncode == 2, (args, p.stderr)
        (line,) = p.stderr.splitlines()
        assert "is a directory, not a manifest" in line and f"file {manifest}" in line, (args, line)
        assert "--rebuild" not in line, line  # it cannot replace a folder
        assert sorted(p.name for p in model.parent.iterdir()) == before, args  # no temporary file, no generation
    assert manifest.is_dir() and not any(manifest.iterdir())


def _linked_cache(model: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The model's cache built in a folder of its own, reached from the default path by a
    symlink (a cache shared between checkouts): (the link, its target)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    target = shared / f"{model.stem}.prepared.onnx"
    cli("build-cache", model, "-o", target)
    link = model.parent / target.name
    link.symlink_to(target)
    return link, target


def _listing(*folders: Path) -> dict:
    return {p: p.read_bytes() if p.is_file() and not p.is_symlink() else os.readlink(p)
            for folder in folders for p in sorted(folder.iterdir())}


def test_a_symlinked_manifest_is_read_through_only_with_trust_symlinks(model, tmp_path):
    link, target = _linked_cache(model, tmp_path)
    refused = cli("check", model, "--json", ok=False)
    assert refused.returncode == 1, refused.stderr
    [f] = json.loads(refused.stdout)["findings"]
    assert f["check"] == "prepared_cache" and "is a symlink" in f["message"] and "--trust-symlinks" in f["message"]
    p = cli("run", model, "--tokens", "2", ok=False)  # the default refuses it, in one line
    assert p.returncode == 2 and "is a symlink" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    trusted = cli("check", model, "--trust-symlinks", "--require-complete", "--verify-payloads", "--json")
    assert json.loads(trusted.stdout)["findings"] == []  # payloads found beside the link's target
    # every command that opens the cache hands it its --trust-symlinks
    ran = json.loads(cli("run", model, "--tokens", "2", "--trust-symlinks", "--cache-policy", "require-complete",
                         "--json").stdout)
    assert ran["load"]["prepacks"] == 0 and ran["load"]["packed_reads"] > 0 and ran["cache"]["entries"]["hit"] > 0
    plan = json.loads(cli("plan-dump", model, "--trust-symlinks", "--format", "json").stdout)
    assert plan["summary"]["recipes"]["read_packed_payload"] > 0 and plan["summary"]["bytes_to_read"]["packed"] > 0


def test_build_cache_never_writes_through_a_symlinked_manifest(model, tmp_path):
    """Neither replacing the link nor writing into its target's folder unasked: refused
    before anything is read or written, naming the link and where to build instead."""
    link, target = _linked_cache(model, tmp_path)
    os.truncate(target.parent / f"{model.stem}.prepared.g1.data", 0)  # damaged: a build would write
    before = _listing(model.parent, target.parent)
    for args in (["--trust-symlinks"], ["--trust-symlinks", "--rebuild"], ["--rebuild"], ["--write-digests"]):
        p = cli("build-cache", model, *args, ok=False)
        assert p.returncode == 2, (args, p.stderr)
        (line,) = p.stderr.splitlines()
        assert "is a symlink" in line and f"file {link}" in line and f"-o {target}" in line, (args, line)
        assert _listing(model.parent, target.parent) == before, args
    assert link.is_symlink() and link.resolve() == target
    done = json.loads(cli("build-cache", model, "-o", target, "--json").stdout)  # the fix it names
    assert done["written"] == done["objects"]


_MAXRSS_CHILD = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True); "
                 "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def _build_rss_kib(*args) -> int:
    """Peak RSS (KiB) of one ``onnx-prep build-cache`` process: a launcher whose only child it is."""
    import sys

    p = subprocess.run([sys.executable, "-c", _MAXRSS_CHILD, *ONNX_PREP, "build-cache", *map(str, args)],
                       capture_output=True, text=True, timeout=120)
    code, rss = p.stdout.split()
    assert code == "0", p.stderr
    return int(rss)


def test_a_memory_budget_builds_the_same_cache_in_groups_in_less_memory(tmp_path):
    # 45 MiB of packed objects: built whole, then under an 8 MiB budget (7 groups). The
    # same entries, byte for byte; the budgeted process's peak RSS lower by most of the
    # packed size (measured here: 111 against 74 MiB).
    from onnx_prep.core.cache.manifest import read_manifest
    from onnx_prep.fixtures import FixtureConfig, generate

    model = generate(FixtureConfig.preset("tiny-llm").replace(hidden=1024, intermediate=4096), tmp_path / "m")
    whole, grouped = tmp_path / "whole.prepared.onnx", tmp_path / "grouped.prepared.onnx"
    rss_whole = _build_rss_kib(model, "-o", whole)
    rss_grouped = _build_rss_kib(model, "-o", grouped, "--memory-budget", "8MiB")
    a, b = read_manifest(whole), read_manifest(grouped)
    packed = sum(e.decoded_length for e in a.entries)
    assert packed > 40 << 20
    assert {e.key: (e.length, e.payload_digest) for e in a.entries} == \
        {e.key: (e.length, e.payload_digest) for e in b.entries}
    assert rss_grouped < rss_whole - (packed >> 10) // 2, (rss_whole, rss_grouped)
    doc = json.loads(cli("build-cache", model, "-o", tmp_path / "again.prepared.onnx", "--memory-budget", "8MiB",
                         "--json").stdout)
    assert doc["groups"] == 7 and doc["memory_budget"] == 8 << 20 and doc["written"] == len(a.entries)
    assert "built in 7 groups" in cli("build-cache", model, "-o", tmp_path / "text.prepared.onnx",
                                      "--memory-budget", "8MiB").stdout
    # the tied embedding / LM head (5 MiB packed) cannot fit 1 MiB: refused before anything is read
    for budget, needle in (("1MiB", "needs 5.0 MiB, over the memory budget of 1.0 MiB; give --memory-budget 6MiB"),
                           ("lots", "--memory-budget must be a size")):
        p = cli("build-cache", model, "-o", tmp_path / "refused.prepared.onnx", "--memory-budget", budget, ok=False)
        assert p.returncode == 2 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert not list(tmp_path.glob("refused.prepared*"))
