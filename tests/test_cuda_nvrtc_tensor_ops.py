"""The device tensor ops' CUDA source (core/cuda/tensor_ops.cu) compiled by the real
NVRTC, which needs no GPU: for the architectures of the GPUs it targets, to a CUBIN
holding every entry DeviceTensorOps launches, none spilling registers. Skipped, saying
so, where cuda-python or the NVRTC library is absent (as test_cuda_nvrtc.py is: the
``cuda`` extra brings both)."""
from __future__ import annotations

import re

import pytest
from test_cuda_nvrtc import needs_nvrtc

from onnx_prep.core.cuda.device_tensor_ops import ENTRIES, kernel_source
from onnx_prep.core.cuda.nvrtc_program import compile_program


@needs_nvrtc
@pytest.mark.parametrize("capability", [(9, 0), (8, 0), (8, 9)], ids=["H100/H200", "A100", "L4"])
def test_the_tensor_ops_compile_to_a_cubin_with_every_entry(capability):
    program = compile_program(kernel_source(), "tensor_ops.cu", capability, options=("--ptxas-options=-v",))
    assert program.kind == "cubin" and program.architecture == f"sm_{capability[0]}{capability[1]}"
    assert program.image[:4] == b"\x7fELF"
    for name in ENTRIES:
        assert name.encode() + b"\0" in program.image, name
    spills = dict(re.findall(r"Function properties for (\w+)\n[^\n]*?(\d+) bytes spill stores", program.log))
    assert set(spills) == set(ENTRIES), program.log
    assert set(spills.values()) == {"0"}, program.log
