"""EvictionPolicy: which resident prepared objects to drop when memory is short.

The one policy of the runtime, fed by the plan: a run walks the plan's invocation steps
in order, again and again, so the step at which each prepared object is next consumed
is known exactly. When the objects runs are waiting for do not fit under the PREPARED
arena's limit, unpinned resident objects are evicted, the one needed furthest from now
first (with exact future knowledge, the choice that evicts least often). Evicted
objects keep their key and slot address and are rebuilt through their recipe when next
needed.

The store keeps residency, pins and generations and refuses to evict a pinned object;
this policy only chooses the order and asks it.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator

from onnx_prep.core.model.prepared_key import PreparedKey
from onnx_prep.core.plan.execution_plan import PreparedExecutionPlan
from onnx_prep.core.runtime.prepared_store import PreparedObjectStore

__all__ = ["EvictionPolicy"]


class EvictionPolicy:
    def __init__(self, plan: PreparedExecutionPlan) -> None:
        self.steps = len(plan.steps)
        self.keys = tuple(r.key for r in plan.requirements)
        uses: dict[PreparedKey, tuple[int, ...]] = {}
        for st in plan.steps:
            for k in plan.by_id[st.task_id].prepared_requirements:
                uses[k] = uses.get(k, ()) + (st.index,)
        self._use_steps = uses
        # NOTE: the order depends on the step alone, so it is made once per step here, not
        # per eviction: sorting every key by its next use cost a page-in under a budget
        # ~100 us of the run's own thread (the medium fixture at half its packed size:
        # 35 page-ins a token, ~3.4 ms CPU of each decode step). The sort is stable over the
        # plan's key order, as it was per call: the same victims, in the same order.
        self._order = tuple(tuple(sorted(self.keys, key=lambda k, at=at: -self.next_use(k, at)))
                            for at in range(self.steps))

    def next_use(self, key: PreparedKey, step: int) -> int:
        """Steps until ``key`` is next needed by a run at ``step`` (wrapping to the next run)."""
        n = self.steps
        return min(((u - step) % n for u in self._use_steps.get(key, ())), default=n)

    def victims(self, store: PreparedObjectStore, at: int, keep: Collection[PreparedKey]) -> list[PreparedKey]:
        """Resident, unpinned objects outside ``keep``, furthest next use from step ``at`` first."""
        return list(self.iter_victims(store, at, keep))

    def iter_victims(self, store: PreparedObjectStore, at: int,
                     keep: Collection[PreparedKey]) -> Iterator[PreparedKey]:
        """:meth:`victims` one at a time, each checked (resident, unpinned) as it is
        reached: a caller that stops after the first few checks only those."""
        if not self.steps:
            return
        for k in self._order[at % self.steps]:
            if k not in keep and store.is_resident(k) and store.pins(k) == 0:
                yield k

    def make_room(self, store: PreparedObjectStore, needed: int, free: int, at: int,
                  keep: Iterable[PreparedKey], nbytes: Callable[[PreparedKey], int]) -> int:
        """Evict victims in order until ``free`` (bytes) reaches ``needed``; ``nbytes(key)``
        is what evicting ``key`` gives back. Returns the number evicted (the store may
        refuse one pinned since it was chosen: it is skipped)."""
        evicted = 0
        for k in self.iter_victims(store, at, set(keep)):
            if free >= needed:
                break
            n = nbytes(k)
            if store.evict(k):
                free += n
                evicted += 1
        return evicted
