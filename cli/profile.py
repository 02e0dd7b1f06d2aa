"""``onnx-prep profile [MODEL]``: the load, measured per configuration (mode x cache
policy), each repeat in a fresh process. One core call
(``core/profile/load_profile.profile_load``), its record rendered as a table (rows:
figures; columns: configurations; cells: min / median / max) or as JSON (schema
``onnx-prep.profile-load/2``, docs/profile.md).

``--batch-sweep 1,2,4,8``: the decode instead, across batch sizes under ``--budget``. One
core call (``core/profile/batch_sweep.record_batch_sweep``), rendered by
``cli/sweep_render.py`` (a table, or json / jsonl / csv / md), ``--plot`` drawn by core.

Exit codes: 0 measured; 2 unusable input (a bad option, a model that cannot load)."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import typer

from onnx_prep.cli import output
from onnx_prep.cli.errors import run_guarded
from onnx_prep.cli.model_argument import DEVICE, FUSE, INPUTS, SHAPE, TRUST_SYMLINKS, model_path
from onnx_prep.core.errors import EXIT_OK


def profile(
    model: Optional[Path] = typer.Argument(
        None, help="Model .onnx file (or a folder holding one). Default: the embedded tiny INT4 LLM."),
    mode: str = typer.Option("parallel", "--mode", metavar="MODE",
                             help="Scheduler: parallel (I/O and CPU workers), sequential (the same tasks one at a "
                                  "time), or both (and their ratio)."),
    cache_policy: str = typer.Option("read-only", "--cache-policy", metavar="POLICY[,...]",
                                     help="The prepared cache (docs/cache-format.md): disabled, read-only, "
                                          "build-if-missing (a first build, from an empty cache each repeat), "
                                          "require-complete; several, comma-separated, are compared side by side."),
    repeat: int = typer.Option(5, "--repeat", help="Loads per configuration, each in a fresh process (1 to 1,000)."),
    cold: bool = typer.Option(False, "--cold", help="Drop the model's (and the cache's) pages from the page cache "
                              "before each load; the output says whether the drop took."),
    trace: Optional[Path] = typer.Option(None, "--trace", metavar="FILE",
                                         help="Write a Chrome trace (Perfetto, chrome://tracing) of one more load "
                                              "and its first output."),
    compare: Optional[str] = typer.Option(None, "--compare", help="Also measure this runtime on the same feeds, "
                                          "in fresh processes: ort."),
    prepared: Optional[Path] = typer.Option(None, "--prepared", metavar="PATH",
                                            help="The prepared cache's manifest (default: <model stem>.prepared.onnx "
                                                 "beside the model)."),
    verify_digests: bool = typer.Option(True, "--verify-digests/--no-verify-digests",
                                        help="Check each tensor's declared digest while reading it."),
    json_out: bool = typer.Option(False, "--json", help="Print the record as JSON (docs/profile.md)."),
    trust_symlinks: bool = TRUST_SYMLINKS,
    batch_sweep: Optional[str] = typer.Option(
        None, "--batch-sweep", metavar="N,N,...",
        help="Measure the decode instead: one fused forward per step over N rows, for each N (e.g. 1,2,4,8), "
             "prepared weights held to --budget (docs/profile.md, Batch sweep)."),
    budget: Optional[str] = typer.Option(None, "--budget", metavar="SIZE",
                                         help="Batch sweep: prepared bytes allowed resident: 512MiB, 1.5GB, or a "
                                              "share of the packed size like 50% (default: no limit)."),
    tokens: int = typer.Option(16, "--tokens", help="Batch sweep: decode steps per run, the prefill included "
                                                     "(2 to 1,048,576)."),
    prompt_ids: str = typer.Option("1,2,3,4", "--prompt-ids", metavar="IDS",
                                   help="Batch sweep: row 0's prompt (the other rows shift each id by the row)."),
    fmt: str = typer.Option("table", "--format", metavar="FORMAT",
                            help="Batch sweep output: table, json, jsonl, csv or md."),
    plot: Optional[Path] = typer.Option(None, "--plot", metavar="FILE.png|svg",
                                        help="Batch sweep: draw bytes paged per token and tokens/s against N "
                                             "(needs matplotlib: pip install 'onnx-prep[plot]')."),
    inputs: Optional[List[str]] = INPUTS,
    shape: Optional[List[str]] = SHAPE,
    fuse: bool = FUSE,
    device: str = DEVICE,
) -> None:
    """Measure the load: plan, bytes read, prepack, time to first step and output, memory peaks, overlap.

    With --batch-sweep: decode throughput and weight streaming across batch sizes under --budget."""

    if batch_sweep is not None:
        raise typer.Exit(run_guarded(lambda: _sweep(
            model, batch_sweep, budget=budget, tokens=tokens, prompt_ids=prompt_ids, fmt=fmt, plot=plot,
            repeat=repeat, cache_policy=cache_policy, prepared=prepared, compare=compare, json_out=json_out,
            trust_symlinks=trust_symlinks, device=device,
            load_options_given=(mode != "parallel" or cold or trace is not None),
            forward_options_given=bool(inputs or shape), fuse=fuse)))

    def go() -> int:
        from onnx_prep.core.profile.load_profile import LoadProfileOptions, parse_modes, profile_load

        options = LoadProfileOptions(modes=parse_modes(mode), cache_policies=tuple(cache_policy.split(",")),
                                     repeat=repeat, cold=cold, trace=trace, compare=compare, prepared=prepared,
                                     verify_digests=verify_digests, trust_symlinks=trust_symlinks,
                                     inputs=tuple(inputs or ()), shape=tuple(shape or ()), fuse=fuse, device=device)
        path = model_path(model)
        with _progress(output.stderr.is_terminal) as progress:
            doc = profile_load(path, options, progress=progress, warn=output.warn)
        output.emit_record(doc, json_out, _render)
        return EXIT_OK

    raise typer.Exit(run_guarded(go))


@contextmanager
def _progress(show: bool) -> Iterator[Callable | None]:
    """A bar on stderr over the loads (only on a terminal: a redirected stderr would just
    collect frames); core calls it as ``progress(done, total, label)``."""
    if not show:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=output.stderr, transient=True) as bar:
        task = bar.add_task("loads", total=None)
        yield lambda done, total, label: bar.update(task, completed=done, total=total,
                                                    description=f"loads ({label})")


def _sweep(model, sizes: str, *, budget, tokens, prompt_ids, fmt, plot, repeat, cache_policy, prepared, compare,
           json_out, trust_symlinks, device, load_options_given, forward_options_given, fuse) -> int:
    from onnx_prep.cli.sweep_render import FORMATS, render
    from onnx_prep.core.errors import UsageError
    from onnx_prep.core.profile.batch_sweep import SweepOptions, record_batch_sweep

    if load_options_given:
        raise UsageError("--mode, --cold and --trace measure the load; --batch-sweep measures the decode",
                         hint="run them as two profile commands")
    if forward_options_given:
        raise UsageError("--inputs and --shape feed one forward of the load; --batch-sweep decodes",
                         hint="drop them, or profile the load without --batch-sweep")
    fmt = "json" if json_out else fmt
    if fmt not in FORMATS:
        raise UsageError(f"--format must be one of {list(FORMATS)}, got {fmt!r}")
    if compare not in (None, "ort"):
        raise UsageError(f"--compare supports only 'ort', got {compare!r}")
    if plot is not None and plot.suffix.lower() not in (".png", ".svg"):
        raise UsageError(f"--plot {plot}: the file name ends in .png or .svg")

    def ints(text: str, what: str) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
        except ValueError:
            raise UsageError(f"{what} takes comma-separated integers, got {text!r}") from None

    options = SweepOptions(batches=ints(sizes, "--batch-sweep"), tokens=tokens, budget=budget, repeat=repeat,
                           cache_policy=cache_policy, prepared=prepared, prompt=ints(prompt_ids, "--prompt-ids"),
                           compare_ort=compare == "ort", trust_symlinks=trust_symlinks, fuse=fuse, device=device)
    with _progress(output.stderr.is_terminal) as progress:
        doc = record_batch_sweep(model_path(model), options,
                                 progress=None if progress is None else (lambda label, d, t: progress(d, t, label)),
                                 warn=output.warn)
    render(doc, fmt)
    if plot is not None:
        from onnx_prep.core.profile import sweep_report

        try:
            sweep_report.plot(doc, plot)
        except ImportError:
            output.warn("the plot needs matplotlib: pip install 'onnx-prep[plot]'; no plot drawn")
        else:
            output.stderr.print(f"plot: {plot}", markup=False, highlight=False)
    return EXIT_OK


def _cell(st: dict | None, unit: str) -> str:
    if st is None:
        return "-"

    def one(v: float) -> str:
        if unit == "bytes":
            return f"{v / 2**20:,.2f}"
        if unit == "count":
            return f"{v:,.0f}"
        if unit == "fraction":
            return f"{v:.2f}"
        return f"{v:,.1f}"

    lo, med, hi = (one(st[k]) for k in ("min", "median", "max"))
    return med if lo == med == hi else f"{lo} / {med} / {hi}"


_UNIT_LABEL = {"ms": "ms", "bytes": "MiB", "count": "", "fraction": "of 1"}


def _render(doc: dict) -> None:
    from rich.table import Table

    from onnx_prep.core.profile.load_profile import FIGURES, ORT_FIGURES
    from onnx_prep.core.profile.machine_activity import describe

    def say(text: str) -> None:
        output.stdout.print(text, markup=False, highlight=False)

    fed = (f"prompt {len(doc['prompt_ids'])} tokens" if doc["prompt_ids"] is not None else
           f"one forward ({doc['kind']['reason']}) on " + ", ".join(
               f"{i['name']} {i['dtype']} {i['shape']} {i['source']}" for i in doc["inputs"]))
    say(f"model {doc['model']}  {fed}  {doc['repeat']} fresh process(es) per "
        f"configuration  page cache {'dropped before each load' if doc['cold'] else 'as found'}")
    say(doc["machine"])
    table = Table(title="load (min / median / max; one value where they agree)", title_justify="left")
    table.add_column("figure", no_wrap=True)
    table.add_column("unit", no_wrap=True)
    for c in doc["configurations"]:
        table.add_column(c["name"], justify="right", no_wrap=True)
    for key, unit in FIGURES:
        table.add_row(key, _UNIT_LABEL[unit], *(_cell(c["summary"][key], unit) for c in doc["configurations"]))
    # a file or a pipe: every column unwrapped (rich assumes 80); for this table only (the
    # console is shared: the demo runs other commands after this one, in this process)
    width = None if output.stdout.is_terminal else max(output.stdout.width, 40 + 30 * len(doc["configurations"]))
    output.stdout.print(table, width=width)
    for c in doc["configurations"]:
        if c["cache"] is not None and not c["cache"]["exists"]:
            say(f"{c['name']}: no prepared cache at {c['cache']['path']}, so it loads as without one "
                "(build it: onnx-prep build-cache)")
    for r in doc["ratios"]:
        say(f"sequential / parallel, {r['cache_policy']}: {r['figure']} {r['sequential_over_parallel']:.2f}x "
            "(medians)")
    for c in doc["configurations"]:
        pc = c["page_cache"]
        if pc["cold"] and pc["all_dropped"] is not True:
            say(f"{c['name']}: page-cache drop requested; "
                + ("not measurable here" if pc["all_dropped"] is None else
                   f"did NOT take: up to {pc['max_resident_after'] / 2**20:,.1f} MiB stayed resident"))
    cmp = doc["compare"]
    if cmp is not None:
        t = Table(title=f"ONNX Runtime, same feeds, {cmp['decode_tokens']} decode tokens (min / median / max)",
                  title_justify="left")
        t.add_column("figure", no_wrap=True)
        t.add_column("unit", no_wrap=True)
        t.add_column("ort", justify="right", no_wrap=True)
        for key, unit in ORT_FIGURES:
            t.add_row(key, _UNIT_LABEL[unit], _cell(cmp["summary"][key], unit))
        output.stdout.print(t)
        for name, ratio in cmp["open_to_first_output_over_ort"].items():
            say(f"{name}: open to first output {ratio:.2f}x ONNX Runtime's (medians)")
    if doc["trace"] is not None:
        say(f"trace of one {doc['trace']['configuration']} load: {doc['trace']['path']} "
            "(open in https://ui.perfetto.dev or chrome://tracing)")
    say(describe(doc["machine_activity"]))
