"""The batch sweep's record (``batch_sweep.record_batch_sweep``) for machines and for
people: one flat row per batch size, printed as JSON lines, CSV or Markdown, and drawn
as a picture (bytes paged per token and tokens/s against N; matplotlib, optional).
The rich table for terminals is the command's (cli/profile.py)."""
from __future__ import annotations

import csv
import io
import json

__all__ = ["COLUMNS", "flat_rows", "as_csv", "as_jsonl", "as_markdown", "plot"]

# (column, what it holds); the order is the printed order: counters first
COLUMNS = (
    ("batch", "rows decoded together, one fused forward per step"),
    ("bytes_paged_per_token", "prepared bytes paged in per emitted token (decode steps)"),
    ("page_ins_per_token", "prepared objects paged in per emitted token"),
    ("hit_rate", "of the objects the decode steps consumed, the fraction already resident"),
    ("byte_hit_rate", "the same, by bytes"),
    ("evictions", "objects evicted over the decode steps"),
    ("counters_identical", "the counters were identical in every repeat"),
    ("row_identity", "row 0 decoded the same tokens as batch 1, every step"),
    ("tokens_per_s_median", "emitted tokens per second over the decode steps (median of repeats)"),
    ("tokens_per_s_min", ""), ("tokens_per_s_max", ""),
    ("step_ms_median", "ms per decode step (median of repeats)"),
    ("step_ms_min", ""), ("step_ms_max", ""),
    ("peak_prepared_bytes", "prepared bytes resident at most"),
    ("ample_step_ms", "ms per step of the same batch with no budget (streaming only)"),
    ("read_ms", "ms to read one step's paged bytes alone (streaming only)"),
    ("pipelining", "step ms / max(ample step ms, read ms): 1.0 = reads fully hidden"),
    ("ort_tokens_per_s_median", "ONNX Runtime's tokens/s, no budget (with --compare ort)"),
    ("device_bytes_to_device_per_token", "--device cuda: bytes copied host to device per emitted token"),
    ("device_page_ins_per_token", "--device cuda: objects paged into device slots per emitted token"),
    ("device_byte_hit_rate", "--device cuda: of the bytes the decode steps read, the fraction resident"),
    ("device_captures", "--device cuda: segment graphs captured over the decode steps"),
    ("device_replays", "--device cuda: segment graphs replayed"),
    ("device_fallbacks", "--device cuda: segments run eagerly"),
    ("device_tokens_identical_to_cpu", "--device cuda: the device decoded the CPU's tokens"),
    ("device_tokens_per_s_median", "--device cuda: emitted tokens per second on the device"),
)


def flat_rows(record: dict) -> list[dict]:
    out = []
    for r in record["rows"]:
        ort = r.get("ort_tokens_per_s") or {}
        out.append({
            "batch": r["batch"], "bytes_paged_per_token": r["bytes_paged_per_token"],
            "page_ins_per_token": r["page_ins_per_token"], "hit_rate": r["hit_rate"],
            "byte_hit_rate": r["byte_hit_rate"], "evictions": r["evictions"],
            "counters_identical": r["counters_identical"], "row_identity": r["row_identity"]["identical"],
            "tokens_per_s_median": r["tokens_per_s"]["median"], "tokens_per_s_min": r["tokens_per_s"]["min"],
            "tokens_per_s_max": r["tokens_per_s"]["max"], "step_ms_median": r["step_ms"]["median"],
            "step_ms_min": r["step_ms"]["min"], "step_ms_max": r["step_ms"]["max"],
            "peak_prepared_bytes": r["peak_prepared_bytes"], "ample_step_ms": r["ample_step_ms"],
            "read_ms": r["read_ms"], "pipelining": r["pipelining"],
            "ort_tokens_per_s_median": ort.get("median"),
            **_device_columns(r.get("device")),
        })
    return out


def _device_columns(d: dict | None) -> dict:
    keys = ("bytes_to_device_per_token", "page_ins_per_token", "byte_hit_rate", "captures", "replays", "fallbacks",
            "tokens_identical_to_cpu")
    out = {f"device_{k}": None if d is None else d[k] for k in keys}
    out["device_tokens_per_s_median"] = None if d is None else d["tokens_per_s"]["median"]
    return out


def as_jsonl(record: dict) -> str:
    """One JSON object per batch size, each carrying the run's context."""
    ctx = {k: record[k] for k in ("model", "budget", "budget_bytes", "packed_bytes", "tokens", "cache_policy")}
    return "".join(json.dumps({**ctx, **row}) + "\n" for row in flat_rows(record))


def as_csv(record: dict) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=[c for c, _ in COLUMNS], lineterminator="\n")
    w.writeheader()
    for row in flat_rows(record):
        w.writerow({k: "" if v is None else v for k, v in row.items()})
    return buf.getvalue()


def _cell(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def as_markdown(record: dict) -> str:
    cols = ["batch", "bytes_paged_per_token", "page_ins_per_token", "hit_rate", "byte_hit_rate", "evictions",
            "counters_identical", "row_identity", "tokens_per_s_median", "step_ms_median", "peak_prepared_bytes",
            "pipelining", "ort_tokens_per_s_median"]
    budget = "none" if record["budget_bytes"] is None else f"{record['budget']} = {record['budget_bytes']:,} bytes"
    lines = [f"Batch sweep of `{record['model']}`: {record['tokens']} tokens, budget {budget} "
             f"(packed {record['packed_bytes']:,} bytes), {record['repeat']} repeats; {record['machine']}", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in flat_rows(record):
        lines.append("| " + " | ".join(_cell(row[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def plot(record: dict, path) -> None:
    """Bytes paged per token and tokens/s against the batch size, side by side (PNG or
    SVG by the file's suffix). Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = flat_rows(record)
    n = [r["batch"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(n, [r["bytes_paged_per_token"] / 2**20 for r in rows], "o-", label="measured")
    if rows and rows[0]["bytes_paged_per_token"]:
        first = rows[0]["bytes_paged_per_token"] * rows[0]["batch"]
        a.plot(n, [first / x / 2**20 for x in n], "--", color="gray", label="ideal 1/N")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(n, [str(x) for x in n])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    a.set_xlabel("batch size N")
    a.set_ylabel("MiB paged in per emitted token")
    a.set_title("weight streaming")
    a.legend()
    b.plot(n, [r["tokens_per_s_median"] for r in rows], "o-", label="onnx-prep, budget")
    if any(r["ample_step_ms"] for r in rows):
        b.plot(n, [x * 1e3 / r["ample_step_ms"] for x, r in zip(n, rows)], "s--", label="onnx-prep, no budget")
    if any(r["ort_tokens_per_s_median"] for r in rows):
        b.plot(n, [r["ort_tokens_per_s_median"] for r in rows], "^:", label="ONNX Runtime, no budget")
    b.set_yscale("log")
    b.set_xlabel("batch size N")
    b.set_ylabel("tokens / s")
    b.set_title("decode throughput")
    b.legend()
    budget = "no budget" if record["budget_bytes"] is None else \
        f"budget {record['budget_bytes'] / 2**20:,.1f} MiB of {record['packed_bytes'] / 2**20:,.1f} MiB packed"
    fig.suptitle(f"{record['model'].rsplit('/', 1)[-1]}: {budget}, {record['tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
