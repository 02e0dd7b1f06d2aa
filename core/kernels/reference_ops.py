"""The ``reference`` kernel: any other op ``onnx.reference`` implements (default and
ai.onnx.ml domains, schemas with a function body, model-local functions), one
``ReferenceOp`` per node (core/ops/reference.py). Slow and complete: the last resort
before a node is unsupported."""
from __future__ import annotations

import functools

from onnx_prep.core.kernels.spec import KernelChoice, KernelSpec, MatchContext
from onnx_prep.core.model.transforms import GraphNode
from onnx_prep.core.ops.registry import OpImpl

ID = "reference"

_CHOICE = KernelChoice(ID)

_REFERENCE_DOMAINS = {"": "onnx.reference.ops._op_list",
                      "ai.onnx": "onnx.reference.ops._op_list",
                      "ai.onnx.ml": "onnx.reference.ops.aionnxml._op_list"}


def match(node: GraphNode, ctx: MatchContext) -> KernelChoice | None:
    if (node.domain, node.op_type) in ctx.local_functions:
        return _CHOICE
    opsets = ctx.opsets
    version = opsets.get(node.domain, opsets.get("ai.onnx" if node.domain == "" else node.domain))
    return _CHOICE if reference_implements(node.domain, node.op_type, version) else None


@functools.lru_cache(maxsize=None)
def reference_implements(domain: str, op_type: str, version: int | None) -> bool:
    """Whether ``onnx.reference`` can run ``domain::op_type`` at opset ``version``: a
    registered implementation, or a schema whose (context-dependent) function body the
    reference evaluator expands.

    NOTE: imports onnx.reference lazily (~0.1 s) on the first op no other kernel takes,
    so a model made only of those never pays for it.
    """
    module_name = _REFERENCE_DOMAINS.get(domain)
    if module_name is None:
        return False
    import importlib

    mod = importlib.import_module(module_name)
    from onnx.reference.op_run import RuntimeContextError

    try:
        mod.load_op("" if domain == "ai.onnx" else domain, op_type, version)
    except RuntimeContextError:
        return True  # a context-dependent function body: the evaluator expands it per node
    except AssertionError:
        return True  # a function body: load_op wants the evaluator class to expand it
    except Exception:  # noqa: BLE001 - NotImplementedError, SchemaError: no implementation
        return False
    return True


def implementation(op_type: str, domain: str, opset: int | None) -> OpImpl | None:
    return None  # every node runs through onnx.reference (core/kernels/binding.py)


SPEC = KernelSpec(
    id=ID,
    op_types=None,
    match=match,
    implementation=implementation,
    generic=True,
)
