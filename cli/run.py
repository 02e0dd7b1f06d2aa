"""``onnx-prep run [MODEL]``: greedy decoding with the prepared runtime (or ONNX
Runtime), optionally compared with ONNX Runtime. Output schema: docs/run.md."""
from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import numpy as np
import typer

from onnx_prep.cli import output
from onnx_prep.cli.app import app
from onnx_prep.cli.errors import run_guarded
from onnx_prep.core.errors import EXIT_FINDINGS, EXIT_OK, UsageError
from onnx_prep.core.io.external_data import SOURCE_PAGES

DEFAULT_PROMPT = "1,2,3,4"
PROGRESS_MIN_TOKENS = 8  # shorter runs finish before a bar is worth drawing
RUNTIMES = ("prepared", "ort")
SCHEMA = "onnx-prep.run/4"


def _open_runtime_runner(path: Path, *, threads: int | None, source_pages: str):
    """The prepared runtime as a ``Runner`` (core/decode/generation.py) with ``close()``.

    NOTE: the one place the CLI obtains our runtime. ``--threads`` maps to the
    session's CPU workers (the pool that runs kernels); I/O workers keep their default.
    """
    try:
        from onnx_prep.core.runtime.session import Session
    except ModuleNotFoundError as exc:
        if exc.name != "onnx_prep.core.runtime.session":
            raise
        raise UsageError("the prepared runtime (onnx_prep.core.runtime.session) is not in this build",
                         hint="decode with --runtime ort") from exc
    kw = {} if threads is None else {"cpu_workers": threads}
    return Session.open(path, source_pages=source_pages, **kw)


def _open_runner(kind: str, path: Path, threads: int | None, source_pages: str):
    if kind == "ort":
        from onnx_prep.core.decode.ort_runner import OrtRunner

        return OrtRunner(path, threads=threads)
    return _open_runtime_runner(path, threads=threads, source_pages=source_pages)


def parse_prompts(prompt_ids: list[str] | None, batch: int | None) -> np.ndarray:
    """Rows [batch, prompt_len]: one ``--prompt-ids`` repeated ``batch`` times, or one
    row per repeated ``--prompt-ids`` (then ``--batch``, if given, must match)."""
    texts = prompt_ids or [DEFAULT_PROMPT]
    rows = []
    for text in texts:
        try:
            row = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
        except ValueError:
            row = None
        if not row or any(t < 0 for t in row):
            raise UsageError(f"--prompt-ids must be comma-separated non-negative integers, got {text!r}")
        rows.append(row)
    if len({len(r) for r in rows}) > 1:
        raise UsageError(f"all --prompt-ids rows must have the same length, got {[len(r) for r in rows]}",
                         hint="padding is not supported: give prompts of equal length")
    if batch is not None and batch < 1:
        raise UsageError(f"--batch must be at least 1, got {batch}")
    if len(rows) > 1 and batch is not None and batch != len(rows):
        raise UsageError(f"--batch {batch} disagrees with the {len(rows)} --prompt-ids rows given",
                         hint="omit --batch, or give --prompt-ids once to repeat it")
    if len(rows) == 1:
        rows = rows * (batch or 1)
    return np.array(rows, dtype=np.int64)


@contextmanager
def _progress(label: str, total: int, enabled: bool) -> Iterator[Callable | None]:
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=output.stderr, transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda event: bar.advance(task)


def _decode(kind: str, path: Path, io, prompt: np.ndarray, tokens: int, threads: int | None,
            show_progress: bool, source_pages: str) -> tuple[float, object, str | None]:
    """Open the runner, decode, close it: (open ms, the GenerationResult, the source
    pages choice of our runtime, None for ONNX Runtime)."""
    from onnx_prep.core.decode.generation import greedy_decode

    with ExitStack() as stack:
        t0 = time.perf_counter()
        runner = _open_runner(kind, path, threads, source_pages)
        if hasattr(runner, "close"):
            stack.callback(runner.close)
        open_ms = (time.perf_counter() - t0) * 1e3
        on_step = stack.enter_context(_progress(f"{kind} decode", tokens, show_progress))
        result = greedy_decode(runner, io, prompt, tokens, on_step=on_step, model=str(path))
    return open_ms, result, getattr(runner, "source_pages", None)


