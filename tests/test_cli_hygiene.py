"""Ctrl-C and one-line errors, through a real ``onnx-prep`` process (docs/cli.md): SIGINT
inside a long reference-fallback op ends the run with 130 and one line; usage errors,
names with control characters, a bad ONNX_PREP_ISA are one line; MODEL may be a folder
for every command."""
from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from decoder_toys import build_toy_decoder
from onnx_prep.core.errors import EXIT_INTERRUPTED, EXIT_UNUSABLE
from test_cli_exit_codes import ONNX_PREP, _ANSI, default_sigint, onnx_prep


def _loop_decoder(path):
    """A toy decoder whose logits wait on a Loop of 10^15 iterations (reference fallback)."""
    build_toy_decoder(path)
    m = onnx.load(str(path))
    for n in m.graph.node:
        n.output[:] = ["logits_raw" if o == "logits" else o for o in n.output]
    body = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"]), helper.make_node("Identity", ["x_in"], ["x_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("x_in", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_out", TensorProto.FLOAT, [])])
    m.graph.initializer.extend([numpy_helper.from_array(np.array(10**15, np.int64), "M"),
                                numpy_helper.from_array(np.array(0, np.float32), "x0")])
    m.graph.node.extend([helper.make_node("Loop", ["M", "", "x0"], ["xs"], body=body, name="long_loop"),
                         helper.make_node("Add", ["logits_raw", "xs"], ["logits"])])
    onnx.save(m, str(path))
    return path


def test_130_within_a_second_on_ctrl_c_inside_a_long_reference_loop(tmp_path):
    model = _loop_decoder(tmp_path / "loop.onnx")
    master, slave = pty.openpty()
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="100")
    proc = subprocess.Popen([*ONNX_PREP, "run", str(model), "--tokens", "8"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=slave, env=env, preexec_fn=default_sigint)
    os.close(slave)
    seen, sent_at, ended_at = "", None, None
    deadline = time.monotonic() + 60  # a bound on a broken test, not a synchronisation
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 1)[0]:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            seen += _ANSI.sub("", chunk.decode(errors="replace"))
            if sent_at is None and "prepared decode" in seen:
                proc.send_signal(signal.SIGINT)
                sent_at = time.monotonic()
        rc = proc.wait(timeout=30)
        ended_at = time.monotonic()
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sent_at is not None, seen
    assert rc == EXIT_INTERRUPTED, (rc, seen)
    assert ended_at - sent_at < 5  # within a second on an idle machine; a loose bound here
    assert "interrupted" in seen and "Traceback" not in seen


def test_a_usage_error_is_one_line():
    p = onnx_prep("run", "--no-such-option")
    assert p.returncode == EXIT_UNUSABLE
    assert p.stderr.splitlines() == ["error: No such option: --no-such-option; see 'onnx-prep run --help'"]


def test_control_characters_in_a_name_are_escaped(tmp_path):
    bad = tmp_path / "a\x1b[31mb\nc\x00".replace("\x00", "")
    p = onnx_prep("resolve", str(bad))
    assert p.returncode == EXIT_UNUSABLE
    assert len(p.stderr.splitlines()) == 1 and "\x1b" not in p.stderr and "\\x1b[31mb\\nc" in p.stderr


def test_a_bad_isa_is_refused_by_every_command(tiny_llm_path):
    for cmd in ("resolve", "run"):
        p = onnx_prep(cmd, str(tiny_llm_path), env={"ONNX_PREP_ISA": "bogus"})
        assert p.returncode == EXIT_UNUSABLE, (cmd, p.stderr)
        assert p.stderr.splitlines() == [p.stderr.splitlines()[0]] and "ONNX_PREP_ISA" in p.stderr


def test_run_takes_a_folder_and_trust_symlinks_like_resolve(tiny_llm_path):
    p = onnx_prep("run", str(tiny_llm_path.parent), "--tokens", "2", "--trust-symlinks")
    assert p.returncode == 0, p.stderr


def test_run_trust_symlinks_reaches_the_prepared_runtime(tiny_llm_path, tmp_path):
    """A data file with a second hard link: refused without the flag, and decoded with it
    (the flag reached resolve before, but not the session's reader)."""
    m = tmp_path / "m"
    m.mkdir()
    for f in tiny_llm_path.parent.iterdir():
        if f.name.startswith(tiny_llm_path.stem):
            (m / f.name).write_bytes(f.read_bytes())
    data = next(f for f in m.iterdir() if f.suffix == ".data")
    os.link(data, tmp_path / "another-name.data")
    refused = onnx_prep("run", str(m / tiny_llm_path.name), "--tokens", "2", "--cache-policy", "disabled")
    assert refused.returncode == EXIT_UNUSABLE and "hard links" in refused.stderr, refused.stderr
    p = onnx_prep("run", str(m / tiny_llm_path.name), "--tokens", "2", "--cache-policy", "disabled",
                  "--trust-symlinks")
    assert p.returncode == 0, p.stderr


def test_numpy_warnings_reach_the_user_only_with_debug(small_llm_path, tmp_path):
    """Every norm weight read one byte off (offsets + 1, digests left as they are,
    verification off): the values are garbage, the ops overflow, and numpy warns. The
    user sees the run's result and no warning; --debug shows them."""
    import shutil

    m = tmp_path / "m"
    shutil.copytree(small_llm_path.parent, m)
    model = onnx.load(str(m / small_llm_path.name), load_external_data=False)
    for t in model.graph.initializer:
        if t.data_type == TensorProto.FLOAT and t.data_location == TensorProto.EXTERNAL and "norm" in t.name:
            e = {p.key: p for p in t.external_data}
            e["offset"].value = str(int(e["offset"].value) + 1)
    onnx.save(model, str(m / small_llm_path.name))
    # unfused: the garbage overflows in numpy's Softmax and MatMuls (the fused attention's C code does not warn)
    args = ["run", str(m / small_llm_path.name), "--tokens", "3", "--no-verify-digests", "--no-fuse"]
    quiet, loud = onnx_prep(*args), onnx_prep("--debug", *args)
    assert "RuntimeWarning" in loud.stderr, loud.stderr[-2000:]  # the control: there is something to hide
    assert quiet.returncode == loud.returncode == 0 and "Warning" not in quiet.stderr, quiet.stderr
