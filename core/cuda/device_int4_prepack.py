"""The INT4 prepack on a CUDA device: the device plan's ``read -> upload the sources ->
prepack on the device`` recipe (core/plan/device_recipes.py, ``read_source_upload_prepack``),
from the source bytes in device memory to the packed object in its device slot.

The kernels (``int4_prepack.cu`` beside this file, shipped as package data) write the
CPU prepack's bytes exactly (native/pack.c), the 64-byte header included, so one packed
format serves the CPU kernels, the device INT4 matmul and the prepared cache whichever
side packed it:

- ``int4_matmul_prepack``: MatMulNBits' B ``[N, n_blocks, block_size / 2]``, scales
  (fp32 / fp16) and zero points (none, packed uint4 ``[N, ceil(n_blocks / 2)]``, fp32 /
  fp16) into the INT4 matmul layout; a block per (64-column panel, K block);
- ``int4_gather_prepack``: GatherBlockQuantized's data ``[V, n_blocks, block_size / 2]``,
  scales and zero points (also one uint4 code a byte, ``[V, n_blocks, 1]``) into the
  INT4 gather layout; a block per table row.

NOTE: the kernel writes the header, not the host. The header is 64 bytes the kernel's
own arguments determine, so one launch makes the whole object (no extra copy from a
page-locked buffer before it, nothing to order between two writers of the slot, and
a captured graph of the prepack holds one node). The header's constants (magic, format
version, kinds, panel width) are the native module's, prepended to the CUDA source as
``#define``\\ s when it is compiled, not repeated in it.

Compiled at run time with NVRTC ONCE per process and device, on first use, like the
device INT4 matmul (core/cuda/device_int4_matmul.py). :meth:`DeviceInt4Prepack.launch`
checks what it can know before launching (the destination view's size against the
native packed size, the sources' sizes where given as views, every address's
alignment, the grid's limit) and queues the kernel on a stream; the bytes are there
once the stream is synchronised. :class:`PrepackStaging` is the whole recipe on one
stream: the sources from page-locked host buffers into a device staging buffer, the
prepack into the weight's :class:`~onnx_prep.core.cuda.device_slot_pool.DeviceSlotPool`
slot, and the staging reused (same stream: ordered after the kernel that read it) or
freed only after the event recorded behind that kernel.

Not built here: a fused DequantizeLinear + MatMul weight (``weight_layout`` "KN": int4 /
uint4 codes ``[K, N]``, which the CPU converts to MatMulNBits' form before packing,
core/ops/int4.py ``dq_to_matmul_nbits``) has no device prepack; :meth:`Int4Source.of_node`
refuses it by name.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from onnx_prep.core.cuda.device_slot_pool import DeviceView
from onnx_prep.core.cuda.compiled_kernels import CompiledKernels, KernelLaunch
from onnx_prep.core.cuda.driver import DeviceDriver, KernelArg
from onnx_prep.core.errors import DeviceError

__all__ = ["DeviceInt4Prepack", "Int4Source", "KERNEL_PARAMS", "KernelLaunch", "PrepackStaging", "kernel_source",
           "plan_prepack"]

SOURCE = Path(__file__).with_name("int4_prepack.cu")
# The kernels' parameters, in order (int4_prepack.cu says the same).
KERNEL_PARAMS: tuple[tuple[str, type], ...] = (
    ("b", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("zp", ctypes.c_void_p), ("out", ctypes.c_void_p),
    ("k", ctypes.c_uint64), ("rows", ctypes.c_uint64), ("block_size", ctypes.c_int32), ("n_blocks", ctypes.c_uint32),
    ("scales_f16", ctypes.c_int32), ("zp_source", ctypes.c_int32), ("flags", ctypes.c_uint32),
    ("stride", ctypes.c_uint64), ("total_size", ctypes.c_uint64))
ENTRIES = {"int4_matmul": "int4_matmul_prepack", "int4_gather": "int4_gather_prepack"}
# The geometry int4_prepack.cu is written for (its #defines).
PREPACK_THREADS = 256
PANEL_N = 64
# Zero points as the source holds them -> the kernels' ZP_SRC_* codes.
ZP_SOURCES = {"none": 0, "u4": 1, "u4_bytes": 2, "float32": 3, "float16": 4}
SCALE_SOURCES = ("float32", "float16")
SOURCE_ALIGNMENT = 4  # bytes: every source and the destination (word loads and stores)
STAGING_ALIGNMENT = 256  # where each source starts in the staging buffer
MAX_GRID_X = 2**31 - 1
HEADER_BYTES = 64
_PARAM_NAMES = tuple(n for n, _ in KERNEL_PARAMS)


@dataclass(frozen=True)
class Int4Source:
    """One INT4 weight's source tensors as the device prepack reads them.

    ``kind``: "int4_matmul" (MatMulNBits: ``rows`` = N output columns, ``K`` its K) or
    "int4_gather" (GatherBlockQuantized: ``rows`` = V table rows, ``K`` their length,
    whole blocks); ``scales``: "float32" | "float16"; ``zero_points``: "none", "u4"
    (two codes a byte, low nibble first, ``ceil(n_blocks / 2)`` bytes a row), "u4_bytes"
    (one code a byte, low nibble: the gather's ``[V, n_blocks, 1]``), "float32" |
    "float16"; ``accuracy_level``: the matmul's, recorded in the header."""

    kind: str
    rows: int
    K: int
    block_size: int
    scales: str = "float32"
    zero_points: str = "none"
    accuracy_level: int = 0

    def __post_init__(self) -> None:
        what = f"device INT4 prepack ({self.kind} rows={self.rows} K={self.K} block_size={self.block_size})"
        if self.kind not in ENTRIES:
            raise DeviceError(f"device INT4 prepack of a {self.kind!r} object: it packs {' and '.join(ENTRIES)}")
        bs = self.block_size
        if not (16 <= bs <= 256 and bs & (bs - 1) == 0):
            raise DeviceError(f"{what}: block_size must be a power of two in [16, 256]")
        if self.rows < 1 or self.K < 1:
            raise DeviceError(f"{what}: rows and K must be positive")
        if self.kind == "int4_gather" and self.K % bs:
            raise DeviceError(f"{what}: a gather's rows are whole blocks")
        if self.scales not in SCALE_SOURCES:
            raise DeviceError(f"{what}: scales of {self.scales}, expected {' or '.join(SCALE_SOURCES)}")
        if self.zero_points not in ZP_SOURCES or (self.kind == "int4_matmul" and self.zero_points == "u4_bytes"):
            allowed = [z for z in ZP_SOURCES if self.kind == "int4_gather" or z != "u4_bytes"]
            raise DeviceError(f"{what}: zero points {self.zero_points!r}, expected one of {', '.join(allowed)}")
        if self.accuracy_level not in ((0, 1, 2, 3, 4) if self.kind == "int4_matmul" else (0,)):
            raise DeviceError(f"{what}: accuracy_level {self.accuracy_level}")

    @classmethod
    def of(cls, kind: str, sources: Sequence[Any], *, block_size: int, K: int | None = None, N: int | None = None,
           accuracy_level: int = 0) -> Int4Source:
        """The source description of host arrays in the lineage order (B or data,
        scales[, zero points]) as the CPU prepack takes them: MatMulNBits' (``K`` and
        ``N`` given), or GatherBlockQuantized's (rows first)."""
        import numpy as np

        data, scales = np.asarray(sources[0]), np.asarray(sources[1])
        zp = np.asarray(sources[2]) if len(sources) > 2 and sources[2] is not None else None
        bs = int(block_size)
        if kind == "int4_gather":
            rows = int(data.shape[0])
            K = 2 * (data.size // rows) if rows else 0
            nb = K // bs
        else:
            rows, K = int(N), int(K)
            nb = -(-K // bs)
        if zp is None:
            zk = "none"
        elif zp.dtype == np.uint8:
            zk = "u4_bytes" if kind == "int4_gather" and nb > 1 and zp.size == rows * nb else "u4"
        else:
            zk = str(zp.dtype)
        return cls(kind, rows, K, bs, str(scales.dtype), zk, int(accuracy_level))

    @classmethod
    def of_node(cls, kind: str, attrs: Mapping[str, Any], weights: Sequence[Any]) -> Int4Source:
        """From a bound node's attributes and its sources' weight descriptors (lineage
        order: B or data, scales[, zero points]), as a device session would have them."""
        if attrs.get("weight_layout", "NK") == "KN":
            raise DeviceError("a fused DequantizeLinear + MatMul weight (int4 [K, N]) has no device prepack: "
                              "pack it on a CPU worker (read_source_prepack_upload)")
        bs = int(attrs.get("block_size", 128))
        data, scales = weights[0], weights[1]
        zp = weights[2] if len(weights) > 2 else None
        if kind == "int4_gather":
            rows = int(scales.dims[0])
            K = 2 * data.length // rows
            nb = K // bs
        else:
            rows, K = int(attrs["N"]), int(attrs["K"])
            nb = -(-K // bs)
        if zp is None:
            zk = "none"
        elif zp.dtype in ("uint8", "uint4"):
            zk = "u4_bytes" if kind == "int4_gather" and nb > 1 and zp.length == rows * nb else "u4"
        else:
            zk = zp.dtype
        return cls(kind, rows, K, bs, scales.dtype, zk, int(attrs.get("accuracy_level", 0)))

    @property
    def n_blocks(self) -> int:
        return -(-self.K // self.block_size)

    @property
    def packed_zero_points(self) -> str:
        """The packed layout's zero-point kind: "none" | "u4" | "float"."""
        return {"none": "none", "u4": "u4", "u4_bytes": "u4"}.get(self.zero_points, "float")

    def source_nbytes(self) -> tuple[int, ...]:
        """The bytes of each source tensor, in the lineage order (B or data, scales[, zero points])."""
        cells = self.rows * self.n_blocks
        sizes = [cells * (self.block_size // 2), cells * (2 if self.scales == "float16" else 4)]
        if self.zero_points != "none":
            sizes.append({"u4": self.rows * ((self.n_blocks + 1) // 2), "u4_bytes": cells, "float32": 4 * cells,
                          "float16": 2 * cells}[self.zero_points])
        return tuple(sizes)

    def packed_size(self) -> int:
        """The packed object's exact size, as the native module computes it."""
        from onnx_prep import native

        if self.kind == "int4_gather":
            return native.gather_packed_size(V=self.rows, n_blocks=self.n_blocks, block_size=self.block_size,
                                             zero_points=self.packed_zero_points)
        return native.matmul_nbits_packed_size(K=self.K, N=self.rows, block_size=self.block_size,
                                               zero_points=self.packed_zero_points, accuracy_level=self.accuracy_level)

    def flags(self) -> int:
        """The header's flags word: the zero-point kind, the accuracy level (matmul),
        whether the scales were fp16."""
        from onnx_prep.native import lib
        from onnx_prep.native.packed import ZP_KINDS

        flags = ZP_KINDS[self.packed_zero_points] | (lib.OP_FLAG_SCALES_F16 if self.scales == "float16" else 0)
        return flags | (self.accuracy_level << lib.OP_FLAG_ACC_SHIFT)

    def stride(self) -> int:
        """The header's ``panel_stride``: bytes per 64-column panel (matmul) or per row (gather)."""
        units = -(-self.rows // PANEL_N) if self.kind == "int4_matmul" else self.rows
        return (self.packed_size() - HEADER_BYTES) // units

    def grid(self) -> tuple[int, int, int]:
        """One block per block record (matmul: panels x K blocks) or per row (gather)."""
        if self.kind == "int4_matmul":
            return (-(-self.rows // PANEL_N) * self.n_blocks, 1, 1)
        return (self.rows, 1, 1)

    def describe(self) -> str:
        return (f"{self.kind} rows={self.rows} K={self.K} block_size={self.block_size} scales={self.scales} "
                f"zero_points={self.zero_points}")

    def header(self) -> Any:
        """The packed object's header (``native.packed.PackedHeader``) as its prepack
        writes it, computed here from the description alone: what a device step's
        launches read (core/cuda/device_graph.py's ``DeviceObject``) before the object
        is on the device, or while it is paged out."""
        from onnx_prep.native import lib
        from onnx_prep.native.packed import PackedHeader

        matmul = self.kind == "int4_matmul"
        return PackedHeader(
            kind=self.kind, format_version=lib.OP_PACK_FORMAT_VERSION,
            K=self.K if matmul else self.n_blocks * self.block_size, N=self.rows, block_size=self.block_size,
            n_blocks=self.n_blocks, zero_points=self.packed_zero_points,
            accuracy_level=self.accuracy_level if matmul else 0, scales_were_f16=self.scales == "float16",
            trans_b=False, panel_n=PANEL_N if matmul else 0, panel_stride=self.stride(),
            total_size=self.packed_size())


def kernel_source() -> str:
    """The CUDA source as compiled: the packed format's constants from the native module
    (``#define``\\ s), then ``int4_prepack.cu``."""
    from onnx_prep.native import lib

    defines = {"OP_PACK_MAGIC": f"{int(lib.OP_PACK_MAGIC):#x}u",
               "OP_PACK_FORMAT_VERSION": int(lib.OP_PACK_FORMAT_VERSION),
               "OP_KIND_INT4_MATMUL": int(lib.OP_KIND_INT4_MATMUL), "OP_KIND_INT4_GATHER": int(lib.OP_KIND_INT4_GATHER),
               "PANEL_N": int(lib.op_packed_panel_n()), "HEADER_BYTES": HEADER_BYTES}
    return "".join(f"#define {k} {v}\n" for k, v in defines.items()) + SOURCE.read_text()


def _address(what: str, given: int | DeviceView, need: int) -> int:
    address = given.address if isinstance(given, DeviceView) else int(given)
    if isinstance(given, DeviceView) and given.nbytes < need:
        raise DeviceError(f"the device view of {what} holds {given.nbytes:,} bytes, its source needs {need:,}")
    if address == 0 or address % SOURCE_ALIGNMENT:
        raise DeviceError(f"device address of {what} {address:#x} is not {SOURCE_ALIGNMENT}-byte aligned device memory")
    return address


def plan_prepack(source: Int4Source, addresses: Sequence[int | DeviceView], dest: DeviceView) -> KernelLaunch:
    """The launch packing ``source`` (its tensors at ``addresses``, lineage order: ints,
    or DeviceViews whose sizes are checked too) into ``dest``, or DeviceError naming what
    does not fit."""
    names = ("B" if source.kind == "int4_matmul" else "data", "scales", "zero points")
    sizes = source.source_nbytes()
    if len(addresses) != len(sizes):
        raise DeviceError(f"device INT4 prepack of {source.describe()} reads {len(sizes)} sources "
                          f"({', '.join(names[:len(sizes)])}), got {len(addresses)} addresses")
    packed = source.packed_size()
    if dest.nbytes != packed:
        raise DeviceError(f"the destination view holds {dest.nbytes:,} bytes, the packed object of "
                          f"{source.describe()} is {packed:,}")
    src = [_address(n, a, s) for n, a, s in zip(names, addresses, sizes)]
    out = _address("the destination", dest, packed)
    grid = source.grid()
    if grid[0] > MAX_GRID_X:
        raise DeviceError(f"device INT4 prepack of {source.describe()} needs {grid[0]:,} blocks, "
                          f"more than a grid holds ({MAX_GRID_X:,})")
    values = {"b": src[0], "scales": src[1], "zp": src[2] if len(src) > 2 else 0, "out": out, "k": source.K,
              "rows": source.rows, "block_size": source.block_size, "n_blocks": source.n_blocks,
              "scales_f16": int(source.scales == "float16"), "zp_source": ZP_SOURCES[source.zero_points],
              "flags": source.flags(), "stride": source.stride(), "total_size": packed}
    args = tuple((ctype, values[name]) for name, ctype in KERNEL_PARAMS)
    return KernelLaunch(ENTRIES[source.kind], grid, (PREPACK_THREADS, 1, 1), args, _PARAM_NAMES)


# compiled once per process and device (compiled_kernels.py)
_KERNELS = CompiledKernels(lambda: kernel_source(), SOURCE.name, ENTRIES.values())
_functions = _KERNELS.functions


class DeviceInt4Prepack:
    """The device INT4 prepack of one device, its kernels compiled on first use."""

    def __init__(self, driver: DeviceDriver, ordinal: int = 0) -> None:
        self.driver = driver
        self.ordinal = ordinal
        self._functions = _functions(driver, ordinal)

    def launch(self, stream: Any, addresses: Sequence[int | DeviceView], dest: DeviceView,
               source: Int4Source) -> KernelLaunch:
        """Queue the prepack of ``source`` (its tensors already on the device at
        ``addresses``: B or data, scales[, zero points]) into ``dest`` (the weight's
        slot view, exactly the packed size) on ``stream``. Nothing is read back: the
        packed bytes are there once the stream is synchronised, and the sources must stay
        where they are until then."""
        plan = plan_prepack(source, addresses, dest)
        self.driver.launch(self._functions[plan.name], plan.grid, plan.block, plan.shared_bytes, stream, plan.args)
        return plan


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class PrepackStaging:
    """The recipe ``upload the sources -> prepack on the device`` on one ``stream``:
    :meth:`prepack` copies a weight's sources from page-locked host buffers
    (``driver.host_alloc``'s) into a device staging buffer, commits the weight's slot in
    ``pool`` and queues the prepack into it.

    The staging buffer is reused by the next prepack on the same stream without a wait
    (its copies are queued behind the kernel that read the previous sources); when it
    must grow, or at :meth:`close`, the event recorded after the last prepack is waited
    for first, so no queued kernel reads freed memory. The host buffers likewise stay
    untouched until :meth:`wait` (or a synchronisation of the stream) returns.
    Counters: ``prepacks``, ``staged_bytes`` (host to device, into staging; the pool
    counts what it uploads itself), ``staging_bytes`` (the buffer's size now)."""

    def __init__(self, driver: DeviceDriver, pool: Any, stream: Any) -> None:
        self.driver, self.pool, self.stream = driver, pool, stream
        self.kernels = DeviceInt4Prepack(driver, pool.device)
        self._staging = 0
        self.staging_bytes = 0
        self._event = driver.event_create()
        self._pending = False
        self.prepacks = 0
        self.staged_bytes = 0

    def prepack(self, key: Any, source: Int4Source, host_sources: Sequence[Any]) -> DeviceView:
        """Queue ``key``'s object: its sources (page-locked host buffers, lineage order)
        into staging, then the prepack into its slot (committed now, exactly the packed
        size); returns the slot's view. DeviceError (nothing queued) when a buffer's size
        is not its source's."""
        sizes = source.source_nbytes()
        if len(host_sources) != len(sizes):
            raise DeviceError(f"device INT4 prepack of {source.describe()} reads {len(sizes)} sources, "
                              f"got {len(host_sources)} host buffers")
        for i, (host, need) in enumerate(zip(host_sources, sizes)):
            if memoryview(host).nbytes != need:
                raise DeviceError(f"source {i} of {source.describe()} holds {memoryview(host).nbytes:,} bytes, "
                                  f"expected {need:,}")
        offsets, total = [], 0
        for need in sizes:
            offsets.append(total)
            total = _round_up(total + need, STAGING_ALIGNMENT)
        if total > self.staging_bytes:
            self._grow(total)
        dest = self.pool.commit(key, source.packed_size())
        for host, offset in zip(host_sources, offsets):
            self.driver.copy_to_device_async(self._staging + offset, host, self.stream)
        views = [DeviceView(self._staging + o, n) for o, n in zip(offsets, sizes)]
        self.kernels.launch(self.stream, views, dest, source)
        self.driver.event_record(self._event, self.stream)
        self._pending = True
        self.prepacks += 1
        self.staged_bytes += sum(sizes)
        return dest

    def wait(self) -> None:
        """Until the last queued prepack has run: its host buffers may be reused."""
        if self._pending:
            self.driver.event_synchronize(self._event)
            self._pending = False

    def close(self) -> None:
        """Wait for the last prepack, free the staging buffer and the event (idempotent)."""
        if self._event is None:
            return
        self.wait()
        if self._staging:
            self.driver.mem_free(self._staging)
            self._staging, self.staging_bytes = 0, 0
        self.driver.event_destroy(self._event)
        self._event = None

    def _grow(self, nbytes: int) -> None:
        self.wait()  # a queued prepack may still read the old buffer
        if self._staging:
            self.driver.mem_free(self._staging)
            self._staging, self.staging_bytes = 0, 0
        self._staging = self.driver.mem_alloc(nbytes)
        self.staging_bytes = nbytes

    def __enter__(self) -> PrepackStaging:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
