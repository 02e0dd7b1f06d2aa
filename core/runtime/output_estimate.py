"""A run's output bytes, estimated before it runs from the declared output shapes (the
IO arena's admission, core/runtime/run_loop.py)."""
from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from onnx_prep.core.model.dtypes import DTYPES
from onnx_prep.core.model.resolved_model import ResolvedModel

__all__ = ["OutputEstimate"]


class OutputEstimate:
    """Output bytes of a run from declared output shapes, symbolic dims bound by the
    feeds' shapes (same symbol name = same size); unknown dims count as 1."""

    def __init__(self, resolved: ResolvedModel) -> None:
        self.inputs = {v.name: v.shape for v in resolved.inputs}
        self.outputs = [(v.shape, v.elem_type) for v in resolved.outputs]

    def estimate(self, feeds: Mapping[str, np.ndarray]) -> int:
        sym: dict[str, int] = {}
        for name, arr in feeds.items():
            shape = self.inputs.get(name)
            if shape is None:
                continue
            for d, n in zip(shape, np.shape(arr)):
                if isinstance(d, str):
                    sym[d] = max(sym.get(d, 0), int(n))
        total = 0
        for shape, elem in self.outputs:
            if shape is None:
                continue
            dims = [d if isinstance(d, int) else sym.get(d, 1) if isinstance(d, str) else 1
                    for d in shape]
            numel = int(math.prod(dims))
            dt = DTYPES.get(elem)  # an unknown type, or string, counts 4 bytes an element
            total += dt.nbytes(numel) if dt is not None and dt.bits else numel * 4
        return total
