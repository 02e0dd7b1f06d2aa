"""INT4 matmul with ONNX Runtime ``com.microsoft.MatMulNBits`` semantics (bits = 4).

``prepack_matmul_nbits`` turns the op's source tensors into the packed layout the
kernels read (see op_internal.h for the byte layout); ``matmul_nbits`` computes
``Y = A x dequant(B) (+ bias)`` on a caller-given column range, with the GIL
released, so the runtime's executor splits a call across its workers.
"""
from __future__ import annotations

import numpy as np

from onnx_prep.native._module import check, ffi, lib
from onnx_prep.native.isa import isa_id
from onnx_prep.native.packed import ZP_KINDS, k_n, new_buffer, ptr

ACCURACY_LEVELS = (0, 1, 2, 3, 4)  # 0-3: fp32-accurate compute; 4: int8 compute (ORT semantics)
# Compute modes beyond the level's own: "fma" runs IEEE fp32 FMA chains (one per output
# and block, ascending k) instead of the levels 0-3 block floating point path.
COMPUTE_MODES = ("fma",)
PANEL_N = int(lib.op_packed_panel_n())  # columns per packed panel: split column ranges on it


def zero_point_kind(zero_points) -> str:
    """"none" | "u4" | "float" for a zero-point argument: None, one of those names,
    or the zero-point array itself (uint8 = packed uint4, a float type = float)."""
    if zero_points is None:
        return "none"
    if isinstance(zero_points, str):
        if zero_points not in ZP_KINDS:
            raise ValueError(f"zero_points kind {zero_points!r}: use one of {', '.join(ZP_KINDS)}")
        return zero_points
    dt = np.asarray(zero_points).dtype
    if dt == np.uint8:
        return "u4"
    if dt in (np.float16, np.float32):
        return "float"
    raise ValueError(f"zero points of dtype {dt}: expected uint8 (packed uint4) or the scales' float type")



def zero_point_arrays(zero_points, kind: str, rows: int, nb: int, unpack_u4):
    """(u4 codes or None, float zero points or None) for the C prepack: packed uint4 zero
    points are unpacked by ``unpack_u4(zero_points, rows, nb)`` (each op packs them its own
    way); float ones are flattened to fp32 and must hold ``rows * nb`` values."""
    if kind == "u4":
        return unpack_u4(zero_points, rows, nb), None
    if kind == "float":
        zf = np.ascontiguousarray(zero_points, dtype=np.float32).reshape(-1)
        if zf.size != rows * nb:
            raise ValueError(f"float zero points hold {zf.size} values, expected {rows * nb}")
        return None, zf
    return None, None

def _check_level(accuracy_level: int) -> int:
    level = int(accuracy_level)
    if level not in ACCURACY_LEVELS:
        raise ValueError(f"accuracy_level {accuracy_level}: MatMulNBits defines 0-4")
    return level


def compute_mode(accuracy_level: int | None, compute: str | None) -> int:
    """The C call's ``accuracy_level`` argument: -1 (the packed buffer's level), a level
    0-4, or OP_COMPUTE_FMA32 for ``compute="fma"``."""
    if compute is None:
        return -1 if accuracy_level is None else _check_level(accuracy_level)
    if compute not in COMPUTE_MODES:
        raise ValueError(f"compute {compute!r}: use one of {', '.join(COMPUTE_MODES)} (or None: the level's)")
    if accuracy_level is not None:
        raise ValueError("give accuracy_level or compute, not both")
    return int(lib.OP_COMPUTE_FMA32)


def matmul_nbits_packed_size(*, K: int, N: int, block_size: int, zero_points, accuracy_level: int = 0) -> int:
    """Exact byte size of the packed buffer (header included). ``zero_points``: None,
    "none" | "u4" | "float", or the zero-point array. No I/O, no allocation."""
    _check_level(accuracy_level)
    size = lib.op_matmul_nbits_packed_size(int(K), int(N), int(block_size),
                                           ZP_KINDS[zero_point_kind(zero_points)])
    if size == 0:
        raise ValueError(f"invalid MatMulNBits shape K={K} N={N} block_size={block_size} "
                         "(block_size must be a power of two in [16, 256])")
    return int(size)


