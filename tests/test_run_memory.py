"""Memory bounded whatever the arguments (docs/run.md, "Ranges" and "Memory budget").

The worst cases run as real ``onnx-prep`` processes under a 2 GiB address-space limit
(RLIMIT_AS): each must end with exit 2 and one ``error:`` line, no traceback, within
the timeout (a FIFO that blocked the open would run into it). The estimate is held to
the bytes a real decode holds, and the budget admits a run at its estimate and refuses
it one byte below."""
from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.decode.io_map import IO_MAP_MAX_BYTES, IO_MAP_MAX_DEPTH, _json_depth, load_io_map
from onnx_prep.core.decode.generation import greedy_decode
from onnx_prep.core.decode.run_memory import admit, estimate_run_memory
from onnx_prep.core.runtime.memory_size import default_memory_budget, parse_size
from onnx_prep.core.decode.run_record import RunOptions, record_run
from onnx_prep.core.errors import EXIT_UNUSABLE, UsageError
from onnx_prep.core.option_ranges import MAX_BATCH, MAX_THREADS, MAX_TOKENS

_SCRIPT = Path(sys.executable).with_name("onnx-prep")
ONNX_PREP = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "onnx_prep"]
ADDRESS_SPACE = 2 << 30


def _capped():
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def onnx_prep_capped(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*ONNX_PREP, *args], capture_output=True, text=True, timeout=120,
                          preexec_fn=_capped, stdin=subprocess.DEVNULL)


