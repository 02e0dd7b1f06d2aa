"""The fixture generator: determinism, the external-data contract, and ONNX Runtime as
the oracle that the graph is a working decoder with a correct KV cache."""
from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import ort_or_skip
from onnx_prep.core.errors import UsageError
from onnx_prep.core.io.content_digest import digest_of
from onnx_prep.core.model.weights import TENSOR_DIGEST_KEY, TENSOR_FAST_DIGEST_KEY
from onnx_prep.fixtures import PRESETS, FixtureConfig, generate, generate_fixture
from onnx_prep.fixtures.data_file import ALIGNMENT

SMALL = dict(layers=2, hidden=128, intermediate=256, heads=4, vocab=512)
KV_REL_TOL = 1e-4  # fp32 scales: prefill+decode vs one prefill differ only by summation order


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(model: Path) -> tuple[Path, Path]:
    return model, model.with_name(model.name + ".data")


# ----------------------------------------------------------------- determinism
@pytest.mark.parametrize("preset", ["tiny-llm", "tiny-gqa"])
def test_same_parameters_give_byte_identical_files(tmp_path, preset):
    a = generate(preset, tmp_path / "a")
    b = generate(FixtureConfig.preset(preset), tmp_path / "b")
    for fa, fb in zip(_files(a), _files(b)):
        assert _digest(fa) == _digest(fb), fa.name


# The presets' config hashes before the attention / kv_heads fields were added: the cache
# folders of every session are named by them (fixtures/cache.py), so a field added with
# its default must leave them as they were (FixtureConfig.to_json omits it).
EARLIER_PRESET_HASHES = {"tiny-llm": "eac8fc849202f273", "medium": "412a05e58e9e9b5e", "large": "9123658144cc9bd8"}


def test_fields_added_later_leave_the_earlier_presets_hashes_unchanged():
    assert {name: PRESETS[name].config_hash for name in EARLIER_PRESET_HASHES} == EARLIER_PRESET_HASHES
    # an explicit default is the same config; a value other than the default is another
    tiny = PRESETS["tiny-llm"]
    assert tiny.replace(attention="standard", kv_heads=0).config_hash == tiny.config_hash
    assert tiny.replace(kv_heads=8).config_hash != tiny.config_hash  # 8 = heads: the same graph, named apart
    gqa = tiny.replace(attention="gqa")
    assert gqa.config_hash != tiny.config_hash and gqa.to_json()["attention"] == "gqa"
    assert "attention" not in tiny.to_json() and "kv_heads" not in tiny.to_json()


# Golden digests of the tiny-llm files. They pin the generator across refactors: a change
# here means every cached default model and every recorded figure changes with it.
# If the change is intended, bump GENERATOR_VERSION (fixtures/config.py) and update both.
# (Generator streams are numpy's; a numpy upgrade that changes them shows up here first.)
TINY_DATA_SHA1 = "6824e8cba39b6857b6d192ffaa59ddc9d1500597"
TINY_MODEL_SHA256 = "a057dd51dfa5f3439cd790f281ba27fdec1523f2e12a320596f81c1a6539dcc8"


def test_tiny_llm_golden_digests(tiny_llm_path):
    from onnx_prep.fixtures import GENERATOR_VERSION

    assert GENERATOR_VERSION == "2", "update the golden digests with the version"
    model, data = _files(tiny_llm_path)
    assert hashlib.sha1(data.read_bytes()).hexdigest() == TINY_DATA_SHA1
    assert _digest(model) == TINY_MODEL_SHA256


def test_different_seed_gives_different_bytes(tmp_path):
    cfg = FixtureConfig.preset("tiny-llm").replace(**SMALL)
    a = generate(cfg, tmp_path / "a")
    b = generate(cfg.replace(seed=1), tmp_path / "b")
    assert _digest(_files(a)[1]) != _digest(_files(b)[1])


def test_tensor_bytes_do_not_depend_on_other_parameters(tmp_path):
    # Per-tensor generators: layer 0 of a 1-layer and a 2-layer model are the same bytes.
    cfg = FixtureConfig.preset("tiny-llm").replace(**SMALL)
    one = _read_initializers(generate(cfg.replace(layers=1), tmp_path / "one"))
    two = _read_initializers(generate(cfg, tmp_path / "two"))
    assert one["layers.0.attn.qkv.weight_q4"].tobytes() == two["layers.0.attn.qkv.weight_q4"].tobytes()
    assert "layers.1.mlp.down.weight_q4" in two and "layers.1.mlp.down.weight_q4" not in one


