"""The device INT4 matmul's CUDA code run on the host, where no GPU is: every entry of
``int4_matmul.cu`` (the GEMVs for M 1, 2, 4, 8 and the tiled kernel), unchanged, built
by tests/cuda_host.py and launched with the very entry, grid, block and arguments
``device_int4_matmul.plan_launch`` decides, over the CPU prepack's bytes, into an
output prefilled with NaN garbage (rows strided past N: the padding must stay garbage).

Against the CPU kernel's FMA mode on the scalar path (``native.matmul_nbits(...,
compute="fma", isa="scalar")``), held to what device_int4_matmul.py's docstring
claims: the tiled kernel (M > 8) in its very order, bit for bit; the GEMV within fp32
reassociation, i.e. test_cuda_gpu_int4_matmul.py's bound (the CPU FMA mode's, plus
GEMV_WARPS roundings for the warps' sums; against float64 and twice that against the
CPU), and bit for bit where the K blocks are one (warp 0 holds the only block, the
other warps add zeros). Random shapes: M 1-33, K and N off the block and the 64-column
panel, block sizes 16-256, every zero-point kind, bias or not, A's rows 16-byte aligned
(the GEMV's vector loads) or not, strided A and Y.

The fake driver's twin of these entries is the CPU kernel itself: this is where the
kernels' own index arithmetic, shared-memory tiling and fold order are checked without
a GPU. What only a device shows (NVRTC's code, the memory model, alignment faults of
plain loads): test_cuda_nvrtc.py and test_cuda_gpu_int4_matmul.py. Skipped, saying so,
without a C++20 compiler."""
from __future__ import annotations

import numpy as np
import pytest
from cuda_host import host_kernels
from cuda_steps import MatmulCase, matmul_case
from test_cuda_gpu_int4_matmul import assert_matches

from onnx_prep import native
from onnx_prep.core.cuda.device_int4_matmul import ENTRIES, KERNEL_PARAMS, ZP_KINDS, kernel_source, plan_launch
from onnx_prep.core.cuda.device_slot_pool import DeviceView

GARBAGE = np.uint32(0x7FBADBAD)  # a NaN: an element the kernel should have written and did not shows


class ScalarCase(MatmulCase):
    def cpu(self, A=None) -> np.ndarray:
        """The CPU kernel's FMA mode on the scalar path: the order the kernels claim."""
        return native.matmul_nbits(self.A if A is None else A, self.packed, bias=self.bias, compute="fma",
                                   isa="scalar")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    return host_kernels(tmp_path_factory, kernel_source(), ENTRIES)


def strided(rows: int, cols: int, ld: int, aligned: bool) -> np.ndarray:
    """A float32 [rows, cols] view with row stride ``ld`` whose start is 16-byte aligned or 4 bytes past."""
    buf = np.zeros(rows * ld + 8, np.float32)
    start = (-buf.ctypes.data % 16) // 4 + (0 if aligned else 1)
    return buf[start:start + rows * ld].reshape(rows, ld)[:, :cols]


def run(kernels, case: MatmulCase, *, lda: int, ldy: int, aligned: bool, zp_kind: int | None = None):
    """(Y [M, N], the launch): the launch plan_launch decides, run on the host."""
    M, K = case.A.shape
    header = native.packed_header(case.packed)
    a = strided(M, K, lda, aligned)
    a[:] = case.A
    y = np.full((M, ldy), GARBAGE, np.uint32)
    bias = case.bias
    plan = plan_launch(header, M, a.ctypes.data, DeviceView(case.packed.ctypes.data, case.packed.nbytes),
                       y.ctypes.data, lda=lda, ldy=ldy, bias_addr=0 if bias is None else bias.ctypes.data)
    args = plan.args
    if zp_kind is not None:  # a misdescribed launch, for the negative control
        at = [name for name, _ in KERNEL_PARAMS].index("zp_kind")
        args = tuple((t, zp_kind if i == at else v) for i, (t, v) in enumerate(args))
    kernels.launch(plan.name, plan.grid, plan.block, plan.shared_bytes, args)
    assert (y[:, header.N:] == GARBAGE).all(), "the kernel wrote past N in Y's row padding"
    return y[:, :header.N].view(np.float32), plan