@pytest.fixture
def hostile_io_maps(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    sparse = tmp_path / "sparse.json"  # 8 GiB of holes: a regular file that must not be read
    with open(sparse, "wb") as f:
        f.truncate(8 << 30)
    return {"fifo": fifo, "deep": deep, "sparse": sparse, "folder": tmp_path}


WORST_CASES = [
    (["--batch", str(10**9)], "--batch must be at most 65,536"),
    (["--tokens", str(1 << 40)], "--tokens must be at most 1,048,576"),
    (["--threads", "10000"], "--threads must be at most 256"),
    (["--prompt-ids", "1,2,9223372036854775808"], "--prompt-ids must be at most 9,223,372,036,854,775,807"),
    (["--prompt-ids", "1," + "9" * 5000], "--prompt-ids must be comma-separated"),
    (["--prompt-ids", "1,2", "--batch", str(MAX_BATCH), "--tokens", str(MAX_TOKENS)],
     "does not fit the memory budget: batch 65536 x (prompt 2 + tokens 1048576)"),
    (["--runtime", "ort", "--batch", str(MAX_BATCH), "--tokens", "4096"], "does not fit the memory budget"),
    # the longest prompt one argument holds (128 KiB), repeated to the largest batch: 32 GiB as an array
    (["--prompt-ids", "1," * 65_000, "--batch", str(MAX_BATCH), "--tokens", "1"],
     "does not fit the memory budget: batch 65536 x (prompt 65000 + tokens 1)"),
    (["--io-map", "/dev/zero"], "io-map is not a regular file"),
    (["--io-map", "{fifo}"], "io-map is not a regular file"),
    (["--io-map", "{folder}"], "io-map is not a regular file"),
    (["--io-map", "{deep}"], "io-map nests 100000 levels deep, more than 16"),
    (["--io-map", "{sparse}"], "io-map is 8,589,934,592 bytes, more than 1,048,576"),
    (["--prompt-ids", "1,512"], "prompt id 512 is outside the vocabulary (size 512)"),
    (["--memory-budget", "1e99"], "--memory-budget must be a size like"),
    (["--memory-budget", "2EiB"], "--memory-budget must be a size like"),
]


@pytest.mark.parametrize("args, needle", WORST_CASES, ids=[" ".join(a)[:40] for a, _ in WORST_CASES])
def test_worst_arguments_end_in_one_line_and_exit_2_under_a_2_gib_address_space(
        args, needle, small_llm_path, hostile_io_maps):
    args = [a.format(**hostile_io_maps) for a in args]
    proc = onnx_prep_capped("run", str(small_llm_path), *args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == EXIT_UNUSABLE, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    assert needle in lines[0]
    assert proc.stdout == ""


def test_a_modest_run_still_runs_under_the_same_cap(small_llm_path):
    proc = onnx_prep_capped("run", str(small_llm_path), "--tokens", "4", "--batch", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("row ") == 2


def test_fixture_options_have_ranges(tmp_path):
    proc = onnx_prep_capped("fixture", "tiny-llm", str(tmp_path / "out"), "--vocab", str(1 << 40))
    assert proc.returncode == EXIT_UNUSABLE
    assert proc.stderr.strip() == "error: --vocab must be at most 1,048,576 (range 1 to 1,048,576), got 1099511627776"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kw, needle", [
    (dict(tokens=MAX_TOKENS + 1), "--tokens must be at most"),
    (dict(threads=MAX_THREADS + 1), "--threads must be at most"),
    (dict(threads=True), "--threads must be an integer"),
    (dict(prompt_ids=((1, 1 << 63),)), "a prompt id must be at most"),
    (dict(prompt_ids=((1,),) * (MAX_BATCH + 1)), "--batch must be at most"),
    (dict(memory_budget=1024), "--memory-budget must be at least 1,048,576"),
])
def test_run_options_enforce_the_ranges(kw, needle):
    with pytest.raises(UsageError, match=needle):
        RunOptions(**kw)


def test_numpy_integers_are_integers():
    assert RunOptions(prompt_ids=((np.int64(3), np.int32(4)),), tokens=np.int64(2)).tokens == 2


# ---------------------------------------------------------------- the estimate


class Recording:
    """ONNX Runtime's runner as is, noting the bytes of each step's outputs."""

    def __init__(self, runner):
        self.runner, self.outputs = runner, []

    def run(self, feeds):
        out = self.runner.run(feeds)
        self.outputs.append({k: v.nbytes for k, v in out.items()})
        return out


def test_the_estimate_holds_the_bytes_a_real_decode_holds(tiny_llm_path):
    pytest.importorskip("onnxruntime", reason="onnxruntime not installed: the real decode is ORT's here")
    from onnx_prep.core.decode.ort_runner import OrtRunner

    io = DecoderIO.from_model(tiny_llm_path)
    batch, plen, tokens = 2, 5, 6
    runner = Recording(OrtRunner(tiny_llm_path))
    result = greedy_decode(runner, io, np.full((batch, plen), 3), tokens)
    est = estimate_run_memory(io, batch, plen, tokens)
    presents = {n for p in io.kv for n in (p.present_key, p.present_value)}
    last_kv = sum(n for name, n in runner.outputs[-1].items() if name in presents)
    assert est.kv_cache == 2 * last_kv  # the last step's past and present, exactly
    assert est.step_outputs >= runner.outputs[0][io.logits]  # the prefill's logits [batch, prompt, vocab]
    assert est.step_outputs - runner.outputs[0][io.logits] == 4 * batch * io.kv[0].kv_heads * plen * plen
    kept = result.tokens.nbytes + result.top2_margin.nbytes + result.logit_range.nbytes
    assert est.records == result.prompt_ids.nbytes + kept + result.first_logits.nbytes
    compared = estimate_run_memory(io, batch, plen, tokens, compare=True).records
    assert compared == 2 * est.records - result.prompt_ids.nbytes


def test_the_budget_admits_a_run_at_its_estimate_and_refuses_it_a_byte_below(tiny_llm_path):
    io = DecoderIO.from_model(tiny_llm_path)
    est = estimate_run_memory(io, 1, 4, 64)
    options = RunOptions(prompt_ids=((1, 2, 3, 4),), tokens=64, memory_budget=est.total)
    assert len(record_run(tiny_llm_path, options)["tokens"][0]) == 64
    with pytest.raises(UsageError) as info:
        record_run(tiny_llm_path, RunOptions(prompt_ids=((1, 2, 3, 4),), tokens=64, memory_budget=est.total - 1))
    line = info.value.one_line()
    assert "batch 1 x (prompt 4 + tokens 64)" in line and "KV cache 2.1 MiB (4 layers)" in line
    assert "over the budget of 2.3 MiB" in line and "\n" not in line
    with pytest.raises(UsageError):
        admit(est, est.total - 1)


@pytest.mark.parametrize("text, size", [("8GiB", 8 << 30), ("512M", 512 << 20), ("2GB", 2 * 10**9),
                                        ("1.5g", 3 << 29), ("1048576", 1 << 20), (" 4 TiB ", 4 << 40)])
def test_sizes_parse(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "-1G", "8 GiBs", "1KiB", "nan", "1e9", "0x10G", "١٢G"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(UsageError, match="--memory-budget"):
        parse_size(text)


def test_the_default_budget_is_within_the_address_space_limit():
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
            "from onnx_prep.core.runtime.memory_size import default_memory_budget; print(default_memory_budget())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert 0 < int(out.stdout) <= 3 << 30
    assert default_memory_budget() > 0


# ---------------------------------------------------------------- the io-map


def test_the_io_map_depth_is_counted_outside_strings_only():
    assert _json_depth(b'{"kv": [{"past_key": "[[[{{\\"[["}]}') == 3
    assert _json_depth(b'"\\\\" [[]]') == 2


def test_an_io_map_at_the_caps_loads_and_one_past_them_is_refused(tmp_path):
    ok = tmp_path / "ok.json"
    ok.write_text('{"input_ids": "' + "[" * (IO_MAP_MAX_BYTES - 100) + '"}')
    assert load_io_map(ok)["input_ids"].startswith("[[[")
    deep = tmp_path / "deep.json"
    deep.write_text('{"kv": ' + "[" * IO_MAP_MAX_DEPTH + "]" * IO_MAP_MAX_DEPTH + "}")
    with pytest.raises(UsageError, match="nests 17 levels deep"):
        load_io_map(deep)
    big = tmp_path / "big.json"
    big.write_text(" " * (IO_MAP_MAX_BYTES + 1))
    with pytest.raises(UsageError, match="more than 1,048,576"):
        load_io_map(big)


def test_a_fifo_with_a_writer_waiting_is_refused_too(tmp_path):
    """With a writer present the open would succeed anyway; the file type refuses it."""
    fifo = tmp_path / "io.json"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # holds the FIFO open for writing
    try:
        os.write(writer, b"{}")
        with pytest.raises(UsageError, match="not a regular file"):
            load_io_map(fifo)
    finally:
        os.close(writer)
