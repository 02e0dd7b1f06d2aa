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

It also reads how much free memory the VM handed back to its host meanwhile (Linux free
page reporting, ``/sys/module/page_reporting/parameters/reported_kib``, where the
kernel has it). The host faults that memory in again on its next touch, billed to the
vCPU that touches it, so a load that allocates it runs slower, by up to 3x for the
medium fixture's cold loads on the VM of docs/runtime.md ("What swings a cold load
here"). Benchmarks print it so that such runs are read with that in mind.

Linux only (``/proc/stat``); elsewhere :meth:`MachineActivity.now` returns a snapshot
whose :meth:`since` reports ``available: False``.
"""
from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass

_PROC_STAT = "/proc/stat"
_REPORTED_KIB = "/sys/module/page_reporting/parameters/reported_kib"


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


def _reported_kib() -> int | None:
    """KiB of free memory this kernel has reported to its host since boot; None where
    it does not report (bare metal, or no free page reporting)."""
    try:
        with open(_REPORTED_KIB, "rb") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


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
    reported_kib: int | None = None

    @classmethod
    def now(cls) -> "MachineActivity":
        t = _machine_ticks()
        return cls(time.perf_counter(), _own_cpu_s(), t[0] if t else None, t[1] if t else None,
                   _reported_kib())

    def since(self, earlier: "MachineActivity") -> dict:
        """The interval from ``earlier`` to this snapshot:

        - ``wall_s``, ``own_cpu_s`` (this process and its reaped children);
        - ``foreign_cpu_s``: CPU time the machine spent on anything else (other
          processes, unreaped children, the kernel's own threads), never below 0 (the
          two counters tick at different granularity: ~10 ms per CPU);
        - ``foreign_cores``: that over the wall time (0.5 = half a core taken all along);
        - ``steal_s``: time the host ran something else on our vCPUs;
        - ``returned_mib``: free memory the VM handed back to its host; absent where
          the kernel does not report it, present even without ``/proc/stat``."""
        wall = self.wall_s - earlier.wall_s
        own = self.own_cpu_s - earlier.own_cpu_s
        out = {"available": False, "wall_s": wall, "own_cpu_s": own}
        if self.reported_kib is not None and earlier.reported_kib is not None:
            out["returned_mib"] = (self.reported_kib - earlier.reported_kib) / 1024
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


def distorted(activity: dict) -> bool:
    """Whether other work or the host took enough CPU in ``activity`` (a ``since``) to
    distort a benchmark's figures (``NOISE_CORES``); False where it cannot be told."""
    if not activity.get("available"):
        return False
    wall = activity["wall_s"]
    return activity["foreign_cores"] > NOISE_CORES or (wall > 0 and activity["steal_s"] / wall > NOISE_CORES)


def describe(activity: dict) -> str:
    """One line for a benchmark's output: how much other work ran, and whether that is
    enough to distort the figures."""
    returned = activity.get("returned_mib")
    tail = ("" if returned is None else
            f"; free memory handed back to the host {returned:,.0f} MiB (memory a load gets"
            " from there is faulted in again by the host: cold loads swing with it)")
    if not activity.get("available"):
        return "other work on the machine: unknown (no /proc/stat)" + tail
    wall = activity["wall_s"]
    f, st = activity["foreign_cpu_s"], activity["steal_s"]
    line = (f"other work on the machine during the run: {f:.2f} CPU-s in {wall:.1f} s "
            f"({activity['foreign_cores']:.2f} cores), host steal {st:.2f} s" + tail)
    if distorted(activity):
        line += ("  ** WARNING: figures distorted: another process or the host took CPU from "
                 "this run; rerun on a quiet machine **")
    return line