def random_case(rng, M: int, bs: int, zp: str) -> tuple[ScalarCase, dict]:
    K = int(rng.integers(1, 5 * bs))
    K += K % 64 == 0 or K % bs == 0  # off the panel and the block
    N = int(rng.integers(1, 160))
    N += N % 64 == 0
    case = matmul_case(int(rng.integers(1 << 30)), M, K, N, bs, zp, bias=bool(rng.integers(2)),
                       accuracy_level=int(rng.integers(4)))
    layout = {"lda": K + int(rng.integers(0, 3)) * 4 + int(rng.integers(0, 2)), "ldy": N + int(rng.integers(0, 5)),
              "aligned": bool(rng.integers(2))}
    return ScalarCase(case.A, case.packed, case.bias, case.sources), layout


@pytest.mark.parametrize("zp", list(ZP_KINDS))
@pytest.mark.parametrize("bs", [16, 32, 64, 128, 256])
def test_the_tiled_kernel_is_the_cpu_fma_mode_bit_for_bit(kernels, bs, zp):
    rng = np.random.default_rng(bs * 10 + len(zp))
    for M in (9, int(rng.integers(10, 34))):
        case, layout = random_case(rng, M, bs, zp)
        got, plan = run(kernels, case, **layout)
        assert plan.name == "int4_matmul_tiled"
        want = case.cpu()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (
            f"M={M} K={case.A.shape[1]} N={got.shape[1]} {layout}: {np.count_nonzero(got != want)} elements differ, "
            f"the worst by {np.max(np.abs(got.astype(np.float64) - want)):.3g}")


@pytest.mark.parametrize("zp", list(ZP_KINDS))
@pytest.mark.parametrize("bs", [16, 32, 64, 128, 256])
def test_the_gemv_is_the_cpu_fma_mode_within_fp32_reassociation(kernels, bs, zp):
    rng = np.random.default_rng(bs * 10 + len(zp) + 1)
    for M in range(1, 9):
        case, layout = random_case(rng, M, bs, zp)
        got, plan = run(kernels, case, **layout)
        assert plan.name == f"int4_matmul_gemv_m{next(r for r in (1, 2, 4, 8) if r >= M)}"
        assert np.isfinite(got).all()
        assert_matches(got, case, f"{plan.name} M={M} {layout}")


@pytest.mark.parametrize("M", [1, 3, 8])
def test_the_gemv_over_one_k_block_is_the_cpu_fma_mode_bit_for_bit(kernels, M):
    rng = np.random.default_rng(M)
    for bs in (16, 64, 256):
        case = matmul_case(M * 100 + bs, M, int(rng.integers(1, bs + 1)), int(rng.integers(1, 200)), bs, "float",
                           bias=M != 3)
        case = ScalarCase(case.A, case.packed, case.bias, case.sources)
        got, _ = run(kernels, case, lda=case.A.shape[1], ldy=got_ldy(case), aligned=True)
        assert np.array_equal(got.view(np.uint32), case.cpu().view(np.uint32))


def got_ldy(case: MatmulCase) -> int:
    return native.packed_header(case.packed).N + 3


@pytest.mark.parametrize("M", [2, 20])
def test_a_misdescribed_launch_is_caught(kernels, M):
    """The comparisons can fail: the same launch told the zero points are absent when
    they are uint4 (records read at the wrong stride, the implicit 8) gives other numbers."""
    case = matmul_case(5, M, 300, 70, 32, "u4")
    case = ScalarCase(case.A, case.packed, case.bias, case.sources)
    got, _ = run(kernels, case, lda=300, ldy=70, aligned=True, zp_kind=ZP_KINDS["none"])
    with pytest.raises(AssertionError):
        assert_matches(got, case, "misdescribed")
