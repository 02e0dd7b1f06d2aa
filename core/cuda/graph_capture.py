"""Whether a decode step's CUDA graph may be captured, and if not, why.

A captured graph replays the kernel launches of one step with the addresses they had at
capture: every buffer it reads or writes must be at the same address on every replay,
and nothing in the step may need the host. ``capture_decision`` is the predicate, a pure
function of what the run knows before its first step:

``host_ops == 0``
    every op of the step runs on the device (an op on the host is a synchronisation the
    graph cannot hold);
``kv_capacity_fixed``
    the KV-cache buffers are sized once for the run (a buffer that grows is reallocated
    at another address);
``not offload_enabled or stable_va``
    weights paged in and out under a budget keep their device address across evict →
    page-in (stable-VA slots: core/cuda/device_slot_pool.py); without stable addresses
    capture is declined rather than replaying reads of freed memory.

The reason names each predicate that fails AND its inputs, so a declined capture says
what to change: ``paged weights need stable addresses (offload_enabled=True
stable_va=False)``. An accepted one lists every input it was decided on.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CaptureDecision", "capture_decision"]


@dataclass(frozen=True)
class CaptureDecision:
    ok: bool
    reason: str

    def __iter__(self):  # ok, reason = capture_decision(...)
        return iter((self.ok, self.reason))


def capture_decision(*, offload_enabled: bool, stable_va: bool, kv_capacity_fixed: bool,
                     host_ops: int) -> CaptureDecision:
    """``(ok, reason)`` for one decode step's graph (see the module docstring)."""
    if host_ops < 0:
        raise ValueError(f"host_ops must be >= 0, got {host_ops}")
    failed = []
    if host_ops:
        failed.append(f"every op must run on the device (host_ops={host_ops})")
    if not kv_capacity_fixed:
        failed.append(f"the KV cache must not move between steps (kv_capacity_fixed={kv_capacity_fixed})")
    if offload_enabled and not stable_va:
        failed.append(f"paged weights need stable addresses (offload_enabled={offload_enabled} "
                      f"stable_va={stable_va})")
    if failed:
        return CaptureDecision(False, "capture declined: " + "; ".join(failed))
    return CaptureDecision(True, f"capturable (host_ops={host_ops} kv_capacity_fixed={kv_capacity_fixed} "
                                 f"offload_enabled={offload_enabled} stable_va={stable_va})")
