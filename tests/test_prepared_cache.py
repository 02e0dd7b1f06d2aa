"""The prepared cache end to end on a real fixture, through the real runtime: a round
trip reads packed payloads instead of sources and gives identical outputs; every way an
entry can stop matching its model gives the documented outcome under every policy
(docs/cache-format.md, "Policies"); persistence records only verified bytes."""
from __future__ import annotations

import hashlib
import json
import subprocess
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnx_prep.core.cache.manifest import (
    T_FORMAT,
    T_KERNEL_ABI,
    CacheManifest,
    encode_manifest,
    read_manifest,
)
from onnx_prep.core.cache.prepared_cache import EntryStatus, PreparedCache, PreparedCacheError
from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.decode.generation import step_feeds
from onnx_prep.core.errors import DigestError, OnnxPrepError
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.io.content_digest import digest_of
from onnx_prep.core.model.weights import TENSOR_DIGEST_KEY, TENSOR_FAST_DIGEST_KEY
from onnx_prep.core.plan.task import ResourceClass
from onnx_prep.core.runtime.scheduler import TaskState
from onnx_prep.core.runtime.session import Session

from conftest import strip_digests
from test_cli_exit_codes import ONNX_PREP


@pytest.fixture
def model(small_llm_copy) -> Path:
    return small_llm_copy


def _feeds(path: Path) -> dict:
    io = DecoderIO.discover(*_io(path), None, model=str(path))
    return step_feeds(io, np.array([[3, 1, 4, 1]]), io.empty_past(1), 0)


def _io(path: Path):
    r = resolve_model(path)
    return r.inputs, r.outputs


def load(path: Path, policy: str, **kw):
    """One session over the model with its cache under ``policy``: (outputs, cache,
    the reader's counters, the session's stats)."""
    resolved = resolve_model(path)
    cache = PreparedCache(resolved, policy=policy, **kw)
    try:
        with Session(resolved, cache=cache) as s:
            out = s.run(_feeds(path))
            counters = s.reader.counters.snapshot()
            stats = s.stats()
        if policy == "build-if-missing":
            cache.commit()
    finally:
        cache.close()
    return out, cache, counters, stats


def reference(path: Path) -> dict:
    with Session(resolve_model(path)) as s:
        return s.run(_feeds(path))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def build(path: Path) -> CacheManifest:
    load(path, "build-if-missing")
    return read_manifest(path.parent / f"{path.stem}.prepared.onnx")


def sources_touched(counters: dict) -> set[str]:
    return set(counters["per_tensor"]) | set(counters["mapped_per_tensor"])


def rewrite(path: Path, manifest: CacheManifest, **changes) -> None:
    """Replace the manifest at ``path`` with ``manifest`` (a crafted change)."""
    (path.parent / f"{path.stem}.prepared.onnx").write_bytes(encode_manifest(manifest))


def packed_sources(path: Path) -> set[str]:
    r = resolve_model(path)
    return {n for req in r.requests.values() if req.layout != "raw" for n in req.source_lineage}


# ------------------------------------------------------------------ round trip

def test_a_cached_load_reads_packed_payloads_only_and_gives_identical_outputs(model):
    want = reference(model)
    manifest = build(model)
    assert manifest.generation == 1 and manifest.entries and not manifest.damaged
    out, cache, counters, stats = load(model, "read-only")
    assert same(out, want)
    assert cache.summary()["entries"]["hit"] == len(manifest.entries)
    assert stats.packed_reads == len(manifest.entries)
    assert stats.packed_bytes_read == sum(e.length for e in manifest.entries)
    assert stats.prepacks == 0
    # not one byte of any source a cached entry was built from
    assert not sources_touched(counters) & packed_sources(model)


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
def test_payloads_are_mapped_into_their_slots_or_read_with_the_same_outputs(model, monkeypatch, mapped):
    want = reference(model)
    manifest = build(model)
    monkeypatch.setenv("ONNX_PREP_MAP_CACHE", "1" if mapped else "0")
    out, cache, _, stats = load(model, "read-only")
    assert same(out, want)
    total = sum(e.length for e in manifest.entries)
    assert stats.packed_bytes_read == total and stats.prepacks == 0
    assert stats.packed_bytes_mapped == (total if mapped else 0)  # mapped: nothing copied


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
def test_a_flipped_payload_byte_is_caught_whether_mapped_or_read(model, monkeypatch, mapped):
    manifest = build(model)
    _flip(model, manifest)
    f, bad = _payload(model, manifest)
    want = reference(model)
    monkeypatch.setenv("ONNX_PREP_MAP_CACHE", "1" if mapped else "0")
    out, cache, _, stats = load(model, "read-only")
    assert same(out, want)  # the flipped entry was rebuilt from its sources in its task
    assert cache.counters["fallbacks"] == 1 and stats.prepacks == 1
    assert "does not match its digest" in cache.warnings[0] and bad.key in cache.warnings[0]
    total = sum(e.length for e in manifest.entries)
    assert stats.packed_bytes_mapped == (total - bad.length if mapped else 0)


