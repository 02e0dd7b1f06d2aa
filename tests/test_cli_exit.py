"""The console script's exit (``cli/app.entry``): once the answer is written, the exit
handlers run and the process ends with the command's code, without the interpreter
freeing what the command left (the collector's young threshold raised meanwhile); with
a non-daemon thread still running, the usual exit, which waits for it. Each case is a
real interpreter running the entry point."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from onnx_prep.cli.app import BLAS_SPIN, GC_YOUNG_THRESHOLD
from onnx_prep.core.errors import EXIT_OK, EXIT_UNUSABLE

# ``entry`` (or ``main``: sys.argv[1]) of the console script in a fresh interpreter,
# with an exit handler and an object only the interpreter's teardown frees.
PROBE = """
import atexit, gc, os, sys
class Left:
    def __del__(self, write=os.write):
        write(2, b"torn down\\n")
left = Left()
young = gc.get_threshold()[0]
atexit.register(lambda: sys.stderr.write(f"exit handler ran; gc threshold {young} -> {gc.get_threshold()[0]}\\n"))
which, sys.argv = sys.argv[1], ["onnx-prep", *sys.argv[2:]]
from onnx_prep.cli import app
getattr(app, which)()
"""


def _run(code: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60, env=env)


# What the environment holds for OpenBLAS when numpy is first imported by a command.
BLAS_PROBE = """
import os, sys
sys.argv = ["onnx-prep", "run", "--tokens", "1"]
from onnx_prep.cli import app
imported_before_entry = "numpy" in sys.modules
class Probe:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            sys.stderr.write(f"numpy imported with {os.environ.get('OPENBLAS_THREAD_TIMEOUT')}; "
                             f"before entry: {imported_before_entry}\\n")
            sys.meta_path.remove(self)
sys.meta_path.insert(0, Probe())
app.entry()
"""


@pytest.mark.parametrize("preset", [None, "12"], ids=["default", "user's"])
def test_openblas_spins_briefly_unless_the_user_says_otherwise(preset):
    env = {k: v for k, v in os.environ.items() if k != BLAS_SPIN[0]}
    if preset is not None:
        env[BLAS_SPIN[0]] = preset
    p = _run(BLAS_PROBE, env=env)
    assert p.returncode == EXIT_OK, p.stderr
    assert f"numpy imported with {preset or BLAS_SPIN[1]}; before entry: False\n" in p.stderr


@pytest.mark.parametrize("args, code", [(["--version"], EXIT_OK), (["run", "--tokens", "0"], EXIT_UNUSABLE),
                                        (["no-such-command"], EXIT_UNUSABLE)],
                         ids=["ok", "unusable", "usage"])
def test_entry_exits_with_the_code_and_without_teardown(args, code):
    p = _run(PROBE, "entry", *args)
    assert p.returncode == code, p.stderr
    assert "exit handler ran" in p.stderr and "torn down" not in p.stderr
    assert f" -> {GC_YOUNG_THRESHOLD}\n" in p.stderr  # the collector's young threshold for the command
    assert (p.stdout.startswith("onnx-prep ") if code == EXIT_OK else "error: " in p.stderr)


def test_main_keeps_the_usual_exit():
    """The same probe through ``main()``: the teardown frees the object and the collector
    keeps its thresholds (the test above can fail)."""
    p = _run(PROBE, "main", "--version")
    assert p.returncode == EXIT_OK
    assert "exit handler ran" in p.stderr and "torn down" in p.stderr
    young = int(p.stderr.split("gc threshold ")[1].split(" ")[0])
    assert f"gc threshold {young} -> {young}\n" in p.stderr and young != GC_YOUNG_THRESHOLD


def test_a_running_thread_gets_the_usual_exit():
    """A non-daemon thread still running when the command returns: the usual exit waits
    for it (it can finish only once entry() has raised SystemExit: the lock is released
    in the ``finally`` an os._exit would skip)."""
    code = """
import os, sys, threading
lock = threading.Lock()
lock.acquire()
def work():
    with lock:
        os.write(1, b"thread done\\n")
threading.Thread(target=work).start()
sys.argv = ["onnx-prep", "run", "--tokens", "0"]
from onnx_prep.cli.app import entry
try:
    entry()
finally:
    lock.release()
"""
    p = _run(code)
    assert p.returncode == EXIT_UNUSABLE, p.stderr
    assert p.stdout == "thread done\n" and "error: " in p.stderr
