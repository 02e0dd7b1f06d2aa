"""``onnx-prep plan-dump [MODEL] [--prepared PATH] [--cache-policy P]
[--format table|json|dot] [--scope session|invocation] [--filter TEXT] [--json]
[--device cpu|cuda] [--budget SIZE] [--granularity SIZE]``: the task plan a session of
the model executes, before running it (with the prepared cache ``run`` would use); with
``--device cuda``, the plan for that device, built without querying one. One core call (``core/plan/plan_report.plan_dump``), one
record, rendered as a summary and a table, as JSON (``core/schemas/plan.schema.json``)
or as Graphviz (docs/plan-dump.md).

Exit codes: 0 the plan was built; 2 the model is unusable (one line on stderr),
including a model with an op that has no kernel (it has no plan)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from onnx_prep.cli import output
from onnx_prep.cli.errors import run_guarded
from onnx_prep.cli.model_argument import FUSE, TRUST_SYMLINKS, model_path
from onnx_prep.core.errors import EXIT_OK, UsageError

FORMATS = ("table", "json", "dot")
SCOPES = ("session", "invocation")


def plan_dump(
    model: Optional[Path] = typer.Argument(
        None, help="Model .onnx file (or a folder holding one). Default: the embedded tiny INT4 LLM."),
    prepared: Optional[Path] = typer.Option(
        None, "--prepared", metavar="PATH",
        help="The prepared cache's manifest (default: <model stem>.prepared.onnx beside the model, if there).",
        show_default=False),
    cache_policy: str = typer.Option(
        "read-only", "--cache-policy",
        help="The prepared cache, as run uses it (docs/cache-format.md): disabled (plan without it), read-only, "
             "build-if-missing (the same plan), require-complete (fail unless every object is cached)."),
    fmt: str = typer.Option("table", "--format", help="table (default), json (the full plan) or dot (Graphviz)."),
    json_out: bool = typer.Option(False, "--json", help="The same as --format json."),
    scope: Optional[str] = typer.Option(None, "--scope", help="List only session or invocation tasks."),
    text: Optional[str] = typer.Option(None, "--filter", metavar="TEXT",
                                       help="List only tasks whose id or label contains TEXT."),
    trust_symlinks: bool = TRUST_SYMLINKS,
    fuse: bool = FUSE,
    device: str = typer.Option(
        "cpu", "--device", metavar="DEVICE",
        help="Plan for: cpu, or cuda (uploads to device slots; planned from metadata: no device is queried)."),
    budget: Optional[str] = typer.Option(
        None, "--budget", metavar="SIZE",
        help="--device cuda: device bytes the slots may commit (512MiB, 1.5GB; default: no limit)."),
    granularity: Optional[str] = typer.Option(
        None, "--granularity", metavar="SIZE",
        help="--device cuda: the slot allocation granularity to size with (default: 2MiB, assumed; "
             "`onnx-prep devices` reports a device's own)."),
) -> None:
    """Show the task plan: summary, then each task's scope, kind, resource, dependencies, result and bytes."""

    def go() -> int:
        if fmt not in FORMATS:
            raise UsageError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        if json_out and fmt not in ("table", "json"):
            raise UsageError(f"--json and --format {fmt} disagree", hint="give one of them")
        if scope is not None and scope not in SCOPES:
            raise UsageError(f"--scope must be one of {', '.join(SCOPES)}, got {scope!r}")
        from onnx_prep.core.cache.prepared_cache import POLICIES, PreparedCache

        if cache_policy not in POLICIES:
            raise UsageError(f"--cache-policy must be one of {', '.join(POLICIES)}, got {cache_policy!r}")
        if prepared is not None and not prepared.is_file():
            raise UsageError(f"--prepared {prepared}: no prepared cache there",
                             hint="build one with `onnx-prep build-cache`, or drop --prepared")
        from onnx_prep.core.plan.plan_report import plan_dot
        from onnx_prep.core.plan.plan_report import plan_dump as build

        def open_cache(resolved):  # the cache `run` would use with the same options
            if cache_policy == "disabled":
                return None
            return PreparedCache(resolved, prepared, policy=cache_policy, warn=output.warn,
                                 trust_symlinks=trust_symlinks)

        doc = build(model_path(model), open_cache=open_cache, trust_symlinks=trust_symlinks, scope=scope,
                    text=text, fuse=fuse, device=device, budget=_size_option("--budget", budget),
                    granularity=_size_option("--granularity", granularity))
        if json_out or fmt == "json":
            output.emit_json(doc)
        elif fmt == "dot":
            output.stdout.file.write(plan_dot(doc))
            output.stdout.file.flush()
        else:
            render(doc)
        return EXIT_OK

    raise typer.Exit(run_guarded(go))


