"""What else ran on the machine while we measured.

A benchmark on a shared or virtual machine reads its own process CPU easily; what it
cannot see is another process taking a core, or the host taking the vCPU (steal). Either
distorts the two-thread figures first, and silently. :class:`MachineActivity` snapshots
the kernel's CPU counters (``/proc/stat``) and this process's CPU, its own threads and
reaped children alike (``getrusage``); :meth:`MachineActivity.since` gives the CPU time
spent by *other* work during the interval ("foreign"), and the host's steal time.

NOTE: found the hard way. A helper thread left spinning by an aborted experiment took a
whole core for 15 minutes; the load benchmark run meanwhile came out 2.4x slower on its
hot path, and nothing it printed said why. Every benchmark prints this now
(docs/runtime.md, "Load benchmark").

Linux only (``/proc/stat``); elsewhere :meth:`MachineActivity.now` returns a snapshot
whose :meth:`since` reports ``available: False``.
"""
from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass

_PROC_STAT = "/proc/stat"


def _ticks_per_s() -> float:
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError, AttributeError):
        return 100.0


def _machine_ticks() -> tuple[int, int] | None:
    """(busy, steal) summed over all CPUs since boot, in clock ticks; None off Linux.
    Busy = user + nice + system + irq + softirq (idle, iowait, steal and the guest
    columns, which user already includes, are left out)."""
    try:
        with open(_PROC_STAT, "rb") as f:
            first = f.readline().split()
    except OSError:
        return None
    if not first or first[0] != b"cpu":
        return None
    v = [int(x) for x in first[1:]] + [0] * 8
    user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
    return user + nice + system + irq + softirq, steal


def _own_cpu_s() -> float:
    """CPU time of this process (all its threads) and of its children already reaped."""
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


@dataclass(frozen=True)
class MachineActivity:
    """One snapshot; ``later.since(earlier)`` is the interval between them."""

    wall_s: float
    own_cpu_s: float
    busy_ticks: int | None
    steal_ticks: int | None

    @classmethod
    def now(cls) -> "MachineActivity":
        t = _machine_ticks()
        return cls(time.perf_counter(), _own_cpu_s(), t[0] if t else None, t[1] if t else None)

    def since(self, earlier: "MachineActivity") -> dict:
        """The interval from ``earlier`` to this snapshot:

        - ``wall_s``, ``own_cpu_s`` (this process and its reaped children);
        - ``foreign_cpu_s``: CPU time the machine spent on anything else (other
          processes, unreaped children, the kernel's own threads), never below 0 (the
          two counters tick at different granularity: ~10 ms per CPU);
        - ``foreign_cores``: that over the wall time (0.5 = half a core taken all along);
        - ``steal_s``: time the host ran something else on our vCPUs."""
        wall = self.wall_s - earlier.wall_s
        own = self.own_cpu_s - earlier.own_cpu_s
        out = {"available": False, "wall_s": wall, "own_cpu_s": own}
        if self.busy_ticks is None or earlier.busy_ticks is None:
            return out
        hz = _ticks_per_s()
        busy = (self.busy_ticks - earlier.busy_ticks) / hz
        foreign = max(0.0, busy - own)
        out.update(available=True, foreign_cpu_s=foreign,
                   foreign_cores=foreign / wall if wall > 0 else 0.0,
                   steal_s=(self.steal_ticks - earlier.steal_ticks) / hz)
        return out


# A benchmark's figures are flagged when other work took more than this share of a core
# on average, or the host stole more than this share: below it, the kernel's own
# threads and the counters' granularity (~10 ms per CPU and interval) are the noise.
NOISE_CORES = 0.05


def describe(activity: dict) -> str:
    """One line for a benchmark's output: how much other work ran, and whether that is
    enough to distort the figures."""
    if not activity.get("available"):
        return "other work on the machine: unknown (no /proc/stat)"
    wall = activity["wall_s"]
    f, st = activity["foreign_cpu_s"], activity["steal_s"]
    line = (f"other work on the machine during the run: {f:.2f} CPU-s in {wall:.1f} s "
            f"({activity['foreign_cores']:.2f} cores), host steal {st:.2f} s")
    if activity["foreign_cores"] > NOISE_CORES or (wall > 0 and st / wall > NOISE_CORES):
        line += ("  ** WARNING: figures distorted: another process or the host took CPU from "
                 "this run; rerun on a quiet machine **")
    return line
