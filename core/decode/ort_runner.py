"""ONNX Runtime as a ``Runner`` (core/decode/generation.py): the external oracle for the
prepared runtime, and the way to decode models whose ops the runtime lacks.

onnxruntime is an optional dependency (the ``test`` extra): it is imported when a
runner is made, and its absence is a ``UsageError`` saying how to install it.

Like for like: ONNX Runtime fuses DequantizeLinear(int4) + MatMul into a MatMulNBits at
the accuracy level of its session key ``session.qdq_matmulnbits_accuracy_level``
(default 4: activations quantized to int8 per block), while the prepared runtime fuses
them at ``FUSED_ACCURACY_LEVEL`` (fp32, what DequantizeLinear + MatMul defines).
``like_for_like_config()`` is the session config that makes ONNX Runtime compute what
the prepared runtime computes; a MatMulNBits node keeps its own ``accuracy_level`` in
both (the prepared runtime honours it: core/kernels/int4_matmul.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from onnx_prep.core.errors import ModelFormatError, ModelIOError, UsageError, Where
from onnx_prep.core.model.resolved_model import ValueInfo
from onnx_prep.core.model.transforms import FUSED_ACCURACY_LEVEL

QDQ_ACCURACY_KEY = "session.qdq_matmulnbits_accuracy_level"
# Where the session reads external data when the model comes as bytes (exposing())
_EXTERNAL_FOLDER_KEY = "session.model_external_initializers_file_folder_path"


def like_for_like_config() -> dict[str, str]:
    """ONNX Runtime's session config under which it computes what the prepared runtime
    does: its QDQ int4 MatMuls at the prepared runtime's fused accuracy level."""
    return {QDQ_ACCURACY_KEY: str(FUSED_ACCURACY_LEVEL)}


def import_onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise UsageError("onnxruntime is not installed",
                         hint="pip install onnxruntime (or the package's 'test' extra)") from exc
    return onnxruntime


