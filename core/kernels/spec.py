"""What a kernel is: the one spec each kernel module declares.

A ``KernelSpec`` holds everything about one kernel, so adding an op is one module under
``core/kernels/`` and one line in ``registry.KERNEL_SPECS``:

- which nodes it takes: ``op_types`` (the ``(domain, op_type)`` pairs it may take, None:
  any) and ``match`` (the checks on the node's attributes and constant inputs; it
  returns the ``KernelChoice``, with the prepared objects the node needs, or None to
  leave the node to the next kernel);
- how a node runs: ``implementation(op_type, domain, opset)`` (an ``OpImpl``,
  core/ops/registry.py); a generic kernel (``numpy``, ``reference``) runs what it has no
  implementation for through ``onnx.reference``, any other kernel implements exactly
  its op types; ``bind_attrs`` adds reserved attributes at compile time;
- for a kernel that reads a prepared object, its ``PreparedForm``: the layout key
  (``layout_name`` is its first field), ``prepack``, the exact ``packed_size`` and the
  input ``position`` the op reads the object at, and per device the recipes that put
  the object there (``DevicePacking``: pack on a CPU worker and upload the packed bytes,
  or upload the sources and pack on the device; which one the kernel prefers).

Pure Python: resolution calls ``match`` without the native module and without I/O.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from onnx_prep.core.errors import ModelFormatError, Where
from onnx_prep.core.model.prepared_key import PrepackRequest, PreparedKey
from onnx_prep.core.model.transforms import GraphNode
from onnx_prep.core.model.weights import WeightDescriptor
from onnx_prep.core.ops.registry import OpImpl

# Prepack backends: the native packed uint8 buffer (what the layout key names and the
# cache persists) or the float32 reference form the numpy ops read (tests, and
# machines without the native module; never persisted).
NATIVE = "native"
REFERENCE = "reference"

# Device recipes: how a prepared object reaches a device's memory (the device plan,
# core/plan/device_recipes.py). Both read the sources; they differ in where they pack.
HOST_PREPACK = "read_source_prepack_upload"  # pack on a CPU worker, upload the packed bytes
DEVICE_PREPACK = "read_source_upload_prepack"  # upload the source bytes, pack on the device


@dataclass(frozen=True)
class KernelChoice:
    """A node's kernel id (None: no kernel) and the prepared objects it consumes;
    ``prepared_inputs`` maps each one's key to the input names it replaces."""

    kernel: str | None
    requirements: tuple[PrepackRequest, ...] = ()
    prepared_inputs: Mapping[PreparedKey, tuple[str, ...]] = field(
        default_factory=lambda: MappingProxyType({}))


UNSUPPORTED = KernelChoice(None)


class MatchContext(NamedTuple):
    """What a kernel's ``match`` may read besides the node: the constant initializers'
    descriptors (an initializer that is also a graph input is not constant: it is only
    a default the caller may override), the model's opsets, its local functions, and
    the device the prepared objects are for. (A NamedTuple: one is built per node.)"""

    constants: Mapping[str, WeightDescriptor]
    opsets: Mapping[str, int]
    local_functions: frozenset[tuple[str, str]] = frozenset()
    device: str = "cpu"

    def constant(self, node: GraphNode, i: int) -> WeightDescriptor | None:
        """The descriptor of input ``i`` when it is present and constant."""
        name = node_input(node, i)
        return self.constants.get(name) if name else None


# prepack(sources in lineage order, normalized node attributes, backend, out) -> array
Prepack = Callable[[list[np.ndarray], Mapping[str, Any], str, "np.ndarray | None"], np.ndarray]
# packed_size(request, normalized node attributes, weight descriptors, backend) -> bytes
PackedSize = Callable[[PrepackRequest, Mapping[str, Any], Mapping[str, WeightDescriptor], str], int]