def _size_option(name: str, text: str | None) -> int | None:
    if text is None:
        return None
    from onnx_prep.core.runtime.memory_size import parse_size

    try:
        return parse_size(text)
    except UsageError as exc:  # its message names --memory-budget
        raise UsageError(exc.message.replace("--memory-budget", name)) from None


# ------------------------------------------------------------------------- render

# How the table names a device plan's recipes (core/plan/device_recipes.py).
RECIPE_NAMES = {"read_packed_payload_upload": "cache → upload", "read_source_upload_prepack": "upload → pack on device",
                "read_source_prepack_upload": "pack on cpu → upload", "read_source_upload": "raw → upload"}

def _size(n: int) -> str:
    return f"{n:,} B" if n < 1 << 20 else f"{n:,} B ({n / (1 << 20):.1f} MiB)"


def _row(table, what: str, value: str) -> None:
    from rich.text import Text

    table.add_row(what, Text(value))  # names from the model are printed as they are, never as markup


def _result(t: dict) -> str:
    """The key a task publishes; "its key" when the task's id already ends with it
    (``S.prepack:<key>``, ``S.read_packed:<key>``), so the table stays readable."""
    key = t["publishes"]
    if key is None:
        return "-"
    return "its key" if t["id"].endswith(":" + key) else key


def _counts(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items())


