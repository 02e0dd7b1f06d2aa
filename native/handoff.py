"""GIL-free hand-off of INT4 matmul chunks to the runtime's helper threads (``handoff.c``).

``matmul_nbits_batch`` cuts one ``matmul_nbits`` into column chunks, like
``matmul_nbits_parts``, but as one C batch instead of one Python callable per chunk.
A ``Mailbox`` belongs to one run: helper threads lent to the run call
:meth:`Mailbox.serve` (it returns when the run calls :meth:`Mailbox.stop`), and the run
calls :meth:`Mailbox.fork_join` for each batch. The caller runs chunks itself and never
waits for a helper that has not arrived; the result is the same bit for bit whoever runs
which chunk (each column is computed as in a whole call).

NOTE: why in C: handing chunks to helpers as Python callables costs each helper the GIL
before its chunk can start, ~5-20 us on a 2-vCPU VM, about a whole decode GEMV of a few
MB. A helper in ``serve`` waits in C with the GIL released, spinning, so it costs a core
while batches keep coming; after ``spin_ns`` without one it sleeps until the next
(docs/runtime.md, "Intra-op parallelism")."""
from __future__ import annotations

import weakref

import numpy as np

from onnx_prep.native._module import check, ffi, lib
from onnx_prep.native.isa import isa_id
from onnx_prep.native.matmul_nbits import bias_f32, col_range, compute_mode, out_rows, rows_f32
from onnx_prep.native.packed import k_n, ptr


_BATCH_SIZE = ffi.sizeof("op_mm_batch")
_F32 = np.dtype(np.float32)
_TEMPLATE_ROWS = 64  # MatmulSplit.through keeps a batch template per row count up to this


class MatmulBatch:
    """One ``matmul_nbits`` cut into column chunks, ready for :meth:`Mailbox.fork_join`
    (or :meth:`run_here`). Keeps its arrays alive."""

    __slots__ = ("c", "_keep", "chunks")

    def __init__(self, c, keep, chunks: int) -> None:
        self.c, self._keep, self.chunks = c, keep, chunks

    def run_here(self) -> None:
        """Every chunk on the calling thread (no mailbox)."""
        self.c.next = 0
        self.c.done = 0
        lib.op_batch_run(self.c)
        for i in range(self.chunks):
            check(self.c.rcs[i], "matmul_nbits")


class MatmulSplit:
    """The fixed part of one weight's split ``matmul_nbits``: the packed buffer and its
    column ``ranges``, checked and handed to C once. A prepared weight keeps its
    address, so an op that splits the same weight every decode step builds this once
    and then, per call, only the batch of that call's A, bias and Y (:meth:`batch`).

    It holds ``packed`` weakly (``weight``: a weak reference, ``on_release`` called when
    the array goes), so a cache of splits never keeps an evicted weight's memory; each
    batch holds the weight while it lives."""

    __slots__ = ("weight", "K", "N", "chunks", "_mode", "_flat", "_pk", "_nbytes", "_full", "_templates")

    def __init__(self, packed: np.ndarray, ranges, *, compute: str | None = None, on_release=None) -> None:
        self._mode = compute_mode(None, compute)
        self.K, self.N = k_n(packed, lib.OP_KIND_INT4_MATMUL)
        ranges = [col_range(cb, ce, self.N, "matmul_nbits") for cb, ce in ranges]
        self._full = sum(ce - cb for cb, ce in ranges) == self.N
        self.chunks = len(ranges)
        self._flat = ffi.new("int64_t[]", [v for cb, ce in ranges for v in (cb, ce)])
        # the address only: a cdata from ffi.from_buffer would keep the array alive
        self._pk = ffi.cast("uint8_t *", ffi.cast("uintptr_t", ptr(packed, "uint8_t *")))
        self._nbytes = packed.nbytes
        self._templates: dict = {}  # rows -> the batch fields ``through`` copies
        self.weight = weakref.ref(packed) if on_release is None else weakref.ref(packed, on_release)

    def batch(self, A: np.ndarray, *, bias: np.ndarray | None = None,
              out: np.ndarray | None = None) -> tuple[np.ndarray, MatmulBatch]:
        """``(Y, batch)`` for this call's ``A`` (and ``bias``, ``out``), checked here."""
        packed = self.weight()
        if packed is None:
            raise ValueError("matmul_nbits: the split's packed weight was released")
        A2, M, lda = rows_f32(A, self.K, "matmul_nbits")
        bias = bias_f32(bias, self.N, "matmul_nbits")
        res, o2, ldy = out_rows(out, A.shape[:-1], M, self.N, self._full, "matmul_nbits")
        c = ffi.new("op_mm_batch *")
        rcs = ffi.new("int[]", max(1, self.chunks))
        c.A, c.M, c.lda = ptr(A2, "float *"), M, lda
        c.packed, c.nbytes = self._pk, self._nbytes
        c.bias, c.Y, c.ldy = ptr(bias, "float *"), ptr(o2, "float *"), ldy
        c.isa, c.level = isa_id(None), self._mode
        c.ranges, c.n, c.rcs = self._flat, self.chunks, rcs
        return res, MatmulBatch(c, (A2, packed, self._flat, bias, o2, rcs), self.chunks)

    def through(self, box: "Mailbox", A: np.ndarray) -> np.ndarray:
        """``Y = A @ W^T`` for ``A`` a C-contiguous float32 array whose last dimension is
        K, with at least one row (the caller's word: the decode step's bound call,
        core/ops/int4.py), no bias, the chunks handed to ``box``'s helpers:
        ``batch`` and ``Mailbox.fork_join`` in one call, the same C call, the same bits.

        NOTE: a decode step makes ~80 of these, each right after the previous one's
        weights streamed through the caches, where every Python object a call touches
        costs a miss; ``batch`` checks and wraps what the bound call already knows, and
        the batch's fields that stay (the weight, its chunks, K, N, the rows) are set
        once per row count in a template the call copies."""
        packed = self.weight()  # held for the call
        if packed is None:
            raise ValueError("matmul_nbits: the split's packed weight was released")
        if A.dtype != _F32 or not A.ndim or A.shape[-1] != self.K or not A.size:  # the C call reads M x K floats
            raise ValueError(f"matmul_nbits: A must be float32 [..., {self.K}] with rows, got {A.dtype} {A.shape}")
        M = A.size // self.K
        t = self._templates.get(M)
        if t is None:
            t = ffi.new("op_mm_batch *")
            t.M, t.lda, t.packed, t.nbytes, t.ldy = M, self.K, self._pk, self._nbytes, self.N
            t.level, t.ranges, t.n = self._mode, self._flat, self.chunks
            if M <= _TEMPLATE_ROWS:  # a decode step's rows; a prefill's (any count) are not kept
                self._templates[M] = t
        Y = (np.empty if self._full else np.zeros)(A.shape[:-1] + (self.N,), np.float32)
        c = ffi.new("op_mm_batch *")
        ffi.memmove(c, t, _BATCH_SIZE)
        rcs = ffi.new("int[]", max(1, self.chunks))  # owned here: a struct field holds no reference
        c.A, c.Y, c.isa, c.rcs = ffi.from_buffer("float[]", A), ffi.from_buffer("float[]", Y), isa_id(None), rcs
        check(lib.op_mailbox_fork_join(box.c, c), "matmul_nbits")
        return Y


