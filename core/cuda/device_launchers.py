"""Device launchers: what runs a node of a resolved model on the device, by
``(op_type, kernel id)``, for the device graph runner (device_graph.py).

A launcher answers three questions, all on the host, none of them touching the device:

- ``check(node, in_dtypes)``: before anything runs, what is missing for this node (a
  dtype or an attribute its kernels lack), or None. ``in_dtypes`` are the inputs' numpy
  dtypes where the runner knows them statically (None where it does not);
- ``outputs(call)``: each output's shape and dtype, or :class:`Alias` (the output IS
  an input's buffer under another shape: Reshape, Squeeze, Unsqueeze, Flatten,
  Identity; no copy, no launch);
- ``launches(call)``: the kernel launches, as ``(function, plan)`` pairs, each plan
  checked (shapes, alignment) when it is made, so a step is issued only once all of
  them exist; the runner queues them on its stream in order.

``call`` (:class:`LaunchCall`) carries the node, its compiled action (normalised
attributes; the CPU op, which the launchers run on zero-stride "phantom" arrays to get
ONNX's exact output shapes without a byte of data), the inputs (device tensors, or host
arrays at the positions the launcher reads on the host: ``host_inputs``, e.g. a
Reshape's shape) and, for ``launches``, the outputs' device tensors; and the runner's
kernels (``call.kernels``: DeviceTensorOps, DeviceInt4Matmul, the prepared objects).

``DEVICE_LAUNCHERS`` holds this package's: the standard ops of device_tensor_ops.py, the
views, and the INT4 matmul. ``register_launcher`` adds more: the fused decoder ops
register theirs there (decoder_launchers.py, which also says the optional ``staged``,
``uses_status`` and ``unwritten`` a launcher may have).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from onnx_prep.core.cuda import device_tensor_ops as tops
from onnx_prep.core.errors import DeviceError

__all__ = ["Alias", "DEVICE_LAUNCHERS", "DeviceLauncher", "DeviceTensor", "LaunchCall", "TensorSpec", "phantom",
           "register_launcher"]


@dataclass(frozen=True)
class DeviceTensor:
    """A value in device memory: contiguous, row-major, at ``address``."""

    address: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


@dataclass(frozen=True)
class TensorSpec:
    """An output the launcher will write: a fresh buffer of this shape and dtype."""

    shape: tuple[int, ...]
    dtype: np.dtype


@dataclass(frozen=True)
class Alias:
    """An output that is input ``input``'s buffer, read as ``shape``."""

    input: int
    shape: tuple[int, ...]


@dataclass
class LaunchCall:
    node: Any  # NodeKernel
    action: Any  # the ActionProgram's Action: attrs, fn (the CPU op), prepared bindings
    inputs: list  # DeviceTensor | np.ndarray (host_inputs) | None (absent or replaced by a prepared object)
    kernels: Any  # the runner: .tensor_ops, .int4, .prepared
    outputs: list = field(default_factory=list)  # DeviceTensor, for launches()
    staged: list = field(default_factory=list)  # DeviceTensor: the launcher's ``staged`` arrays, for launches()


class DeviceLauncher(Protocol):
    host_inputs: frozenset[int]  # positions read on the host (shapes, sizes, axes), never uploaded

    def check(self, node: Any, in_dtypes: Sequence[np.dtype | None]) -> str | None: ...

    def outputs(self, call: LaunchCall) -> list[TensorSpec | Alias]: ...

    def launches(self, call: LaunchCall) -> list[tuple[Any, Any]]: ...


def phantom(shape: Sequence[int], dtype: Any = np.float32) -> np.ndarray:
    """A read-only array of ``shape`` whose every element is one zero: the CPU's shape
    ops run on it to give ONNX's output shapes without the data."""
    return np.broadcast_to(np.zeros((), dtype=dtype), tuple(shape))


def _cpu_shapes(call: LaunchCall) -> list[tuple[int, ...]]:
    """Output shapes from the CPU op run on phantoms of the device inputs."""
    ins = [phantom(x.shape, x.dtype) if isinstance(x, DeviceTensor) else x for x in call.inputs]
    return [tuple(o.shape) for o in call.action.fn(ins, call.action.attrs, {})]


def _float32(node: Any, in_dtypes: Sequence[np.dtype | None], positions: Sequence[int]) -> str | None:
    for pos in positions:
        dt = in_dtypes[pos] if pos < len(in_dtypes) else None
        if dt is not None and dt != np.float32:
            return f"its device kernel computes float32, input {pos} ({node.inputs[pos]}) is {dt}"
    return None


