"""ONNX Runtime as a ``Runner`` (core/decode/generation.py): the external oracle for the
prepared runtime, and the way to decode models whose ops the runtime lacks.

onnxruntime is an optional dependency (the ``test`` extra): it is imported when a
runner is made, and its absence is a ``UsageError`` saying how to install it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from onnx_prep.core.errors import ModelFormatError, ModelIOError, UsageError, Where
from onnx_prep.core.model.resolved_model import ValueInfo


def import_onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise UsageError("onnxruntime is not installed",
                         hint="pip install onnxruntime (or the package's 'test' extra)") from exc
    return onnxruntime


class OrtRunner:
    """One CPU ``InferenceSession``; ``run`` returns every output by name.

    ``threads`` sets intra-op threads (None: ONNX Runtime's default). Holds no decode
    state; safe to reuse across generations.
    """

    def __init__(self, model_path: str | Path, threads: int | None = None) -> None:
        ort = import_onnxruntime()
        self.model_path = Path(model_path)
        opts = ort.SessionOptions()
        if threads is not None:
            if threads < 1:
                raise UsageError(f"--threads must be at least 1, got {threads}")
            opts.intra_op_num_threads = threads
        opts.log_severity_level = 3  # errors only: warnings would mix into CLI output
        try:
            self.session = ort.InferenceSession(str(model_path), opts,
                                                providers=["CPUExecutionProvider"])
        except Exception as exc:  # ORT raises its own Fail/InvalidGraph/NoSuchFile types
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelFormatError(f"onnxruntime cannot load the model: {first}",
                                   Where(model=str(model_path))) from exc
        self.output_names = [o.name for o in self.session.get_outputs()]

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
