"""The device a plan is built for, and what the plan's prepared objects take there.

A plan built for a device (``build_prepared_execution_plan(..., device=DeviceTarget("cuda"))``,
core/plan/device_recipes.py) holds every prepared object a step pins in a device slot.
Building it is metadata only: no device is queried and no driver is imported. What a
device would report is therefore an input here, said as such wherever the plan is
shown: the slot allocation granularity is the one given, or ``DEFAULT_GRANULARITY``,
assumed (``onnx-prep devices`` reports a device's own; the device slot pool always asks
its driver).

``device_memory(plan)`` is the device side of the plan's report: slots, the bytes they
commit as the device slot pool commits them (a packed object in whole granules of its
own; the raw weights, read as stored and read by every step, placed first fit in plan
order into granules they share, each share ``SHARED_ALIGNMENT`` multiples, each shared
granule counted once: ``slot_placement``), the bytes a load copies host to device, the
most any one step pins, and, under a budget, whether every slot fits at once or how
much a pass must page in at least. ``require_budget(plan)`` refuses a budget that a
step alone does not fit in.

``prepack`` chooses where a packed object is packed when its kernel offers both
(``core/kernels/spec.py``, ``DevicePacking``): ``"kernel"`` takes the kernel's
preference (``plan-dump``'s default: what a device build would do), ``"host"`` packs on
a CPU worker and uploads the packed bytes wherever the kernel offers that. A session
on a device plans with ``"kernel"`` where the device has the device-side prepack's
kernels, else with ``"host"`` (core/cuda/session_device.py, ``packs_on_device``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from onnx_prep.core.errors import DeviceBudgetError
from onnx_prep.core.plan.execution_plan import RAW_LAYOUT
from onnx_prep.core.plan.task import TaskKind

__all__ = ["PLAN_DEVICES", "PREPACK_CHOICES", "DEFAULT_GRANULARITY", "SHARED_ALIGNMENT", "DeviceTarget",
           "SlotPlacement", "device_memory", "require_budget", "slot_placement"]

PLAN_DEVICES = ("cpu", "cuda")  # what a plan can be built for; cpu is the plan without a target
PREPACK_CHOICES = ("kernel", "host")  # where packing happens when a kernel offers both (module docstring)
# NOTE: 2 MiB is the minimum VMM allocation granularity current NVIDIA GPUs report
# (cuMemGetAllocationGranularity); assumed for sizing only, and said so: the device
# slot pool never assumes it.
DEFAULT_GRANULARITY = 2 << 20
# A shared object's start and size in its granule: cudaMalloc's alignment, more than any
# kernel's widest load needs (the device slot pool places shared objects by it too).
SHARED_ALIGNMENT = 256


@dataclass(frozen=True)
class DeviceTarget:
    """A device to plan for: its name, the slot granularity to size with (``granularity_given``:
    the caller's figure, else assumed), an optional budget of committed bytes, and where
    to pack (``prepack``: one of ``PREPACK_CHOICES``)."""

    name: str
    granularity: int = DEFAULT_GRANULARITY
    granularity_given: bool = False
    budget: int | None = None
    prepack: str = "kernel"

    def __post_init__(self) -> None:
        if self.name not in PLAN_DEVICES or self.name == "cpu":
            devices = [d for d in PLAN_DEVICES if d != "cpu"]
            raise ValueError(f"a device target is one of {devices}, got {self.name!r}")
        g = self.granularity
        if not isinstance(g, int) or g <= 0 or g & (g - 1):
            raise ValueError(f"granularity must be a power of two, got {g!r}")
        if self.budget is not None and (not isinstance(self.budget, int) or self.budget <= 0):
            raise ValueError(f"budget must be a positive number of bytes, got {self.budget!r}")
        if self.prepack not in PREPACK_CHOICES:
            raise ValueError(f"prepack must be one of {list(PREPACK_CHOICES)}, got {self.prepack!r}")

    def slot_bytes(self, nbytes: int) -> int:
        """What an object of ``nbytes`` commits in a slot of its own: whole granules."""
        return -(-nbytes // self.granularity) * self.granularity

    def share_bytes(self, nbytes: int) -> int | None:
        """What an object of ``nbytes`` takes of a granule it shares (``SHARED_ALIGNMENT``
        multiples); None where it is larger than one granule (a slot of its own)."""
        share = -(-max(nbytes, 1) // SHARED_ALIGNMENT) * SHARED_ALIGNMENT
        return share if share <= self.granularity else None

    def to_json(self) -> dict:
        return {"name": self.name, "queried": False, "granularity": self.granularity,
                "granularity_source": "given" if self.granularity_given else "assumed", "budget": self.budget}


@dataclass(frozen=True)
class SlotPlacement:
    """Where a plan's requirements live on the device, per requirement in plan order (its bit):
    ``own`` the bytes of a slot of its own (whole granules; 0 where shared or empty),
    ``granule`` the index of the shared granule it is placed in (None where not shared);
    ``shared_granules`` how many shared granules there are."""

    own: tuple[int, ...]
    granule: tuple[int | None, ...]
    shared_granules: int

    def committed_bytes(self, target: DeviceTarget, bits: int = -1) -> int:
        """What the requirements whose bit is set in ``bits`` commit (all: -1): their own
        slots, and each shared granule holding one of them once."""
        own = sum(b for i, b in enumerate(self.own) if bits >> i & 1)
        granules = {g for i, g in enumerate(self.granule) if g is not None and bits >> i & 1}
        return own + len(granules) * target.granularity


def slot_placement(plan: Any) -> SlotPlacement:
    """Place ``plan``'s requirements as a device session reserves them: in plan order, a
    raw weight (``RAW_LAYOUT``) of at most one granule first fit into the shared
    granules, every other object in whole granules of its own (core/cuda/device_slot_pool.py)."""
    target: DeviceTarget = plan.device
    own, granule, free = [], [], []  # free: bytes left in each shared granule
    for r in plan.requirements:
        share = target.share_bytes(r.packed_bytes) if r.request.layout == RAW_LAYOUT and r.packed_bytes > 0 else None
        if share is None:
            own.append(target.slot_bytes(r.packed_bytes))
            granule.append(None)
            continue
        g = next((i for i, left in enumerate(free) if left >= share), None)
        if g is None:
            g = len(free)
            free.append(target.granularity)
        free[g] -= share
        own.append(0)
        granule.append(g)
    return SlotPlacement(tuple(own), tuple(granule), len(free))


def _step_slot_bytes(plan: Any, placement: SlotPlacement) -> list[int]:
    """What each step pins: the slots of the requirements its bits name (a requirement's
    bit is its place in plan order)."""
    return [placement.committed_bytes(plan.device, s.requirement_bits) for s in plan.steps]


def device_memory(plan: Any) -> dict:
    """The device side of ``plan`` (a plan built for a ``DeviceTarget``; module docstring)."""
    target: DeviceTarget = plan.device
    placement = slot_placement(plan)
    committed = placement.committed_bytes(target)
    per_step = _step_slot_bytes(plan, placement)
    largest = max(range(len(per_step)), key=per_step.__getitem__, default=None)
    budget = target.budget
    return {
        **target.to_json(),
        "slots": len(plan.requirements),
        "packed_bytes": sum(r.packed_bytes for r in plan.requirements),
        "committed_bytes": committed,
        "host_to_device_bytes": sum(t.estimated_input_bytes for t in plan.session_tasks
                                    if t.kind is TaskKind.UPLOAD),
        "largest_step": None if largest is None else {
            "step": largest, "label": plan.steps[largest].label, "committed_bytes": per_step[largest]},
        "fits": None if budget is None else committed <= budget,
        # each pass uses every slot: what is not resident when it starts is paged in
        "min_page_in_bytes_per_pass": None if budget is None else max(0, committed - budget),
    }


def require_budget(plan: Any) -> None:
    """Raise ``DeviceBudgetError`` (exit 2) when one step's slots alone pass the budget:
    no order of page-ins runs that step."""
    target: DeviceTarget = plan.device
    if target is None or target.budget is None:
        return
    placement = slot_placement(plan)
    per_step = _step_slot_bytes(plan, placement)
    for i, need in enumerate(per_step):
        if need > target.budget:
            source = "given" if target.granularity_given else "assumed"
            raise DeviceBudgetError(
                f"--budget {target.budget:,} B: step {i} ({plan.steps[i].label}) pins {need:,} B of device slots "
                f"({target.granularity:,} B granules, {source}); no order of page-ins runs it",
                hint="raise --budget (every slot at once takes "
                     f"{placement.committed_bytes(target):,} B)")
