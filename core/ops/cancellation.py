"""A run's cancellation, as its long ops see it: the cooperative check between the
iterations of an op that may run for a long time (a ``Loop`` with a huge trip count in
the reference fallback, ``core/ops/reference.py``).

The runtime installs the running task's cancel token for the duration of its actions
on a worker thread (``core/runtime/run_loop.py``)::

    with cancellation.checking(tctx.token):
        program.execute(values, prepared)

An op calls :func:`check` where it can stop; it raises the token's ``CancelledError``
once the run is cancelled (Ctrl-C: the waiting main thread cancels the submission,
``core/runtime/execution_handle.py``). With no token installed (an op called
directly, a hot run on the caller's own thread, where Ctrl-C interrupts it anyway) the
check does nothing.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, Protocol


class Token(Protocol):
    def raise_if_cancelled(self, what: str = "task") -> None: ...


_TOKEN: contextvars.ContextVar[Any] = contextvars.ContextVar("onnx_prep_cancellation", default=None)


@contextlib.contextmanager
def checking(token: Token | None) -> Iterator[None]:
    """Within the block, :func:`check` on this thread asks ``token``."""
    reset = _TOKEN.set(token)
    try:
        yield
    finally:
        _TOKEN.reset(reset)


def check(what: str = "op") -> None:
    """Raise the installed token's ``CancelledError`` if its run was cancelled."""
    token = _TOKEN.get()
    if token is not None:
        token.raise_if_cancelled(what)