def unpack_u4_zero_points(zero_points: np.ndarray, N: int, n_blocks: int) -> np.ndarray:
    """MatMulNBits uint8 zero points ``[N, ceil(n_blocks / 2)]`` (two uint4 per byte,
    low nibble first) -> one code per byte, ``[N * n_blocks]``."""
    zp = np.asarray(zero_points, dtype=np.uint8)
    per_col = (n_blocks + 1) // 2
    if zp.size != N * per_col:
        raise ValueError(f"uint8 zero points hold {zp.size} bytes, expected N * ceil(n_blocks / 2) = {N * per_col}")
    zp = zp.reshape(N, per_col)
    codes = np.empty((N, per_col * 2), dtype=np.uint8)
    codes[:, 0::2] = zp & 0x0F
    codes[:, 1::2] = zp >> 4
    return np.ascontiguousarray(codes[:, :n_blocks]).reshape(-1)


def prepack_matmul_nbits(B: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, *, K: int,
                         N: int, block_size: int, accuracy_level: int = 0,
                         out: np.ndarray | None = None) -> np.ndarray:
    """Pack MatMulNBits sources into the kernels' layout.

    B: uint8 ``[N, n_blocks, block_size / 2]`` (any shape of that size); scales:
    fp16 or fp32, ``N * n_blocks``; zero_points: None (implicit 8), uint8 packed uint4
    ``[N, ceil(n_blocks / 2)]``, or the scales' float type ``N * n_blocks``.
    Returns a uint8 array of exactly :func:`matmul_nbits_packed_size` bytes (a slice
    of ``out`` when given). Deterministic: equal inputs give byte-identical output.
    """
    K, N, bs = int(K), int(N), int(block_size)
    level = _check_level(accuracy_level)
    kind = zero_point_kind(zero_points)
    size = matmul_nbits_packed_size(K=K, N=N, block_size=bs, zero_points=kind, accuracy_level=level)
    nb = -(-K // bs)
    B = np.asarray(B)
    if B.dtype != np.uint8 or B.size != N * nb * (bs // 2):
        raise ValueError(f"B must be uint8 [N={N}, n_blocks={nb}, {bs // 2}], got {B.dtype} {B.shape}")
    scales = np.asarray(scales)
    if scales.dtype not in (np.float16, np.float32) or scales.size != N * nb:
        raise ValueError(f"scales must be fp16/fp32 with N * n_blocks = {N * nb} values, got {scales.dtype} {scales.shape}")
    B = np.ascontiguousarray(B)
    sc = np.ascontiguousarray(scales, dtype=np.float32).reshape(-1)
    zu, zf = zero_point_arrays(zero_points, kind, N, nb, unpack_u4_zero_points)
    buf = new_buffer(size, out, "prepack_matmul_nbits")
    check(lib.op_prepack_matmul_nbits(ptr(B, "uint8_t *"), ptr(sc, "float *"), ptr(zu, "uint8_t *"),
                                      ptr(zf, "float *"), K, N, bs, ZP_KINDS[kind], level,
                                      int(scales.dtype == np.float16), ptr(buf, "uint8_t *"), size),
          "prepack_matmul_nbits")
    return buf


def rows_f32(A: np.ndarray, K: int, what: str) -> tuple[np.ndarray, int, int]:
    """A as a C-contiguous float32 [M, K] array (a view when A already is): (A2, M, lda)."""
    if not isinstance(A, np.ndarray) or A.dtype != np.float32:
        raise ValueError(f"{what}: A must be a float32 numpy array")
    if A.ndim == 0 or A.shape[-1] != K:
        raise ValueError(f"{what}: A's last dimension must be K={K}, got shape {A.shape}")
    A2 = A if A.ndim == 2 and A.flags.c_contiguous else np.ascontiguousarray(A).reshape(-1, K)
    if A2.shape[0] == 0:
        raise ValueError(f"{what}: A has no rows")
    return A2, A2.shape[0], K


def out_rows(out: np.ndarray | None, lead: tuple[int, ...], M: int, N: int, full: bool,
             what: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(the array to return, its [M, N] view, ldy); zero-filled when only part is written."""
    if out is None:
        res = (np.empty if full else np.zeros)(lead + (N,), dtype=np.float32)
        return res, res.reshape(M, N), N
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.size != M * N \
            or out.shape[-1] != N or not out.flags.writeable or not out.flags.c_contiguous:
        raise ValueError(f"{what}: out must be a writable C-contiguous float32 array of {M} x {N}")
    return out, out.reshape(M, N), N


def col_range(col_begin: int, col_end: int | None, N: int, what: str) -> tuple[int, int]:
    cb, ce = int(col_begin), N if col_end is None else int(col_end)
    if not 0 <= cb <= ce <= N:
        raise ValueError(f"{what}: column range [{cb}, {ce}) is not within [0, {N}]")
    return cb, ce


def bias_f32(bias: np.ndarray | None, N: int, what: str) -> np.ndarray | None:
    """``bias`` as N contiguous float32 values (None stays None)."""
    if bias is None:
        return None
    bias = np.ascontiguousarray(bias, dtype=np.float32).reshape(-1)
    if bias.size != N:
        raise ValueError(f"{what}: bias must have N={N} values, got {bias.size}")
    return bias


def split_args(A: np.ndarray, packed: np.ndarray, ranges, bias, out):
    """A split matmul's arguments, checked once: ``(Y, A2, M, lda, bias, ranges, o2, ldy)``
    (Y the result, o2 its 2-D row view); for :func:`matmul_nbits_parts`
    (``handoff.MatmulSplit`` checks the same, its weight once and A per call)."""
    K, N = k_n(packed, lib.OP_KIND_INT4_MATMUL)
    A2, M, lda = rows_f32(A, K, "matmul_nbits")
    bias = bias_f32(bias, N, "matmul_nbits")
    ranges = [col_range(cb, ce, N, "matmul_nbits") for cb, ce in ranges]
    covered = sum(ce - cb for cb, ce in ranges)
    res, o2, ldy = out_rows(out, A.shape[:-1], M, N, covered == N, "matmul_nbits")
    return res, A2, M, lda, bias, ranges, o2, ldy


def matmul_nbits_parts(A: np.ndarray, packed: np.ndarray, ranges, *, bias: np.ndarray | None = None,
                       out: np.ndarray | None = None, compute: str | None = None) -> tuple[np.ndarray, list]:
    """``matmul_nbits`` cut into column ranges for a caller that runs them on several
    threads: returns ``(Y, calls)``, one zero-argument callable per ``(col_begin,
    col_end)`` of ``ranges``, each filling its columns of ``Y`` (all of them together:
    all of Y). Arguments are checked and pointers taken once, here; a call costs one C
    call (about 1 us instead of ~5 us through :func:`matmul_nbits`), which matters when a
    decode GEMV is cut into several parts. Each column is computed as in a whole call:
    the result is equal bit for bit. ``A``, ``packed``, ``bias`` and ``Y`` stay alive as
    long as the callables. ``compute``: as for :func:`matmul_nbits`."""
    mode = compute_mode(None, compute)
    res, A2, M, lda, bias, ranges, o2, ldy = split_args(A, packed, ranges, bias, out)
    fn, isa = lib.op_matmul_nbits, isa_id(None)
    a_p, pk_p, b_p, y_p = ptr(A2, "float *"), ptr(packed, "uint8_t *"), ptr(bias, "float *"), ptr(o2, "float *")
    nbytes = packed.nbytes
    keep = (A2, packed, bias, o2)

    def call(cb: int, ce: int, keep=keep) -> None:
        check(fn(isa, a_p, M, lda, pk_p, nbytes, b_p, y_p, ldy, cb, ce, mode), "matmul_nbits")

    return res, [lambda cb=cb, ce=ce: call(cb, ce) for cb, ce in ranges]


def set_weight_streaming(on: bool) -> bool:
    """Whether INT4 matmul passes that read their weights once (decode GEMVs) prefetch
    them non-temporally, past the caches, so the weights they stream do not evict what
    the ops between them use (native/op_internal.h, ``OP_STREAM_AHEAD``). On by default
    here; a session sets it to core/ops/weight_streaming.py's choice for the machine;
    process-wide; the same bits either way. Returns the previous setting: for
    benchmarks that time both in one run (scripts/gemv_step_profile.py --compare streaming)."""
    return bool(lib.op_set_weight_streaming(1 if on else 0))


def probe_weight_streaming(nbytes: int = 512 << 10, passes: int = 3) -> tuple[float, float] | None:
    """What streaming costs here: the fastest of ``passes`` reads of an ``nbytes``
    buffer flushed from the caches, plainly and with the GEMVs' non-temporal prefetch
    (seconds, plain first); None where it cannot be measured (not an x86 CPU, no
    memory). core/ops/weight_streaming.py decides from it."""
    nbytes = max(64, int(nbytes) // 64 * 64)
    out = ffi.new("int64_t[2]")
    if lib.op_probe_weight_streaming(nbytes, int(passes), out, out + 1) != 0:
        return None
    return out[0] * 1e-9, out[1] * 1e-9


def set_gemv_panels(panels: int) -> int:
    """How many whole 64-column panels a one-row int8 GEMV (accuracy level 4 at batch 1,
    AVX-512) reads side by side: 2, the default (two sequential streams keep more reads
    in flight: native/kernels_avx512.c, ``DEFINE_I8_PANEL_PAIR``), or 1. Process-wide;
    the same bits either way. Returns the previous setting: for benchmarks that time
    both in one run (scripts/gemv_step_profile.py --compare panels)."""
    return int(lib.op_set_gemv_panels(int(panels)))


def set_amx(on: bool) -> bool:
    """Whether INT4 matmuls of several rows (4 and up at levels 0-3, each whole 16 at
    level 4: a prompt's prefill, a batch's decode step) run on AMX tiles where the CPU
    has them (native/kernels_amx.c; ISA avx512).
    On by default; process-wide, read when a matmul is prepared; the same bits either
    way. Returns the previous setting: for tests and benchmarks that compare both."""
    return bool(lib.op_set_amx(1 if on else 0))


def matmul_nbits(A: np.ndarray, packed: np.ndarray, *, bias: np.ndarray | None = None,
                 out: np.ndarray | None = None, col_begin: int = 0, col_end: int | None = None,
                 accuracy_level: int | None = None, isa: str | None = None,
                 compute: str | None = None) -> np.ndarray:
    """``Y[..., c] = A x dequant(B) (+ bias)`` for c in [col_begin, col_end).

    A: float32 ``[..., K]`` (copied if not C-contiguous). Only the
    range's columns of ``out`` are written; a fresh ``out`` is zeros outside the
    range. accuracy_level None = the packed buffer's; 0-3 compute fp32-accurately
    (block floating point: A as 24-bit mantissas per block, exact integer dot
    products; ONNX Runtime computes 0 and 1 alike), 4 quantizes A per block to int8
    (ONNX Runtime's semantics). ``compute="fma"`` (instead of a level) runs IEEE fp32
    FMA chains, one per output and block in ascending k: as accurate, slower at
    decode. ``isa`` forces a kernel path (tests, benchmarks); default
    :func:`active_isa`.
    Releases the GIL for the whole computation. For work splitting, column ranges
    on multiples of :data:`PANEL_N` avoid computing a shared panel twice.
    """
    K, N = k_n(packed, lib.OP_KIND_INT4_MATMUL)
    A2, M, lda = rows_f32(A, K, "matmul_nbits")
    cb, ce = col_range(col_begin, col_end, N, "matmul_nbits")
    level = compute_mode(accuracy_level, compute)
    bias = bias_f32(bias, N, "matmul_nbits")
    res, o2, ldy = out_rows(out, A.shape[:-1], M, N, cb == 0 and ce == N, "matmul_nbits")
    check(lib.op_matmul_nbits(isa_id(isa), ptr(A2, "float *"), M, lda, ptr(packed, "uint8_t *"), packed.nbytes,
                              ptr(bias, "float *"), ptr(o2, "float *"), ldy, cb, ce, level),
          "matmul_nbits")
    return res
