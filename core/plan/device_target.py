"""The device a plan is built for, and what the plan's prepared objects take there.

A plan built for a device (``build_prepared_execution_plan(..., device=DeviceTarget("cuda"))``,
core/plan/device_recipes.py) holds every prepared object a step pins in a device slot.
Building it is metadata only: no device is queried and no driver is imported. What a
device would report is therefore an input here, said as such wherever the plan is
shown: the slot allocation granularity is the one given, or ``DEFAULT_GRANULARITY``,
assumed (``onnx-prep devices`` reports a device's own; the device slot pool always asks
its driver).

``device_memory(plan)`` is the device side of the plan's report: slots, the bytes they
commit (each object rounded up to whole granules, as the device slot pool commits
them), the bytes a load copies host to device, the most any one step pins, and, under
a budget, whether every slot fits at once or how much a pass must page in at least.
``require_budget(plan)`` refuses a budget that a step alone does not fit in.

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
from onnx_prep.core.plan.task import TaskKind

__all__ = ["PLAN_DEVICES", "PREPACK_CHOICES", "DEFAULT_GRANULARITY", "DeviceTarget", "device_memory",
           "require_budget"]

PLAN_DEVICES = ("cpu", "cuda")  # what a plan can be built for; cpu is the plan without a target
PREPACK_CHOICES = ("kernel", "host")  # where packing happens when a kernel offers both (module docstring)
# NOTE: 2 MiB is the minimum VMM allocation granularity current NVIDIA GPUs report
# (cuMemGetAllocationGranularity); assumed for sizing only, and said so: the device
# slot pool never assumes it.
DEFAULT_GRANULARITY = 2 << 20


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
        """What an object of ``nbytes`` commits in its slot: whole granules."""
        return -(-nbytes // self.granularity) * self.granularity

    def to_json(self) -> dict:
        return {"name": self.name, "queried": False, "granularity": self.granularity,
                "granularity_source": "given" if self.granularity_given else "assumed", "budget": self.budget}


def _step_slot_bytes(plan: Any, target: DeviceTarget) -> list[int]:
    slots = [target.slot_bytes(r.packed_bytes) for r in plan.requirements]
    return [sum(b for bit, b in enumerate(slots) if s.requirement_bits >> bit & 1) for s in plan.steps]


def device_memory(plan: Any) -> dict:
    """The device side of ``plan`` (a plan built for a ``DeviceTarget``; module docstring)."""
    target: DeviceTarget = plan.device
    committed = sum(target.slot_bytes(r.packed_bytes) for r in plan.requirements)
    per_step = _step_slot_bytes(plan, target)
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
    per_step = _step_slot_bytes(plan, target)
    for i, need in enumerate(per_step):
        if need > target.budget:
            source = "given" if target.granularity_given else "assumed"
            raise DeviceBudgetError(
                f"--budget {target.budget:,} B: step {i} ({plan.steps[i].label}) pins {need:,} B of device slots "
                f"({target.granularity:,} B granules, {source}); no order of page-ins runs it",
                hint="raise --budget (every slot at once takes "
                     f"{sum(target.slot_bytes(r.packed_bytes) for r in plan.requirements):,} B)")