def matmul_nbits_batch(A: np.ndarray, packed: np.ndarray, ranges, *, bias: np.ndarray | None = None,
                       out: np.ndarray | None = None, compute: str | None = None) -> tuple[np.ndarray, MatmulBatch]:
    """``(Y, batch)``: ``matmul_nbits`` over the column ``ranges`` (together: all of Y),
    as one batch. Arguments are checked here, as by ``matmul_nbits_parts``."""
    return MatmulSplit(packed, ranges, compute=compute).batch(A, bias=bias, out=out)


# NOTE: how long an idle helper spins before it sleeps. A hot decode step publishes a
# batch every ~0.1-0.3 ms (its other ops run in between), so 1 ms keeps the helpers
# spinning through a run of the fixtures; a run that stalls in a slow op (the generic
# fallback, say) costs a core for 1 ms instead of for as long as the op takes. A wake
# from sleep costs a futex call on the publishing side and ~10-50 us before the helper
# joins, during which the caller runs the chunks itself.
SPIN_NS_DEFAULT = 1_000_000


class Mailbox:
    """Where one caller at a time publishes its batches to the helpers lent to it.
    ``spin_ns``: how long an idle helper spins before it sleeps until the next publish
    (0: it never sleeps); ``linger_ns``: how long a helper serves without a batch before
    :meth:`serve` returns on its own (0: only at :meth:`stop`)."""

    __slots__ = ("c",)

    def __init__(self, spin_ns: int | None = None, linger_ns: int = 0) -> None:
        spin_ns = SPIN_NS_DEFAULT if spin_ns is None else int(spin_ns)
        if spin_ns < 0 or linger_ns < 0:
            raise ValueError(f"spin_ns and linger_ns must be >= 0, got {spin_ns} and {linger_ns}")
        self.c = ffi.new("op_mailbox *")
        self.c.seq = 1  # closed
        self.c.spin_ns = spin_ns
        self.c.linger_ns = int(linger_ns)

    def serve(self) -> int:
        """Helper side: run chunks of every batch published until :meth:`stop` (GIL
        released all along). Returns the chunks this helper ran."""
        return int(lib.op_mailbox_serve(self.c))

    def stop(self) -> None:
        """Make every ``serve`` return (at once, or when its current chunk ends)."""
        lib.op_mailbox_stop(self.c)

    @property
    def serving(self) -> int:
        """Helpers inside :meth:`serve` right now (one that lingered out has left)."""
        return max(0, int(self.c.serving))

    def fork_join(self, batch: MatmulBatch) -> None:
        """Run ``batch`` with whichever helpers are serving; returns when every chunk is
        done and no helper is inside the batch. Raises NativeError for a failing chunk."""
        check(lib.op_mailbox_fork_join(self.c, batch.c), "matmul_nbits")

    @property
    def chunks_by_helpers(self) -> int:
        return int(self.c.chunks_by_helpers)

    @property
    def sleeps(self) -> int:
        """Times a helper went to sleep after ``spin_ns`` without a batch."""
        return int(self.c.sleeps)

    @property
    def sleepers(self) -> int:
        """Helpers asleep (or about to be) right now."""
        return max(0, int(self.c.sleepers))

    @property
    def wakes(self) -> int:
        """Publishes that found a helper asleep and woke it."""
        return int(self.c.wakes)

    @property
    def batches(self) -> int:
        """Batches published through :meth:`fork_join`."""
        return int(self.c.batches)

    @property
    def solo_batches(self) -> int:
        """Batches whose every chunk the caller ran itself (no helper took one in time)."""
        return int(self.c.solo_batches)

    @property
    def wait_ns(self) -> int:
        """The caller's time waiting, once it had no chunk left to take, for chunks
        helpers were still running (nanoseconds, monotonic clock)."""
        return int(self.c.wait_ns)
