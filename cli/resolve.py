"""``onnx-prep resolve [MODEL] [--json] [--trust-symlinks] [--no-fuse]``: what a model will load,
before loading it. One core call (``resolution_report(resolve_model(...))``), one
record, rendered as rich tables or as JSON (docs/resolve.md).

Exit codes: 0 resolved and every node has a kernel; 2 the model is unusable (one line
on stderr), including when some op has no kernel: then the full summary / JSON is
still printed to stdout first and the stderr line names the ops and nodes.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from onnx_prep.cli import output
from onnx_prep.cli.errors import run_guarded
from onnx_prep.cli.model_argument import FUSE, TRUST_SYMLINKS, model_path
from onnx_prep.core.errors import EXIT_OK, UnsupportedOpError, Where


def resolve(
    model: Optional[Path] = typer.Argument(
        None, help="Model .onnx file (or a folder holding one). Default: the embedded tiny INT4 LLM."),
    json_out: bool = typer.Option(False, "--json", help="Print the resolution record as JSON (docs/resolve.md)."),
    trust_symlinks: bool = TRUST_SYMLINKS,
    fuse: bool = FUSE,
) -> None:
    """Resolve a model without reading its weights: kept nodes, kernels, prepared requirements, payload."""

    def go() -> int:
        from onnx_prep.core.model.resolution import resolve_model
        from onnx_prep.core.model.resolution_report import resolution_report

        doc = resolution_report(resolve_model(model_path(model), trust_symlinks=trust_symlinks, fuse=fuse))
        if json_out:
            output.emit_json(doc)
        else:
            render(doc)
        if doc["unsupported"]:
            raise _unsupported_error(doc)
        return EXIT_OK

    raise typer.Exit(run_guarded(go))


def _unsupported_error(doc: dict) -> UnsupportedOpError:
    items = [f"{u['domain'] or 'ai.onnx'}::{u['op_type']} (nodes {', '.join(u['nodes'][:3])}"
             f"{', ...' if len(u['nodes']) > 3 else ''})" for u in doc["unsupported"]]
    n = len(doc["unsupported"])
    return UnsupportedOpError(
        f"{n} op type{'s' if n > 1 else ''} with no kernel: {'; '.join(items)}",
        Where(model=doc["model"]["path"]),
        hint="the model cannot run here; the summary above lists what resolved")


# ------------------------------------------------------------------------- render

def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,} B" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def render(doc: dict) -> None:
    """The resolution record as rich tables on stdout."""
    from rich.table import Table

    nodes, inits, payload, digests = doc["nodes"], doc["initializers"], doc["payload"], doc["digests"]
    summary = Table(title=f"resolve {doc['model']['path']}", show_header=False, title_justify="left")
    summary.add_column("what", style="bold")
    summary.add_column("value")
    opsets = ", ".join(f"{d or 'ai.onnx'} {v}" for d, v in doc["model"]["opsets"].items())
    summary.add_row("opsets", opsets)
    summary.add_row("inputs / outputs", f"{len(doc['inputs'])} / {len(doc['outputs'])}")
    summary.add_row("nodes", f"{nodes['kept']} kept of {nodes['total']} ({nodes['pruned']} pruned, "
                             f"{nodes['fused_away']} fused away; {nodes['fused_int4_matmuls']} "
                             f"DequantizeLinear+MatMul fused to int4_matmul)")
    fusion = doc["fusion"]
    fused = ", ".join(f"{p['count']} {p['pattern']}" for p in fusion["patterns"]) or "none"
    summary.add_row("fusion", f"{fused}; {len(fusion['near_misses'])} near-misses" if fusion["enabled"] else "off")
    summary.add_row("initializers", f"{inits['active']} active of {inits['total']} ({inits['pruned']} pruned); "
                                    f"{inits['external']} external, {inits['inline']} inline "
                                    f"({_bytes(inits['inline_bytes'])})")
    files = ", ".join(f"{f['file']} ({f['entries']} tensors)" for f in payload["files"]) or "none"
    summary.add_row("payload", f"{_bytes(payload['bytes'])} in {payload['entries']} entries: {files}")
    trusted = digests["tensor_metadata"] + digests["file_checksum"]
    summary.add_row("digests", f"{trusted} trusted ({digests['tensor_metadata']} fine: per-tensor sha256/xxh3, "
                               f"{digests['file_checksum']} coarse: file sha1+range), {digests['none']} missing")
    summary.add_row("prepared requirements", f"{len(doc['requirements'])} distinct; "
                                             f"{len(doc['shared_sources'])} source weights feed more than one")
    for f in doc["folded_views"]:  # one line per fold
        through = " -> ".join(f"{t['op_type']} {t['node']!r}" for t in f["through"])
        summary.add_row("folded view", f"{f['node']} reads {f['source']} {f['source_dims']} as {f['dims']} "
                                       f"({through} folded: a view, no bytes read)")
    summary.add_row("resolve time", f"{doc['resolve_ms']:.1f} ms")
    output.stdout.print(summary)

    kernels = Table(title="kernels", title_justify="left")
    kernels.add_column("kernel")
    kernels.add_column("nodes", justify="right")
    kernels.add_column("layouts")
    for k in doc["kernels"]:
        kernels.add_row(k["kernel"] or "[red]none[/red]", str(k["nodes"]), "\n".join(k["layouts"]) or "-")
    output.stdout.print(kernels)

    by_layout: dict[str, list[dict]] = {}
    for r in doc["requirements"]:
        by_layout.setdefault(r["layout"], []).append(r)
    if by_layout:
        reqs = Table(title="prepared requirements", title_justify="left")
        reqs.add_column("layout")
        reqs.add_column("device")
        reqs.add_column("objects", justify="right")
        reqs.add_column("source bytes", justify="right")
        for layout, rs in by_layout.items():
            reqs.add_row(layout, ", ".join(sorted({r["device"] for r in rs})), str(len(rs)),
                         _bytes(sum(r["source_bytes"] for r in rs)))
        output.stdout.print(reqs)
    if doc["shared_sources"]:
        shared = Table(title="shared source weights (one read, several prepared objects)", title_justify="left")
        shared.add_column("weight")
        shared.add_column("prepared objects")
        for s in doc["shared_sources"]:
            shared.add_row(s["weight"], "\n".join(s["requirements"]))
        output.stdout.print(shared)
    if doc["fusion"]["near_misses"]:
        misses = Table(title="fusion near-misses (left unfused)", title_justify="left")
        misses.add_column("pattern")
        misses.add_column("node")
        misses.add_column("why")
        for m in doc["fusion"]["near_misses"]:
            misses.add_row(m["pattern"], m["node"], m["reason"])
        output.stdout.print(misses)
    if doc["unsupported"]:
        uns = Table(title="unsupported ops (no kernel)", title_justify="left", style="red")
        uns.add_column("op")
        uns.add_column("domain")
        uns.add_column("nodes")
        for u in doc["unsupported"]:
            uns.add_row(u["op_type"], u["domain"] or "ai.onnx", ", ".join(u["nodes"]))
        output.stdout.print(uns)