@app.command()
def run(
    model: Optional[Path] = typer.Argument(None, help="ONNX decoder model (default: the embedded tiny model)."),
    prompt_ids: Optional[List[str]] = typer.Option(
        None, "--prompt-ids", help=f"Comma-separated prompt token ids (default {DEFAULT_PROMPT}); "
                                   "repeat for one row per prompt."),
    tokens: int = typer.Option(16, "--tokens", help="Tokens to generate per row."),
    batch: Optional[int] = typer.Option(None, "--batch", help="Rows: the one --prompt-ids repeated B times."),
    runtime: str = typer.Option("prepared", "--runtime", help="Decode with: prepared (ours) or ort."),
    compare: Optional[str] = typer.Option(None, "--compare", help="Also decode with this runtime and "
                                                                   "compare: ort."),
    io_map: Optional[Path] = typer.Option(None, "--io-map", help="JSON file naming the decoder I/O "
                                                                 "(format: docs/run.md)."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON (schema: docs/run.md)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Intra-op threads."),
    source_pages: str = typer.Option("auto", "--source-pages",
                                     help="Prepared runtime: drop each source tensor from the page cache once "
                                          "prepacked: keep, drop, or auto (drop when the payload is over a "
                                          "quarter of the available memory)."),
) -> None:
    """Greedy-decode --tokens tokens per row; print the generated ids and timings.

    Exit 0 on success (with --compare, also when the runtimes diverge only at a near tie), 1 when --compare finds a real divergence, 2 for unusable input."""

    def go() -> int:
        from onnx_prep.core.decode.decoder_io import DecoderIO, load_io_map
        from onnx_prep.core.decode.generation import compare_generations

        if runtime not in RUNTIMES:
            raise UsageError(f"--runtime must be one of {list(RUNTIMES)}, got {runtime!r}")
        if compare is not None and compare != "ort":
            raise UsageError(f"--compare supports only 'ort', got {compare!r}")
        if compare == runtime:
            raise UsageError("--compare ort with --runtime ort compares ONNX Runtime with itself")
        if tokens < 1:
            raise UsageError(f"--tokens must be at least 1, got {tokens}")
        if threads is not None and threads < 1:
            raise UsageError(f"--threads must be at least 1, got {threads}")
        if source_pages not in SOURCE_PAGES:
            raise UsageError(f"--source-pages must be one of {list(SOURCE_PAGES)}, got {source_pages!r}")
        prompt = parse_prompts(prompt_ids, batch)
        mapping = load_io_map(io_map) if io_map is not None else None
        if model is None:
            from onnx_prep.fixtures import default_model_path

            path = Path(default_model_path())
        else:
            path = model
        io = DecoderIO.from_model(path, mapping)
        # Only on a terminal: a redirected stderr would just collect blank frames.
        show = tokens >= PROGRESS_MIN_TOKENS and output.stderr.is_terminal
        open_ms, result, pages = _decode(runtime, path, io, prompt, tokens, threads, show, source_pages)
        doc = {"schema": SCHEMA, "model": str(path), "runtime": runtime,
               "prompt_ids": prompt.tolist(), "batch": int(prompt.shape[0]), "tokens_requested": tokens,
               "io": io.to_json(), "tokens": result.tokens.tolist(),
               "timings": {"open_ms": open_ms, **result.timings_json()},
               "counters": result.counters_json(), "source_pages": pages, "compare": None}
        code = EXIT_OK
        if compare is not None:
            ref_open_ms, ref, _ = _decode(compare, path, io, prompt, tokens, threads, show, source_pages)
            cmp = compare_generations(result, ref)
            doc["compare"] = {"runtime": compare, "tokens": ref.tokens.tolist(), **cmp.to_json(),
                              "timings": {"open_ms": ref_open_ms, **ref.timings_json()}}
            code = EXIT_OK if cmp.agrees else EXIT_FINDINGS
        if json_out:
            output.emit_json(doc)
        else:
            _render(doc)
        return code

    raise typer.Exit(run_guarded(go))


def _fmt_rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.1f}"


def _render(doc: dict) -> None:
    def say(text: str) -> None:  # plain text: token ids and figures are not markup
        output.stdout.print(text, markup=False, highlight=False)

    t = doc["timings"]
    say(f"model {doc['model']}  runtime {doc['runtime']}  batch {doc['batch']}  "
        f"prompt {len(doc['prompt_ids'][0])} tokens  kv {doc['io']['kv_layout']} "
        f"x{len(doc['io']['kv'])} layers ({doc['io']['source']})")
    for i, row in enumerate(doc["tokens"]):
        say(f"row {i}: {' '.join(map(str, row))}")
    say(f"open {t['open_ms']:.1f} ms · time to first output {t['first_output_ms']:.1f} ms · "
        f"decode {_fmt_rate(t['decode_tokens_per_s'])} tokens/s "
        f"({_fmt_rate(t['decode_steps_per_s'])} steps/s x {doc['batch']} rows)")
    cmp = doc["compare"]
    if cmp is None:
        return
    if cmp["identical"]:
        verdict = "identical"
    else:
        kind = "near tie" if cmp["near_tie"] else "DIVERGED"
        verdict = (f"{kind} at step {cmp['first_divergence_step']} row {cmp['first_divergence_row']} "
                   f"({cmp['runtime']} top-2 margin {cmp['reference_margin']:.3g})")
        for i, row in enumerate(cmp["tokens"]):
            say(f"{cmp['runtime']} row {i}: {' '.join(map(str, row))}")
    say(f"{cmp['runtime']}: tokens {verdict}; first-step max |logit diff| "
        f"{cmp['first_step_max_abs_logit_diff']:.3g} (logit range {cmp['first_step_logit_range']:.3g}); "
        f"{cmp['runtime']} time to first output {cmp['timings']['first_output_ms']:.1f} ms")
