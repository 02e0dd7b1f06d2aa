"""ResolvedModel: the frozen result of model resolution, consumed by the plan builder.

Frozen is enforced: every container is immutable (tuples, read-only mappings,
read-only arrays) and the dataclasses are frozen, so mutation raises. Resolution
builds a ``ResolvedModel`` only through ``freeze()`` on its builder; the plan builder
accepts nothing else (``require_frozen``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterator, Mapping

import numpy as np

from onnx_prep.core.errors import OnnxPrepError
from onnx_prep.core.model.prepared_key import PrepackRequest, PreparedKey
from onnx_prep.core.model.weight_views import FoldedView
from onnx_prep.core.model.weights import WeightDescriptor


def frozen_mapping(d: Mapping) -> Mapping:
    return MappingProxyType(dict(d))


def readonly_array(a: np.ndarray) -> np.ndarray:
    a = np.array(a, copy=True)
    a.setflags(write=False)
    return a


@dataclass(frozen=True, slots=True)
class ValueInfo:
    name: str
    elem_type: int  # onnx.TensorProto.DataType
    shape: tuple[int | str | None, ...] | None  # int, symbolic name, None=unknown; None=rank unknown

    def to_json(self) -> dict:
        return {"name": self.name, "elem_type": self.elem_type,
                "shape": None if self.shape is None else list(self.shape)}

    @classmethod
    def from_proto(cls, v: Any) -> "ValueInfo":
        """One ``onnx.ValueInfoProto``. A value that is not a tensor has elem_type 0, one
        without a shape shape None; a dim is its value, its symbol, or None when neither."""
        tt = v.type.tensor_type  # the empty default when the type is not a tensor
        if not tt.HasField("shape"):
            return cls(v.name, int(tt.elem_type), None)
        return cls(v.name, int(tt.elem_type), tuple(
            int(d.dim_value) if d.HasField("dim_value")
            else d.dim_param if d.HasField("dim_param") else None
            for d in tt.shape.dim))


def graph_value_infos(graph: Any) -> tuple[tuple[ValueInfo, ...], tuple[ValueInfo, ...]]:
    """An ``onnx.GraphProto``'s inputs and outputs. An input that is also an initializer
    is left out: the project treats it as a weight, not as an input to feed."""
    inits = {t.name for t in graph.initializer}
    return (tuple(ValueInfo.from_proto(v) for v in graph.input if v.name not in inits),
            tuple(ValueInfo.from_proto(v) for v in graph.output))


@dataclass(frozen=True, slots=True)
class NodeKernel:
    """One reachable node, in topological order, with its kernel choice.

    ``kernel`` is a kernel id from the kernel registry ("int4_matmul", "int4_gather",
    "gqa", "gemm_packed", "row_norm", "rotary", "activation", "numpy", "reference") or None when no
    kernel exists (then the model is listed in ``ResolvedModel.unsupported``).
    ``requirements`` are the prepared objects the node consumes; ``prepared_inputs``
    maps each requirement's key to the input names it replaces (the kernel reads the
    packed object instead of those raw initializers).
    """

    index: int
    name: str
    op_type: str
    domain: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: Mapping[str, Any]
    kernel: str | None
    requirements: tuple[PrepackRequest, ...] = ()
    prepared_inputs: Mapping[PreparedKey, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    fused_from: tuple[str, ...] = ()  # names of source nodes a transform fused into this one
    implicit_inputs: tuple[str, ...] = ()  # outer-scope values the node's subgraphs read (If, Loop, Scan)

    def to_json(self) -> dict:
        return {
            "index": self.index, "name": self.name, "op_type": self.op_type,
            "domain": self.domain, "inputs": list(self.inputs), "outputs": list(self.outputs),
            "kernel": self.kernel, "requirements": [r.key for r in self.requirements],
            "fused_from": list(self.fused_from),
        }


@dataclass(frozen=True, slots=True)
class UnsupportedOp:
    op_type: str
    domain: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class PayloadManifest:
    """The external payload bytes reachable nodes need, and nothing else.

    The one external-data reader refuses any read not named here.
    """

    entries: tuple[WeightDescriptor, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", MappingProxyType({e.name: e for e in self.entries}))

    def __contains__(self, name: object) -> bool:
        return name in self._by_name  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[WeightDescriptor]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, name: str) -> WeightDescriptor | None:
        return self._by_name.get(name)  # type: ignore[attr-defined]

    @property
    def total_bytes(self) -> int:
        return sum(e.length for e in self.entries)


@dataclass(frozen=True)
class ResolutionStats:
    nodes_total: int
    nodes_kept: int
    initializers_total: int
    initializers_active: int
    fused_int4_matmuls: int  # DequantizeLinear(int4)+MatMul recognised as the INT4 matmul kernel
    resolve_ms: float

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class ResolvedModel:
    model_path: Path
    model_dir: Path
    opsets: Mapping[str, int]
    inputs: tuple[ValueInfo, ...]  # graph inputs that are not initializers
    outputs: tuple[ValueInfo, ...]
    nodes: tuple[NodeKernel, ...]  # reachable nodes, topological order
    weights: Mapping[str, WeightDescriptor]  # active initializers (external and inline)
    inline_values: Mapping[str, np.ndarray]  # read-only arrays of active inline initializers
    requests: Mapping[PreparedKey, PrepackRequest]  # deduplicated prepared requirements
    manifest: PayloadManifest
    unsupported: tuple[UnsupportedOp, ...]
    stats: ResolutionStats
    metadata: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    folded_views: tuple[FoldedView, ...] = ()  # weight inputs read as a view of an initializer
    fusion_enabled: bool = False  # whether resolution ran pattern fusion (core/model/fusion.py)
    fusions: tuple = ()  # fusion.Fusion: each node fused from a standard-op pattern
    near_misses: tuple = ()  # fusion.NearMiss: each pattern anchor left unfused, and why


def require_frozen(resolved: object) -> ResolvedModel:
    """Downstream entry check: only a frozen ResolvedModel is accepted."""
    if not isinstance(resolved, ResolvedModel) or not isinstance(resolved.manifest, PayloadManifest):
        raise OnnxPrepError(
            f"expected a frozen ResolvedModel, got {type(resolved).__name__}",
            hint="resolve the model with onnx_prep.core.model.resolution.resolve_model()",
        )
    return resolved
