"""A cache folder that cannot take the cache, through real processes: ``build-cache`` exits
2 with one line naming the folder; ``run --cache-policy build-if-missing`` warns in one
line, decodes the right tokens and leaves nothing behind (docs/cache-format.md, "Writing").

Two ways a folder refuses: its mode (0555; root ignores modes, so as root the children see
the folder on a read-only bind mount in a namespace of their own, where unshare can make
one, else the case is skipped), and
a full disk, simulated in the child with RLIMIT_FSIZE (a write past the limit fails with
EFBIG, SIGXFSZ ignored), which binds root as well.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_cache_crash import ONNX_PREP, child_env, copy_model, run_tokens

FSIZE_LIMIT = 64 << 10  # under the small fixture's cache (~300 KiB), over nothing else the child writes


def _full_disk() -> None:
    """In the child, before exec: regular files end at FSIZE_LIMIT bytes, as on a full disk."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, FSIZE_LIMIT))


# As root: the folder bind-mounted read-only over itself, in a user and mount namespace
# of the child's own ($0 is the folder, the rest the command).
_READ_ONLY_MOUNT = ["unshare", "--map-root-user", "--mount", "sh", "-c",
                    'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"']


@pytest.fixture
def read_only_model(small_llm_path, tmp_path):
    """(the model copied into a folder the children cannot write, the command prefix that
    makes it so), or a skip. Not root: the folder's mode is 0555. Root ignores modes: the
    children see the folder on a read-only bind mount (EROFS), where unshare can make one."""
    model = copy_model(small_llm_path, tmp_path / "m")
    if os.geteuid() != 0:
        os.chmod(model.parent, 0o555)
        try:
            yield model, []
        finally:
            os.chmod(model.parent, 0o755)  # pytest removes the folder afterwards
        return
    prefix = [*_READ_ONLY_MOUNT, str(model.parent)]
    try:
        probe = subprocess.run([*prefix, "touch", str(model.parent / "probe")], capture_output=True, text=True)
    except OSError as exc:
        pytest.skip(f"running as root, which ignores a folder's mode, and no unshare ({exc.strerror}): "
                    "the full-disk case covers the write failure")
    if probe.returncode == 0 or "Read-only file system" not in probe.stderr:
        pytest.skip("running as root, which ignores a folder's mode, and no read-only bind mount in a user "
                    f"namespace here ({probe.stderr.strip()[:200]}): the full-disk case covers the write failure")
    yield model, prefix


def _onnx_prep(args: list, prefix: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, *ONNX_PREP, *map(str, args)], capture_output=True, text=True, timeout=120,
                          env=child_env(), **kw)


def _assert_refused_and_warned(model: Path, tokens: list, prefix: list = (), **kw) -> None:
    before = sorted(os.listdir(model.parent))
    folder = str(model.parent)

    p = _onnx_prep(["build-cache", model], prefix, **kw)
    assert p.returncode == 2, p.stderr
    (line,) = p.stderr.splitlines()  # one line: the error, no warning before it
    assert line.startswith("error: cannot write the prepared cache") and folder in line, line
    assert sorted(os.listdir(model.parent)) == before

    p = _onnx_prep(["run", model, "--tokens", "4", "--json", "--cache-policy", "build-if-missing"], prefix, **kw)
    assert p.returncode == 0, p.stderr
    (line,) = p.stderr.splitlines()
    assert line.startswith("warning: cannot write the prepared cache") and folder in line, line
    doc = json.loads(p.stdout)
    assert doc["tokens"] == tokens
    assert doc["cache"]["exists"] is False and doc["cache"]["committed"]["written"] == 0
    assert sorted(os.listdir(model.parent)) == before  # no cache, no temporary file, no lock


def test_a_read_only_folder_refuses_the_cache_in_one_line(small_llm_path, read_only_model):
    model, prefix = read_only_model
    _assert_refused_and_warned(model, run_tokens(small_llm_path, "disabled")["tokens"], prefix)


def test_a_full_disk_refuses_the_cache_in_one_line(small_llm_path, tmp_path):
    tokens = run_tokens(small_llm_path, "disabled")["tokens"]
    model = copy_model(small_llm_path, tmp_path / "m")
    _assert_refused_and_warned(model, tokens, preexec_fn=_full_disk)


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE's EFBIG is checked on Linux")
def test_the_full_disk_stand_in_fails_a_write_past_its_limit(tmp_path):
    """The simulation is real: a child under it cannot write a file past FSIZE_LIMIT."""
    target = tmp_path / "big"
    code = f"with open({str(target)!r}, 'wb', buffering=0) as f:\n    f.write(b'x' * {FSIZE_LIMIT})\n    f.write(b'x')"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=_full_disk)
    assert p.returncode != 0 and "File too large" in p.stderr
    assert target.stat().st_size <= FSIZE_LIMIT
