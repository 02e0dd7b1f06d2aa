"""``onnx-prep build-cache [MODEL]``: build or update the model's companion prepared
cache. One core call (``core/cache/cache_build.build_prepared_cache``), its record
rendered as a summary or as JSON (docs/build-cache.md).

Exit codes: 0 built (or already up to date); 2 unusable input, including a cache folder
that cannot be written (read-only, full) and a malformed cache (``--rebuild`` replaces it)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from onnx_prep.cli import output
from onnx_prep.cli.errors import run_guarded
from onnx_prep.cli.model_argument import TRUST_SYMLINKS, model_path
from onnx_prep.core.errors import EXIT_OK


def build_cache(
    model: Optional[Path] = typer.Argument(
        None, help="Model .onnx file (or a folder holding one). Default: the embedded tiny INT4 LLM."),
    out: Optional[Path] = typer.Option(None, "-o", "--output", help="The cache's manifest path "
                                       "(default: <model stem>.prepared.onnx beside the model)."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="Folder for the cache (instead of the "
                                             "model's folder)."),
    compress: Optional[str] = typer.Option(None, "--compress", help="Store payloads compressed: zstd."),
    device: str = typer.Option("cpu", "--device", help="Device the packed objects are for: cpu."),
    rebuild: bool = typer.Option(False, "--rebuild", help="Build every object again, replacing the cache "
                                 "(also one that is malformed)."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Read every entry kept and check it "
                                "against its payload digest first; a damaged one is rebuilt (default: on)."),
    write_digests: bool = typer.Option(False, "--write-digests", help="First give the model's weights their "
                                       "missing digests (as onnx-prep digest --write): a load uses no entry "
                                       "built from a weight without one."),
    memory_budget: Optional[str] = typer.Option(None, "--memory-budget", metavar="SIZE",
                                                help="The packed bytes held at once, e.g. 2GiB (default: 1 GiB, or "
                                                "the largest object, within 80% of the memory available); the "
                                                "objects are built in groups that fit, each persisted and released "
                                                "before the next."),
    json_out: bool = typer.Option(False, "--json", help="Print the build record as JSON (docs/build-cache.md)."),
    trust_symlinks: bool = TRUST_SYMLINKS,
) -> None:
    """Build or update the prepared cache: packed weights persisted beside the model, so later loads skip repacking."""

    def go() -> int:
        from onnx_prep.core.cache.cache_build import build_prepared_cache
        from onnx_prep.core.runtime.memory_size import parse_size

        budget = None if memory_budget is None else parse_size(memory_budget)
        show = not json_out and output.stderr.is_terminal
        with _progress(show) as progress:
            doc = build_prepared_cache(model_path(model), output=out, cache_dir=cache_dir, compress=compress,
                                       device=device, rebuild=rebuild, verify=verify,
                                       write_digests=write_digests, trust_symlinks=trust_symlinks,
                                       warn=output.warn, progress=progress, memory_budget=budget)
        if json_out:
            output.emit_json(doc)
        else:
            _render(doc)
        return EXIT_OK

    raise typer.Exit(run_guarded(go))


class _progress:
    """A bar on stderr over the bytes persisted (only on a terminal)."""

    def __init__(self, show: bool) -> None:
        self.show, self.bar, self.task = show, None, None

    def __enter__(self):
        if not self.show:
            return None
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("packing"), BarColumn(), DownloadColumn(), TimeElapsedColumn(),
                            console=output.stderr, transient=True)
        self.bar.__enter__()
        return self.update

    def update(self, done: int, total: int, done_bytes: int, total_bytes: int) -> None:
        if self.task is None:
            self.task = self.bar.add_task("packing", total=total_bytes)
        self.bar.update(self.task, completed=done_bytes)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _render(doc: dict) -> None:
    def say(text: str) -> None:
        output.stdout.print(text, markup=False, highlight=False)

    t = doc["timings"]
    if doc["written"] == 0 and doc["rebuilt"] == 0 and doc["reused"] == doc["objects"]:
        checked = f", {doc['verified']} checked" if doc["verified"] else ""
        say(f"{doc['cache']}: up to date, {doc['objects']} objects{checked}, generation {doc['generation']} "
            f"({_mib(doc['cache_bytes'])}); nothing written ({t['total_ms']:.0f} ms)")
        return
    say(f"{doc['cache']}: generation {doc['generation']}"
        f"{'' if doc['previous_generation'] is None else ' (was ' + str(doc['previous_generation']) + ')'}")
    say(f"  objects: {doc['written']} written ({doc['rebuilt']} of them rebuilt), {doc['reused']} reused, "
        f"of {doc['objects']}")
    enc = f", {doc['compress']}" if doc["compress"] else ""
    say(f"  bytes: {_mib(doc['bytes_written'])} written{enc}; cache {_mib(doc['cache_bytes'])} stored for "
        f"{_mib(doc['packed_bytes'])} packed; {_mib(doc['source_bytes_read'])} of source read")
    if doc["groups"] > 1:
        say(f"  memory: built in {doc['groups']} groups, each within the budget of {_mib(doc['memory_budget'])} "
            "of packed bytes")
    if doc["digests_added"]:
        say(f"  digests: {doc['digests_added']} weights given one (the model file rewritten; its data files not)")
    say(f"  time: {t['total_ms']:.0f} ms (resolve {t['resolve_ms']:.0f} ms, build {t['build_ms']:.0f} ms)")
