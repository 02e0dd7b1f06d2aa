"""The ``resolve`` command's record: ``resolution_report(resolved)``, the stable JSON of
a resolution (docs/resolve.md, pinned by ``schema_path()``), built from the frozen
``ResolvedModel`` without any I/O."""
from __future__ import annotations

from pathlib import Path

from onnx_prep.core.kernels import registry as kernels_registry
from onnx_prep.core.model.fusion import fusion_record
from onnx_prep.core.model.resolved_model import NodeKernel, ResolvedModel
from onnx_prep.core.model.weights import DigestSource

__all__ = ["RESOLVE_SCHEMA_VERSION", "resolution_report", "schema_path"]

RESOLVE_SCHEMA_VERSION = 1


def schema_path() -> Path:
    """The JSON Schema (draft 2020-12) of ``resolution_report``'s document."""
    return Path(__file__).parents[1] / "schemas" / "resolve.schema.json"


def resolution_report(resolved: ResolvedModel) -> dict:
    """The stable JSON record of a resolution (``onnx-prep resolve --json``), documented
    field by field in docs/resolve.md and pinned by ``schema_path()``. The rich summary
    renders this same record. No I/O."""
    from onnx_prep import __version__

    nodes = resolved.nodes
    stats = resolved.stats
    bypassed = {name for n in nodes for name in n.fused_from} - {n.name for n in nodes}
    manifest = list(resolved.manifest)
    files: dict[str, dict] = {}
    for d in manifest:
        f = files.setdefault(d.file, {"file": d.file, "entries": 0, "bytes": 0})
        f["entries"] += 1
        f["bytes"] += d.length
    by_source = {s.value: 0 for s in DigestSource}
    for d in manifest:
        by_source[d.digest_source.value] += 1

    kernel_nodes: dict[str | None, list[NodeKernel]] = {}
    for n in nodes:
        kernel_nodes.setdefault(n.kernel, []).append(n)
    kernels = []
    for k in (*kernels_registry.KERNELS, None):
        ns = kernel_nodes.get(k)
        if ns:
            layouts = sorted({r.layout for n in ns for r in n.requirements})
            kernels.append({"kernel": k, "nodes": len(ns), "layouts": layouts})

    consumers: dict[str, list[str]] = {}
    for n in nodes:
        for r in n.requirements:
            consumers.setdefault(r.key, []).append(n.name)
    weights = resolved.weights
    requirements = []
    for key, r in resolved.requests.items():
        doc = r.to_json()
        doc["source_bytes"] = sum(weights[s].length for s in r.source_lineage if s in weights)
        doc["consumers"] = consumers.get(key, [])
        requirements.append(doc)
    uses: dict[str, list[str]] = {}
    for key, r in resolved.requests.items():
        for s in r.source_lineage:
            uses.setdefault(s, []).append(key)

    return {
        "schema_version": RESOLVE_SCHEMA_VERSION,
        "tool": {"name": "onnx-prep", "version": __version__},
        "model": {
            "path": str(resolved.model_path),
            "dir": str(resolved.model_dir),
            "opsets": dict(resolved.opsets),
            "metadata": dict(resolved.metadata),
        },
        "inputs": [v.to_json() for v in resolved.inputs],
        "outputs": [v.to_json() for v in resolved.outputs],
        "nodes": {
            "total": stats.nodes_total,
            "kept": stats.nodes_kept,
            "pruned": stats.nodes_total - stats.nodes_kept - len(bypassed),
            "fused_away": len(bypassed),
            "fused_int4_matmuls": stats.fused_int4_matmuls,
        },
        "initializers": {
            "total": stats.initializers_total,
            "active": stats.initializers_active,
            "pruned": stats.initializers_total - stats.initializers_active,
            "external": len(manifest),
            "inline": len(resolved.inline_values),
            "inline_bytes": sum(weights[n].length for n in resolved.inline_values),
        },
        "payload": {
            "entries": len(manifest),
            "bytes": resolved.manifest.total_bytes,
            "files": list(files.values()),
        },
        "digests": {
            "tensor_metadata": by_source[DigestSource.TENSOR_METADATA.value],
            "file_checksum": by_source[DigestSource.FILE_CHECKSUM.value],
            "none": by_source[DigestSource.NONE.value],
            "missing": [d.name for d in manifest if not d.trusted],
        },
        "kernels": kernels,
        "requirements": requirements,
        "shared_sources": [{"weight": s, "requirements": keys} for s, keys in uses.items() if len(keys) > 1],
        "folded_views": [f.to_json() for f in resolved.folded_views],
        "unsupported": [{"op_type": u.op_type, "domain": u.domain, "nodes": list(u.nodes)}
                        for u in resolved.unsupported],
        "fusion": fusion_record(resolved.fusion_enabled, resolved.fusions, resolved.near_misses),
        "weights": [d.to_json() for d in weights.values()],
        "node_kernels": [n.to_json() for n in nodes],
        "resolve_ms": round(stats.resolve_ms, 3),
    }

