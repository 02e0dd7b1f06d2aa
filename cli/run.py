"""``onnx-prep run [MODEL]``: greedy decoding with the prepared runtime (or ONNX
Runtime), optionally compared with ONNX Runtime; for a model that is not a decoder, or
with ``--inputs`` / ``--shape``, one forward of its graph. One core call
(``core/decode/run_record.record_run``), its record (a decode's or a forward's) rendered
as text or JSON (schemas: docs/run.md).

Exit codes: 0 success (with ``--compare``, also when the runtimes diverge only at a
near tie); 1 ``--compare`` found a real divergence (or ``--per-node`` a value beyond
tolerance); 2 unusable input."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import typer

from onnx_prep.cli import output
from onnx_prep.cli.errors import run_guarded
from onnx_prep.cli.model_argument import DEVICE, FUSE, INPUTS, SHAPE, TRUST_SYMLINKS, model_path
from onnx_prep.core.errors import EXIT_FINDINGS, EXIT_OK, UsageError

DEFAULT_PROMPT = "1,2,3,4"
PROGRESS_MIN_TOKENS = 8  # shorter runs finish before a bar is worth drawing


def parse_prompts(prompt_ids: list[str] | None, batch: int | None) -> tuple[tuple[int, ...], ...]:
    """Rows [batch][prompt_len]: one ``--prompt-ids`` repeated ``batch`` times, or one
    row per repeated ``--prompt-ids`` (then ``--batch``, if given, must match; equal
    lengths are ``RunOptions``' check). Ranges are checked before the rows are repeated."""
    from onnx_prep.core.option_ranges import MAX_BATCH, MAX_TOKEN_ID, check_range

    texts = prompt_ids or [DEFAULT_PROMPT]
    rows = []
    for text in texts:
        try:
            row = tuple(int(t) for t in text.replace(" ", "").split(",") if t != "")
        except ValueError:
            row = None
        if not row or any(t < 0 for t in row):
            raise UsageError(f"--prompt-ids must be comma-separated non-negative integers, got {text!r}")
        for t in row:
            check_range("--prompt-ids", t, 0, MAX_TOKEN_ID)
        rows.append(row)
    check_range("--batch", len(rows) if batch is None else batch, 1, MAX_BATCH)
    if len(rows) > 1 and batch is not None and batch != len(rows):
        raise UsageError(f"--batch {batch} disagrees with the {len(rows)} --prompt-ids rows given",
                         hint="omit --batch, or give --prompt-ids once to repeat it")
    if len(rows) == 1:
        rows = rows * (batch or 1)
    return tuple(rows)


@contextmanager
def _progress(label: str, total: int) -> Iterator[Callable]:
    """A bar on stderr that advances once per decode step (core's ``Progress``)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=output.stderr, transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda event: bar.advance(task)


def run(
    model: Optional[Path] = typer.Argument(None, help="ONNX decoder model (default: the embedded tiny model)."),
    prompt_ids: Optional[List[str]] = typer.Option(
        None, "--prompt-ids", help=f"Comma-separated prompt token ids (default {DEFAULT_PROMPT}); "
                                   "repeat for one row per prompt."),
    tokens: Optional[int] = typer.Option(None, "--tokens", show_default="16",
                                         help="Tokens to generate per row (1 to 1,048,576)."),
    batch: Optional[int] = typer.Option(None, "--batch", help="Rows: the one --prompt-ids repeated B times "
                                                              "(1 to 65,536)."),
    runtime: str = typer.Option("prepared", "--runtime", help="Decode with: prepared (ours) or ort."),
    compare: Optional[str] = typer.Option(None, "--compare", help="Also decode with this runtime and "
                                                                   "compare: ort."),
    per_node: bool = typer.Option(False, "--per-node",
                                  help="With --compare ort: compare the first step (or the one forward) value by "
                                       "value and name the first node whose output differs beyond tolerance."),
    io_map: Optional[Path] = typer.Option(None, "--io-map", help="JSON file naming the decoder I/O "
                                                                 "(format: docs/run.md)."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON (schema: docs/run.md)."),
    trust_symlinks: bool = TRUST_SYMLINKS,
    fuse: bool = FUSE,
    threads: Optional[int] = typer.Option(None, "--threads", help="Intra-op threads (1 to 256)."),
    memory_budget: Optional[str] = typer.Option(
        None, "--memory-budget", metavar="SIZE",
        help="Memory the run may take (KV cache, outputs), e.g. 8GiB; a run that does not fit is refused "
             "before it starts (default: 80% of the memory available)."),
    source_pages: str = typer.Option("auto", "--source-pages",
                                     help="Prepared runtime: drop each source tensor from the page cache once "
                                          "prepacked: keep, drop, or auto (drop when the payload is over a "
                                          "quarter of the available memory)."),
    verify_digests: bool = typer.Option(True, "--verify-digests/--no-verify-digests",
                                        help="Prepared runtime: check each tensor's declared digest while "
                                             "reading it (a mismatch is an error, exit 2)."),
    cache_policy: str = typer.Option("read-only", "--cache-policy",
                                     help="Prepared runtime: the prepared cache (docs/cache-format.md): disabled, "
                                          "read-only (use what is cached), build-if-missing (also persist what "
                                          "this run builds), require-complete (fail unless every object is cached)."),
    prepared: Optional[Path] = typer.Option(None, "--prepared", metavar="PATH",
                                            help="The prepared cache's manifest (default: <model stem>.prepared.onnx "
                                                 "beside the model)."),
    logits_out: Optional[Path] = typer.Option(None, "--logits-out", metavar="FILE.npz",
                                              help="Decoding: write every step's logits (steps x batch x vocab) and "
                                                   "the tokens to this .npz."),
    inputs: Optional[List[str]] = INPUTS,
    shape: Optional[List[str]] = SHAPE,
    outputs_out: Optional[Path] = typer.Option(None, "--outputs-out", metavar="FILE.npz",
                                               help="One forward: write every output to this .npz."),
    device: str = DEVICE,
    device_budget: Optional[str] = typer.Option(
        None, "--device-budget", metavar="SIZE",
        help="With --device cuda: device memory the packed weights may commit (e.g. 256MiB); above it they "
             "are streamed, evicted and paged back every step (default: all resident)."),
) -> None:
    """Greedy-decode --tokens tokens per row; print the generated ids and timings. A model that is not a decoder, or --inputs / --shape: run one forward of its graph and summarise each output.

    Exit 0 on success (with --compare, also when the runtimes diverge only at a near tie), 1 when --compare finds a real divergence, 2 for unusable input."""

    def go() -> int:
        from onnx_prep.core.decode.run_record import RunOptions, record_run
        from onnx_prep.core.runtime.memory_size import parse_size

        budget = None if memory_budget is None else parse_size(memory_budget)
        dev_budget = None if device_budget is None else parse_size(device_budget, option="--device-budget")
        given = {"--prompt-ids": prompt_ids, "--batch": batch, "--tokens": tokens}
        options = RunOptions(prompt_ids=parse_prompts(prompt_ids, batch), tokens=16 if tokens is None else tokens,
                             runtime=runtime, compare=compare, io_map=io_map, threads=threads,
                             source_pages=source_pages, memory_budget=budget, verify_digests=verify_digests,
                             trust_symlinks=trust_symlinks, cache_policy=cache_policy, prepared=prepared,
                             logits_out=logits_out, inputs=tuple(inputs or ()), shape=tuple(shape or ()),
                             outputs_out=outputs_out, fuse=fuse, per_node=per_node, device=device, device_budget=dev_budget,
                             decode_flags=tuple(flag for flag, value in given.items() if value is not None))
        # Only on a terminal: a redirected stderr would just collect blank frames.
        show = options.tokens >= PROGRESS_MIN_TOKENS and output.stderr.is_terminal
        doc = record_run(model_path(model), options, progress=_progress if show else None, warn=output.warn)
        if json_out:
            output.emit_json(doc)
        elif doc["schema"].startswith("onnx-prep.graph-run/"):  # one forward (core/decode/graph_run.py)
            _render_forward(doc)
        else:
            _render(doc)
        cmp = doc["compare"]
        found = cmp is not None and (not cmp["agrees"] or (cmp.get("per_node") or {}).get("first_divergence"))
        return EXIT_FINDINGS if found else EXIT_OK

    raise typer.Exit(run_guarded(go))


def _fmt_rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.1f}"


def _say(text: str) -> None:  # plain text: token ids, names and figures are not markup
    output.stdout.print(text, markup=False, highlight=False)


def _render(doc: dict) -> None:
    say = _say
    t = doc["timings"]
    say(f"model {doc['model']}  runtime {doc['runtime']}  batch {doc['batch']}  "
        f"prompt {len(doc['prompt_ids'][0])} tokens  kv {doc['io']['kv_layout']} "
        f"x{len(doc['io']['kv'])} layers ({doc['io']['source']})")
    for i, row in enumerate(doc["tokens"]):
        say(f"row {i}: {' '.join(map(str, row))}")
    say(f"open {t['open_ms']:.1f} ms · time to first output {t['first_output_ms']:.1f} ms · "
        f"decode {_fmt_rate(t['decode_tokens_per_s'])} tokens/s "
        f"({_fmt_rate(t['decode_steps_per_s'])} steps/s x {doc['batch']} rows)")
    dv = doc["device"]
    if dv is not None:
        budget = "all resident" if dv["budget"] is None else f"budget {dv['budget'] / 2**20:,.1f} MiB"
        say(f"device {dv['device']} ({budget}): {dv['segments_per_step']} segment(s) a step, "
            f"{dv['page_ins']} page-ins ({dv['page_in_bytes'] / 2**20:,.1f} MiB host to device), "
            f"{dv['evictions']} evictions, peak committed {dv['peak_committed_bytes'] / 2**20:,.1f} MiB; graphs: "
            f"{dv['captures']} captured, {dv['replays']} replayed, {dv['fallbacks']} eager "
            f"({dv['capture_reason']})")
    c = doc["cache"]
    if c is not None and c["exists"] or (c is not None and c["committed"]):
        e = c["entries"]
        line = (f"prepared cache: {e['hit']} of {sum(e.values())} objects read from it "
                f"({c['packed_bytes'] / 2**20:,.1f} MiB)")
        if c["committed"] and c["committed"]["written"]:
            line += f"; {c['committed']['written']} persisted (generation {c['committed']['generation']})"
        say(line)
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
    config = ", ".join(f"{k}={v}" for k, v in cmp["session_config"].items())
    default = cmp["ort_default"]
    say(f"{cmp['runtime']}: tokens {verdict}; first-step max |logit diff| "
        f"{cmp['first_step_max_abs_logit_diff']:.3g} (logit range {cmp['first_step_logit_range']:.3g})"
        + (f", like for like ({config})" if config else "")
        + (f"; {default['first_step_max_abs_logit_diff']:.3g} under ONNX Runtime's default config" if default else "")
        + f"; {cmp['runtime']} time to first output {cmp['timings']['first_output_ms']:.1f} ms")
    if cmp["per_node"] is not None:
        _render_per_node(cmp["per_node"], say)


def _fmt_stat(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def _render_forward(doc: dict) -> None:
    say = _say
    say(f"model {doc['model']}  runtime {doc['runtime']}  one forward ({doc['kind']['reason']})")
    for i in doc["inputs"]:
        say(f"input {i['name']!r} {i['dtype']} {i['shape']} {i['source']}")
    for o in doc["outputs"]:
        bad = f"  non-finite {o['non_finite']}" if o["non_finite"] else ""
        say(f"output {o['name']!r} {o['dtype']} {o['shape']}  min {_fmt_stat(o['min'])}  max {_fmt_stat(o['max'])}  "
            f"mean {_fmt_stat(o['mean'])}{bad}")
    t = doc["timings"]
    say(f"open {t['open_ms']:.1f} ms · forward {t['run_ms']:.1f} ms")
    if doc["outputs_file"]:
        say(f"outputs written to {doc['outputs_file']}")
    cmp = doc["compare"]
    if cmp is None:
        return
    for row in cmp["outputs"]:
        verdict = "ok" if row["ok"] else "DIVERGED"
        diff = row["mismatch"] or f"max |diff| {row['max_abs_diff']:.3g} (limit {row['limit']:.3g})"
        say(f"{cmp['runtime']}: output {row['name']!r} {verdict}: {diff}")
    say(f"{cmp['runtime']}: outputs {'agree' if cmp['agrees'] else 'DIVERGE'}; "
        f"{cmp['runtime']} forward {cmp['timings']['run_ms']:.1f} ms")
    if cmp["per_node"] is not None:
        _render_per_node(cmp["per_node"], say, what="the forward")


def _stats(s: dict) -> str:
    if s["min"] is None:
        return f"shape {s['shape']} {s['dtype']}, no finite value"
    extra = f", {s['nonfinite']} non-finite" if s["nonfinite"] else ""
    return (f"shape {s['shape']} {s['dtype']}, min {s['min']:.6g} max {s['max']:.6g} "
            f"mean {s['mean']:.6g}{extra}")


def _render_per_node(pn: dict, say: Callable[[str], None], what: str = "step 0") -> None:
    d = pn["first_divergence"]
    untyped = f"; {len(pn['untyped'])} without a known type not compared" if pn["untyped"] else ""
    if d is None:
        worst = pn["largest"]
        say(f"per node ({what}): all {pn['compared']} values within {pn['tolerance']:g} x their range "
            f"({pn['tolerance_basis']}){untyped}"
            + (f"; largest {worst['relative_diff']:.3g} at node {worst['node']!r} ({worst['op_type']})"
               if worst else ""))
        return
    say(f"per node ({what}): FIRST DIVERGENCE at node {d['node']!r} ({d['op_type']}, #{d['position']}), "
        f"value {d['value']!r}: {d['reason']}; {pn['divergent']} of {pn['compared']} values beyond "
        f"{pn['tolerance']:g} x their range{untyped}")
    say(f"  ours: {_stats(d['ours'])}")
    say(f"  ort:  {_stats(d['reference'])}")
    if d["max_abs_diff"] is not None:
        say(f"  max |diff| {d['max_abs_diff']:.6g} at {d['max_diff_index']} "
            f"({d['relative_diff']:.3g} of the range {d['scale']:.6g})")