def _ops(call: LaunchCall, launches: Sequence[Any]) -> list[tuple[Any, Any]]:
    functions = call.kernels.tensor_ops._functions
    return [(functions[p.name], p) for p in launches]


class Binary:
    host_inputs = frozenset()

    def check(self, node, in_dtypes):
        return _float32(node, in_dtypes, (0, 1))

    def outputs(self, call):
        a, b = call.inputs[0], call.inputs[1]
        return [TensorSpec(tops.broadcast_shape(a.shape, b.shape), np.dtype(np.float32))]

    def launches(self, call):
        a, b = call.inputs[0], call.inputs[1]
        return _ops(call, tops.plan_binary(call.node.op_type, call.outputs[0].address, a.address, a.shape,
                                           b.address, b.shape))


class Unary:
    host_inputs = frozenset()

    def check(self, node, in_dtypes):
        return _float32(node, in_dtypes, (0,))

    def outputs(self, call):
        return [TensorSpec(call.inputs[0].shape, np.dtype(np.float32))]

    def launches(self, call):
        x = call.inputs[0]
        return _ops(call, tops.plan_unary(call.node.op_type, call.outputs[0].address, x.address, x.size))


class QuickGelu:
    """com.microsoft QuickGelu with alpha 1, ``x * sigmoid(x)`` (what the silu fusion
    makes of a SwiGLU gate): the Sigmoid kernel into Y, then Y = X * Y, the two ops it
    replaced. Another alpha is refused."""

    host_inputs = frozenset()

    def check(self, node, in_dtypes):
        from onnx_prep.core.ops.activation import DEFAULT_ALPHA

        alpha = float(node.attributes.get("alpha", DEFAULT_ALPHA))
        if alpha != 1.0:
            return f"its device kernels compute x * sigmoid(x) (alpha 1), alpha is {alpha:g}"
        return _float32(node, in_dtypes, (0,))

    def outputs(self, call):
        return [TensorSpec(call.inputs[0].shape, np.dtype(np.float32))]

    def launches(self, call):
        x, y = call.inputs[0], call.outputs[0]
        return _ops(call, (*tops.plan_unary("Sigmoid", y.address, x.address, x.size),
                           *tops.plan_binary("Mul", y.address, x.address, x.shape, y.address, x.shape)))


def _cast_target(node: Any) -> np.dtype:
    from onnx import helper

    return np.dtype(helper.tensor_dtype_to_np_dtype(int(node.attributes["to"])))


class Cast:
    host_inputs = frozenset()

    def check(self, node, in_dtypes):
        target, source = _cast_target(node), in_dtypes[0] if in_dtypes else None
        if source is not None and source != target and (source.name, target.name) not in tops.CASTS:
            built = ", ".join(f"{s}->{t}" for s, t in tops.CASTS)
            return f"no device Cast from {source} to {target} (built: {built})"
        return None

    def outputs(self, call):
        x, target = call.inputs[0], _cast_target(call.node)
        return [Alias(0, x.shape) if x.dtype == target else TensorSpec(x.shape, target)]

    def launches(self, call):
        x, y = call.inputs[0], call.outputs[0]
        if x.dtype == y.dtype:
            return []
        return _ops(call, tops.plan_cast(y.address, x.address, x.size, x.dtype.name, y.dtype.name))


def _words(node: Any, in_dtypes: Sequence[np.dtype | None]) -> str | None:
    dt = in_dtypes[0] if in_dtypes else None
    if dt is not None and dt.itemsize != 4:
        return f"its device copy moves 32-bit elements, input 0 ({node.inputs[0]}) is {dt}"
    return None


class Transpose:
    host_inputs = frozenset()

    def check(self, node, in_dtypes):
        return _words(node, in_dtypes)

    def outputs(self, call):
        return [TensorSpec(_cpu_shapes(call)[0], call.inputs[0].dtype)]

    def launches(self, call):
        x = call.inputs[0]
        perm = call.action.attrs.get("perm")
        return _ops(call, tops.plan_transpose(call.outputs[0].address, x.address, x.shape, perm))


class Split:
    host_inputs = frozenset({1})

    def check(self, node, in_dtypes):
        return _words(node, in_dtypes)

    def outputs(self, call):
        return [TensorSpec(s, call.inputs[0].dtype) for s in _cpu_shapes(call)]

    def launches(self, call):
        x = call.inputs[0]
        axis = int(call.action.attrs.get("axis", 0)) % max(len(x.shape), 1)
        return _ops(call, tops.plan_split([y.address for y in call.outputs], x.address, x.shape, axis,
                                          [y.shape[axis] for y in call.outputs]))


