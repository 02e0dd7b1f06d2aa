"""DeviceDecoder on the fake driver: a model's steps on the device with its packed
weights streamed under a budget. The model is test_cuda_device_graph.py's (two INT4
matmuls, a SiLU over a Split, host shape values, Transpose, Div, a cos/sin table).
All resident, the outputs are the CPU runtime's (its tolerance); under a budget of one
granule the two weights take turns in the one granule, two segments a step, and the
outputs are the all-resident decoder's bit for bit, with each segment's graph captured
once and replayed, or, where the shapes change between steps, capture declined by the
predicate with its reason and every segment run eagerly."""
from __future__ import annotations

import numpy as np
import pytest
from fake_cuda_driver import MiB, ready
from test_cuda_device_graph import _assert_cpu, build_model, feeds

from onnx_prep.core.cuda.device_decoder import DeviceDecoder, open_device_decoder
from onnx_prep.core.errors import DeviceBudgetError
from onnx_prep.core.kernels.prepack import prepack_all

G = 2 * MiB  # the fake's granularity


@pytest.fixture
def model(tmp_path):
    resolved = build_model(tmp_path / "m.onnx")
    return resolved, prepack_all(resolved, lambda name: resolved.inline_values[name])


@pytest.fixture
def d():
    return ready(memory=64 << 20)


def test_all_resident_the_device_gives_the_cpu_runtimes_outputs(model, d):
    resolved, packed = model
    with DeviceDecoder(resolved, d, packed) as dec:
        for seed in range(3):
            f = feeds(seed)
            _assert_cpu(dec.run(f), resolved, packed, f)
        c = dec.counters()
        assert (c["segments_per_step"], c["page_ins"], c["evictions"], c["steps"]) == (1, 2, 0, 3)
        assert c["page_in_bytes"] == sum(p.nbytes for p in packed.values())
        # shapes change from step to step as a growing KV cache's do: capture is declined, saying why
        assert not c["capture"] and "kv_capacity_fixed=False" in c["capture_reason"]
        assert (c["captures"], c["fallbacks"]) == (0, 3)
    live = d.live()  # closing gave back everything but the compiled modules (cached per process)
    assert {k: n for k, n in live.items() if k != "modules"} == dict.fromkeys(set(live) - {"modules"}, 0)
    assert not d.mappings and not d.live_handles()


def test_weights_over_the_budget_stream_through_replayed_segments_bit_for_bit(model, d):
    resolved, packed = model
    inputs = [feeds(seed) for seed in range(4)]
    with DeviceDecoder(resolved, d, packed) as resident:
        want = [resident.run(f) for f in inputs]
    with DeviceDecoder(resolved, d, packed, budget=G, kv_capacity_fixed=True) as dec:
        addresses = {k: dec.pool.address(k) for k in packed}
        for f, w in zip(inputs, want):
            got = dec.run(f)
            assert all(np.array_equal(got[n], w[n]) for n in w)
        c = dec.counters()
        assert c["segments_per_step"] == 2 and c["capture"]
        # step 1: w1 in, w1 out, w2 in; then each step: w2 out, w1 in, w1 out, w2 in
        assert (c["page_ins"], c["evictions"], c["hits"]) == (8, 7, 0)
        assert c["peak_committed_bytes"] == G and c["byte_hit_rate"] == 0.0
        assert (c["captures"], c["replays"], c["fallbacks"], c["invalidations"]) == (2, 6, 0, 0)
        assert {k: dec.pool.address(k) for k in packed} == addresses


def test_new_shapes_invalidate_and_capture_again_then_replay(model, d):
    resolved, packed = model
    with DeviceDecoder(resolved, d, packed, budget=G, kv_capacity_fixed=True) as dec:
        for seq in (3, 3, 5, 5):
            f = feeds(seq, seq=seq)
            _assert_cpu(dec.run(f), resolved, packed, f)
        c = dec.counters()
        assert (c["captures"], c["replays"], c["invalidations"]) == (4, 4, 2)


def test_a_budget_below_one_weight_is_refused_before_anything_is_paged(model, d):
    resolved, packed = model
    with pytest.raises(DeviceBudgetError, match="below one allocation granule"):
        DeviceDecoder(resolved, d, packed, budget=G // 2)
    assert d.live()["graphs"] == 0 and not d.mappings


def test_opened_from_the_model_it_reads_packs_and_runs_the_same(model, d):
    """open_device_decoder loads through a device session (core/cuda/session_pages.py):
    its slots hold the CPU prepack's bytes, no host copy is kept, and streamed under one
    granule the step gives the same outputs."""
    resolved, packed = model
    f = feeds(7)
    with open_device_decoder(resolved, d) as dec:
        assert dec.host == {} and set(dec.runner.prepared) == set(packed)
        for k, obj in dec.runner.prepared.items():
            assert d.copy_to_host(obj.view.address, obj.view.nbytes) == packed[k].tobytes(), k
        _assert_cpu(dec.run(f), resolved, packed, f)
    with open_device_decoder(resolved, d, budget=G) as dec:
        _assert_cpu(dec.run(f), resolved, packed, f)
        assert dec.counters()["segments_per_step"] == 2


@pytest.mark.gpu
def test_on_a_device_streamed_weights_replay_and_give_the_all_resident_outputs(model):
    """On a real device (skipped here, with discovery's reason): the same as on the fake,
    with the budget one granule as the device reports it."""
    from test_cuda_weight_residency import _real_driver

    drv = _real_driver()
    g = drv.allocation_granularity(0)
    resolved, packed = model
    inputs = [feeds(seed) for seed in range(4)]
    with DeviceDecoder(resolved, drv, packed) as resident:
        want = [resident.run(f) for f in inputs]
        _assert_cpu(want[0], resolved, packed, inputs[0])
    with DeviceDecoder(resolved, drv, packed, budget=g, kv_capacity_fixed=True) as dec:
        for f, w in zip(inputs, want):
            got = dec.run(f)
            assert all(np.array_equal(got[n], w[n]) for n in w)
        c = dec.counters()
        assert (c["segments_per_step"], c["page_ins"], c["evictions"]) == (2, 8, 7)
        assert (c["captures"], c["replays"], c["fallbacks"], c["invalidations"]) == (2, 6, 0, 0)