class OrtRunner:
    """One CPU ``InferenceSession``; ``run`` returns every output by name.

    ``threads`` sets intra-op threads (None: ONNX Runtime's default); ``profile_prefix``
    turns ONNX Runtime's profiler on, its trace written under that prefix. ``session_config``
    adds session config entries (``like_for_like_config()``; None: ONNX Runtime's
    defaults). ``model_bytes``: the model to load instead of the file (a rewritten copy
    of it, ``exposing``), its external data read beside ``model_path``. Holds no decode
    state; safe to reuse across generations.
    """

    def __init__(self, model_path: str | Path, threads: int | None = None, *,
                 session_config: Mapping[str, str] | None = None, model_bytes: bytes | None = None,
                 profile_prefix: str | None = None) -> None:
        ort = import_onnxruntime()
        self.model_path = Path(model_path)
        self.session_config = dict(session_config or {})
        opts = ort.SessionOptions()
        if threads is not None:
            if threads < 1:
                raise UsageError(f"--threads must be at least 1, got {threads}")
            opts.intra_op_num_threads = threads
        opts.log_severity_level = 3  # errors only: warnings would mix into CLI output
        for key, value in self.session_config.items():
            opts.add_session_config_entry(key, value)
        if model_bytes is not None:
            opts.add_session_config_entry(_EXTERNAL_FOLDER_KEY, str(self.model_path.resolve().parent))
        if profile_prefix is not None:  # ONNX Runtime's profiler on (session.end_profiling() gives its file)
            opts.enable_profiling = True
            opts.profile_file_prefix = profile_prefix
        try:
            self.session = ort.InferenceSession(str(model_path) if model_bytes is None else model_bytes, opts,
                                                providers=["CPUExecutionProvider"])
        except Exception as exc:  # ORT raises its own Fail/InvalidGraph/NoSuchFile types
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelFormatError(f"onnxruntime cannot load the model: {first}",
                                   Where(model=str(model_path))) from exc
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.untyped: tuple[str, ...] = ()  # values exposing() could not ask for (no type)

    @classmethod
    def exposing(cls, model_path: str | Path, values: Iterable[str], threads: int | None = None, *,
                 session_config: Mapping[str, str] | None = None,
                 fallback_types: Mapping[str, Any] | None = None) -> "OrtRunner":
        """A runner whose outputs are the model's and each of ``values`` that a node of
        the main graph computes (what Polygraphy calls marking outputs). An output
        needs an element type: ONNX shape inference's, else ``fallback_types[name]`` (a
        numpy dtype: what the other runtime computed; ONNX shape inference knows no
        com.microsoft op), else it is left out and listed in ``untyped``. Should ONNX
        Runtime reject a fallback type, the model is loaded again without them.

        The model is rewritten in memory (its protobuf without the weights) and loaded
        from bytes, its external data read in place from the model's folder: nothing is
        copied or linked.

        NOTE: ONNX Runtime does not fuse across a graph output, so a value exposed
        inside a pattern it fuses (a DequantizeLinear's output before its MatMul) is
        computed unfused; expose only what the other runtime computes too."""
        import onnx
        from onnx import helper

        path = Path(model_path)
        try:
            model = onnx.load(str(path), load_external_data=False)
        except Exception as exc:  # a protobuf ONNX Runtime could not load either
            raise ModelFormatError(f"cannot parse the model: {exc}", Where(model=str(path))) from exc
        try:
            inferred = onnx.shape_inference.infer_shapes(model).graph
            known = (*inferred.value_info, *inferred.output, *model.graph.value_info)
        except Exception:  # noqa: BLE001 - inference is best effort: the declared types remain
            known = tuple(model.graph.value_info)
        elem = {vi.name: vi.type.tensor_type.elem_type for vi in known
                if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type}
        computed = {o for node in model.graph.node for o in node.output if o}
        have = {o.name for o in model.graph.output}
        wanted = [n for n in dict.fromkeys(values) if n in computed and n not in have]
        fallback = {}
        for name, dtype in (fallback_types or {}).items():
            try:
                fallback[name] = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
            except (KeyError, TypeError, ValueError):
                continue
        base = list(model.graph.output)

        def load(types: Mapping[str, int]) -> "OrtRunner":
            del model.graph.output[:]
            model.graph.output.extend(base)
            for name in wanted:  # the type only: ONNX Runtime infers the shape itself
                if name in types:
                    model.graph.output.append(helper.make_tensor_value_info(name, types[name], None))
            runner = cls(path, threads, session_config=session_config, model_bytes=model.SerializeToString())
            runner.untyped = tuple(n for n in wanted if n not in types)
            return runner

        if not any(n not in elem and n in fallback for n in wanted):
            return load(elem)
        try:
            return load({**fallback, **elem})
        except ModelFormatError:
            return load(elem)

    def value_infos(self) -> tuple[tuple[ValueInfo, ...], tuple[ValueInfo, ...]]:
        from onnx_prep.core.decode.decoder_io import value_infos_from_ort

        return value_infos_from_ort(self.session)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            values = self.session.run(self.output_names, feeds)
        except Exception as exc:
            # NOTE: a feed the model rejects (wrong name, dtype or rank) is an I/O
            # interpretation problem, reported in one line; anything else is a bug
            # or a kernel failure and keeps its traceback.
            if type(exc).__name__ not in ("InvalidArgument", "Fail"):
                raise
            first = str(exc).strip().splitlines()[0]
            raise ModelIOError(f"onnxruntime rejected the step's feeds: {first}",
                               Where(model=str(self.model_path)),
                               hint="check the I/O roles (--io-map FILE, docs/run.md)") from exc
        return dict(zip(self.output_names, values))

    def close(self) -> None:
        self.session = None  # type: ignore[assignment]

    def __enter__(self) -> "OrtRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