class Concat:
    host_inputs = frozenset()

    def check(self, node, in_dtypes):
        return _words(node, in_dtypes)

    def outputs(self, call):
        xs = [x for x in call.inputs if x is not None]
        rank = len(xs[0].shape)
        axis = int(call.action.attrs["axis"]) % max(rank, 1)
        shape = list(xs[0].shape)
        shape[axis] = sum(x.shape[axis] for x in xs)
        return [TensorSpec(tuple(shape), xs[0].dtype)]

    def launches(self, call):
        xs = [x for x in call.inputs if x is not None]
        return _ops(call, tops.plan_concat(call.outputs[0].address, [x.address for x in xs], [x.shape for x in xs],
                                           int(call.action.attrs["axis"])))


class Gather:
    """Gather along axis 0 with int64 indices: rows of 32-bit elements (an embedding)."""

    host_inputs = frozenset()

    def check(self, node, in_dtypes):
        axis = int(node.attributes.get("axis", 0))
        if axis != 0:
            return f"its device kernel gathers along axis 0 (rows), not axis {axis}"
        idx = in_dtypes[1] if len(in_dtypes) > 1 else None
        if idx is not None and idx != np.int64:
            return f"its device kernel reads int64 indices, input 1 ({node.inputs[1]}) is {idx}"
        return _words(node, in_dtypes)

    def outputs(self, call):
        x, idx = call.inputs[0], call.inputs[1]
        return [TensorSpec(tuple(idx.shape) + tuple(x.shape[1:]), x.dtype)]

    def launches(self, call):
        x, idx = call.inputs[0], call.inputs[1]
        return _ops(call, tops.plan_gather(call.outputs[0].address, x.address, x.shape, idx.address, idx.shape))


class View:
    """Reshape, Squeeze, Unsqueeze, Flatten, Identity: the input's buffer under the shape
    the CPU op gives (every device value is contiguous, so each is a view)."""

    host_inputs = frozenset({1})

    def check(self, node, in_dtypes):
        return None

    def outputs(self, call):
        return [Alias(0, _cpu_shapes(call)[0])]

    def launches(self, call):
        return []


class Int4Matmul:
    """MatMulNBits on its packed object (DeviceInt4Matmul): A [..., K] fp32 rows, Y
    [..., N]; the bias, if any, a device input."""

    host_inputs = frozenset()
    BIAS = 5

    def check(self, node, in_dtypes):
        return _float32(node, in_dtypes, (0,))

    def _object(self, call):
        (_, key), = call.action.prepared
        return call.kernels.prepared[key]

    def outputs(self, call):
        a, header = call.inputs[0], self._object(call).header
        if not a.shape or a.shape[-1] != header.K:
            raise DeviceError(f"MatMulNBits input A of shape {list(a.shape)} does not end in K={header.K}")
        return [TensorSpec(tuple(a.shape[:-1]) + (header.N,), np.dtype(np.float32))]

    def launches(self, call):
        from onnx_prep.core.cuda.device_int4_matmul import plan_launch

        a, y, obj = call.inputs[0], call.outputs[0], self._object(call)
        m = a.size // obj.header.K
        if m == 0:
            return []
        bias = call.inputs[self.BIAS] if len(call.inputs) > self.BIAS else None
        plan = plan_launch(obj.header, m, a.address, obj.view, y.address, bias_addr=bias.address if bias else 0)
        return [(call.kernels.int4._functions[plan.name], plan)]


DEVICE_LAUNCHERS: dict[tuple[str, str], DeviceLauncher] = {
    **{(op, "numpy"): Binary() for op in tops.BINARY},
    **{(op, "numpy"): Unary() for op in tops.UNARY},
    ("Cast", "numpy"): Cast(),
    ("Transpose", "numpy"): Transpose(),
    ("Split", "numpy"): Split(),
    ("Concat", "numpy"): Concat(),
    ("Gather", "numpy"): Gather(),
    **{(op, "numpy"): View() for op in ("Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity")},
    ("MatMulNBits", "int4_matmul"): Int4Matmul(),
    ("QuickGelu", "activation"): QuickGelu(),
}


def register_launcher(op_type: str, kernel: str, launcher: DeviceLauncher) -> None:
    """Run ``op_type`` nodes of kernel id ``kernel`` on the device through ``launcher``."""
    DEVICE_LAUNCHERS[(op_type, kernel)] = launcher
