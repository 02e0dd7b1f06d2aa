"""Model resolution (core/model/resolution.py, transforms.py, core/kernels): real ONNX
files with real external data; ONNX Runtime and onnx's own loader as oracles."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import sys
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from onnx_prep.core.errors import DigestError, ModelFormatError, UnsafePathError
from onnx_prep.core.io.external_data import ExternalDataReader
from onnx_prep.core.kernels.numpy_ops import NUMPY_OPS
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.model.resolved_model import require_frozen
from onnx_prep.core.model.weights import DigestSource
from onnx_prep.core.kernels.gemm_packed import gemm_b_layout
from onnx_prep.core.kernels.int4_matmul import matmul_nbits_layout

from test_resolve_models import (
    DATA,
    custom_op_model,
    gemm_model,
    matmul_nbits_model,
    qdq_matmul_model,
    single_weight_model,
    tied_int4_model,
    write_model,
    from_array,
)


def _copy_model(src: Path, dst_dir: Path) -> Path:
    dst_dir.mkdir(parents=True, exist_ok=True)
    for f in src.parent.iterdir():
        shutil.copy2(f, dst_dir / f.name)
    return dst_dir / src.name


# ------------------------------------------------------------------ the tiny INT4 LLM

def test_tiny_llm_kernels_requirements_and_tie(tiny_llm_path):
    r = resolve_model(tiny_llm_path)
    kinds = {}
    for n in r.nodes:
        kinds[n.kernel] = kinds.get(n.kernel, 0) + 1
    # 4 blocks x (qkv, out, gate_up, down) + LM head; one embedding gather; 2 RMSNorms
    # per block + the final one, 2 rotaries, the attention and the SiLU per block, fused (test_fusion.py,
    # test_attention_fusion.py); the rest numpy.
    assert kinds.pop("int4_matmul") == 4 * 4 + 1
    assert kinds.pop("int4_gather") == 1
    assert kinds.pop("row_norm") == 2 * 4 + 1
    assert kinds.pop("rotary") == 2 * 4
    assert kinds.pop("gqa") == 4
    assert kinds.pop("activation") == 4  # each block's SiLU gate, fused into QuickGelu
    assert set(kinds) == {"numpy"}
    assert r.unsupported == ()
    assert (r.stats.nodes_total, r.stats.nodes_kept, len(r.nodes)) == (255, 111, 111)
    # The tied embedding / LM head: one source descriptor, one prepared object (the LM
    # head's matmul layout, which the gather reads; test_tied_embedding.py).
    gather = next(n for n in r.nodes if n.kernel == "int4_gather")
    head = next(n for n in r.nodes if n.name == "lm_head")
    data = gather.inputs[0]
    assert head.inputs[1] == data
    assert [d.name for d in r.manifest].count(data) == 1
    [key] = [k for k, req in r.requests.items() if req.source_lineage[0] == data]
    assert r.requests[key].layout.split(".")[0] == "int4mm"
    assert gather.requirements[0].key == head.requirements[0].key == key
    # Every weight external, digest per tensor, all within the one data file.
    size = os.path.getsize(tiny_llm_path.with_name(tiny_llm_path.name + ".data"))
    assert len(r.manifest) == r.stats.initializers_active == len(r.weights)
    for d in r.manifest:
        assert d.digest_source is DigestSource.TENSOR_METADATA and d.digest.startswith("sha256:")
        assert 0 <= d.offset and d.offset + d.length <= size and d.offset % 4096 == 0
    # resolve_ms is recorded (its speed is scripts/bench_resolve.py's, not a test's: a
    # time bound here failed under load); that it reads no payload is asserted below
    assert r.stats.resolve_ms > 0


def test_tiny_llm_descriptors_match_onnx_external_data_loader(tiny_llm_path):
    """onnx's own loader is the oracle for offsets/lengths/dtypes: reading every manifest
    entry through our reader gives exactly the arrays onnx.load produces."""
    r = resolve_model(tiny_llm_path)
    reader = ExternalDataReader.for_model(r)
    full = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(tiny_llm_path)).graph.initializer}
    for d in r.manifest:
        ours = reader.read_array(d, verify=True)
        np.testing.assert_array_equal(ours, full[d.name])
        assert ours.dtype == full[d.name].dtype
    assert reader.counters.bytes_read == r.manifest.total_bytes


_FILE_EVENTS: list[tuple] = []
_AUDITING = threading.Event()
_HOOKED = threading.Event()


def _audit(event, args):
    if _AUDITING.is_set() and event in ("open", "mmap.__new__", "os.open"):
        _FILE_EVENTS.append((event, args))


def file_events(fn) -> tuple[object, list[tuple]]:
    """``fn()``'s result and the files it opened or mapped, by audit hook (one hook for
    the session: a hook cannot be removed; it is inert outside this call)."""
    if not _HOOKED.is_set():
        sys.addaudithook(_audit)
        _HOOKED.set()
    _FILE_EVENTS.clear()
    _AUDITING.set()
    try:
        result = fn()
    finally:
        _AUDITING.clear()
    return result, list(_FILE_EVENTS)


def opened_paths(seen: list[tuple]) -> list[str]:
    return [os.path.realpath(a[0]) for e, a in seen if e == "open" and isinstance(a[0], (str, bytes, os.PathLike))]


def test_resolution_reads_no_payload_byte(tiny_llm_path):
    """By audit hook: resolution never opens or maps the external data file (there is
    no reader to count with: every reader's counters are its own)."""
    data_file = os.path.realpath(tiny_llm_path.with_name(tiny_llm_path.name + ".data"))
    r, seen = file_events(lambda: resolve_model(tiny_llm_path))
    opened = opened_paths(seen)
    assert os.path.realpath(tiny_llm_path) in opened  # hook works
    assert data_file not in opened
    assert not any(e == "mmap.__new__" for e, _ in seen)
    assert r.manifest.total_bytes > 10_000_000


def test_resolution_ignores_payload_contents(tiny_llm_path, tmp_path):
    """Replace the data file by a sparse file of the same size (all zeros, no blocks):
    resolution gives the identical result; the digests were never computed from bytes,
    so the first verified read of a zeroed tensor fails."""
    original = resolve_model(tiny_llm_path)
    path = _copy_model(tiny_llm_path, tmp_path / "m")
    data = path.with_name(path.name + ".data")
    size = data.stat().st_size
    data.unlink()
    with open(data, "wb") as f:
        f.truncate(size)
    assert data.stat().st_size == size
    sparse = resolve_model(path)
    assert list(sparse.manifest) == list(original.manifest)
    assert dict(sparse.requests) == dict(original.requests)
    assert [n.kernel for n in sparse.nodes] == [n.kernel for n in original.nodes]
    reader = ExternalDataReader.for_model(sparse)
    with pytest.raises(DigestError):
        reader.read(sparse.manifest.entries[0], verify=True)


# ----------------------------------------------------------------------- descriptors

@pytest.mark.parametrize("digest,source", [
    ("sha256", DigestSource.TENSOR_METADATA),
    ("checksum", DigestSource.FILE_CHECKSUM),
    ("both", DigestSource.TENSOR_METADATA),  # the fine-grained digest wins
    (None, DigestSource.NONE),
])
def test_digest_sources(tmp_path, digest, source):
    path = single_weight_model(tmp_path, digest=digest)
    (d,) = resolve_model(path).manifest
    raw = np.arange(8, dtype=np.float32).tobytes()
    assert d.digest_source is source
    assert d.trusted is (source is not DigestSource.NONE)
    if source is DigestSource.TENSOR_METADATA:
        assert d.digest == "sha256:" + hashlib.sha256(raw).hexdigest()
    elif source is DigestSource.FILE_CHECKSUM:
        sha1 = hashlib.sha1((tmp_path / DATA).read_bytes()).hexdigest()
        assert d.digest == f"sha1:{sha1}@{d.offset}+{d.length}"
    else:
        assert d.digest is None
    assert (d.dtype, d.dims, d.file, d.length) == ("float32", (8,), DATA, 32)


def test_pruning_drops_dead_nodes_and_their_initializers(tmp_path):
    path = tied_int4_model(tmp_path)
    r = resolve_model(path)
    names = [n.name for n in r.nodes]
    assert names == ["embed", "embed.reshape", "lm_head"]
    assert (r.stats.nodes_total, r.stats.nodes_kept) == (5, 3)
    assert (r.stats.initializers_total, r.stats.initializers_active) == (5, 4)
    assert "dead.weight" not in r.weights and "dead.weight" not in r.manifest
    assert [d.name for d in r.manifest] == ["W", "embed.scales", "head.scales"]  # first-use order
    # The inline shape constant is active, inline, read-only.
    d = r.weights["shape_bsh"]
    assert d.file is None and d.length == 24
    v = r.inline_values["shape_bsh"]
    np.testing.assert_array_equal(v, [0, 0, 64])
    with pytest.raises(ValueError):
        v[0] = 1


def test_tied_requirements_one_source_two_layouts(tmp_path):
    r = resolve_model(tied_int4_model(tmp_path))
    assert len(r.requests) == 2
    by_kernel = {n.kernel: n.requirements[0] for n in r.nodes if n.requirements}
    g, m = by_kernel["int4_gather"], by_kernel["int4_matmul"]
    assert g.source_lineage == ("W", "embed.scales") and m.source_lineage == ("W", "head.scales")
    assert g.layout == "int4gather.v1.bs32.zp-none.sc-float32"
    assert m.layout == matmul_nbits_layout(block_size=32, zero_points="none", scale_dtype="float32",
                                           accuracy_level=0)
    head = next(n for n in r.nodes if n.name == "lm_head")
    assert dict(head.prepared_inputs) == {m.key: ("W", "head.scales")}


# ------------------------------------------------------------------------ transforms

@pytest.mark.parametrize("signed,zero_points,nbits_zp", [(True, False, False), (False, True, True)])
def test_dequantize_matmul_fuses_to_the_matmul_nbits_layout(tmp_path, signed, zero_points, nbits_zp):
    r = resolve_model(qdq_matmul_model(tmp_path / "qdq", signed=signed, zero_points=zero_points))
    (node,) = r.nodes
    assert node.kernel == "int4_matmul" and node.fused_from == ("W.dq", "mm")
    assert node.outputs == ("Y",)
    assert node.inputs == ("A", "W", "W.scales") + (("W.zp",) if zero_points else ())
    a = node.attributes
    assert (a["K"], a["N"], a["bits"], a["block_size"], a["weight_layout"]) == (64, 32, 4, 32, "KN")
    assert a["weight_dtype"] == ("int4" if signed else "uint4")
    assert r.stats.fused_int4_matmuls == 1 and r.stats.nodes_total == 2
    nbits = resolve_model(matmul_nbits_model(tmp_path / "nbits", zero_points=nbits_zp))
    (req,) = r.requests.values()
    (nreq,) = nbits.requests.values()
    assert req.layout == nreq.layout
    assert req.source_lineage == ("W", "W.scales") + (("W.zp",) if zero_points else ())


def test_shared_dequantize_fuses_both_matmuls_into_one_requirement(tmp_path):
    r = resolve_model(qdq_matmul_model(tmp_path, shared=True))
    assert [n.fused_from for n in r.nodes] == [("W.dq", "mm"), ("W.dq", "mm2")]
    assert r.stats.fused_int4_matmuls == 2
    assert len(r.requests) == 1
    assert r.nodes[0].requirements[0].key == r.nodes[1].requirements[0].key


def test_dequantize_not_fused_outside_the_int4_kernel(tmp_path):
    """Blocks along N (axis=1) are not what the INT4 kernel computes: left as DQ + MatMul."""
    path = qdq_matmul_model(tmp_path)
    model = onnx.load(str(path), load_external_data=False)
    dq = model.graph.node[0]
    for a in dq.attribute:
        if a.name == "axis":
            a.i = 1
    onnx.save(model, str(path))
    r = resolve_model(path)
    assert [(n.op_type, n.kernel) for n in r.nodes] == [("DequantizeLinear", "reference"), ("MatMul", "numpy")]
    assert r.stats.fused_int4_matmuls == 0 and r.requests == {}


def test_out_of_order_nodes_are_sorted(tmp_path):
    w = np.ones(4, dtype=np.float32)
    nodes = [helper.make_node("Relu", ["t"], ["Y"], name="second"),
             helper.make_node("Add", ["X", "W"], ["t"], name="first")]
    path = write_model(tmp_path, nodes, [from_array("W", w)],
                       [helper.make_tensor_value_info("X", 1, [4])], [helper.make_tensor_value_info("Y", 1, [4])])
    assert [n.name for n in resolve_model(path).nodes] == ["first", "second"]


def test_every_truncation_of_a_model_is_a_typed_error(tmp_path):
    """Exhaustive: each proper prefix of a model file is refused with ModelFormatError
    (never accepted as a smaller model, never an untyped exception)."""
    path = tied_int4_model(tmp_path)
    data = path.read_bytes()
    for n in range(len(data)):
        path.write_bytes(data[:n])
        with pytest.raises(ModelFormatError):
            resolve_model(path)


def test_undefined_value_is_a_model_format_error(tmp_path):
    nodes = [helper.make_node("Relu", ["nowhere"], ["Y"], name="relu")]
    path = write_model(tmp_path, nodes, [], [helper.make_tensor_value_info("X", 1, [4])],
                       [helper.make_tensor_value_info("Y", 1, [4])])
    with pytest.raises(ModelFormatError, match="undefined value 'nowhere'") as e:
        resolve_model(path)
    assert e.value.where.node == "relu"


# ------------------------------------------------------------------------- kernels

def test_gemm_packed_dedup_and_non_constant_b(tmp_path):
    r = resolve_model(gemm_model(tmp_path))
    k = {n.name: n for n in r.nodes}
    assert k["gemm1"].kernel == k["gemm1b"].kernel == k["mm2"].kernel == "gemm_packed"
    assert k["gemm1"].requirements == k["gemm1b"].requirements  # same (lineage, layout, device)
    assert k["gemm1"].requirements[0].layout == gemm_b_layout(trans_b=True)
    assert k["mm2"].requirements[0].layout == gemm_b_layout(trans_b=False)
    assert k["mm_dynamic"].kernel == "numpy" and k["mm_dynamic"].requirements == ()
    # B3 is an initializer AND a graph input: a caller may override it, so no prepack.
    assert k["mm_overridable"].kernel == "numpy"
    assert sorted(req.source_lineage for req in r.requests.values()) == [("B1",), ("B2",)]
    assert "B3" not in [i.name for i in r.inputs]


def test_op_without_kernel_is_listed_not_raised(tmp_path):
    r = resolve_model(custom_op_model(tmp_path))
    assert [(n.name, n.kernel) for n in r.nodes] == [
        ("relu", "numpy"), ("frob1", None), ("frob2", None), ("gelu", "reference")]
    (u,) = r.unsupported
    assert (u.op_type, u.domain, u.nodes) == ("Frobnicate", "custom.ops", ("frob1", "frob2"))


def test_model_local_function_runs_on_the_reference_kernel(tmp_path):
    fn = helper.make_function("local.fns", "Double", ["x"], ["y"],
                              [helper.make_node("Add", ["x", "x"], ["y"])],
                              opset_imports=[helper.make_opsetid("", 21)])
    nodes = [helper.make_node("Double", ["X"], ["Y"], name="double", domain="local.fns")]
    path = write_model(tmp_path, nodes, [], [helper.make_tensor_value_info("X", 1, [4])],
                       [helper.make_tensor_value_info("Y", 1, [4])],
                       opsets={"": 21, "local.fns": 1}, functions=[fn])
    r = resolve_model(path)
    assert r.nodes[0].kernel == "reference" and r.unsupported == ()


def test_numpy_ops_cover_the_tiny_llm_graph(tiny_llm_path):
    """Every default-domain op the fixture emits is in NUMPY_OPS (no slow fallback)."""
    model = onnx.load(str(tiny_llm_path), load_external_data=False)
    ops = {n.op_type for n in model.graph.node if n.domain in ("", "ai.onnx")}
    assert ops <= NUMPY_OPS, ops - NUMPY_OPS


# ---------------------------------------------------------------- frozen, options

def test_resolved_model_is_frozen(tmp_path):
    r = resolve_model(tied_int4_model(tmp_path))
    assert require_frozen(r) is r
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.nodes = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.nodes[0].kernel = "numpy"  # type: ignore[misc]
    with pytest.raises(TypeError):
        r.requests["x"] = None  # type: ignore[index]
    with pytest.raises(TypeError):
        r.nodes[0].attributes["bits"] = 8  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.manifest.entries[0].offset = 0  # type: ignore[misc]


def test_resolution_takes_no_isa_and_its_layout_keys_name_none(tiny_llm_path):
    # every ISA reads the same packed bytes; the kernel code is chosen where the model runs
    from onnx_prep.native.isa import ISAS, KERNEL_CODES, VARIANTS
    r = resolve_model(tiny_llm_path)
    assert r.requests
    for req in r.requests.values():
        parts = set(req.layout.split(".")) | {req.device}
        assert not parts & set(ISAS + VARIANTS + KERNEL_CODES), req.layout
    with pytest.raises(TypeError):
        resolve_model(tiny_llm_path, isa="avx2")  # type: ignore[call-arg]


def test_folder_with_one_model_resolves(tmp_path):
    path = single_weight_model(tmp_path)
    assert resolve_model(tmp_path).model_path == path


# ------------------------------------------------------ Hugging Face cache layout

def hf_snapshot(tmp_path: Path) -> Path:
    """``blobs/<sha>`` files and ``snapshots/<rev>/`` symlinks into them, as huggingface_hub
    stores a downloaded repository."""
    src = single_weight_model(tmp_path / "src")
    blobs = tmp_path / "hub" / "blobs"
    snap = tmp_path / "hub" / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in (src, src.with_name(DATA)):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy2(f, blobs / digest)
        os.symlink(os.path.join("..", "..", "blobs", digest), snap / f.name)
    return snap / src.name


def test_hugging_face_snapshot_needs_trust_symlinks(tmp_path):
    path = hf_snapshot(tmp_path)
    with pytest.raises(UnsafePathError, match="symlink") as e:
        resolve_model(path)
    assert e.value.where.file == DATA and e.value.where.tensor == "W"
    r = resolve_model(path, trust_symlinks=True)
    assert r.model_dir == path.parent  # data looked up beside the link, not in blobs/
    reader = ExternalDataReader.for_model(r, trust_symlinks=True)
    np.testing.assert_array_equal(reader.read_array(r.manifest.entries[0], verify=True),
                                  np.arange(8, dtype=np.float32))
    with pytest.raises(UnsafePathError):
        ExternalDataReader.for_model(r).read(r.manifest.entries[0])  # untrusted reader refuses
