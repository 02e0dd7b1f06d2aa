"""``onnx-prep digest MODEL [--write] [-o OUT] [--json]``: compute, check and record the
digests of a model's external weights (per-tensor SHA-256 and XXH3, the data file's SHA-1
``checksum``). One core call (``core/model/weight_digests.digest_model``), its record
rendered as rich tables or JSON (docs/digest.md).

Exit codes: 0 digests computed (and written with --write); 2 unusable input, including
bytes that do not match a digest the model records (one line naming tensor, file,
offset and both digests; nothing is written)."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import typer

from onnx_prep.cli import output
from onnx_prep.cli.errors import run_guarded
from onnx_prep.cli.model_argument import TRUST_SYMLINKS, model_path
from onnx_prep.core.errors import EXIT_OK


@contextmanager
def _progress(label: str, total: int) -> Iterator[Callable[[int], None]]:
    """A bar on stderr that advances by the bytes hashed."""
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                               TransferSpeedColumn)

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeElapsedColumn(), console=output.stderr, transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def digest(
    model: Path = typer.Argument(..., help="Model .onnx file (or a folder holding one)."),
    write: bool = typer.Option(False, "--write", help="Write the model with its missing digests (atomically; "
                                                      "the data files are never written)."),
    out: Optional[Path] = typer.Option(None, "-o", "--output", help="Write to this file instead of replacing "
                                                                    "MODEL; it must be in MODEL's folder. "
                                                                    "Implies --write."),
    json_out: bool = typer.Option(False, "--json", help="Print the record as JSON (docs/digest.md)."),
    trust_symlinks: bool = TRUST_SYMLINKS,
) -> None:
    """Compute every external weight's SHA-256 and XXH3 and each data file's SHA-1, check those the model records, and with --write record the missing ones."""

    def go() -> int:
        from onnx_prep.core.model.weight_digests import digest_model

        show = not json_out and output.stderr.is_terminal
        doc = digest_model(model_path(model), write=write, out=out, trust_symlinks=trust_symlinks,
                           progress=_progress if show else None)
        if json_out:
            output.emit_json(doc)
        else:
            _render(doc)
        return EXIT_OK

    raise typer.Exit(run_guarded(go))


def _render(doc: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    tot, hashing, written = doc["totals"], doc["hashing"], doc["write"]
    tensors = Table(title=f"digest {escape(doc['model']['path'])}", title_justify="left")
    for col in ("tensor", "file", "offset", "bytes", "sha256", "status"):
        tensors.add_column(col, justify="right" if col in ("offset", "bytes") else "left", overflow="fold")
    for t in doc["tensors"]:
        tensors.add_row(escape(t["name"]), escape(t["file"]), f"{t['offset']:,}", f"{t['length']:,}",
                        t["sha256"][len("sha256:"):][:16] + "…", t["status"])
    if doc["tensors"]:
        output.stdout.print(tensors)
    files = Table(title="data files", title_justify="left")
    for col in ("file", "bytes", "sha1 (checksum)", "status", "entries without it"):
        files.add_column(col, overflow="fold")
    for f in doc["files"]:
        files.add_row(escape(f["file"]), f"{f['bytes']:,}", f["sha1"], f["status"],
                      f"{f['entries_missing']} of {f['entries']}")
    if doc["files"]:
        output.stdout.print(files)
    seconds = hashing["seconds"]
    rate = f", {hashing['bytes'] / seconds / 1e6:,.0f} MB/s" if seconds > 0 and hashing["bytes"] else ""
    say = lambda text: output.stdout.print(text, markup=False, highlight=False)  # noqa: E731
    say(f"tensors: {tot['verified']} verified, {tot['missing']} missing, {tot['added']} added "
        f"({tot['inline']} inline and {tot['unused']} unused initializers have none); "
        f"files: {tot['files_verified']} verified, {tot['files_missing']} missing, {tot['files_added']} added")
    say(f"hashed {hashing['bytes']:,} bytes in {seconds:.3f} s{rate}")
    if written is None:
        if tot["missing"] or tot["files_missing"]:
            say("nothing written: --write records the missing digests")
    elif written["written"]:
        say(f"wrote {written['path']}: {written['tensor_digests_added']} tensor digests and "
            f"{written['checksums_added']} checksums added")
    else:
        say(f"nothing written: every digest is recorded in {written['path']} already")