def test_mapped_page_ins_do_not_wait_behind_source_reads_holding_the_io_queue(model):
    """With a complete cache every packed object is mapped into its slot on the mapped
    queue. Every source read (the raw norm weights) held in the reader's hook, so the
    I/O queue is busy with a read that does not end: prepare() still maps and publishes
    every packed object meanwhile; released, the session's outputs are the reference's."""
    manifest = build(model)
    want = reference(model)
    resolved = resolve_model(model)
    cache = PreparedCache(resolved, policy="read-only")
    gate, entered = threading.Event(), threading.Event()

    def before_read(desc):
        entered.set()
        assert gate.wait(30)

    try:
        with Session(resolved, cache=cache) as s:
            s.reader.hooks.before_read = before_read
            try:
                h = s.prepare_async()
                assert entered.wait(30)
                packed = [t for t in h.tasks if t.name.startswith("S.read_packed:")]
                assert len(packed) == len(manifest.entries)
                assert all(t.wait(30) for t in packed)
                assert all(t.state is TaskState.DONE and t.resource is ResourceClass.MAPPED for t in packed)
                assert all(s.store.is_resident(s.plan.by_id[t.name].publishes) for t in packed)
                reads = [t for t in h.tasks if t.name.startswith("S.read_source:")]
                assert reads and not any(t.done() for t in reads)  # held all along
            finally:
                gate.set()
            h.wait()
            assert same(s.run(_feeds(model)), want)
            stats = s.stats()
        assert stats.packed_bytes_mapped == sum(e.length for e in manifest.entries) and stats.prepacks == 0
    finally:
        cache.close()


