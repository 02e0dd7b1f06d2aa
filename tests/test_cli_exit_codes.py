"""The exit codes (docs/cli.md), each through a real ``onnx-prep`` process: 0 ok,
2 unusable input (typer's usage errors and the library's one-line errors), 3 internal
error (a fault injected into a core function of that process: the traceback and a
request to report it), 130 Ctrl-C (SIGINT sent while a decode is drawing its progress
bar: no traceback). Code 1 (findings: a real ``--compare`` divergence) is
tests/test_cli_run.py::test_compare_reports_a_real_divergence_with_exit_1."""
from __future__ import annotations

import errno
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from onnx_prep.cli.errors import REPORT_REQUEST
from onnx_prep.core.errors import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, EXIT_UNUSABLE

# The console script installed beside this interpreter (the one users run), else the
# same entry point through ``python -m onnx_prep``.
_SCRIPT = Path(sys.executable).with_name("onnx-prep")
ONNX_PREP = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "onnx_prep"]


def default_sigint() -> None:
    """In a child before it runs: SIGINT's default disposition. A suite started from a
    shell's background job (``pytest &``) inherits SIGINT ignored, and so would the CLI,
    which then never sees the Ctrl-C a test sends (Python installs its handler only where
    SIGINT is not ignored at start)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)

# ``main()`` of the console script in a fresh interpreter, after a fault is put into one
# core function: sys.argv[1] names it ("module:function"), the rest is the command line.
FAULTY = """
import importlib, sys
module, name = sys.argv[1].split(":")
def fault(*args, **kwargs):
    raise RuntimeError("injected fault")
setattr(importlib.import_module(module), name, fault)
sys.argv = ["onnx-prep", *sys.argv[2:]]
from onnx_prep.cli.app import main
main()
"""


def onnx_prep(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*ONNX_PREP, *args], capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else dict(os.environ, **env))


def with_fault(target: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", FAULTY, target, *args], capture_output=True, text=True,
                          timeout=120)


def test_0_on_success():
    p = onnx_prep("--version")
    assert p.returncode == EXIT_OK, p.stderr
    assert p.stdout.startswith("onnx-prep ") and p.stderr == ""


@pytest.mark.parametrize("args, needle", [
    (["run", "--no-such-option"], "No such option"),
    (["no-such-command"], "No such command"),
    (["fixture"], "Missing argument"),
])
def test_2_on_a_usage_error(args, needle):
    p = onnx_prep(*args)
    assert p.returncode == EXIT_UNUSABLE, (p.stdout, p.stderr)
    assert needle in p.stderr and "Traceback" not in p.stderr


def test_2_on_unusable_input_with_one_line(tmp_path):
    p = onnx_prep("resolve", str(tmp_path / "absent.onnx"))
    assert p.returncode == EXIT_UNUSABLE
    assert p.stderr.strip().splitlines() == [f"error: model file not found (model {tmp_path / 'absent.onnx'})"]
    bad = onnx_prep("run", "--runtime", "tvm")
    assert bad.returncode == EXIT_UNUSABLE and bad.stderr.startswith("error: --runtime must be one of")


def test_3_on_an_internal_error_with_the_traceback_and_a_request_to_report_it(tiny_llm_path):
    p = with_fault("onnx_prep.core.model.resolution:resolve_model", "resolve", str(tiny_llm_path))
    assert p.returncode == EXIT_INTERNAL, (p.stdout, p.stderr)
    assert "Traceback (most recent call last)" in p.stderr and "RuntimeError: injected fault" in p.stderr
    assert p.stderr.strip().splitlines()[-1] == REPORT_REQUEST
    assert p.stdout == ""


def test_3_on_an_internal_error_in_run(small_llm_path):
    p = with_fault("onnx_prep.core.decode.generation:greedy_decode", "run", str(small_llm_path), "--tokens", "2")
    assert p.returncode == EXIT_INTERNAL, (p.stdout, p.stderr)
    assert "RuntimeError: injected fault" in p.stderr and p.stderr.strip().endswith(REPORT_REQUEST)


def test_3_on_an_internal_error_outside_the_guarded_commands():
    """``demo`` drives the other commands; a fault in its own code reaches ``main``."""
    p = with_fault("onnx_prep.cli.demo:demo_steps", "demo")
    assert p.returncode == EXIT_INTERNAL, (p.stdout, p.stderr)
    assert "RuntimeError: injected fault" in p.stderr and p.stderr.strip().endswith(REPORT_REQUEST)


def test_a_library_error_is_not_reported_as_a_bug(tmp_path):
    p = onnx_prep("--debug", "resolve", str(tmp_path / "absent.onnx"))
    assert p.returncode == EXIT_UNUSABLE
    assert "Traceback" in p.stderr and REPORT_REQUEST not in p.stderr


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_130_on_ctrl_c_during_a_decode_without_a_traceback(small_llm_path, tmp_path):
    """stderr is a terminal (a pty), so the run draws its progress bar there; SIGINT is
    sent once the bar shows, with thousands of decode steps still to go."""
    master, slave = pty.openpty()
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="100")
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([*ONNX_PREP, "run", str(small_llm_path), "--tokens", "20000", "--json"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env=env,
                            preexec_fn=default_sigint)
    os.close(slave)
    seen = ""
    deadline = time.monotonic() + 60  # a bound on a broken test, not a synchronisation
    try:
        sent = False
        while time.monotonic() < deadline:
            if not select.select([master], [], [], deadline - time.monotonic())[0]:
                break
            try:
                chunk = os.read(master, 4096)
            except OSError as exc:  # EIO: the child closed its end of the pty
                if exc.errno != errno.EIO:
                    raise
                break
            if not chunk:
                break
            seen += _ANSI.sub("", chunk.decode(errors="replace"))
            if not sent and "prepared decode" in seen:
                proc.send_signal(signal.SIGINT)
                sent = True
        rc = proc.wait(timeout=30)
        stdout = proc.stdout.read().decode()
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sent, seen
    assert rc == EXIT_INTERRUPTED, (rc, seen)
    assert "interrupted" in seen and "Traceback" not in seen and "KeyboardInterrupt" not in seen
    assert stdout == ""  # no record for a run that did not finish