@dataclass(frozen=True)
class DevicePacking:
    """The recipes a kernel offers to put its prepared object on one device, and which
    it prefers for an object of ``source`` bytes packing to ``packed`` bytes
    (``prefers(source, packed)``, one of ``offers``). A kernel that declares nothing
    for a device offers ``HOST_PREPACK`` only: any packed bytes can be uploaded as they
    are, but only the kernel knows how to pack on the device. ``on_device(attributes)``:
    whether the device-side prepack packs a node of these (normalized) attributes; where
    it does not, ``DEVICE_PREPACK`` is not offered for that node's object."""

    offers: tuple[str, ...] = (HOST_PREPACK,)
    prefers: Callable[[int, int], str] = lambda source, packed: HOST_PREPACK
    on_device: Callable[[Mapping[str, Any]], bool] = lambda attributes: True

    def __post_init__(self) -> None:
        if not self.offers or any(r not in (HOST_PREPACK, DEVICE_PREPACK) for r in self.offers):
            raise ValueError(f"device recipes must be among {HOST_PREPACK}, {DEVICE_PREPACK}: {self.offers}")

    def recipes(self, source: int, packed: int, attributes: Mapping[str, Any] | None = None) -> tuple[str, ...]:
        """The offered recipes, the preferred one first; with the packing node's
        ``attributes``, only those that pack it (``on_device``)."""
        first = self.prefers(source, packed)
        if first not in self.offers:
            raise ValueError(f"preferred device recipe {first!r} is not offered: {self.offers}")
        kinds = (first,) + tuple(r for r in self.offers if r != first)
        if attributes is not None and DEVICE_PREPACK in kinds and HOST_PREPACK in kinds \
                and not self.on_device(attributes):
            kinds = tuple(r for r in kinds if r != DEVICE_PREPACK)
        return kinds


HOST_PREPACK_ONLY = DevicePacking()


@dataclass(frozen=True)
class PreparedForm:
    """The prepared object a kernel reads instead of some of its constant inputs.

    ``prepack`` gets the sources in the lineage order ``match`` put in the request and
    writes into ``out`` (native backend only: a uint8 buffer of exactly ``packed_size``
    bytes, e.g. a stable-VA slot's view) when given. ``packed_size`` is exact and reads
    descriptors only. ``layout`` builds the layout key from keyword parameters; every
    key starts with ``layout_name`` (unique per kernel: two kernels never share a key).
    ``devices``: per device name, the recipes that put the object there (absent:
    ``HOST_PREPACK_ONLY``).
    """

    position: int
    layout_name: str
    layout: Callable[..., str]
    prepack: Prepack
    packed_size: PackedSize
    devices: Mapping[str, DevicePacking] = field(default_factory=lambda: MappingProxyType({}))

    def device_packing(self, device: str) -> DevicePacking:
        return self.devices.get(device, HOST_PREPACK_ONLY)


@dataclass(frozen=True)
class KernelSpec:
    """One kernel: its id (``NodeKernel.kernel``), the nodes it takes, how they run, and
    the prepared object it reads (None for a generic kernel). See the module docstring."""

    id: str
    op_types: frozenset[tuple[str, str]] | None
    match: Callable[[GraphNode, MatchContext], KernelChoice | None]
    implementation: Callable[[str, str, "int | None"], OpImpl | None]
    generic: bool = False
    prepared: PreparedForm | None = None
    # bind_attrs(node, attrs, weights): reserved attributes the op reads, set at compile time.
    bind_attrs: Callable[[Any, dict, Mapping[str, WeightDescriptor]], None] | None = None

    def takes(self, node: GraphNode) -> bool:
        return self.op_types is None or (node.domain, node.op_type) in self.op_types

    @classmethod
    def of_table(cls, id: str, table: Mapping[tuple[str, str], OpImpl],
                 match: Callable[[GraphNode, MatchContext], KernelChoice | None]) -> KernelSpec:
        """A kernel that takes exactly the ``(domain, op_type)`` pairs of ``table`` and
        runs each with the implementation the table names."""
        return cls(id=id, op_types=frozenset(table), match=match,
                   implementation=lambda op_type, domain, opset: table.get((domain, op_type)))


def refuse(node: GraphNode, rule: str, tensor: str | None = None) -> ModelFormatError:
    """The one-line error of a node ONNX Runtime would refuse (resolution adds the model)."""
    return ModelFormatError(f"{node.op_type}: {rule}", Where(node=node.name, tensor=tensor))


def power_of_two_block(node: GraphNode, block_size: int) -> None:
    """ONNX Runtime's block-size rule for the block-quantized contrib ops."""
    if block_size < 16 or block_size & (block_size - 1):
        raise refuse(node, f"block_size {block_size} is not a power of two >= 16")


def node_input(node: GraphNode, i: int) -> str | None:
    """Input ``i``'s name, None when absent (past the end, or an empty name)."""
    return node.inputs[i] if len(node.inputs) > i and node.inputs[i] else None


def prepared_choice(kernel_id: str, request: PrepackRequest, replaces: tuple[str, ...]) -> KernelChoice:
    """The choice of a kernel reading one prepared object in place of ``replaces``."""
    return KernelChoice(kernel_id, (request,), MappingProxyType({request.key: replaces}))
