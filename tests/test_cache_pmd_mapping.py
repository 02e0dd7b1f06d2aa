"""Prepared-cache payloads mapped with 2 MiB page-table entries (docs/cache-format.md,
"Writing"; docs/runtime.md, "Page-ins"): the writer starts each plain payload of at least
2 MiB on a 2 MiB boundary of its file, the space skipped left as a hole (or filled by a
smaller payload), so the disk holds no more bytes; a mapped load's slots (2 MiB-aligned)
then map those payloads' whole 2 MiB units by PMD entries, which the runtime counts
exactly from the page tables (``packed_bytes_pmd_mapped``) — on a fresh load, on every
page-in under a budget, and after the page cache was dropped. An old cache, its payloads
only 4 KiB-aligned, is still read (its large payloads by 4 KiB entries).

Where the kernel or file system gives no 2 MiB page-cache folios (or cannot report page
table entries), the PMD counts are skipped, saying why: the probe is the same 64 MiB file,
written in 2 MiB writes in the cache's folder and mapped into a slot."""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from onnx_prep import native
from onnx_prep.core.cache.cache_writer import CacheWriter
from onnx_prep.core.cache.manifest import (
    ALIGNMENT,
    HUGE_ALIGNMENT,
    encode_manifest,
    read_manifest,
)
from onnx_prep.core.cache.prepared_cache import PreparedCache
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.plan.task import TaskKind
from onnx_prep.core.profile.page_cache import drop_files
from onnx_prep.core.runtime.arenas import Arena, MemoryBudget
from onnx_prep.core.runtime.session import Session, SessionOptions

from test_cache_manifest import identity
from test_cli_exit_codes import ONNX_PREP
from test_prepared_cache import _feeds, build, reference, same

MIB = 1 << 20
UNIT = HUGE_ALIGNMENT
PROBE = 64 * MIB


def pmd_folios_or_skip(folder: Path, *, cold: bool = False) -> None:
    """Skip unless a 64 MiB file written in 2 MiB writes in ``folder`` (``cold``: its page
    cache dropped first) maps into a slot with 2 MiB page-table entries throughout."""
    path = folder / ".pmd-probe"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        step = np.random.default_rng(0).integers(0, 256, UNIT, dtype=np.uint8).tobytes()
        for lo in range(0, PROBE, UNIT):
            os.pwrite(fd, step, lo)
        if cold:
            drop_files([path])
        slot = native.StableSlot(PROBE)
        slot.map_file(fd, 0, PROBE)
        pmd = slot.pmd_mapped_bytes()
        slot.decommit()
    finally:
        os.close(fd)
        path.unlink()
    if pmd is None:
        pytest.skip("the kernel cannot report page-table entries (PAGEMAP_SCAN needs Linux 6.7+)")
    if pmd != PROBE:
        pytest.skip(f"no 2 MiB page-cache folios {'read cold ' if cold else ''}on this kernel and file system: "
                    f"{pmd >> 20} of 64 MiB of a 2 MiB-aligned file mapping were PMD-mapped")


def assert_pmd_mapped(actual: int | None, expected: int, folder: Path, *, cold: bool = False) -> None:
    """``actual == expected``, unless the probe fails now as well: a 2 MiB folio is one
    order-9 allocation, which fragmented memory on a busy machine can refuse (the page
    cache then falls back to smaller folios); that skips, saying so, rather than fails."""
    if actual != expected:
        pmd_folios_or_skip(folder, cold=cold)
    assert actual == expected


def _whole_units(entries) -> dict[str, int]:
    """Per key: the bytes of whole 2 MiB units of each 2 MiB-aligned plain entry."""
    return {e.key: e.length // UNIT * UNIT for e in entries
            if e.encoding is None and e.offset % UNIT == 0 and e.length >= UNIT}


# ------------------------------------------------------------------ the writer

