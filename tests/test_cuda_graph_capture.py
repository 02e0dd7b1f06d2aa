"""The CUDA-graph capture predicate over its whole truth table: every combination of its
inputs, written out below (not recomputed), with which predicates fail; a declined
capture names each failing predicate AND its inputs, an accepted one every input."""
from __future__ import annotations

import pytest

from onnx_prep.core.cuda.graph_capture import CaptureDecision, capture_decision

HOST = "every op must run on the device"
KV = "the KV cache must not move between steps"
VA = "paged weights need stable addresses"

# offload_enabled, stable_va, kv_capacity_fixed, host_ops -> the predicates that fail
TABLE = [
    (False, False, True, 0, []),
    (False, True, True, 0, []),
    (True, True, True, 0, []),
    (True, False, True, 0, [VA]),
    (False, False, False, 0, [KV]),
    (False, True, False, 0, [KV]),
    (True, True, False, 0, [KV]),
    (True, False, False, 0, [KV, VA]),
    (False, False, True, 2, [HOST]),
    (False, True, True, 2, [HOST]),
    (True, True, True, 2, [HOST]),
    (True, False, True, 2, [HOST, VA]),
    (False, False, False, 2, [HOST, KV]),
    (False, True, False, 2, [HOST, KV]),
    (True, True, False, 2, [HOST, KV]),
    (True, False, False, 2, [HOST, KV, VA]),
]


def test_the_table_is_the_whole_truth_table():
    assert len({row[:4] for row in TABLE}) == 16


@pytest.mark.parametrize("offload, stable, kv_fixed, host_ops, failing", TABLE,
                         ids=lambda v: repr(v) if not isinstance(v, list) else "+".join(x.split()[0] for x in v))
def test_each_combination(offload, stable, kv_fixed, host_ops, failing):
    ok, reason = capture_decision(offload_enabled=offload, stable_va=stable, kv_capacity_fixed=kv_fixed,
                                  host_ops=host_ops)
    assert ok is (not failing)
    if ok:
        assert reason == (f"capturable (host_ops=0 kv_capacity_fixed=True offload_enabled={offload} "
                          f"stable_va={stable})")
        return
    assert reason.startswith("capture declined: ")
    named = [part.split(" (")[0] for part in reason.removeprefix("capture declined: ").split("; ")]
    assert named == failing
    inputs = {HOST: f"(host_ops={host_ops})", KV: "(kv_capacity_fixed=False)",
              VA: "(offload_enabled=True stable_va=False)"}
    for predicate in failing:
        assert f"{predicate} {inputs[predicate]}" in reason


def test_the_offload_decline_reads_as_it_is_reported():
    decision = capture_decision(offload_enabled=True, stable_va=False, kv_capacity_fixed=True, host_ops=0)
    assert decision == CaptureDecision(False, "capture declined: paged weights need stable addresses "
                                              "(offload_enabled=True stable_va=False)")


def test_host_ops_count_is_named_and_cannot_be_negative():
    _, reason = capture_decision(offload_enabled=False, stable_va=True, kv_capacity_fixed=True, host_ops=7)
    assert reason == "capture declined: every op must run on the device (host_ops=7)"
    with pytest.raises(ValueError, match="host_ops must be >= 0"):
        capture_decision(offload_enabled=False, stable_va=True, kv_capacity_fixed=True, host_ops=-1)
