"""A tied embedding / LM head (core/kernels/tied_embedding.py): GatherBlockQuantized and
MatMulNBits reading one INT4 table alike share ONE prepared object, the matmul's
int4mm, packed by the LM head's node, read once, cached once; the gather's own scales
are no longer read; tokens and logits are bit for bit the untied model's (the native
gather reads the matmul layout's rows exactly) and ONNX Runtime's. A table the two
read differently (other scale values, zero points in each op's byte form, no digest
to tell equal bytes) stays untied, in the int4gather layout."""
from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest

from conftest import ort_or_skip
from onnx_prep.core.cache.cache_build import build_prepared_cache
from onnx_prep.core.cache.prepared_cache import PreparedCache
from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.decode.generation import greedy_decode, step_feeds
from onnx_prep.core.kernels.prepack import prepack_all, source_loader
from onnx_prep.core.model.resolution import resolve_model
from onnx_prep.core.model.weights import TENSOR_DIGEST_KEY, TENSOR_FAST_DIGEST_KEY
from onnx_prep.core.plan.execution_plan import build_prepared_execution_plan
from onnx_prep.core.plan.task import TaskKind
from onnx_prep.core.runtime.action_program import ActionProgram
from onnx_prep.core.runtime.session import Session
from test_resolve_models import tied_int4_model
from test_weight_views import builder_tied_model

DATA, EMBED_SCALES = "embed_tokens.weight_q4", "embed_tokens.scales"
PROMPTS = np.array([[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 31, 409, 5, 77, 500, 12]])


def _layouts(resolved) -> list[str]:
    return sorted(r.layout.split(".")[0] for r in resolved.requests.values())


def _node(resolved, name):
    return next(n for n in resolved.nodes if n.name == name)


def _untied_copy(src, dst):
    """A copy of the fixture whose embedding scales declare no digest: nothing says they
    hold the LM head's bytes, so the embedding keeps its own layout."""
    shutil.copytree(src.parent, dst)
    path = dst / src.name
    model = onnx.load(str(path), load_external_data=False)
    t = next(t for t in model.graph.initializer if t.name == EMBED_SCALES)
    keep = [p for p in t.metadata_props if p.key not in (TENSOR_DIGEST_KEY, TENSOR_FAST_DIGEST_KEY)]
    del t.metadata_props[:]
    t.metadata_props.extend(keep)
    onnx.save(model, str(path))
    return path


def test_the_fixture_gather_reads_the_lm_head_object(small_llm_path):
    r = resolve_model(small_llm_path)
    embed, head = _node(r, "embed_tokens"), _node(r, "lm_head")
    assert embed.kernel == "int4_gather" and head.kernel == "int4_matmul"
    assert embed.requirements == head.requirements
    [req] = embed.requirements
    assert req.layout.startswith("int4mm.") and req.source_lineage == (DATA, "lm_head.scales")
    # the gather's own inputs are what the object replaces; its scales are read by no one
    assert embed.prepared_inputs == {req.key: (DATA, EMBED_SCALES)}
    assert "int4gather" not in _layouts(r)
    assert EMBED_SCALES not in r.weights and EMBED_SCALES not in r.manifest
    assert r.stats.initializers_active == r.stats.initializers_total - 1


def test_one_read_one_prepack_packed_by_the_lm_head(small_llm_path):
    r = resolve_model(small_llm_path)
    plan = build_prepared_execution_plan(r)
    read = f"S.read_source:{DATA}"
    [prepack] = [t for t in plan.session_tasks if read in t.dependencies]
    assert prepack.kind is TaskKind.PREPACK
    req = plan.by_key[prepack.publishes]
    assert (req.node, req.kernel) == ("lm_head", "int4_matmul")
    assert req.first_step == 0  # published for the embedding, the first step
    reads = {t.id.split(":", 1)[1] for t in plan.session_tasks if t.kind is TaskKind.READ_SOURCE}
    assert reads == {d.name for d in r.manifest} and EMBED_SCALES not in reads


def test_same_initializers_tie_without_digests(tmp_path):
    """The builder's Qwen2 pattern: the gather reads a view of the LM head's weight and
    its very scales; no digest is needed to know the bytes are the same."""
    r = resolve_model(builder_tied_model(tmp_path))
    assert _layouts(r) == ["int4mm"]
    assert _node(r, "embed").requirements == _node(r, "lm_head").requirements


