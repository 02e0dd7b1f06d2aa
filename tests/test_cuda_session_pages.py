"""One load path for a device decode (core/cuda/session_pages.py): ``open_device_decoder``
loads through a device session's plan and pages through it, on the fake driver.

- the decoder's objects are the session's device slots: nothing of the model is kept in
  host memory; the plan's own tasks made them (device prepacks from uploaded sources,
  raw weights uploaded); every packed object's header, described on the host from its
  node, is the 64 bytes the device prepack wrote;
- under a budget the residency's page-ins are the session's recipes run again (each
  page-in a device prepack), its evictions the session's, and the raw weights stay
  resident, off the budget the packed weights page under;
- from a complete prepared cache, every page-in is a payload read from the cache: no
  source byte of a packed object is read, however many times it pages;
- a budget that the raw weights leave too small for the largest packed weight is
  refused in one line before any step, with the budget that would do.
"""
from __future__ import annotations

import numpy as np
import pytest
from fake_cuda_driver import MiB, ready

from onnx_prep.core.cache.cache_build import build_prepared_cache
from onnx_prep.core.cache.prepared_cache import PreparedCache
from onnx_prep.core.cuda.device_decoder import open_device_decoder
from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.decode.generation import greedy_decode
from onnx_prep.core.decode.run_record import open_prepared_runner
from onnx_prep.core.errors import DeviceBudgetError
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.plan.execution_plan import RAW_LAYOUT
from onnx_prep.native.packed import HEADER_SIZE, read_header

G = 2 * MiB  # the fake's granularity
TOKENS = 4
PROMPT = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]]


@pytest.fixture(scope="module")
def tiny():
    from onnx_prep.fixtures import default_model_path

    path = default_model_path()
    resolved = resolve_model(path)
    io = DecoderIO.discover(resolved.inputs, resolved.outputs, None, model=str(path))
    with open_prepared_runner(resolved, threads=1, source_pages="auto") as cpu:
        want = greedy_decode(cpu, io, np.array(PROMPT), TOKENS).tokens.tolist()
    return path, resolved, io, want


def _packed(session):
    return [r for r in session.plan.requirements if r.request.layout != RAW_LAYOUT]


def _raw(session):
    return [r for r in session.plan.requirements if r.request.layout == RAW_LAYOUT]


def test_the_decoder_reads_the_device_sessions_slots_and_keeps_no_host_copy(tiny):
    _, resolved, io, want = tiny
    d = ready(memory=256 << 20)
    with open_device_decoder(resolved, d) as dec:
        s = dec.session
        assert s.device.slots is dec.pool and dec.host == {}  # no page-locked copies of the model
        packed, raw = _packed(s), _raw(s)
        load = dec.load.to_json()["device"]
        # the plan's own tasks made every object: packed on the device, raw weights uploaded
        assert (load["device_prepacks"], load["uploads"]) == (len(packed), len(raw))
        for r in packed:  # the header the launches read, described on the host, is the prepack's
            obj = next(o for o in dec.runner.prepared.values() if o.view.address == dec.pool.address(r.key))
            head = np.frombuffer(d.copy_to_host(obj.view.address, HEADER_SIZE), np.uint8)
            assert obj.header == read_header(head, header_only=True)[1], r.key
        got = greedy_decode(dec, io, np.array(PROMPT), TOKENS)
        assert got.tokens.tolist() == want
        assert dec.counters()["evictions"] == 0 and s.stats().to_json()["device"]["device_prepacks"] == len(packed)
    assert all(n == 0 for k, n in d.live().items() if k != "modules"), d.live()  # the session closed with it


def test_under_a_budget_each_page_in_runs_the_sessions_recipe_and_the_raw_weights_stay(tiny):
    _, resolved, io, want = tiny
    d = ready(memory=256 << 20)
    with open_device_decoder(resolved, d, budget=6 * G) as dec:
        s = dec.session
        raw_keys = [r.key for r in _raw(s)]
        got = greedy_decode(dec, io, np.array(PROMPT), TOKENS)
        c = dec.counters()
        st = s.stats().to_json()
        assert got.tokens.tolist() == want
        assert c["segments_per_step"] > 1 and c["evictions"] > 0 and c["peak_committed_bytes"] <= 6 * G
        # a page-in is the plan's recipe again (a device prepack from its sources), an
        # eviction the session's own
        assert st["device"]["device_prepacks"] == c["page_ins"] and st["prepare"]["evictions"] == c["evictions"]
        assert all(s.slots.committed_bytes(k) > 0 for k in raw_keys)  # never paged out
        raw_committed = st["device"]["committed_bytes"] - sum(s.slots.committed_bytes(r.key) for r in _packed(s))
        assert raw_committed > 0 and dec.residency.budget == 6 * G - raw_committed  # off the step's budget
    assert all(n == 0 for k, n in d.live().items() if k != "modules"), d.live()


def test_from_a_complete_cache_every_page_in_is_a_payload_read_and_no_packed_source_is_read(tiny, tmp_path):
    path, resolved, io, want = tiny
    cache_path = tmp_path / "tiny.prepared.onnx"
    build_prepared_cache(path, output=cache_path)
    cache = PreparedCache(resolved, cache_path, policy="require-complete")
    d = ready(memory=256 << 20)
    with open_device_decoder(resolved, d, budget=6 * G, cache=cache) as dec:
        dec.own(cache)
        s = dec.session
        got = greedy_decode(dec, io, np.array(PROMPT), TOKENS)
        c = dec.counters()
        st = s.stats().to_json()
        assert got.tokens.tolist() == want and c["evictions"] > 0
        assert cache.counters["packed_reads"] == c["page_ins"]  # each page-in read its payload again
        assert st["device"]["device_prepacks"] == 0
        assert st["io"]["source_bytes"] == sum(r.packed_bytes for r in _raw(s))  # the raw weights' only


def test_a_budget_the_raw_weights_leave_too_small_is_refused_in_one_line(tiny):
    _, resolved, _, _ = tiny
    d = ready(memory=256 << 20)
    with pytest.raises(DeviceBudgetError, match=r"leaves .* B for the packed weights once the raw weights commit "
                                                r".* give a budget of at least"):
        open_device_decoder(resolved, d, budget=G)
    assert all(n == 0 for k, n in d.live().items() if k != "modules"), d.live()  # closed on the way out
