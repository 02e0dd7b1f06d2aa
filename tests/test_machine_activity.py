"""MachineActivity: CPU spent by other work during an interval, from the real counters."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from onnx_prep.core.profile.machine_activity import MachineActivity, describe

linux = pytest.mark.skipif(not os.path.exists("/proc/stat") or not hasattr(os, "waitid"),
                           reason="needs /proc/stat and waitid (Linux)")

BURN = 0.4  # CPU-seconds the other process spends


def _burner() -> subprocess.Popen:
    code = ("import time\nt = time.process_time()\n"
            f"while time.process_time() - t < {BURN}: pass\n")
    return subprocess.Popen([sys.executable, "-c", code])


@linux
def test_other_process_cpu_counts_as_foreign_until_it_is_ours():
    before = MachineActivity.now()
    child = _burner()
    # Wait for it to exit WITHOUT reaping it: its CPU is not in RUSAGE_CHILDREN yet, so
    # for this process it is somebody else's work.
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    exited = MachineActivity.now()
    child.wait()  # reaped: now its CPU is this process's (children)
    reaped = MachineActivity.now()

    a = exited.since(before)
    assert a["available"]
    assert a["foreign_cpu_s"] >= BURN - 0.05, a
    assert a["foreign_cores"] > 0.05 and "WARNING" in describe(a)

    b = reaped.since(before)
    assert b["own_cpu_s"] >= BURN - 0.02, b
    # the same work, counted as ours: at most the interpreter start-up and the
    # counters' granularity (~10 ms per CPU per snapshot) stay foreign
    assert b["foreign_cpu_s"] < a["foreign_cpu_s"] - BURN / 2, (a, b)


def test_without_proc_stat_it_says_unknown():
    a = MachineActivity(1.0, 0.5, None, None).since(MachineActivity(0.0, 0.0, None, None))
    assert a == {"available": False, "wall_s": 1.0, "own_cpu_s": 0.5}
    assert "unknown" in describe(a)


def test_memory_returned_to_the_host_is_the_reported_difference():
    kib = 3 * 1024 * 1024  # 3 GiB reported in between
    a = MachineActivity(2.0, 0.5, 200, 0, 1_000 + kib).since(MachineActivity(0.0, 0.0, 100, 0, 1_000))
    assert a["returned_mib"] == 3072.0
    assert "handed back to the host 3,072 MiB" in describe(a)
    # only where both snapshots have the counter; without /proc/stat it is still told
    b = MachineActivity(1.0, 0.5, None, None, 5_120).since(MachineActivity(0.0, 0.0, None, None, 1_024))
    assert b["returned_mib"] == 4.0 and "unknown" in describe(b) and "4 MiB" in describe(b)
    c = MachineActivity(1.0, 0.5, 200, 0, None).since(MachineActivity(0.0, 0.0, 100, 0, 1_024))
    assert "returned_mib" not in c and "handed back" not in describe(c)


def test_now_reads_the_kernels_page_reporting_counter_where_it_has_one():
    snap = MachineActivity.now()
    path = "/sys/module/page_reporting/parameters/reported_kib"
    if os.path.exists(path):
        with open(path) as f:
            before = int(f.read())
        snap = MachineActivity.now()
        with open(path) as f:
            after = int(f.read())
        # the kernel's own figure (it only grows), read between two reads of the file
        assert isinstance(snap.reported_kib, int) and before <= snap.reported_kib <= after
        later = MachineActivity.now()
        assert later.since(snap)["returned_mib"] == (later.reported_kib - snap.reported_kib) / 1024
    else:
        assert snap.reported_kib is None
