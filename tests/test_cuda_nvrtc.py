"""The device kernels' CUDA sources (the INT4 matmul, the INT4 prepack, the decoder ops)
compiled by the real NVRTC, which needs no GPU:
for the architectures of the GPUs it targets, to a CUBIN holding every entry the
launches name, none spilling registers to local memory; a source
NVRTC refuses raises KernelCompileError carrying NVRTC's log. Skipped, saying so,
where cuda-python or the NVRTC library is absent (this CI installs neither: the
``cuda`` extra brings both). The choice of target architecture runs everywhere."""
from __future__ import annotations

import re

import pytest

from onnx_prep.core.cuda import device_decoder_ops, device_int4_matmul, device_int4_prepack
from onnx_prep.core.cuda.nvrtc_program import KernelCompileError, compile_program, import_nvrtc, target_architecture
from onnx_prep.core.errors import EXIT_INTERNAL, DeviceError


def _nvrtc_missing() -> str | None:
    try:
        import_nvrtc()
    except DeviceError as exc:
        return str(exc)
    return None


MISSING = _nvrtc_missing()
needs_nvrtc = pytest.mark.skipif(MISSING is not None, reason=f"needs NVRTC: {MISSING}")


def test_the_target_is_the_devices_own_architecture_else_ptx_for_the_newest_below():
    supported = [75, 80, 86, 89, 90, 100, 120]
    assert target_architecture((9, 0), supported) == ("sm_90", "cubin")
    assert target_architecture((8, 6), supported) == ("sm_86", "cubin")
    assert target_architecture((12, 1), supported) == ("compute_120", "ptx")  # newer than this NVRTC
    assert target_architecture((9, 5), supported) == ("compute_90", "ptx")
    with pytest.raises(DeviceError, match=r"cannot compile for compute capability 7\.0 \(it supports sm_75 to sm_120\)"):
        target_architecture((7, 0), supported)


PROGRAMS = {"int4_matmul.cu": (device_int4_matmul.kernel_source, tuple(device_int4_matmul.ENTRIES)),
            "int4_prepack.cu": (device_int4_prepack.kernel_source, tuple(device_int4_prepack.ENTRIES.values())),
            "decoder_ops.cu": (device_decoder_ops.kernel_source, device_decoder_ops.ENTRIES)}


@needs_nvrtc
@pytest.mark.parametrize("program_name", sorted(PROGRAMS))
@pytest.mark.parametrize("capability", [(9, 0), (8, 0), (8, 9)], ids=["H100/H200", "A100", "L4"])
def test_the_kernels_compile_to_a_cubin_with_every_entry(capability, program_name):
    source, entries = PROGRAMS[program_name]
    program = compile_program(source(), program_name, capability, options=("--ptxas-options=-v",))
    assert program.kind == "cubin" and program.architecture == f"sm_{capability[0]}{capability[1]}"
    assert program.image[:4] == b"\x7fELF"
    for name in entries:
        assert name.encode() + b"\0" in program.image, name
    spills = dict(re.findall(r"Function properties for (\w+)\n[^\n]*?(\d+) bytes spill stores", program.log))
    assert set(spills) == set(entries), program.log
    assert set(spills.values()) == {"0"}, program.log  # no entry spills registers to local memory


@needs_nvrtc
def test_a_source_nvrtc_refuses_raises_with_its_log():
    broken = 'extern "C" __global__ void k(float *y) { y[0] = undeclared_name; }\n'
    with pytest.raises(KernelCompileError) as info:
        compile_program(broken, "broken.cu", (9, 0))
    err = info.value
    assert str(err).startswith("NVRTC could not compile broken.cu for sm_90: NVRTC_ERROR_COMPILATION (6)")
    assert "undeclared_name" in err.log and "broken.cu(1)" in err.log
    assert err.exit_code == EXIT_INTERNAL  # our own source failing to compile is a bug
