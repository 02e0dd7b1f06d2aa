"""A prepared cache written before payload digests were XXH3 (format version 2, xxh64
digests) is still read through the real runtime, each entry checked in the algorithm
its digest names: a flipped byte is still caught, and an update keeps the old entries'
digests while the entries it adds get xxh3."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from onnx_prep.core.cache.manifest import CacheManifest, read_manifest
from onnx_prep.core.cache.payload_digest import payload_digest_of
from test_prepared_cache import _flip, build, load, reference, rewrite, same


@pytest.fixture
def model(small_llm_copy) -> Path:
    return small_llm_copy


def as_written_before(model: Path, manifest: CacheManifest) -> CacheManifest:
    """Rewrite the cache's manifest as the writer before XXH3 made it: version 2, each
    entry's digest the XXH64 of its stored bytes."""
    entries = []
    for e in manifest.entries:
        with open(model.parent / e.file, "rb") as f:
            f.seek(e.offset)
            entries.append(replace(e, payload_digest=payload_digest_of(f.read(e.length), "xxh64")))
    old = replace(manifest, entries=tuple(entries), format_version=2)
    rewrite(model, old)
    return read_manifest(model.parent / f"{model.stem}.prepared.onnx")


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
def test_a_cache_with_xxh64_digests_is_read_and_each_entry_checked(model, monkeypatch, mapped):
    want = reference(model)
    manifest = build(model)
    assert manifest.format_version == 3
    assert all(e.payload_digest.startswith("xxh3:") for e in manifest.entries)
    old = as_written_before(model, manifest)
    assert old.format_version == 2 and all(e.payload_digest.startswith("xxh64:") for e in old.entries)
    monkeypatch.setenv("ONNX_PREP_MAP_CACHE", "1" if mapped else "0")
    out, cache, _, stats = load(model, "read-only")
    assert same(out, want) and not cache.warnings
    assert cache.summary()["entries"]["hit"] == len(old.entries) and stats.prepacks == 0
    _flip(model, old)  # one byte of the first entry
    out, cache, _, stats = load(model, "read-only")
    assert same(out, want)  # the flipped entry was rebuilt from its sources
    assert cache.counters["fallbacks"] == 1 and stats.prepacks == 1
    assert f"does not match its digest {old.entries[0].payload_digest}" in cache.warnings[0]


def test_an_update_of_an_older_cache_keeps_its_digests_and_adds_xxh3(model):
    old = as_written_before(model, build(model))
    gone = old.entries[len(old.entries) // 2]
    rewrite(model, replace(old, entries=tuple(e for e in old.entries if e is not gone)))
    out, cache, _, stats = load(model, "build-if-missing")
    assert same(out, reference(model)) and stats.prepacks == 1
    after = read_manifest(model.parent / f"{model.stem}.prepared.onnx")
    assert after.format_version == 3
    digests = {e.key: e.payload_digest for e in after.entries}
    assert digests.pop(gone.key).startswith("xxh3:")
    assert digests == {e.key: e.payload_digest for e in old.entries if e is not gone}
    out, cache, _, stats = load(model, "read-only")  # both algorithms in one manifest
    assert same(out, reference(model)) and not cache.warnings and stats.prepacks == 0