def test_a_new_process_reads_the_cache_and_decodes_the_same_tokens(model, tmp_path):
    """The round trip as a user makes it: each run its own process; from the cache
    (read-only, the default policy, and require-complete) the logits are the uncached
    run's bit for bit and not one byte of a packed source is read."""
    def run(name, *args):
        logits = tmp_path / f"{name}.npz"
        p = subprocess.run([*ONNX_PREP, "run", str(model), "--tokens", "6", "--json", "--logits-out", str(logits),
                            *args], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        return doc, np.load(logits)["logits"]

    plain, plain_logits = run("plain", "--cache-policy", "disabled")
    built, built_logits = run("built", "--cache-policy", "build-if-missing")
    assert plain["cache"] is None and plain["load"]["packed_reads"] == 0
    assert plain["load"]["prepacks"] > 0 and plain["load"]["packed_source_bytes"] > 0
    assert built["cache"]["committed"]["written"] == built["cache"]["entries"]["missing"] > 0
    for policy in ("read-only", "require-complete"):
        cached, logits = run(policy, "--cache-policy", policy)
        assert cached["cache"]["packed_reads"] == cached["cache"]["entries"]["hit"] == built["cache"]["persisted"]
        assert cached["load"]["prepacks"] == 0 and cached["load"]["packed_source_bytes"] == 0
        assert 0 < cached["load"]["source_bytes"] < plain["load"]["source_bytes"]  # the raw weights only
        assert plain["tokens"] == built["tokens"] == cached["tokens"]
        assert np.array_equal(logits, plain_logits) and np.array_equal(built_logits, plain_logits)


def _bytes_read_by_this_process() -> int:
    """``rchar`` of /proc/self/io: every byte this process's read-like calls returned."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs /proc/self/io (Linux) to count bytes read")
def test_opening_a_cache_reads_its_manifest_and_no_payload(model):
    """Opening (every entry validated, its payload file opened) reads the manifest, not
    one payload: the bytes this process reads while it opens are far fewer than one
    payload's (counted by the kernel, not by the cache's own counters)."""
    manifest = build(model)
    resolved = resolve_model(model)
    PreparedCache(resolved).close()  # the first open imports what it needs: not counted below
    smallest = min(e.length for e in manifest.entries)
    manifest_size = (model.parent / f"{model.stem}.prepared.onnx").stat().st_size
    before = _bytes_read_by_this_process()
    cache = PreparedCache(resolved)
    read = _bytes_read_by_this_process() - before
    try:
        assert all(o.status is EntryStatus.HIT for o in cache.outcomes.values())
        assert cache.counters["packed_bytes"] == 0
        assert read < manifest_size + 64 * 1024 < smallest * len(manifest.entries), (read, manifest_size)
    finally:
        cache.close()


def test_with_one_entry_removed_only_its_sources_are_read_and_repacked(model):
    manifest = build(model)
    gone = manifest.entries[len(manifest.entries) // 2]
    rewrite(model, CacheManifest(manifest.generation, manifest.source_model_digest, manifest.sources,
                                 tuple(e for e in manifest.entries if e is not gone)))
    out, cache, counters, stats = load(model, "build-if-missing")
    assert same(out, reference(model))
    assert stats.prepacks == 1 and stats.packed_reads == len(manifest.entries) - 1
    assert sources_touched(counters) & packed_sources(model) == set(gone.source_lineage)
    after = read_manifest(model.parent / f"{model.stem}.prepared.onnx")
    assert after.generation == 2 and {e.key for e in after.entries} == {e.key for e in manifest.entries}


def test_an_up_to_date_cache_is_not_written_again(model):
    build(model)
    path = model.parent / f"{model.stem}.prepared.onnx"
    before = path.read_bytes(), sorted(p.name for p in model.parent.iterdir())
    out, cache, counters, stats = load(model, "build-if-missing")
    assert cache.counters["persisted"] == 0
    assert (path.read_bytes(), sorted(p.name for p in model.parent.iterdir())) == before


def test_compressed_payloads_decode_into_the_slots(model):
    from onnx_prep.core.cache.cache_build import build_prepared_cache

    doc = build_prepared_cache(model, compress="zstd")
    manifest = read_manifest(model.parent / f"{model.stem}.prepared.onnx")
    assert doc["written"] == len(manifest.entries) and all(e.encoding == "zstd" for e in manifest.entries)
    out, cache, counters, stats = load(model, "require-complete")
    assert same(out, reference(model)) and stats.prepacks == 0


# ------------------------------------------------------------------ validation x policy

def _change_source(model: Path) -> None:
    """New bytes for one packed source, with its new digest (a re-exported model)."""
    r = resolve_model(model)
    name = sorted(packed_sources(model))[0]
    desc = r.weights[name]
    data_file = model.parent / desc.file
    raw = bytearray(data_file.read_bytes())
    raw[desc.offset:desc.offset + 4] = bytes(b ^ 0x01 for b in raw[desc.offset:desc.offset + 4])
    data_file.write_bytes(bytes(raw))
    tensor = bytes(raw[desc.offset:desc.offset + desc.length])
    new = {TENSOR_DIGEST_KEY: "sha256:" + hashlib.sha256(tensor).hexdigest(), TENSOR_FAST_DIGEST_KEY: digest_of(tensor)}
    m = onnx.load(str(model), load_external_data=False)
    t = next(t for t in m.graph.initializer if t.name == name)
    for p in t.metadata_props:
        p.value = new.get(p.key, p.value)
    onnx.save(m, str(model))


def _edit_entry(model: Path, manifest: CacheManifest, **fields) -> None:
    from dataclasses import replace

    e = manifest.entries[0]
    rewrite(model, CacheManifest(manifest.generation, manifest.source_model_digest, manifest.sources,
                                 (replace(e, **fields),) + manifest.entries[1:]))


def _other_layout(model, manifest):
    e = manifest.entries[0]
    layout = e.layout + ".other"
    _edit_entry(model, manifest, layout=layout, key=f"P:{'+'.join(e.source_lineage)}|{layout}|{e.device}")


def _payload(model, manifest, entry_index=0):
    e = manifest.entries[entry_index]
    return model.parent / e.file, e


def _truncate(model, manifest):
    f, e = _payload(model, manifest, -1)  # the last payload of the file: a shorter file cuts it
    with open(f, "r+b") as fh:
        fh.truncate(e.offset + e.length // 2)


def _flip(model, manifest):
    f, e = _payload(model, manifest)
    raw = bytearray(f.read_bytes())
    raw[e.offset + e.length // 2] ^= 0xFF
    f.write_bytes(bytes(raw))


def _missing_file(model, manifest):
    _edit_entry(model, manifest, file="nowhere.data")


CASES = {
    "source-changed": (lambda m, man: _change_source(m), EntryStatus.STALE),
    "other-layout": (_other_layout, EntryStatus.MISSING),
    "other-packed-format": (lambda m, man: _edit_entry(m, man, format_version=99), EntryStatus.INCOMPATIBLE),
    "other-kernel-abi": (lambda m, man: _edit_entry(m, man, kernel_abi="someone-else/v9"), EntryStatus.INCOMPATIBLE),
    "truncated-payload": (_truncate, EntryStatus.DAMAGED),
    "missing-file": (_missing_file, EntryStatus.DAMAGED),
    "flipped-payload-byte": (_flip, EntryStatus.HIT),  # found only when read
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("policy", ["disabled", "read-only", "build-if-missing", "require-complete"])
def test_each_way_an_entry_stops_matching_gives_the_policys_outcome(model, case, policy):
    manifest = build(model)
    damage, status = CASES[case]
    damage(model, manifest)
    want = reference(model)
    cache_file = model.parent / f"{model.stem}.prepared.onnx"
    on_disk = cache_file.read_bytes()
    if policy == "require-complete":  # at open, or (a payload's digest) when it is read
        with pytest.raises(OnnxPrepError, match="prepared cache (is incomplete|entry .* is unusable)"):
            load(model, policy)
        return
    out, cache, counters, stats = load(model, policy)
    assert same(out, want)  # whatever the cache held, never a wrong answer
    if policy == "disabled":
        assert stats.packed_reads == 0 and cache_file.read_bytes() == on_disk
        return
    bad = [o for o in cache.outcomes.values() if o.status is not EntryStatus.HIT]
    if status is EntryStatus.HIT:  # the digest check while reading caught it: rebuilt from sources
        assert cache.counters["fallbacks"] == 1 and len(cache.warnings) == 1
        assert "does not match its digest" in cache.warnings[0]
    else:
        assert [o.status for o in bad] == [status] or (status is EntryStatus.MISSING and bad[0].status is status)
    if policy == "read-only":
        assert cache_file.read_bytes() == on_disk  # read-only never writes
    else:  # build-if-missing repaired it: the next load is complete
        out2, cache2, _, stats2 = load(model, "require-complete")
        assert same(out2, want) and stats2.prepacks == 0


def test_a_payload_file_cut_after_the_cache_opened_is_rebuilt_not_a_crash(model):
    """The payload file shrinks between the cache's open (which took its size) and the
    load's mapping of its last entry: the mapping says so, the entry is recorded
    unusable and rebuilt from its sources, and the outputs are the reference's."""
    manifest = build(model)
    want = reference(model)
    resolved = resolve_model(model)
    cache = PreparedCache(resolved, policy="read-only")
    try:
        f, e = _payload(model, manifest, -1)
        with open(f, "r+b") as fh:
            fh.truncate(e.offset + e.length // 2)
        with Session(resolved, cache=cache) as s:
            out = s.run(_feeds(model))
        assert same(out, want)
        assert cache.counters["fallbacks"] == 1 and len(cache.warnings) == 1
        assert "shrank" in cache.warnings[0]
    finally:
        cache.close()


def test_a_malformed_manifest_is_an_error_under_every_policy_but_disabled(model):
    from onnx_prep.core.cache.manifest import CacheFormatError

    build(model)
    (model.parent / f"{model.stem}.prepared.onnx").write_bytes(b"\x08\x99garbage")
    for policy in ("read-only", "build-if-missing", "require-complete"):
        with pytest.raises(CacheFormatError, match="unparseable"):
            load(model, policy)
    out, *_ = load(model, "disabled")
    assert same(out, reference(model))


# ------------------------------------------------------------------ what gets persisted

def test_a_source_whose_bytes_do_not_match_its_digest_is_never_persisted(model):
    r = resolve_model(model)
    name = sorted(packed_sources(model))[0]
    desc = r.weights[name]
    f = model.parent / desc.file
    raw = bytearray(f.read_bytes())
    raw[desc.offset] ^= 0xFF  # digest left as declared
    f.write_bytes(bytes(raw))
    with pytest.raises(Exception) as info:
        load(model, "build-if-missing")
    assert isinstance(info.value, DigestError) or isinstance(info.value.__cause__, DigestError)
    manifest = read_manifest(model.parent / f"{model.stem}.prepared.onnx")
    assert manifest is None or all(name not in e.source_lineage for e in manifest.entries)


def test_sources_without_digests_are_recorded_as_read_and_never_reused_until_digested(model):
    digests = strip_digests(model)  # neither the per-tensor digest nor the file checksum
    manifest = build(model)
    assert manifest.entries  # persisted, with the digests computed on that read ...
    out, cache, _, stats = load(model, "read-only")
    assert stats.prepacks == len(manifest.entries)  # ... but nothing proves them current
    assert {o.status for o in cache.outcomes.values()} == {EntryStatus.UNVERIFIED}
    # once the model declares the digests (what `onnx-prep digest --write` does), they hit
    m = onnx.load(str(model), load_external_data=False)
    for t in m.graph.initializer:
        for key, value in digests[t.name]:
            t.metadata_props.add(key=key, value=value)
    onnx.save(m, str(model))
    out, cache, _, stats = load(model, "require-complete")
    assert stats.prepacks == 0 and same(out, reference(model))


def test_persistence_needs_digest_verification(model):
    from onnx_prep.core.errors import UsageError

    resolved = resolve_model(model)
    cache = PreparedCache(resolved, policy="build-if-missing")
    with pytest.raises(UsageError, match="verified bytes"):
        Session(resolved, cache=cache, verify_digests=False)


def test_the_manifest_is_an_onnx_model_the_checker_accepts(model):
    build(model)
    path = model.parent / f"{model.stem}.prepared.onnx"
    onnx.checker.check_model(str(path), full_check=True)
    m = onnx.load(str(path), load_external_data=False)
    assert not m.graph.node and all(t.data_type == onnx.TensorProto.UINT8 for t in m.graph.initializer)
    props = {p.key for p in m.graph.initializer[0].metadata_props}
    assert {T_FORMAT, T_KERNEL_ABI, "onnx_light.prepack.source_lineage_digest"} <= props


# ------------------------------------------------------------------ findings for `check`

def test_check_findings_name_each_unusable_entry(model):
    from onnx_prep.core.cache.preflight import prepared_cache_findings

    resolved = resolve_model(model)
    assert prepared_cache_findings(resolved) == []  # no cache, not required: nothing to say
    [missing] = prepared_cache_findings(resolved, require_complete=True)
    assert missing["severity"] == "error" and "build-cache" in missing["message"]
    manifest = build(model)
    assert prepared_cache_findings(resolve_model(model), require_complete=True, verify_payloads=True) == []
    _flip(model, manifest)  # found only by reading the payloads
    assert prepared_cache_findings(resolve_model(model)) == []
    [bad] = prepared_cache_findings(resolve_model(model), verify_payloads=True)
    assert bad["subject"] == manifest.entries[0].key and "does not match its digest" in bad["message"]
    assert bad["where"]["offset"] == manifest.entries[0].offset
    _edit_entry(model, manifest, kernel_abi="other/v2")
    found = prepared_cache_findings(resolve_model(model))
    assert [(f["subject"], f["severity"]) for f in found] == [(manifest.entries[0].key, "warning")]
    assert "incompatible: kernel ABI other/v2" in found[0]["message"]
    assert prepared_cache_findings(resolve_model(model), require_complete=True)[0]["severity"] == "error"
    (model.parent / f"{model.stem}.prepared.onnx").write_bytes(b"junk")
    [broken] = prepared_cache_findings(resolve_model(model))
    assert broken["severity"] == "error" and "unparseable" in broken["message"]


def _first_run_watching_the_writer(path: Path, **session_kw):
    """A first build's first run, noting at each of its steps whether the cache's
    background writer may run (its objects are queued meanwhile); then the commit."""
    from onnx_prep.core.runtime.session import RuntimeContext

    resolved = resolve_model(path)
    cache = PreparedCache(resolved, policy="build-if-missing")
    open_at_steps: list[bool] = []
    try:
        with Session(resolved, cache=cache, **session_kw) as s:
            ctx = RuntimeContext(_feeds(path))
            ctx.before_step = lambda i: open_at_steps.append(cache.writes_open)
            with s.run_async(ctx):
                pass
            after_run = cache.writes_open
            with s.run_async(RuntimeContext(_feeds(path))):  # a second run holds nothing
                pass
            after_second = cache.writes_open
        committed = cache.commit()
    finally:
        cache.close()
    return open_at_steps, after_run, after_second, committed


def test_a_first_build_writes_its_objects_after_the_first_output(model):
    """The session holds the cache's writer over its first run (the writer's page-cache
    writes and checksums slowed a first build's first output by ~20% though it runs at
    idle priority): at every step of that run the writer is held, at its end it is free,
    and every object is written and committed all the same."""
    steps, after_run, after_second, committed = _first_run_watching_the_writer(model)
    assert steps and not any(steps)
    assert after_run and after_second
    assert committed["error"] is None and committed["written"] > 0
    assert len(read_manifest(model.parent / f"{model.stem}.prepared.onnx").entries) == committed["written"]


def test_under_a_prepared_limit_the_writer_is_never_held(model):
    """Objects waiting to be written stay pinned, and a run under a limit may need their
    room: there the writer runs beside the first run as before."""
    from onnx_prep.core.runtime.arenas import Arena, MemoryBudget

    steps, *_ , committed = _first_run_watching_the_writer(model, budget=MemoryBudget(limits={Arena.PREPARED: 1 << 40}))
    assert steps and all(steps)
    assert committed["error"] is None and committed["written"] > 0


def test_a_hold_ends_with_its_release_or_a_flush(model):
    cache = PreparedCache(resolve_model(model), policy="build-if-missing")
    try:
        first, second = cache.hold_writes(), cache.hold_writes()
        first()
        first()  # a second call does nothing
        assert not cache.writes_open  # the other hold remains
        second()
        assert cache.writes_open
        cache.hold_writes()
        cache.flush()  # a session's close: the writer must drain whatever was held
        assert cache.writes_open
    finally:
        cache.close()


# ------------------------------------------------------------------ reading first

def _first_run_timeline(path: Path, cache_policy: str | None, **session_kw):
    """A session's first run (its cache under ``cache_policy``, or none): (outputs, the
    run's counters, when its first step started, when its last read ended, the plan)."""
    from onnx_prep.core.plan.task import TaskKind
    from onnx_prep.core.runtime.session import RuntimeContext

    resolved = resolve_model(path)
    cache = PreparedCache(resolved, policy=cache_policy) if cache_policy else None
    try:
        with Session(resolved, cache=cache, **session_kw) as s:
            ctx = RuntimeContext(_feeds(path))
            s.run_async(ctx).wait()
            reads = [e.end_ns for e in s.timeline()
                     if e.kind in (TaskKind.READ_PACKED, TaskKind.READ_SOURCE) and e.end_ns is not None]
            out = dict(ctx.outputs)
            return out, ctx.counters.snapshot(), ctx.first_step_ns, max(reads), s.plan, s.budget
    finally:
        if cache is not None:
            cache.close()


def test_a_load_from_a_complete_mapped_cache_reads_every_object_before_its_first_step(model):
    """Such a load builds nothing (it maps pages and checks checksums), so its first run
    waits for every object instead of contending with it for the cores: the first step
    starts after the last read ended, the run counts it, and the outputs are the
    reference's."""
    from onnx_prep.core.runtime.load_order import reads_first

    want = reference(model)
    build(model)
    out, counters, first_step, last_read, plan, budget = _first_run_timeline(model, "read-only")
    assert reads_first(plan, budget)
    assert counters.get("reads_first") == 1
    assert first_step >= last_read
    assert same(out, want)


def test_a_load_that_prepacks_or_streams_does_not_read_first(model):
    """Without a cache (prepacks), with one entry missing (one prepack), or under a
    PREPARED limit (the load streams), the first run starts as soon as its first step's
    objects are in: no barrier."""
    from onnx_prep.core.runtime.arenas import Arena, MemoryBudget
    from onnx_prep.core.runtime.load_order import reads_first

    want = reference(model)
    out, counters, *_, plan, budget = _first_run_timeline(model, None)
    assert not reads_first(plan, budget) and "reads_first" not in counters and same(out, want)
    manifest = build(model)
    limit = MemoryBudget(limits={Arena.PREPARED: 1 << 40})
    out, counters, *_, plan, budget = _first_run_timeline(model, "read-only", budget=limit)
    assert not reads_first(plan, budget) and "reads_first" not in counters and same(out, want)
    rewrite(model, CacheManifest(manifest.generation, manifest.source_model_digest, manifest.sources,
                                 manifest.entries[1:]))
    out, counters, *_, plan, budget = _first_run_timeline(model, "read-only")
    assert not reads_first(plan, budget) and "reads_first" not in counters and same(out, want)


def test_a_load_whose_payloads_left_the_page_cache_keeps_overlapping(model):
    """Payloads out of the page cache (dropped): the reads wait on storage, so the first
    run starts as soon as its first step's objects are in, as any other load; the
    outputs are the reference's."""
    from onnx_prep.core.profile.page_cache import drop_files
    from onnx_prep.core.runtime.load_order import reads_first

    want = reference(model)
    manifest = build(model)
    dropped = drop_files([model.parent / f for f in manifest.files])
    if dropped["dropped"] is not True:
        pytest.skip(f"the payload file's pages could not be dropped here: {dropped}")
    out, counters, first_step, last_read, plan, budget = _first_run_timeline(model, "read-only")
    assert "reads_first" not in counters  # decided when the session opened, the pages out
    assert same(out, want)
    # read by that load, the payloads are back in the page cache: the next load reads first
    assert reads_first(plan, budget)
    out, counters, first_step, last_read, *_ = _first_run_timeline(model, "read-only")
    assert counters.get("reads_first") == 1 and first_step >= last_read and same(out, want)


def test_a_trusted_symlinked_manifest_is_read_through_and_never_written_through(model, tmp_path):
    """--trust-symlinks: the manifest is read through its link and its payloads found
    beside the link's target; a build-if-missing load persists nothing through it (one
    warning), so neither the link nor its target's folder changes."""
    import os

    manifest = build(model)
    shared = tmp_path / "shared"
    shared.mkdir()
    name = f"{model.stem}.prepared.onnx"
    for f in (name, *manifest.files):
        os.rename(model.parent / f, shared / f)
    link = model.parent / name
    link.symlink_to(shared / name)
    out, cache, _, _ = load(model, "require-complete", trust_symlinks=True)
    assert same(out, reference(model)) and cache.counters["packed_reads"] == len(manifest.entries)
    os.truncate(shared / manifest.entries[0].file, 0)  # every entry damaged: a build would write them all
    listing = lambda: {p.name: p.read_bytes() for p in shared.iterdir()} | {"link": os.readlink(link)}  # noqa: E731
    before = listing()
    out, cache, _, _ = load(model, "build-if-missing", trust_symlinks=True)
    assert same(out, reference(model)) and cache.counters["persisted"] == 0
    assert any("is a symlink" in w and "going on without persisting" in w for w in cache.warnings), cache.warnings
    assert listing() == before and not any(p.name.startswith(".") for p in model.parent.iterdir())