# ------------------------------------------------------- external-data contract
def test_external_data_contract(tiny_llm_path):
    model = onnx.load(str(tiny_llm_path), load_external_data=False)
    data_path = tiny_llm_path.with_name("tiny-llm.onnx.data")
    blob = data_path.read_bytes()
    file_sha1 = hashlib.sha1(blob).hexdigest()
    assert model.graph.initializer, "no initializers"
    spans = []
    for t in model.graph.initializer:
        assert t.data_location == onnx.TensorProto.EXTERNAL, t.name
        ext = {e.key: e.value for e in t.external_data}
        assert [e.key for e in t.external_data] == ["location", "offset", "length", "checksum"], t.name
        assert ext["location"] == "tiny-llm.onnx.data"
        off, length = int(ext["offset"]), int(ext["length"])
        assert off % ALIGNMENT == 0, (t.name, off)
        assert ext["checksum"] == file_sha1
        props = {p.key: p.value for p in t.metadata_props}
        assert props[TENSOR_DIGEST_KEY] == "sha256:" + hashlib.sha256(blob[off:off + length]).hexdigest(), t.name
        assert props[TENSOR_FAST_DIGEST_KEY] == digest_of(blob[off:off + length]), t.name
        # length matches dtype x dims
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        assert length == itemsize * int(np.prod(t.dims)), t.name
        spans.append((off, off + length))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), "overlapping tensors"
    assert spans[-1][1] == len(blob)


def test_onnx_checker_accepts_the_model(tiny_llm_path):
    onnx.checker.check_model(str(tiny_llm_path))


