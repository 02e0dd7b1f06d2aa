"""Draw a load trace (``onnx-prep profile --trace FILE.json``) as a picture: one row per
track (scheduler worker, per resource), each task a bar coloured by its kind, the first
forward's steps on their own row, the first output and all-ready as vertical lines, and
the arenas' bytes over time below. The picture in the README comes from this script;
Perfetto (https://ui.perfetto.dev) shows the same file interactively.

    .venv/bin/python scripts/plot_trace.py TRACE.json OUT.png [--title TEXT]

Needs matplotlib (the ``plot`` extra).
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

KIND_COLOURS = {
    "read_source": "#4c78a8", "read_packed": "#72b7b2", "prepack": "#f58518",
    "read_raw": "#54a24b", "execute": "#e45756", "persist": "#b279a2",
}
OTHER = "#9d9d9d"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    doc = json.load(open(args.trace))
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    names = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "process_name"}
    rows: dict[tuple, list] = defaultdict(list)
    for e in events:
        if e["ph"] == "X" and e.get("cat") != "load":
            rows[(e["pid"], e["tid"])].append(e)
    marks = {e["name"]: e["ts"] / 1e3 for e in events if e["ph"] == "i"}
    counters: dict[str, list] = defaultdict(list)
    for e in events:
        if e["ph"] == "C":
            counters[e["name"]].append((e["ts"] / 1e3, next(iter(e["args"].values())) / 2**20))

    keys = sorted(rows, key=lambda k: (k[0] != 2, k))  # run steps first, then io, cpu, ...
    fig, (ax, axm) = plt.subplots(2, 1, figsize=(12, 1.2 + 0.45 * len(keys) + 2.2), sharex=True,
                                  gridspec_kw={"height_ratios": [max(2, len(keys)), 2.2]})
    used = set()
    for y, k in enumerate(keys):
        for e in rows[k]:
            kind = e.get("args", {}).get("kind", "")
            colour = KIND_COLOURS.get(kind, OTHER)
            used.add(kind if kind in KIND_COLOURS else "other")
            ax.broken_barh([(e["ts"] / 1e3, max(e["dur"] / 1e3, 0.05))], (y - 0.4, 0.8),
                           facecolors=colour, edgecolors="none")
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels([f"{names.get(p, p)} worker {t}" if p != 2 else f"first forward (worker {t})"
                        for p, t in keys], fontsize=8)
    ax.invert_yaxis()
    for i, (name, t) in enumerate(sorted(marks.items(), key=lambda m: m[1])):
        for a in (ax, axm):
            a.axvline(t, color="black", lw=0.8, ls="--")
        ax.text(t, -0.55 - 0.45 * (i % 2), f" {name} {t:.0f} ms", fontsize=7, va="bottom")
    ax.legend(handles=[Patch(color=KIND_COLOURS.get(k, OTHER), label=k) for k in sorted(used)],
              loc="lower right", fontsize=7, ncol=len(used))
    ax.set_title(args.title or args.trace, fontsize=10)
    for name, pts in sorted(counters.items()):
        if any(v for _, v in pts):
            xs, ys = zip(*pts)
            axm.step(xs, ys, where="post", label=name, lw=1)
    axm.set_ylabel("MiB")
    axm.set_xlabel("ms since session construction")
    axm.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
