"""Test helper: whether a native call releases the GIL, checked deterministically."""
from __future__ import annotations

import sys
import threading
from typing import Any, Callable


def run_checking_gil_release(call: Callable[[], Any]) -> Any:
    """Run ``call`` on a worker thread and return its result; fail unless the main
    thread could run while the worker was inside it.

    With a huge switch interval a Python thread gives up the GIL only when it blocks or
    enters C code that releases it. The worker signals, then enters ``call`` while
    holding the GIL; the main thread, waiting on the event, can wake up only when the
    worker lets go, and must find the worker still inside the call (no timing)."""
    entered, finished, result = threading.Event(), [False], [None]

    def worker():
        entered.set()  # does not release the GIL
        result[0] = call()
        finished[0] = True

    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        t = threading.Thread(target=worker)
        t.start()
        entered.wait()
        inside = not finished[0]
    finally:
        sys.setswitchinterval(old)
    t.join()
    assert inside, "the main thread could not run while the worker was in the call"
    return result[0]