def test_tables_read_differently_stay_untied(tmp_path, tiny_zp_llm_path, small_llm_path):
    # other scale values
    assert _layouts(resolve_model(tied_int4_model(tmp_path / "a"))) == ["int4gather", "int4mm"]
    # zero points in each op's byte form (one per byte / two per byte): other bytes
    r = resolve_model(tiny_zp_llm_path)
    assert "embed_tokens.zero_points" in r.weights
    assert _layouts(r).count("int4gather") == 1
    # equal values, but no digest says so
    r = resolve_model(_untied_copy(small_llm_path, tmp_path / "b"))
    assert _layouts(r).count("int4gather") == 1 and EMBED_SCALES in r.manifest


@pytest.fixture(scope="module")
def medium_shaped_path(tmp_path_factory):
    """The medium preset's graph (16 blocks) at small widths."""
    from onnx_prep.fixtures import FixtureConfig, generate

    cfg = FixtureConfig.preset("medium").replace(hidden=128, intermediate=256, heads=4, vocab=512)
    return generate(cfg, tmp_path_factory.mktemp("medium-shaped"))


@pytest.fixture(params=["small", "medium-shaped"])
def tied_model(request, small_llm_path):
    return small_llm_path if request.param == "small" else request.getfixturevalue("medium_shaped_path")


def test_tied_decode_is_the_untied_one_bit_for_bit(tied_model, tmp_path):
    assert _layouts(resolve_model(tied_model)).count("int4gather") == 0
    untied = _untied_copy(tied_model, tmp_path / "u")
    io = DecoderIO.from_model(tied_model)
    runs = []
    for path in (tied_model, untied):
        with Session.open(path) as s:
            runs.append(greedy_decode(s, io, PROMPTS, 12, keep_logits=True))
    tied, plain = runs
    assert np.array_equal(tied.tokens, plain.tokens)
    assert all(np.array_equal(a, b) for a, b in zip(tied.logits, plain.logits))


def test_tied_decode_matches_onnxruntime(tied_model):
    ort_or_skip()
    from onnx_prep.core.decode.ort_runner import OrtRunner

    io = DecoderIO.from_model(tied_model)
    ref = greedy_decode(OrtRunner(tied_model, threads=1), io, PROMPTS, 12, keep_logits=True)
    with Session.open(tied_model) as s:
        ours = greedy_decode(s, io, PROMPTS, 12, keep_logits=True)
    for step in range(12):
        d = np.abs(ours.logits[step] - ref.logits[step]).max(axis=-1)
        assert (d <= 1e-5 * ref.logit_range[:, step]).all(), (step, d)
        decided = ref.top2_margin[:, step] > 2 * d
        assert (ours.tokens[decided, step] == ref.tokens[decided, step]).all(), step


def test_the_reference_backend_takes_rows_as_the_columns(small_llm_path):
    """The float32 reference form of the tied object is the LM head's [K, V]: the gather
    takes its columns, and the first step's logits are the native ones'."""
    r = resolve_model(small_llm_path)
    program = ActionProgram.compile(r)
    io = DecoderIO.from_model(small_llm_path)
    feeds = step_feeds(io, PROMPTS, io.empty_past(len(PROMPTS)), 0)
    with Session.open(small_llm_path) as s:
        load = source_loader(r, s.reader)
        weights = {n: load(n) for n in program.weight_names}
        native = program.run(feeds, prepack_all(r, load), weights=weights)["logits"]
        ref = program.run(feeds, prepack_all(r, load, backend="reference"), weights=weights)["logits"]
    np.testing.assert_allclose(ref, native, rtol=0, atol=1e-4 * float(np.ptp(native)))


def test_build_cache_writes_one_entry_for_the_tied_table(small_llm_path, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(small_llm_path.parent, folder)
    model = folder / small_llm_path.name
    built = build_prepared_cache(model)
    r = resolve_model(model)
    assert built["written"] == len(r.requests)
    cache = PreparedCache(r, policy="require-complete")
    try:
        keys = [k for k in cache.manifest.by_key]
    finally:
        cache.close()
    assert sum(1 for k in keys if DATA in k) == 1 and not any("int4gather" in k for k in keys)
