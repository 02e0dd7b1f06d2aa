"""EvictionPolicy over a real plan (the small fixture) and a real store: next uses from
the plan's step order, victims furthest-next-use first, never a pinned or kept object,
and no more evictions than the room asked for. (Under a real budget, end to end:
tests/test_cold_run.py and tests/test_session.py.)"""
from __future__ import annotations

import pytest

from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.plan.execution_plan import build_prepared_execution_plan
from onnx_prep.core.runtime.eviction_policy import EvictionPolicy
from onnx_prep.core.runtime.prepared_store import PreparedObjectStore
from tests.test_prepared_store import Buf


@pytest.fixture(scope="module")
def plan(small_llm_path):
    return build_prepared_execution_plan(resolve_model(small_llm_path))


def _uses(plan) -> dict:
    uses: dict = {}
    for st in plan.steps:
        for k in plan.by_id[st.task_id].prepared_requirements:
            uses.setdefault(k, []).append(st.index)
    return uses


def _all_resident(plan) -> PreparedObjectStore:
    store = PreparedObjectStore()
    for r in plan.requirements:
        fut, owner = store.begin_load(r.key)
        assert owner
        store.publish(r.key, fut.generation, Buf(r.packed_bytes))
    return store


def test_next_use_counts_steps_to_the_next_consumer_wrapping_to_the_next_run(plan):
    policy = EvictionPolicy(plan)
    n = len(plan.steps)
    for key, steps in _uses(plan).items():
        for u in steps:
            assert policy.next_use(key, u) == 0
        last = steps[-1]
        if last + 1 < n:  # after its last use the next consumer is in the next run
            assert policy.next_use(key, last + 1) == n - 1 - last + steps[0]


def test_victims_go_furthest_next_use_first_never_pinned_or_kept(plan):
    policy = EvictionPolicy(plan)
    store = _all_resident(plan)
    at = len(plan.steps) // 2
    step_keys = plan.by_id[plan.steps[at].task_id].prepared_requirements
    pinned = plan.requirements[0].key
    keep = set(step_keys)
    with store.pin_many([pinned]):
        victims = policy.victims(store, at, keep)
        assert pinned not in victims and not keep & set(victims)
        assert set(victims) == {r.key for r in plan.requirements} - keep - {pinned}
        distances = [policy.next_use(k, at) for k in victims]
        assert distances == sorted(distances, reverse=True) and distances[0] > distances[-1]


def test_the_order_made_once_per_step_is_the_sort_by_next_use_at_every_step(plan):
    """Victims come from an order made once per step: at every step (and one past the
    last, a run's end) it is exactly the plan's keys sorted by next use, furthest first,
    ties in plan order, the order sorting them on every eviction gave."""
    policy = EvictionPolicy(plan)
    store = _all_resident(plan)
    keys = [r.key for r in plan.requirements]
    for at in range(len(plan.steps) + 1):
        assert policy.victims(store, at, ()) == sorted(keys, key=lambda k: -policy.next_use(k, at)), at


def test_victims_are_checked_as_they_are_reached(plan):
    """A caller evicting as it goes: what it evicted meanwhile, and what got pinned, is
    not offered again; the rest come in the same order."""
    policy = EvictionPolicy(plan)
    store = _all_resident(plan)
    order = policy.victims(store, 0, ())
    it = policy.iter_victims(store, 0, ())
    assert next(it) == order[0] and store.evict(order[0])
    assert store.evict(order[2])
    with store.pin_many([order[3]]):
        assert next(it) == order[1]
        assert next(it) == order[4]  # order[2] evicted, order[3] pinned since the start


def test_make_room_evicts_until_the_room_is_there_and_no_further(plan):
    policy = EvictionPolicy(plan)
    store = _all_resident(plan)
    at = 0
    keep = set(plan.by_id[plan.steps[at].task_id].prepared_requirements)
    order = policy.victims(store, at, keep)
    sizes = {r.key: r.packed_bytes for r in plan.requirements}
    needed = sizes[order[0]] + sizes[order[1]]  # exactly the two furthest
    evicted = policy.make_room(store, needed, 0, at, keep, sizes.__getitem__)
    assert evicted == 2
    assert not store.is_resident(order[0]) and not store.is_resident(order[1])
    assert all(store.is_resident(k) for k in order[2:]) and all(store.is_resident(k) for k in keep)
    assert policy.make_room(store, needed, needed, at, keep, sizes.__getitem__) == 0  # room enough
