"""Ctrl-C inside a run: a KeyboardInterrupt raised on the caller's thread at the unlucky
points of a run's start, its wait and its helpers' lending. Whatever the point, the
interrupt reaches the caller, the run stops, and the session's close returns (a close
that waits forever is the process ignoring Ctrl-C: tests/test_cli_exit_codes.py). The
interrupt is injected where a signal can land (a hook around the real call); the real
fixture model, scheduler, store and kernels; Event-gated hooks, no sleeps."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import onnx_prep.core.runtime.run_loop as run_loop
from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.decode.generation import step_feeds
from onnx_prep.core.errors import CancelledError
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.runtime.arenas import Arena
from onnx_prep.core.runtime.execution_handle import ExecutionHandle
from onnx_prep.core.runtime.session import RuntimeContext, Session

T = 30  # a blocked hook or a broken close gives up after this (a failing test, not a hang)


def _feeds(path) -> dict:
    r = resolve_model(path)
    io = DecoderIO.discover(r.inputs, r.outputs)
    ids = np.asarray([[3, 1, 4]])
    return step_feeds(io, ids, io.empty_past(1), 0)


def _assert_closes(s: Session) -> None:
    closer = threading.Thread(target=s.close, daemon=True)
    closer.start()
    closer.join(T)  # a bound on a broken close, not a synchronisation
    assert not closer.is_alive(), "the session's close waited for an interrupted run"


def test_an_interrupt_before_a_runs_handle_exists_abandons_the_run(small_llm_path, monkeypatch):
    """Ctrl-C between the first continuation's submit and the run's handle: the
    continuation, which yields waiting for its weights, must not wait for that handle
    forever, nor the session's close for it."""
    real = run_loop.ExecutionHandle

    class Interrupted(real):
        def __init__(self, *args, **kwargs):
            raise KeyboardInterrupt

    s = Session.open(small_llm_path)
    monkeypatch.setattr(run_loop, "ExecutionHandle", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        s.run_async(RuntimeContext(_feeds(small_llm_path)))  # cold: the continuation yields for its weights
    monkeypatch.setattr(run_loop, "ExecutionHandle", real)
    _assert_closes(s)


def test_an_interrupt_inside_the_first_submit_abandons_the_run(small_llm_path):
    """Ctrl-C inside the submit of a cold run's first continuation, once the scheduler has
    queued it: run_async never learns of the task, which runs and yields for its weights.
    The CLI's decode met this one (the test sends SIGINT as the decode starts; under load
    the main thread often takes it as it gets the GIL back from the woken worker): the
    yield waited for a handle that never came, and the close for that worker."""
    s = Session.open(small_llm_path)
    real = s.runs._submit_continuation
    yielded = threading.Event()
    calls = []

    def submit(run, deps):
        task = real(run, deps=deps)
        calls.append(task)
        if len(calls) == 1:
            raise KeyboardInterrupt  # queued; the caller never gets the task
        yielded.set()  # the continuation yielded: it submitted its next step
        return task

    s.runs._submit_continuation = submit
    ctx = RuntimeContext(_feeds(small_llm_path))
    with pytest.raises(KeyboardInterrupt):
        s.run_async(ctx)
    ctx.release()
    assert yielded.wait(T), "the continuation did not yield (its weights were resident?)"
    _assert_closes(s)
    assert s.budget.live(Arena.EXECUTION) == 0  # the abandoned run's working set went back
    assert calls[0].state.terminal and calls[1].state.terminal


def test_an_interrupt_as_wait_starts_cancels_the_run(small_llm_path, monkeypatch):
    """Ctrl-C in wait() before it blocks (raising what it waits for to DEMANDED): the run
    is cancelled as for a Ctrl-C while blocked, not left running with nobody waiting."""
    entered, go = threading.Event(), threading.Event()

    def before_step(si):
        if si == 0:
            entered.set()
            go.wait(T)

    s = Session.open(small_llm_path)
    try:
        h = s.run_async(RuntimeContext(_feeds(small_llm_path), before_step=before_step))
        assert entered.wait(T)  # the run is inside its first step: far from done

        def interrupted(self):
            raise KeyboardInterrupt

        monkeypatch.setattr(ExecutionHandle, "_inherit_priority", interrupted)
        with pytest.raises(KeyboardInterrupt):
            h.wait()
        monkeypatch.undo()
        go.set()
        with pytest.raises(CancelledError):
            h.wait(T)
    finally:
        go.set()
        _assert_closes(s)


def test_an_interrupt_while_lending_helpers_stops_their_mailbox(small_llm_path, monkeypatch):
    """Ctrl-C inside the lending of a hot run's helpers, once the offers are queued: a
    helper serves its mailbox until the mailbox stops, and the close joins every worker,
    so the mailbox must stop whatever the point (before, the offer was not yet listed
    for the stop, and a worker taking it served forever)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: a hot run lends no helper")
    s = Session.open(small_llm_path, cpu_workers=2, spin_helpers=True)
    try:
        feeds = _feeds(small_llm_path)
        s.prepare()
        s.run(feeds)  # every requirement resident: the next run is hot
        boxes = []
        real = s.scheduler.lend

        def lend(fn, workers=1):
            boxes.append(fn.__self__)  # the Mailbox whose serve is offered
            real(fn, workers)
            raise KeyboardInterrupt  # queued; the run never gets the offers back

        monkeypatch.setattr(s.scheduler, "lend", lend)
        s.runs._lend_at_start = True  # lend as the run starts (as after a run that split)
        with pytest.raises(KeyboardInterrupt):
            s.run(feeds)
        monkeypatch.undo()
        assert boxes and all(box.c.stop for box in boxes), "a lent mailbox was left serving"
    finally:
        _assert_closes(s)
