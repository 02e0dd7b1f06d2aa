"""``onnx-prep check [MODEL] [--prepared PATH] [--require-complete] [--verify-payloads]
[--json] [--junit FILE]``: the CI preflight. One core call (``core/cache/preflight.py``),
one record, rendered as one line per check and then the findings, each on one line, or
as JSON; ``--junit`` also writes it as JUnit XML for CI systems to show (docs/check.md).

Exit codes: 0 no finding is an error; 1 findings; 2 the input cannot be used at all (no
such file, not an ONNX protobuf, a bad option); 3 internal error.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import typer

from onnx_prep.cli import output
from onnx_prep.cli.errors import run_guarded
from onnx_prep.cli.model_argument import TRUST_SYMLINKS, model_path

JUNIT_SUITE = "onnx-prep check"


def check(
    model: Optional[Path] = typer.Argument(
        None, help="Model .onnx file (or a folder holding one). Default: the embedded tiny INT4 LLM."),
    prepared: Optional[Path] = typer.Option(
        None, "--prepared", help="The prepared cache's manifest to check (default: <model stem>.prepared.onnx "
                                 "beside the model, where one exists)."),
    require_complete: bool = typer.Option(
        False, "--require-complete", help="Every prepared object must have a usable cache entry."),
    verify_payloads: bool = typer.Option(
        False, "--verify-payloads", help="Read every payload (weights and cache entries) and check its digest."),
    json_out: bool = typer.Option(False, "--json", help="Print the record as JSON (docs/check.md)."),
    junit: Optional[Path] = typer.Option(
        None, "--junit", help="Also write the result as JUnit XML to FILE (one testcase per check)."),
    trust_symlinks: bool = TRUST_SYMLINKS,
) -> None:
    """Preflight a model for CI: every problem a load would meet, each named; exit 1 on findings."""

    def go() -> int:
        from onnx_prep.core.cache.preflight import preflight
        from onnx_prep.core.errors import OnnxPrepError

        try:
            doc = preflight(model_path(model), prepared=prepared, require_complete=require_complete,
                            verify_payloads=verify_payloads, trust_symlinks=trust_symlinks,
                            progress=_progress if output.stderr.is_terminal else None)
        except OnnxPrepError as exc:  # unusable input: the JUnit file says so too, never stale
            if junit is not None:
                write_junit(junit, junit_error_xml(exc.one_line()))
            raise
        if junit is not None:
            write_junit(junit, junit_xml(doc))
        if json_out:
            output.emit_json(doc)
        else:
            render(doc)
        return doc["exit_code"]

    raise typer.Exit(run_guarded(go))


@contextmanager
def _progress(label: str, total: int) -> Iterator[Callable[[int], None]]:
    """A bar on stderr counting the payload bytes verified (core's ``Progress``)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=output.stderr, transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda nbytes: bar.advance(task, nbytes)


# ------------------------------------------------------------------------- render

def finding_line(f: dict) -> str:
    """One finding on one line: severity, check, subject (and where in its file, or
    which node), message; control characters escaped."""
    from onnx_prep.core.errors import terminal_safe

    return terminal_safe(f"{f['severity']}: {f['check']}: {_subject(f)}: {f['message']}")


# Findings of one check alike (same severity, same message but for the names of their
# own subject) are one line past this many: an export without digests has one per
# weight, hundreds of lines that say one thing.
ALIKE_MAX = 3


def finding_lines(group: list[dict]) -> list[str]:
    """The lines of one check's findings: each on its own line, except where more than
    ``ALIKE_MAX`` are alike (``_alike_key``): those are one line at the first one's
    place, the first in full, then how many more and the next subjects (``--json`` and
    ``--junit`` list every one)."""
    from onnx_prep.core.errors import terminal_safe

    alike: dict[tuple[str, str], list[dict]] = {}
    for f in group:
        alike.setdefault(_alike_key(f), []).append(f)
    lines = []
    for f in group:
        same = alike[_alike_key(f)]
        if len(same) <= ALIKE_MAX:
            lines.append(finding_line(f))
        elif f is same[0]:
            rest = ", ".join(g["subject"] for g in same[1:ALIKE_MAX])
            lines.append(terminal_safe(f"{finding_line(f)}; and {len(same) - 1} more like it: {rest}, ... "
                                       "(each in --json)"))
    return lines


def _alike_key(f: dict) -> tuple[str, str]:
    """Severity and message with the finding's own names (its subject, its tensor, and
    the parts of a cache entry's key) masked."""
    import re

    names = {f["subject"], f["where"].get("tensor") or "", *re.split(r"[:+|]", f["subject"])}
    message = f["message"]
    for name in sorted((n for n in names if len(n) > 2), key=len, reverse=True):
        message = message.replace(name, "\0")
    return f["severity"], message


def _subject(f: dict) -> str:
    w = f["where"]
    place = [f"{key} {w[key]}" for key in ("node", "file", "offset") if key in w and w[key] != f["subject"]]
    return f"{f['subject']} ({', '.join(place)})" if place else f["subject"]


def render(doc: dict) -> None:
    """One line per check (✓ ok, ✗ findings, ! warnings only, - skipped), then the
    findings grouped by check, one line each; then the summary."""
    from onnx_prep.core.errors import terminal_safe

    out = output.stdout
    out.print(f"check {terminal_safe(doc['model'])}", markup=False, highlight=False)
    for c in doc["checks"]:
        if c["status"] == "ok":
            out.print(f"  [green]✓[/green] {c['id']}", highlight=False)
        elif c["status"] == "skipped":
            out.print(f"  [dim]- {c['id']}: skipped: {terminal_safe(c['reason'] or '')}[/dim]", highlight=False)
        elif any(f["check"] == c["id"] and f["severity"] == "error" for f in doc["findings"]):
            out.print(f"  [red]✗[/red] {c['id']}: {c['findings']} finding{'s' * (c['findings'] != 1)}",
                      highlight=False)
        else:  # warnings only: they do not fail it
            out.print(f"  [yellow]![/yellow] {c['id']}: {c['findings']} warning{'s' * (c['findings'] != 1)}",
                      highlight=False)
    for c in doc["checks"]:
        group = [f for f in doc["findings"] if f["check"] == c["id"]]
        if group:
            out.print(f"\n{c['id']}:", style="bold", markup=False, highlight=False)
            for line in finding_lines(group):
                out.print(line, markup=False, highlight=False)
    s = doc["summary"]
    verdict = "[red]findings[/red]" if doc["exit_code"] else "[green]clean[/green]"
    out.print(f"\n{verdict}: {s['errors']} error{'s' * (s['errors'] != 1)}, {s['warnings']} "
              f"warning{'s' * (s['warnings'] != 1)}; checks: {s['ok']} ok, {s['findings']} with findings, "
              f"{s['skipped']} skipped", highlight=False)


def junit_xml(doc: dict) -> bytes:
    """The record as JUnit XML: one testsuite, one testcase per check, a ``<failure>``
    per error finding (a warning is a line of ``<system-out>``), ``<skipped>`` for a
    check that did not run."""
    import xml.etree.ElementTree as ET

    from onnx_prep.core.errors import terminal_safe

    findings = doc["findings"]
    errors = [f for f in findings if f["severity"] == "error"]
    suite = ET.Element("testsuite", name=JUNIT_SUITE, tests=str(len(doc["checks"])),
                       failures=str(sum(any(f["check"] == c["id"] for f in errors) for c in doc["checks"])),
                       errors="0", skipped=str(doc["summary"]["skipped"]),
                       time=f"{sum(c['duration_ms'] for c in doc['checks']) / 1000:.3f}")
    ET.SubElement(ET.SubElement(suite, "properties"), "property", name="model", value=doc["model"])
    for c in doc["checks"]:
        case = ET.SubElement(suite, "testcase", classname=JUNIT_SUITE, name=c["id"],
                             time=f"{c['duration_ms'] / 1000:.3f}")
        if c["status"] == "skipped":
            ET.SubElement(case, "skipped", message=c["reason"] or "")
        warnings = []
        for f in findings:
            if f["check"] != c["id"]:
                continue
            line = terminal_safe(f"{f['subject']}: {f['message']}")
            if f["severity"] == "error":
                ET.SubElement(case, "failure", message=line, type=c["id"]).text = line
            else:
                warnings.append(f"warning: {line}")
        if warnings:
            ET.SubElement(case, "system-out").text = "\n".join(warnings)
    ET.indent(suite)
    return ET.tostring(suite, encoding="utf-8", xml_declaration=True) + b"\n"


def junit_error_xml(line: str) -> bytes:
    """The JUnit file of a check that could not run (exit 2): one testcase, ``input``,
    with an ``<error>`` holding the one-line error."""
    import xml.etree.ElementTree as ET

    suite = ET.Element("testsuite", name=JUNIT_SUITE, tests="1", failures="0", errors="1", skipped="0")
    case = ET.SubElement(suite, "testcase", classname=JUNIT_SUITE, name="input")
    ET.SubElement(case, "error", message=line, type="unusable input").text = line
    ET.indent(suite)
    return ET.tostring(suite, encoding="utf-8", xml_declaration=True) + b"\n"


def write_junit(path: Path, data: bytes) -> None:
    """The JUnit file, written atomically (a CI step never publishes half of one); a
    folder that cannot be written is a UsageError (exit 2) naming the path."""
    from onnx_prep.core.errors import UsageError, Where
    from onnx_prep.core.io.atomic_file import write_atomically

    try:
        write_atomically(path, data)
    except OSError as exc:
        raise UsageError(f"cannot write the JUnit file: {exc.strerror}", Where(file=str(path))) from None