def test_the_writer_puts_large_plain_payloads_on_2_mib_boundaries_and_leaves_holes(tmp_path):
    rng = np.random.default_rng(1)
    sizes = {"a": 5000, "big": 3 * MIB + 5, "c": 100, "big2": 2 * MIB, "d": 100 << 10, "e": 2 * MIB - 1}
    data = {k: rng.integers(0, 256, n, dtype=np.uint8) for k, n in sizes.items()}
    w = CacheWriter(tmp_path, "m", "m.prepared.onnx")
    try:
        for k, d in data.items():
            w.append(identity(k), d)
    except BaseException:
        w.discard()
        raise
    entries = {e.source_lineage[0]: e for e in w.entries}
    path = tmp_path / w.temp.name
    offsets = {k: e.offset for k, e in entries.items()}
    # 2 MiB and more: the next 2 MiB boundary; smaller ones fill the first gap they fit,
    # 4 KiB-aligned (2 MiB - 1 is small: it goes to the end, no gap is that large)
    assert offsets == {"a": 0, "big": 2 * MIB, "c": 8192, "big2": 6 * MIB, "d": 12288, "e": 8 * MIB}
    raw = path.read_bytes()
    for k, d in data.items():
        assert raw[offsets[k]:offsets[k] + sizes[k]] == d.tobytes()
    os.fsync(os.open(path, os.O_RDONLY))
    st = os.stat(path)
    assert st.st_size == 8 * MIB + sizes["e"]
    stored = sum(-(-n // ALIGNMENT) * ALIGNMENT for n in sizes.values())
    holes = st.st_size - stored
    assert holes > 2 * MIB  # [12 KiB + 100 KiB, 2 MiB) and [5 MiB + 4 KiB, 6 MiB) were skipped
    # the holes take no disk: the allocated bytes are the payloads' (a little metadata aside)
    assert st.st_blocks * 512 <= stored + (64 << 10)
    w.discard()


def test_a_compressed_payload_stays_4_kib_aligned(tmp_path):
    pytest.importorskip("zstandard")
    w = CacheWriter(tmp_path, "m", "m.prepared.onnx", compress="zstd")
    try:
        w.append(identity("a"), np.arange(5000, dtype=np.uint8))
        noise = np.random.default_rng(2).integers(0, 256, 3 * MIB, dtype=np.uint8)  # incompressible
        e = w.append(identity("big"), noise)
        assert e.encoding == "zstd" and e.length >= 2 * MIB
        assert e.offset == 4096  # right after the first: never mapped, so never moved to a 2 MiB boundary
    finally:
        w.discard()


# ------------------------------------------------------------------ the mapping

def test_a_slot_maps_a_2_mib_aligned_file_range_with_pmd_entries_again_after_each_unmap(tmp_path):
    pmd_folios_or_skip(tmp_path)
    path = tmp_path / "payload.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        step = np.random.default_rng(3).integers(0, 256, UNIT, dtype=np.uint8).tobytes()
        for lo in range(0, 8 * MIB, UNIT):
            os.pwrite(fd, step, lo)
        slot = native.StableSlot(8 * MIB)
        for _ in range(2):  # an eviction unmaps; the page-in maps the same folios again
            slot.map_file(fd, 0, 5 * MIB)
            # the whole units; the last MiB by 4 KiB entries
            assert_pmd_mapped(slot.pmd_mapped_bytes(), 4 * MIB, tmp_path)
            assert np.array_equal(slot.view(5 * MIB)[:UNIT], np.frombuffer(step, np.uint8))
            slot.decommit()
            assert slot.pmd_mapped_bytes() == 0
        slot.map_file(fd, 4096, 5 * MIB)  # address and offset disagree modulo 2 MiB: no PMD entry
        assert slot.pmd_mapped_bytes() == 0
        slot.decommit()
    finally:
        os.close(fd)


@pytest.fixture
def tiny_copy(tiny_llm_path, tmp_path) -> Path:
    """A private copy of the tiny fixture (its embedding packs to 2.5 MiB: one whole unit)."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    for f in tiny_llm_path.parent.iterdir():
        if f.suffix in (".onnx", ".data"):
            (folder / f.name).write_bytes(f.read_bytes())
    return folder / tiny_llm_path.name


def _load(model: Path, **options):
    resolved = resolve_model(model)
    cache = PreparedCache(resolved, policy="read-only")
    try:
        with Session(resolved, SessionOptions(cache=cache, **options)) as s:
            out = s.run(_feeds(model))
            return out, s.stats(), cache.summary()
    finally:
        cache.close()


def test_a_cached_load_maps_the_aligned_objects_whole_units_with_pmd_entries(tiny_copy):
    manifest = build(tiny_copy)
    units = _whole_units(manifest.entries)
    assert units and sum(units.values()) >= UNIT  # the fixture has a payload of 2 MiB or more
    assert all(e.offset % UNIT == 0 for e in manifest.entries if e.length >= UNIT)
    pmd_folios_or_skip(tiny_copy.parent)
    out, stats, summary = _load(tiny_copy)
    assert same(out, reference(tiny_copy))
    assert stats.packed_bytes_mapped == sum(e.length for e in manifest.entries)
    assert_pmd_mapped(stats.packed_bytes_pmd_mapped, sum(units.values()), tiny_copy.parent)
    assert summary["pmd_mapped_bytes"] == stats.to_json()["io"]["packed_bytes_pmd_mapped"] == sum(units.values())
    # a new process (the run record): the payload file's folios are in the page cache
    p = subprocess.run([*ONNX_PREP, "run", str(tiny_copy), "--tokens", "2", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert_pmd_mapped(json.loads(p.stdout)["cache"]["pmd_mapped_bytes"], sum(units.values()), tiny_copy.parent)


def test_page_ins_under_a_budget_map_the_aligned_objects_with_pmd_entries_again(tiny_copy):
    manifest = build(tiny_copy)
    units = _whole_units(manifest.entries)
    pmd_folios_or_skip(tiny_copy.parent)
    resolved = resolve_model(tiny_copy)
    cache = PreparedCache(resolved, policy="read-only")
    try:
        with Session(resolved, SessionOptions(cache=cache)) as probe:
            plan = probe.plan
        largest_step = max(sum(plan.by_key[k].packed_bytes for k in plan.by_id[st.task_id].prepared_requirements)
                           for st in plan.steps)
        budget = MemoryBudget(limits={Arena.PREPARED: largest_step + 4096, Arena.PREPARATION: 4 << 20})
        with Session(resolved, SessionOptions(cache=cache, budget=budget)) as s:
            want = reference(tiny_copy)
            for _ in range(2):
                assert same(s.run(_feeds(tiny_copy)), want)
            stats = s.stats()
            maps = {}
            for ev in s.timeline():
                if ev.kind is TaskKind.READ_PACKED and ev.start_ns is not None and ev.name in s.plan.by_id:
                    key = s.plan.by_id[ev.name].publishes
                    maps[key] = maps.get(key, 0) + 1
    finally:
        cache.close()
    assert stats.page_ins > 0
    big = [k for k in units if maps.get(k, 0) > 1]
    assert big, f"no object of 2 MiB or more was paged in again: {maps}"
    assert_pmd_mapped(stats.packed_bytes_pmd_mapped, sum(units[k] * maps.get(k, 0) for k in units), tiny_copy.parent)


def test_after_the_page_cache_was_dropped_a_load_still_maps_whole_units_with_pmd_entries(tiny_copy):
    """One worker (``sequential``): two faulting neighbouring payloads of a cold file at
    once can let one's readahead fill part of the other's 2 MiB unit with small folios
    (docs/runtime.md, "Reading first"; ~1 cold load in 30 of this fixture on two
    workers). What is checked here is the mapping's own readahead: whole 2 MiB folios."""
    manifest = build(tiny_copy)
    units = _whole_units(manifest.entries)
    pmd_folios_or_skip(tiny_copy.parent, cold=True)
    dropped = drop_files([tiny_copy.parent / f for f in manifest.files])
    assert dropped["dropped"] is not False, dropped  # nothing of the payload file left in the page cache
    out, stats, _ = _load(tiny_copy, sequential=True)
    assert same(out, reference(tiny_copy))
    # the mapping is advised MADV_HUGEPAGE: its faults read ahead whole 2 MiB folios
    assert_pmd_mapped(stats.packed_bytes_pmd_mapped, sum(units.values()), tiny_copy.parent, cold=True)


def test_a_cache_of_4_kib_aligned_large_payloads_is_still_read(tiny_copy):
    """What the writer wrote before: every payload packed at 4 KiB boundaries."""
    manifest = build(tiny_copy)
    folder = tiny_copy.parent
    (name,) = manifest.files
    old = (folder / name).read_bytes()
    packed, entries, end = bytearray(), [], 0
    for e in sorted(manifest.entries, key=lambda e: (e.length >= UNIT, e.offset)):  # small ones first
        end = -(-end // ALIGNMENT) * ALIGNMENT
        packed += b"\0" * (end - len(packed)) + old[e.offset:e.offset + e.length]
        entries.append(replace(e, offset=end))
        end += e.length
    assert any(e.length >= UNIT and e.offset % UNIT for e in entries)  # a large payload off 2 MiB
    (folder / name).write_bytes(bytes(packed))
    (folder / f"{tiny_copy.stem}.prepared.onnx").write_bytes(
        encode_manifest(replace(manifest, entries=tuple(entries))))
    assert read_manifest(folder / f"{tiny_copy.stem}.prepared.onnx").entries
    out, stats, summary = _load(tiny_copy)
    assert same(out, reference(tiny_copy))
    assert summary["entries"]["hit"] == len(entries) and stats.prepacks == 0
    assert stats.packed_bytes_mapped == sum(e.length for e in entries)
    assert stats.packed_bytes_pmd_mapped == 0 or stats.pmd_mapped is None  # 4 KiB entries only
