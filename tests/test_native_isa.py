"""ISA selection: detection, the ONNX_PREP_ISA override and its errors, version check."""
from __future__ import annotations

import numpy as np
import pytest

from onnx_prep import native
from onnx_prep.core.errors import NativeError
from onnx_prep.native import isa as isa_mod


def test_scalar_is_always_available_and_active_is_available():
    avail = native.available_isas()
    assert avail[0] == "scalar"
    assert native.active_isa() in avail


def test_env_var_forces_each_available_isa(monkeypatch):
    for name in native.available_isas():
        monkeypatch.setenv("ONNX_PREP_ISA", name)
        assert native.active_isa() == name
    # the variable is read where os.environ writes it (native/isa.py _env_isa): a change
    # or removal shows at the next call, and the kernels follow
    monkeypatch.setenv("ONNX_PREP_ISA", "scalar")
    assert native.active_isa() == "scalar"
    native.matmul_nbits(np.ones((1, 32), np.float32), native.prepack_matmul_nbits(
        np.zeros((4, 1, 16), np.uint8), np.ones(4, np.float32), None, K=32, N=4, block_size=32))
    assert native.last_kernel() == "scalar"
    monkeypatch.delenv("ONNX_PREP_ISA")
    assert native.active_isa() == native.available_isas()[-1]


def test_unknown_isa_lists_the_valid_ones(monkeypatch):
    monkeypatch.setenv("ONNX_PREP_ISA", "sse9")
    with pytest.raises(NativeError, match="scalar, avx2, avx512"):
        native.active_isa()


def test_forcing_an_isa_the_build_or_cpu_lacks_is_a_clear_error(monkeypatch):
    missing = [n for n in isa_mod.ISAS if n not in native.available_isas()]
    if not missing:
        # Every ISA runs here; prove the refusal path through the C check instead:
        # an out-of-range ISA id must be refused by the kernel itself.
        from onnx_prep.native._module import lib, ffi
        g = native.prepack_gemm_b(np.ones((4, 4), np.float32), trans_b=False)
        a = np.ones((1, 4), np.float32)
        y = np.zeros((1, 4), np.float32)
        st = lib.op_gemm(99, ffi.from_buffer("float[]", a), 1, 4, ffi.from_buffer("uint8_t[]", g), g.nbytes,
                         ffi.NULL, 0, 0, 1.0, 0.0, ffi.from_buffer("float[]", y), 4, 0, 4)
        assert st == lib.OP_E_ISA
        return
    monkeypatch.setenv("ONNX_PREP_ISA", missing[0])
    with pytest.raises(NativeError, match="forced"):
        native.active_isa()


def test_cpu_features_are_consistent():
    f = native.cpu_features()
    assert not f["avx512_vnni"] or f["avx512"]
    assert not f["avx512"] or f["avx2_fma"]


def test_native_version_matches_package():
    from onnx_prep import __version__
    assert native.NATIVE_VERSION == __version__


def test_forcing_an_isa_missing_here_names_the_available_ones(monkeypatch):
    # Simulate a CPU with only the scalar path; the error must say what to use instead.
    monkeypatch.setattr(isa_mod, "available_isas", lambda: ("scalar",))
    with pytest.raises(NativeError, match="ONNX_PREP_ISA=avx512 was forced.*available here: scalar"):
        isa_mod.select_isa("avx512")


def test_kernels_follow_the_forced_isa_and_refuse_bad_values(monkeypatch):
    g = native.prepack_gemm_b(np.ones((8, 8), np.float32), trans_b=False)
    monkeypatch.setenv("ONNX_PREP_ISA", "bogus")
    with pytest.raises(NativeError, match="not an ISA name"):
        native.gemm(np.ones((1, 8), np.float32), g)
    monkeypatch.setenv("ONNX_PREP_ISA", "scalar")
    assert native.gemm(np.ones((1, 8), np.float32), g).tolist() == [[8.0] * 8]


def test_stale_module_version_is_refused_with_a_rebuild_hint(monkeypatch):
    import onnx_prep
    from onnx_prep.native import _module
    monkeypatch.setattr(onnx_prep, "__version__", "9.9.9")
    with pytest.raises(NativeError, match="rebuild"):
        _module._check_version()


def test_kernel_variants_are_not_env_values(monkeypatch):
    assert set(native.available_isas()) <= set(native.kernel_variants())
    monkeypatch.setenv("ONNX_PREP_ISA", "avx512-novnni")
    with pytest.raises(NativeError, match="not an ISA name"):
        native.active_isa()


def test_unavailable_reason_is_none_exactly_for_the_paths_that_run():
    for name in isa_mod.ISAS + isa_mod.VARIANTS:
        reason = native.unavailable_reason(name)
        assert (reason is None) == (name in native.kernel_variants()), (name, reason)
        if reason:  # on a CPU without it: the features it lacks, and what it has
            assert reason.startswith(f"{name}: ") and ("lacks" in reason or "no code" in reason)
    with pytest.raises(ValueError, match="not an ISA"):
        native.unavailable_reason("sse9")


def test_a_missing_isa_is_a_visible_skip_with_its_reason(monkeypatch):
    # This CPU may run every path; stand in a CPU without AVX-512 for the question.
    from test_native_reference import isa_params
    lacks = "avx512: CPU lacks avx512f/avx512bw/avx512vl/avx512dq; it has: avx2_fma"
    monkeypatch.setattr(native, "unavailable_reason", lambda n: lacks if n.startswith("avx512") else None)
    params = isa_params(isa_mod.ISAS + isa_mod.VARIANTS)
    assert [p if isinstance(p, str) else p.values[0] for p in params] == list(isa_mod.ISAS + isa_mod.VARIANTS)
    skipped = {p.values[0]: [m.kwargs["reason"] for m in p.marks] for p in params if not isinstance(p, str)}
    assert skipped == {"avx512": [lacks], "avx512-novnni": [lacks]}


def test_isa_names_import_without_the_compiled_module():
    import subprocess
    import sys
    code = ("import sys; sys.modules['onnx_prep.native._native'] = None\n"
            "from onnx_prep.native.isa import ISAS, VARIANTS, KERNEL_CODES\n"
            "from onnx_prep.native.layouts import PACK_FORMAT_VERSION\n"
            "print(ISAS, VARIANTS, KERNEL_CODES)\n"
            "import onnx_prep.native as n\n"
            "try:\n    n.active_isa()\nexcept Exception as e:\n    print(type(e).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [f"{isa_mod.ISAS} {isa_mod.VARIANTS} {isa_mod.KERNEL_CODES}", "NativeError"]
