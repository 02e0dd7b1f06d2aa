"""``onnx-prep fixture NAME OUT_DIR``: generate a deterministic synthetic INT4 LLM."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from onnx_prep.cli import output
from onnx_prep.cli.errors import run_guarded


def fixture(
    name: str = typer.Argument(..., help="Preset: tiny-llm, medium, large, tiny-gqa or medium-gqa; or a real "
                                         "export (builder-llama-acc4-b32, ...: docs/fixture.md, needs the "
                                         "'exports' extra)."),
    out_dir: Path = typer.Argument(..., help="Folder to write <name>.onnx and <name>.onnx.data into."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Decoder blocks (1 to 1,024)."),
    hidden: Optional[int] = typer.Option(
        None, "--hidden", help="Hidden size (1 to 65,536; a multiple of block size and heads)."),
    intermediate: Optional[int] = typer.Option(
        None, "--intermediate", help="MLP size (1 to 262,144; a multiple of block size)."),
    heads: Optional[int] = typer.Option(None, "--heads", help="Attention heads (1 to 1,024)."),
    vocab: Optional[int] = typer.Option(None, "--vocab", help="Vocabulary size (1 to 1,048,576)."),
    block_size: Optional[int] = typer.Option(
        None, "--block-size", help="INT4 block size (a power of two from 16 to 4,096)."),
    fp16_scales: bool = typer.Option(False, "--fp16-scales", help="Store fp16 scales (default fp32)."),
    zero_points: bool = typer.Option(False, "--zero-points", help="Store explicit uint4 zero points."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Weight seed (0 to 2^63-1; default 0)."),
    attention: Optional[str] = typer.Option(
        None, "--attention", help="standard (standard ops) or gqa (com.microsoft GroupQueryAttention)."),
    kv_heads: Optional[int] = typer.Option(
        None, "--kv-heads", help="KV heads of the gqa attention (0 to 1,024, dividing heads; 0: heads)."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Generate a deterministic synthetic INT4 decoder LLM (same parameters, same bytes)."""

    def go() -> int:
        from onnx_prep.core.option_ranges import FIXTURE_RANGES, check_range
        from onnx_prep.fixtures import FixtureConfig, generate_fixture

        overrides = {k: v for k, v in dict(layers=layers, hidden=hidden, intermediate=intermediate, heads=heads,
                                           vocab=vocab, block_size=block_size, seed=seed, kv_heads=kv_heads).items()
                     if v is not None}
        if name.startswith(REAL_EXPORT_PREFIXES):
            return _real_export(name, out_dir, bool(overrides or attention or fp16_scales or zero_points), json_out)
        for key, value in overrides.items():
            option = "--" + key.replace("_", "-")
            check_range(option, value, *FIXTURE_RANGES[option])
        if attention is not None:
            overrides["attention"] = attention  # FixtureConfig.validate names the choices
        if fp16_scales:
            overrides["fp16_scales"] = True
        if zero_points:
            overrides["zero_points"] = True
        cfg = FixtureConfig.preset(name)
        if overrides:
            cfg = cfg.replace(**overrides)
        result = generate_fixture(cfg, out_dir)
        if json_out:
            output.emit_json(result.to_json())
        else:
            _render(result.to_json())
        return 0

    raise typer.Exit(run_guarded(go))


REAL_EXPORT_PREFIXES = ("builder-", "quantizer-")  # fixtures/real_exports.py EXPORTS


def _real_export(name: str, out_dir: Path, shaped: bool, json_out: bool) -> int:
    from onnx_prep.core.errors import UsageError
    from onnx_prep.fixtures.real_exports import write_export

    if shaped:
        raise UsageError("shape and encoding options apply to the synthetic presets, not to a real export")
    doc = write_export(name, out_dir)
    if json_out:
        output.emit_json(doc)
    else:
        beside = [f for f in doc["files"] if f != "model.onnx"]
        output.stdout.print(f"{doc['name']} ({doc['tool']}): {doc['model']}, with {', '.join(beside)}")
    return 0


def _render(doc: dict) -> None:
    from rich.table import Table

    table = Table(title=f"fixture {doc['name']}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    cfg = doc["config"]
    table.add_row("model", doc["model"])
    table.add_row("data", doc["data"])
    table.add_row("shape", f"{cfg['layers']} blocks, hidden {cfg['hidden']}, intermediate {cfg['intermediate']}, "
                           f"{cfg['heads']} heads, vocab {cfg['vocab']}")
    if cfg.get("attention", "standard") != "standard":  # absent: the standard attention (FixtureConfig.to_json)
        table.add_row("attention", f"{cfg['attention']}, {cfg.get('kv_heads') or cfg['heads']} kv heads")
    table.add_row("int4", f"block {cfg['block_size']}, {'fp16' if cfg['fp16_scales'] else 'fp32'} scales, "
                          f"{'explicit' if cfg['zero_points'] else 'implicit (8)'} zero points, seed {cfg['seed']}")
    table.add_row("tensors", str(doc["tensors"]))
    table.add_row("data file", f"{doc['data_bytes']:,} bytes (int4 {doc['int4_bytes']:,}, sha1 {doc['data_sha1']})")
    table.add_row("model file", f"{doc['model_bytes']:,} bytes")
    table.add_row("time", f"{doc['seconds']:.2f} s")
    output.stdout.print(table)
