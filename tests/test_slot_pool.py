"""HostSlotPool over real stable slots: a key keeps its address across decommit and
commit, the reserved slot is used when large enough, committed bytes are whole
granules and go back on decommit, sizes never change, and warming commits reserved
slots ahead of their loads (stopping when asked, giving a wanted slot up)."""
from __future__ import annotations

import os

import threading

import numpy as np
import pytest

from onnx_prep.core.errors import OnnxPrepError
from onnx_prep.core.runtime.slot_pool import WARM_STEP_BYTES, HostSlotPool
from onnx_prep.native.stable_slot import GRANULE

PAGE = os.sysconf("SC_PAGESIZE")

T = 30


def test_a_key_keeps_its_address_across_decommit_and_commit():
    pool = HostSlotPool()
    pool.reserve("k", 3 * GRANULE)
    reserved = pool.reserved()["k"]
    view = pool.commit("k", GRANULE + 5)
    assert view.ctypes.data == reserved and pool.view("k").ctypes.data == reserved
    assert "k" not in pool.reserved()  # taken by its load
    assert pool.committed_bytes("k") == GRANULE + PAGE == pool.committed_bytes()  # whole pages
    view[:] = 7
    buf = pool.buffer("k", GRANULE + 5, None)
    assert buf.nbytes == GRANULE + 5 and buf.committed_bytes == GRANULE + PAGE
    del view
    buf.release()  # what eviction calls
    assert pool.committed_bytes("k") == 0
    again = pool.commit("k", GRANULE + 5)
    assert again.ctypes.data == reserved and pool.view("k").ctypes.data == reserved
    assert not again.any()  # fresh pages: the old bytes are gone
    with pytest.raises(OnnxPrepError, match="changed size"):
        pool.commit("k", 4)
    pool.close()


def test_an_unreserved_or_too_small_key_gets_its_own_slot_and_typed_views(small_llm_path):
    from onnx_prep.core.io.external_data import ExternalDataReader
    from onnx_prep.core.model.resolution import resolve_model

    pool = HostSlotPool()
    pool.reserve("small", 16)
    raw = pool.commit("small", GRANULE * 2)  # the estimate was too low: a new slot
    assert raw.nbytes == GRANULE * 2 and pool.committed_bytes("small") == 2 * GRANULE
    assert pool.reserved() == {}
    resolved = resolve_model(small_llm_path)
    wd = resolved.weights["final_norm.weight"]  # a raw weight: the bytes are the object
    raw = pool.commit("norm", wd.length, typed_as=wd)
    reader = ExternalDataReader.for_model(resolved)
    reader.read_into(wd, raw)
    typed = pool.view("norm")
    assert typed.dtype == np.dtype(wd.dtype) and typed.shape == tuple(wd.dims)
    assert typed.ctypes.data == raw.ctypes.data  # the typed view aliases the slot
    assert np.array_equal(typed.view(np.uint8).reshape(-1), reader.read(wd))
    reader.close_shared()
    pool.close()


def test_warming_commits_reserved_slots_in_order_and_gives_a_wanted_one_up():
    pool = HostSlotPool()
    sizes = {"a": 2 * WARM_STEP_BYTES, "b": 2 * WARM_STEP_BYTES}
    for k, n in sizes.items():
        pool.reserve(k, n)
    warmed: list[int] = []
    stop_after_first_step = threading.Event()

    def on_warmed(n):
        warmed.append(n)
        stop_after_first_step.set()

    pool.warm(sizes.items(), stop=stop_after_first_step.is_set, on_warmed=on_warmed)
    assert warmed == [WARM_STEP_BYTES]  # one step of "a", then asked to stop
    assert pool.committed_bytes("a") == WARM_STEP_BYTES and pool.committed_bytes("b") == 0
    assert pool.wait_warmed(WARM_STEP_BYTES, 0)
    # the load takes the partly warmed slot at the same address and commits the rest
    addr = pool.reserved()["a"]
    assert pool.commit("a", sizes["a"]).ctypes.data == addr
    assert pool.committed_bytes("a") == sizes["a"]
    pool.warm(sizes.items(), stop=lambda: False)  # "a" is taken: only "b" is warmed
    assert pool.committed_bytes("b") == sizes["b"] and pool.bytes_warmed == WARM_STEP_BYTES + sizes["b"]
    pool.close()
    assert pool.reserved() == {}
