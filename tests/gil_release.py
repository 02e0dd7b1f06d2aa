"""Test helper: whether a native call releases the GIL, checked deterministically."""
from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable

# How long the main thread may wait for the GIL before the call counts as holding it. A
# call that releases it lets the main thread in at its next release: milliseconds even on
# a loaded machine. One that holds it lets the main thread in only at the forced switch
# (the 30 s switch interval below), at any bytecode boundary of the worker's loop.
_HELD_AFTER_S = 15.0


def run_checking_gil_release(call: Callable[[], Any]) -> Any:
    """Run ``call`` on a worker thread and return its result; fail unless the main
    thread could run while the worker was inside it.

    With a huge switch interval a Python thread gives up the GIL only when it blocks or
    enters C code that releases it. The worker signals, then calls ``call`` again and
    again, holding the GIL between calls, until the main thread has looked; the main
    thread, waiting on the event, can wake up only while the worker lets go, and must
    find the worker inside a call. Calling again until the main thread has looked is
    what makes this independent of scheduling: a short call that ended before a
    descheduled main thread woke up simply runs again (once, it failed a loaded run)."""
    entered = threading.Event()
    state: dict[str, Any] = {"inside": False, "seen": False, "result": None}

    def worker():
        entered.set()  # does not release the GIL
        while True:
            state["inside"] = True
            result = call()
            state["inside"] = False
            state["result"] = result
            if state["seen"]:
                return

    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        t = threading.Thread(target=worker, daemon=True)
        t0 = time.monotonic()
        t.start()
        entered.wait()
        inside = state["inside"]  # the main thread holds the GIL here: the worker let go
        state["seen"] = True
        waited = time.monotonic() - t0
    finally:
        sys.setswitchinterval(old)
    t.join()
    assert inside and waited < _HELD_AFTER_S, \
        f"the main thread could not run while the worker was in the call (it waited {waited:.1f} s)"
    return state["result"]
