"""The decode GEMVs' weight streaming, chosen per machine (core/ops/weight_streaming.py):
the probe measures, the rule decides, the environment overrides, and a process's
first choice is what the native kernels then do."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from onnx_prep.core.errors import UsageError
from onnx_prep.core.ops import weight_streaming as ws

native = pytest.importorskip("onnx_prep.native")
X86 = platform.machine() in ("x86_64", "AMD64", "i686")


@pytest.mark.skipif(not X86, reason="the probe flushes lines with an x86 instruction; elsewhere it returns None")
def test_the_probe_times_both_reads():
    plain, streamed = native.probe_weight_streaming(1 << 20, 2)
    # 1 MiB from memory: between ~20 us (50 GB/s) and 100 ms on any machine this runs on
    assert 2e-5 < plain < 0.1 and 2e-5 < streamed < 0.1
    assert native.probe_weight_streaming(100, 1) is not None  # rounded down to whole lines


def test_the_rule_turns_streaming_off_only_when_it_costs_over_the_threshold():
    assert ws.streams(1.0, 1.0) and ws.streams(1.0, 0.5) and ws.streams(1.0, ws.SLOWER_BY)
    assert not ws.streams(1.0, ws.SLOWER_BY * 1.01)
    assert not ws.streams(0.25e-3, 0.8e-3)  # what the machine it hurt measured (3.2x)


def test_the_environment_decides_without_a_probe(monkeypatch):
    for raw, on in (("0", False), ("1", True)):
        monkeypatch.setenv(ws.STREAMING_ENV, raw)
        c = ws._choose()
        assert (c.on, c.source, c.plain_ms) == (on, "environment", None)
        assert ws.STREAMING_ENV in c.describe()
    monkeypatch.setenv(ws.STREAMING_ENV, "auto")
    with pytest.raises(UsageError, match=ws.STREAMING_ENV):
        ws._choose()


@pytest.mark.skipif(not X86, reason="the probe flushes lines with an x86 instruction")
def test_without_the_environment_the_probe_decides(monkeypatch):
    monkeypatch.delenv(ws.STREAMING_ENV, raising=False)
    c = ws._choose()
    assert c.source == "probe" and c.plain_ms > 0 and c.streamed_ms > 0
    assert c.on == ws.streams(c.plain_ms, c.streamed_ms)
    assert f"{c.streamed_ms / c.plain_ms:.2f}x" in c.describe()
    assert c.as_dict()["on"] is c.on


@pytest.mark.parametrize("raw", ["0", "1"])
def test_the_first_choice_of_a_process_sets_the_kernels(raw):
    """In a fresh process: the choice sets the native switch, a later choice() leaves
    alone what was set since, and a machine description says what was chosen."""
    code = ("from onnx_prep import native\n"
            "from onnx_prep.core.ops.weight_streaming import choice\n"
            "from onnx_prep.core.profile.machine import describe_machine\n"
            "c = choice()\n"
            "print(native.set_weight_streaming(not c.on) == c.on)\n"
            "choice()\n"
            "print(native.set_weight_streaming(c.on) == (not c.on))\n"
            "print(describe_machine())\n")
    env = dict(os.environ, ONNX_PREP_WEIGHT_STREAMING=raw)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:2] == ["True", "True"]
    assert f"weight streaming {'on' if raw == '1' else 'off'} (ONNX_PREP_WEIGHT_STREAMING)" in lines[2]