def test_tied_embedding_and_lm_head_share_one_int4_initializer(tiny_llm_path):
    model = onnx.load(str(tiny_llm_path), load_external_data=False)
    nodes = {n.name: n for n in model.graph.node}
    gather, head = nodes["embed_tokens"], nodes["lm_head"]
    assert (gather.op_type, gather.domain) == ("GatherBlockQuantized", "com.microsoft")
    assert (head.op_type, head.domain) == ("MatMulNBits", "com.microsoft")
    assert gather.input[0] == head.input[1] == "embed_tokens.weight_q4"
    matmuls = [n.name for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(matmuls) == 4 * 4 + 1  # qkv, out, gate_up, down per block + LM head
    init = {t.name: t for t in model.graph.initializer}
    cfg = PRESETS["tiny-llm"]
    assert list(init["embed_tokens.weight_q4"].dims) == [cfg.vocab, cfg.hidden // 32, 16]
    assert list(init["embed_tokens.scales"].dims) == [cfg.vocab, cfg.hidden // 32, 1]
    assert list(init["lm_head.scales"].dims) == [cfg.vocab, cfg.hidden // 32]


def test_sizes_reported_match_the_files(tmp_path):
    r = generate_fixture(FixtureConfig.preset("tiny-llm").replace(**SMALL), tmp_path)
    assert r.data_path.stat().st_size == r.data_bytes
    assert r.int4_bytes == (512 * 128 + 2 * (3 * 128 * 128 + 128 * 128 + 2 * 256 * 128 + 128 * 256)) // 2
    assert r.data_sha1 == hashlib.sha1(r.data_path.read_bytes()).hexdigest()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")], "temp files left behind"


@pytest.mark.parametrize("changes, needle", [
    (dict(hidden=500), "multiple of block_size"),
    (dict(block_size=24), "power of two"),
    (dict(heads=3), "multiple of heads"),
    (dict(layers=0), "layers must be"),
    (dict(name="../x"), "plain file stem"),
    (dict(attention="mha"), "attention must be one of standard, gqa"),
    (dict(attention="gqa", kv_heads=3), "kv_heads=3 does not divide heads=8"),
    (dict(attention="gqa", kv_heads=-2), "kv_heads=-2 does not divide"),
    (dict(kv_heads=2), "kv_heads=2 needs attention 'gqa'"),
])
def test_bad_config_raises_usage_error(changes, needle):
    with pytest.raises(UsageError, match=needle):
        FixtureConfig.preset("tiny-llm").replace(**changes)


def test_unknown_preset_and_parameter():
    with pytest.raises(UsageError, match="unknown fixture preset"):
        FixtureConfig.preset("huge")
    with pytest.raises(UsageError, match="unknown fixture parameter"):
        FixtureConfig.preset("tiny-llm").replace(depth=3)


def test_presets():
    tiny, medium = PRESETS["tiny-llm"], PRESETS["medium"]
    assert (tiny.layers, tiny.hidden, tiny.intermediate, tiny.heads, tiny.vocab, tiny.block_size) == \
        (4, 512, 2048, 8, 8192, 32)
    assert (medium.layers, medium.hidden, medium.intermediate, medium.vocab) == (16, 2048, 5632, 32000)
    large = PRESETS["large"]  # 7B-shaped
    assert (large.layers, large.hidden, large.intermediate, large.vocab) == (32, 4096, 11008, 32000)
    assert not tiny.fp16_scales and not tiny.zero_points
    assert tiny.attention == medium.attention == "standard" and tiny.kv_head_count == tiny.heads
    # the GroupQueryAttention presets: the same shapes, fewer KV heads
    for name, base, kv_heads, zero_points in (("tiny-gqa", tiny, 2, True), ("medium-gqa", medium, 8, False)):
        gqa = PRESETS[name]
        assert (gqa.attention, gqa.kv_heads) == ("gqa", kv_heads)
        assert gqa.replace(name=base.name, attention="standard", kv_heads=0, zero_points=False) == base
        assert gqa.zero_points == zero_points  # tiny-gqa's: its greedy output does not collapse


# ------------------------------------------------------------- default model
def test_default_model_path_generates_once_into_the_cache(tmp_path, monkeypatch):
    from onnx_prep.fixtures import default_model_path

    monkeypatch.setenv("ONNX_PREP_CACHE", str(tmp_path / "cache"))
    first = default_model_path()
    assert first.is_file() and first.is_relative_to(tmp_path / "cache")
    mtime = first.stat().st_mtime_ns
    assert default_model_path() == first
    assert first.stat().st_mtime_ns == mtime, "regenerated although present"


def test_default_model_path_is_safe_under_concurrent_callers(tmp_path, monkeypatch):
    from onnx_prep.fixtures import cached_model_path, ensure_cached

    monkeypatch.setenv("ONNX_PREP_CACHE", str(tmp_path / "cache"))
    cfg = FixtureConfig.preset("tiny-llm").replace(**SMALL)
    start = threading.Barrier(4)
    results, errors = [], []

    def call():
        start.wait()
        try:
            results.append(ensure_cached(cfg))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert set(results) == {cached_model_path(cfg)}
    reference = generate(cfg, tmp_path / "ref")
    for fa, fb in zip(_files(results[0]), _files(reference)):
        assert _digest(fa) == _digest(fb)
    leftovers = [p.name for p in (tmp_path / "cache" / "fixtures").iterdir() if p.name.startswith(".")]
    assert not leftovers, leftovers


# ------------------------------------------------------ ONNX Runtime oracle
def _read_initializers(model_path: Path) -> dict[str, np.ndarray]:
    from onnx.numpy_helper import to_array

    model = onnx.load(str(model_path), load_external_data=True)
    return {t.name: to_array(t) for t in model.graph.initializer}


class _Decoder:
    """Runs a fixture through ONNX Runtime with an explicit KV cache."""

    def __init__(self, model_path: Path):
        ort = ort_or_skip()
        self.session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
        kv = [i for i in self.session.get_inputs() if i.name.startswith("past_key_values.")]
        self.layers = len(kv) // 2
        self.heads, self.head_dim = kv[0].shape[1], kv[0].shape[3]
        self.output_names = [o.name for o in self.session.get_outputs()]
        # the standard attention takes position ids; GroupQueryAttention the attention mask
        self.masked = "attention_mask" in {i.name for i in self.session.get_inputs()}

    def empty_cache(self, batch: int) -> dict[str, np.ndarray]:
        z = np.zeros((batch, self.heads, 0, self.head_dim), np.float32)
        return {f"past_key_values.{i}.{kind}": z for i in range(self.layers) for kind in ("key", "value")}

    def __call__(self, ids: np.ndarray, past: dict[str, np.ndarray], start: int):
        if self.masked:
            step = {"attention_mask": np.ones((ids.shape[0], start + ids.shape[1]), np.int64)}
        else:
            step = {"position_ids": np.broadcast_to(np.arange(start, start + ids.shape[1], dtype=np.int64), ids.shape)}
        outs = dict(zip(self.output_names, self.session.run(None, {"input_ids": ids, **step, **past})))
        present = {k.replace("present.", "past_key_values.", 1): v for k, v in outs.items() if k != "logits"}
        return outs["logits"], present


def test_ort_loads_tiny_and_logits_are_finite_and_vary_with_input(tiny_llm_path):
    dec = _Decoder(tiny_llm_path)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, PRESETS["tiny-llm"].vocab, size=(2, 6), dtype=np.int64)
    logits, present = dec(ids, dec.empty_cache(2), 0)
    assert logits.shape == (2, 6, 8192) and logits.dtype == np.float32
    assert np.isfinite(logits).all()
    assert 0.5 < logits.std() < 20, logits.std()  # a spread: softmax neither flat nor saturated
    assert present["past_key_values.3.value"].shape == (2, 8, 6, 64)
    # different input -> different logits (batch rows differ, and a changed token changes them)
    assert not np.allclose(logits[0], logits[1])
    ids2 = ids.copy()
    ids2[0, 0] = (ids2[0, 0] + 1) % 8192
    logits2, _ = dec(ids2, dec.empty_cache(2), 0)
    assert not np.allclose(logits2[0, -1], logits[0, -1])
    np.testing.assert_array_equal(logits2[1], logits[1])  # batch rows are independent


def _assert_kv_cache_matches_prefill(model_path: Path, rel_tol: float) -> None:
    dec = _Decoder(model_path)
    ids = np.random.default_rng(1).integers(0, 512, size=(2, 12), dtype=np.int64)
    full, _ = dec(ids, dec.empty_cache(2), 0)
    logits, past = dec(ids[:, :8], dec.empty_cache(2), 0)  # prefill 8
    np.testing.assert_allclose(logits, full[:, :8], rtol=0, atol=rel_tol * np.abs(full).max())
    for t in range(8, 12):  # 4 decode steps, one token each
        logits, past = dec(ids[:, t:t + 1], past, t)
        err = np.abs(logits[:, -1] - full[:, t]).max() / np.abs(full[:, t]).max()
        assert err < rel_tol, (t, err)
    # prefill with past (seq > 1, past > 0): 8 tokens, then the last 4 in one call
    # (GroupQueryAttention takes a continued prompt at batch 1 only, as ONNX Runtime does)
    rows = 1 if dec.masked else 2
    _, past = dec(ids[:rows, :8], dec.empty_cache(rows), 0)
    logits, past = dec(ids[:rows, 8:], past, 8)
    err = np.abs(logits - full[:rows, 8:]).max() / np.abs(full[:rows, 8:]).max()
    assert err < rel_tol, err
    assert past["past_key_values.0.key"].shape[2] == 12


def test_kv_cache_decode_equals_one_prefill_tiny(tiny_llm_path):
    _assert_kv_cache_matches_prefill(tiny_llm_path, KV_REL_TOL)


@pytest.mark.parametrize("encoding", [dict(zero_points=True), dict(fp16_scales=True),
                                      dict(block_size=16, zero_points=True, fp16_scales=True),
                                      dict(attention="gqa", kv_heads=2), dict(attention="gqa", kv_heads=1)])
def test_kv_cache_decode_equals_one_prefill_encodings(tmp_path, encoding):
    path = generate(FixtureConfig.preset("tiny-llm").replace(**SMALL, **encoding), tmp_path)
    # fp16 scales mean fp16 activations into every MatMulNBits: a looser bound.
    _assert_kv_cache_matches_prefill(path, 2e-3 if encoding.get("fp16_scales") else KV_REL_TOL)


def test_decode_48_steps_stays_finite(tiny_llm_path):
    dec = _Decoder(tiny_llm_path)
    logits, past = dec(np.array([[1, 2, 3, 4]], dtype=np.int64), dec.empty_cache(1), 0)
    for t in range(4, 52):
        tok = logits[:, -1:].argmax(-1).astype(np.int64)
        logits, past = dec(tok, past, t)
        assert np.isfinite(logits).all(), t
        assert 0.5 < logits.std() < 20, (t, logits.std())


# ------------------------------------------- the graph computes what docs say
def _reference_logits(cfg: FixtureConfig, w: dict[str, np.ndarray], ids: np.ndarray) -> np.ndarray:
    """An independent numpy forward of docs/fixture.md's architecture (no KV cache)."""
    from onnx_prep.fixtures.int4_weights import dequantize

    def unpack_zp(packed: np.ndarray, kb: int) -> np.ndarray:  # [N, ceil(kb/2)] -> [N, kb]
        z = np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
        return z[:, :kb]

    def proj(x, prefix, weight=None):
        codes = w[weight or f"{prefix}.weight_q4"]
        zp = unpack_zp(w[f"{prefix}.zero_points"], codes.shape[1]) if cfg.zero_points else None
        return x @ dequantize(codes, w[f"{prefix}.scales"], zp).T

    def rms(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_eps) * weight

    h, nh, d, kv = cfg.hidden, cfg.heads, cfg.head_dim, cfg.kv_head_count
    zp_emb = w["embed_tokens.zero_points"][:, :, 0] if cfg.zero_points else None
    table = dequantize(w["embed_tokens.weight_q4"], w["embed_tokens.scales"][:, :, 0], zp_emb)
    x = table[ids]  # [B, S, H]
    s = ids.shape[1]
    if cfg.attention == "gqa":  # GroupQueryAttention's tables: [positions, D/2] for positions 0..
        cos, sin = (np.concatenate([w[name][:s], w[name][:s]], -1) for name in ("cos_cache", "sin_cache"))
    else:
        freqs = np.arange(s)[:, None] * w["rotary.inv_freq"][None, :]
        cos, sin = np.cos(np.concatenate([freqs, freqs], -1)), np.sin(np.concatenate([freqs, freqs], -1))

    def rope(t):
        t1, t2 = t[..., : d // 2], t[..., d // 2:]
        return t * cos + np.concatenate([-t2, t1], -1) * sin

    causal = np.tril(np.ones((s, s), bool))
    for i in range(cfg.layers):
        p = f"layers.{i}"
        qkv = proj(rms(x, w[f"{p}.input_norm.weight"]), f"{p}.attn.qkv")
        # Q over nh heads, then K and V over kv heads; query head j reads KV head j // (nh / kv)
        q = qkv[..., :h].reshape(*ids.shape, nh, d).transpose(0, 2, 1, 3)
        k, v = (qkv[..., h + j * kv * d:h + (j + 1) * kv * d].reshape(*ids.shape, kv, d).transpose(0, 2, 1, 3)
                .repeat(nh // kv, axis=1) for j in range(2))
        scores = rope(q) @ rope(k).transpose(0, 1, 3, 2) / np.sqrt(d)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(*ids.shape, h)
        x = x + proj(ctx, f"{p}.attn.out")
        gu = proj(rms(x, w[f"{p}.post_attention_norm.weight"]), f"{p}.mlp.gate_up")
        gate, up = gu[..., : cfg.intermediate], gu[..., cfg.intermediate:]
        x = x + proj(gate / (1 + np.exp(-gate)) * up, f"{p}.mlp.down")
    return proj(rms(x, w["final_norm.weight"]), "lm_head", weight="embed_tokens.weight_q4")


@pytest.mark.parametrize("encoding", [{}, dict(zero_points=True, block_size=16), dict(attention="gqa", kv_heads=2)])
def test_ort_matches_an_independent_numpy_forward(tmp_path, encoding):
    # Proves the documented encoding (nibble order, zero points in both ops' shapes, the
    # tie, rotary, causal mask) is what ONNX Runtime computes from these files.
    cfg = FixtureConfig.preset("tiny-llm").replace(**SMALL, **encoding)
    path = generate(cfg, tmp_path)
    dec = _Decoder(path)
    ids = np.random.default_rng(2).integers(0, cfg.vocab, size=(2, 7), dtype=np.int64)
    got, _ = dec(ids, dec.empty_cache(2), 0)
    weights = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in _read_initializers(path).items()}

    def err(w) -> float:
        want = _reference_logits(cfg, w, ids)
        return float(np.abs(got - want).max() / np.abs(want).max())

    tol = 1e-5  # of the largest logit: ORT in fp32 vs float64 (measured 6-8e-7)
    assert err(weights) < tol, err(weights)
    # Negative controls: the reference with one projection's scales 1% off, or one of
    # its zero points off by one, must fail the same bound.
    name = "layers.1.mlp.down"
    scaled = dict(weights, **{f"{name}.scales": weights[f"{name}.scales"] * 1.01})
    assert err(scaled) >= tol, err(scaled)  # measured 4.4e-3
    if cfg.zero_points:
        zp = weights[f"{name}.zero_points"].copy()
        zp[0, 0] ^= 1  # low nibble, block 0 of output 0: 7 -> 6 or 8 -> 9
        assert err(dict(weights, **{f"{name}.zero_points": zp})) >= tol  # measured 2.7e-3


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("ONNX_PREP_TEST_MEDIUM"),
                    reason="writes 563 MB; set ONNX_PREP_TEST_MEDIUM=1 to run")
def test_medium_preset_generates_and_runs(tmp_path):
    r = generate_fixture(FixtureConfig.preset("medium"), tmp_path)
    assert r.int4_bytes == 443_809_792 and r.data_bytes == r.data_path.stat().st_size
    dec = _Decoder(r.model_path)
    logits, _ = dec(np.array([[1, 2, 3]], dtype=np.int64), dec.empty_cache(1), 0)
    assert logits.shape == (1, 3, 32000) and np.isfinite(logits).all() and 0.5 < logits.std() < 20
