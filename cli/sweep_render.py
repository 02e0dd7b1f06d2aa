"""How ``onnx-prep profile --batch-sweep`` shows its record: a rich table for people
(like llama-bench's: counters first, then times), or one of the machine formats the
core prints (core/profile/sweep_report.py): json, jsonl, csv, md."""
from __future__ import annotations

from onnx_prep.cli import output

FORMATS = ("table", "json", "jsonl", "csv", "md")


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def _spread(s: dict, fmt: str = "{:,.1f}") -> str:
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"


def render(record: dict, fmt: str) -> None:
    import sys

    from onnx_prep.core.profile import sweep_report

    if fmt == "json":
        output.emit_json(record)
        return
    if fmt in ("jsonl", "csv", "md"):
        printer = {"jsonl": sweep_report.as_jsonl, "csv": sweep_report.as_csv, "md": sweep_report.as_markdown}[fmt]
        sys.stdout.write(printer(record))
        return
    from rich.table import Table

    budget = ("no budget" if record["budget_bytes"] is None else
              f"budget {record['budget']} = {_mib(record['budget_bytes'])} MiB of {_mib(record['packed_bytes'])} MiB packed"
              + (" (streaming)" if record["streaming"] else " (fits)"))
    output.stdout.print(f"batch sweep · {record['model']}\n{budget} · {record['tokens']} tokens · "
                        f"{record['repeat']} repeats · cache {record['cache_policy']}", markup=False, highlight=False)
    counters = Table(title="weight streaming (decode steps; deterministic)", title_justify="left")
    for name in ("N", "MiB paged/token", "page-ins/token", "hit rate", "byte hit", "evictions",
                 "same in repeats", "row 0 = N1", "peak MiB"):
        counters.add_column(name, justify="right")
    streaming, ort = record["streaming"], record["ort"] is not None
    times = Table(title="time (median, min–max over repeats)", title_justify="left")
    for name in ("N", "tokens/s", "ms/step") + (("no-budget ms", "read ms", "pipelining") if streaming else ()) \
            + (("ORT tokens/s (no budget)",) if ort else ()):
        times.add_column(name, justify="right")
    for r in record["rows"]:
        ident = r["row_identity"]
        counters.add_row(str(r["batch"]), _mib(r["bytes_paged_per_token"]), f"{r['page_ins_per_token']:.2f}",
                         f"{r['hit_rate']:.3f}", f"{r['byte_hit_rate']:.3f}", str(r["evictions"]),
                         "yes" if r["counters_identical"] else "[red]no[/red]",
                         "yes" if ident["identical"] else f"[red]step {ident['first_divergence_step']}[/red]",
                         _mib(r["peak_prepared_bytes"]))
        cells = [str(r["batch"]), _spread(r["tokens_per_s"]), _spread(r["step_ms"], "{:,.2f}")]
        if streaming:
            cells += [f"{r['ample_step_ms']:,.2f}", f"{r['read_ms']:,.2f}", f"{r['pipelining']:.2f}×"]
        if ort:
            o = r["ort_tokens_per_s"]
            cells.append("–" if o is None else o.get("error", "") or _spread(o))
        times.add_row(*cells)
    output.stdout.print(counters)
    output.stdout.print(times)
    if record["device"] is not None:
        _render_device(record, Table)
    output.stdout.print(f"[dim]{record['machine']}[/dim]")


def _render_device(record: dict, Table) -> None:
    dv = record["device"]
    budget = "all resident" if dv["budget_bytes"] is None else f"budget {_mib(dv['budget_bytes'])} MiB"
    table = Table(title=f"on {dv['name']} ({budget} of {_mib(dv['committed_bytes'])} MiB committed in "
                        f"{_mib(dv['granularity'])} MiB granules; {dv['segments_per_step']} segment(s) a step; "
                        f"{dv['capture_reason']})", title_justify="left")
    for name in ("N", "MiB to device/token", "page-ins/token", "byte hit", "evictions", "graphs: captured",
                 "replayed", "eager", "same in repeats", "tokens = CPU", "tokens/s"):
        table.add_column(name, justify="right")
    for r in record["rows"]:
        d = r["device"]
        table.add_row(str(r["batch"]), _mib(d["bytes_to_device_per_token"]), f"{d['page_ins_per_token']:.2f}",
                      f"{d['byte_hit_rate']:.3f}", str(d["evictions"]), str(d["captures"]), str(d["replays"]),
                      str(d["fallbacks"]), "yes" if d["counters_identical"] else "[red]no[/red]",
                      "yes" if d["tokens_identical_to_cpu"] else "[red]no[/red]", _spread(d["tokens_per_s"]))
    output.stdout.print(table)
