"""``onnx-prep devices [--json]``: what onnx-prep can run on. The CPU's kernel ISA, and
whether CUDA is usable: if not, the one-line reason (cuda-python not installed, the
driver library missing, ``cuInit``'s error code and name, no device); if so, each
device's name, compute capability, memory, VMM support and allocation granularity. One
core call (``core/cuda/device_probe.devices_record``), rendered as text or JSON (schema
``onnx-prep.devices/2``, docs/cuda.md).

Exit codes: 0 when the devices were probed, CUDA usable or not (no CUDA is an answer,
not a failure: ``run --device cuda`` is where it is an error, exit 2)."""
from __future__ import annotations

import typer

from onnx_prep.cli import output
from onnx_prep.cli.errors import run_guarded
from onnx_prep.core.errors import EXIT_OK


def devices(
    json_out: bool = typer.Option(False, "--json", help="Print the record as JSON (docs/cuda.md)."),
) -> None:
    """Show what onnx-prep can run on: the CPU's kernel ISA, and whether CUDA is usable (and if not, why)."""

    def go() -> int:
        from onnx_prep.core.cuda.device_probe import devices_record

        output.emit_record(devices_record(), json_out, _render)
        return EXIT_OK

    raise typer.Exit(run_guarded(go))


def _render(doc: dict) -> None:
    say = lambda text: output.stdout.print(text, markup=False, highlight=False)  # noqa: E731 - names are not markup
    cpu = doc["cpu"]
    tiles = " with AMX tiles" if cpu["amx_tiles"] else ""
    say(f"cpu: kernels {cpu['isa']}{tiles}, {cpu['logical_cpus']} logical CPUs")
    say(f"cuda: {doc['summary'].removeprefix('CUDA ')}")