def render(doc: dict) -> None:
    """The summary, then the task table, on stdout."""
    from rich.table import Table
    from rich.text import Text

    s = doc["summary"]
    summary = Table(title=Text(f"plan-dump {doc['model']}"), show_header=False, title_justify="left")
    summary.add_column("what", style="bold")
    summary.add_column("value")
    if "device" in s:
        _device_rows(summary, s["device"])
    _row(summary, "tasks", str(s["tasks"]))
    for key in ("scope", "kind", "resource"):
        _row(summary, f"  by {key}", _counts(s[f"by_{key}"]))
    _row(summary, "prepared objects", f"{s['requirements']}, {_size(s['prepared_bytes'])}")
    rc = s["recipes"]
    if "device" in s:
        _row(summary, "  by recipe", ", ".join(f"{RECIPE_NAMES[k]} {n}" for k, n in rc.items()))
    else:
        _row(summary, "  by recipe", f"read packed {rc['read_packed_payload']}, read and prepacked "
                                     f"{rc['read_source_and_prepack']}, raw reads {rc['read_source']}")
    _row(summary, "invocation steps", str(s["invocation_steps"]))
    _row(summary, "bytes to read", f"source {_size(s['bytes_to_read']['source'])}")
    _row(summary, "", f"packed {_size(s['bytes_to_read']['packed'])}")
    cp = s["critical_path"]
    _row(summary, "critical path", f"{len(cp['tasks'])} tasks, {_size(cp['bytes'])}")
    _row(summary, "", f"{cp['read_bytes']:,} B read, {cp['prepack_bytes']:,} B prepacked"
                      + (f", {cp['upload_bytes']:,} B uploaded" if "upload_bytes" in cp else ""))
    _row(summary, "", f"est. {cp['estimated_ms']:.2f} ms with unlimited workers")
    for r, v in s["serial_by_resource"].items():
        _row(summary, f"{r} queue, one worker", f"{v['tasks']} tasks, {v['bytes']:,} B, est. {v['serial_ms']:.2f} ms")
    cm = doc["cost_model"]
    _row(summary, "cost model", f"reads {cm['io_bytes_per_s'] / 1e9:g} GB/s; prepacks "
                                f"{cm['prepack_bytes_per_s'] / 1e9:g} GB/s of source")
    _row(summary, "", f"execute {cm['execute']}")
    if "upload_bytes_per_s" in cm:
        _row(summary, "", f"uploads {cm['upload_bytes_per_s'] / 1e9:g} GB/s; device prepacks {cm['device_prepack']}")
    for f in s["fan_out"]:
        _row(summary, "fan-out", f"{f['task']} feeds {len(f['consumers'])} prepacks")
    _row(summary, "look-ahead", f"{s['lookahead']['steps']} steps, {_size(s['lookahead']['bytes'])}")
    flt = s["filter"]
    if flt["filtered_out"]:
        by = " and ".join(x for x in (f"--scope {flt['scope']}" if flt["scope"] else "",
                                      f"--filter {flt['text']!r}" if flt["text"] else "") if x)
        _row(summary, "shown", f"{flt['shown']} of {s['tasks']} tasks")
        _row(summary, "", f"{flt['filtered_out']} filtered out by {by}")
    _row(summary, "plan build", f"{s['build_ms']:.1f} ms")
    output.stdout.print(summary)

    from rich import box

    table = Table(title="tasks (* on the critical path; → the key a task publishes, where its id does not say)",
                  title_justify="left", box=box.SIMPLE_HEAD, expand=True)
    rows = []
    device = "device" in s
    for t in doc["tasks"]:
        task = t["id"] if _result(t) in ("-", "its key") else f"{t['id']}\n→ {t['publishes']}"
        rows.append((f"{t['index']}{'*' if t['critical'] else ''}", task, t["scope"], t["kind"], t["resource"],
                     " ".join(f"#{i}" for i in t["dependency_indices"]) or "-",
                     f"{t['estimated_bytes']:,}" if t["estimated_bytes"] else "-")
                    + (("\n".join(RECIPE_NAMES[r] for r in t["recipes"]) or "-",) if device else ()))
    # the short columns keep their width; the ids and dependencies fold
    columns = (("#", True), ("task", False), ("scope", True), ("kind", True), ("resource", True),
               ("depends on", False), ("est. bytes", True)) + ((("recipe", True),) if device else ())
    for i, (name, short) in enumerate(columns):
        width = max([len(name)] + [len(line) for r in rows for line in r[i].split("\n")]) if short else None
        table.add_column(name, justify="right" if name in ("#", "est. bytes") else "left", overflow="fold",
                         no_wrap=short, min_width=width, ratio=None if short else {"task": 3}.get(name, 1))
    for r in rows:
        table.add_row(*(Text(c) for c in r))
    output.stdout.print(table)


def _device_rows(summary, d: dict) -> None:
    """A device plan's rows: what was assumed (no device was queried), its slots, its
    uploads and its budget."""
    _row(summary, "device", f"{d['name']}: planned from metadata, no device queried")
    source = ("given (--granularity)" if d["granularity_source"] == "given"
              else "assumed (`onnx-prep devices` reports a device's; --granularity)")
    _row(summary, "", f"slot granularity {_size(d['granularity'])}, {source}")
    _row(summary, "device slots", f"{d['slots']}, {_size(d['committed_bytes'])} committed (granules; raw weights share)")
    _row(summary, "", f"for {_size(d['packed_bytes'])} packed")
    step = d["largest_step"]
    if step is not None:
        _row(summary, "", f"largest step: {step['step']} {step['label']}, {_size(step['committed_bytes'])}")
    _row(summary, "host to device", f"{_size(d['host_to_device_bytes'])} a load")
    if d["budget"] is None:
        _row(summary, "budget", "none")
    elif d["fits"]:
        _row(summary, "budget", f"{_size(d['budget'])}: every slot fits at once")
    else:
        _row(summary, "budget", f"{_size(d['budget'])}: the slots do not fit at once")
        _row(summary, "", f"a pass pages in at least {_size(d['min_page_in_bytes_per_pass'])}")
