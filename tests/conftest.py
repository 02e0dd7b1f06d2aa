"""Shared test fixtures. Generated models are cached in a session temp dir, never
committed. Hypothesis runs under named profiles (HYPOTHESIS_PROFILE=ci|dev|thorough).
Every test has a timeout (pyproject.toml: 120 s; SLOW_TIMEOUT_S for tests marked slow)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile("ci", max_examples=40, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("dev", max_examples=15, deadline=None)
    settings.register_profile("thorough", max_examples=500, deadline=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # pragma: no cover - hypothesis is in the test extra
    pass


# Tests marked slow (a benchmark smoke run, a stress loop) get this timeout instead of
# the suite's 120 s: each takes up to ~60 s alone on 2 vCPUs, more beside other work.
SLOW_TIMEOUT_S = 600


def pytest_collection_modifyitems(config, items):
    """A slow test without a timeout of its own gets SLOW_TIMEOUT_S."""
    for item in items:
        if item.get_closest_marker("slow") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


@pytest.fixture(scope="session")
def tiny_llm_path(tmp_path_factory) -> Path:
    """The seed's tiny INT4 LLM (4 blocks, hidden 512, vocab 8192), generated once per session."""
    from onnx_prep.fixtures import generate

    return generate("tiny-llm", tmp_path_factory.mktemp("tiny-llm"))


@pytest.fixture(scope="session")
def small_llm_path(tmp_path_factory) -> Path:
    """A smaller variant of the same architecture for fast, many-case tests."""
    from onnx_prep.fixtures import FixtureConfig, generate

    cfg = FixtureConfig.preset("tiny-llm").replace(layers=2, hidden=128, intermediate=256,
                                                   heads=4, vocab=512)
    return generate(cfg, tmp_path_factory.mktemp("small-llm"))


@pytest.fixture(scope="session")
def tiny_zp_llm_path(tmp_path_factory) -> Path:
    """The tiny LLM with stored zero points: its greedy output does not collapse onto a
    few tokens (23-31 distinct of 32 on the prompts of test_greedy_tokens_ort.py, where
    the plain tiny-llm repeats one token 20 times in 32), so a token comparison
    discriminates; it runs the zero-point kernels end to end as well."""
    from onnx_prep.fixtures import FixtureConfig, generate

    cfg = FixtureConfig.preset("tiny-llm").replace(zero_points=True)
    return generate(cfg, tmp_path_factory.mktemp("tiny-zp-llm"))


@pytest.fixture
def small_llm_copy(small_llm_path, tmp_path) -> Path:
    """A private copy of the small fixture's folder (for tests that change its files or
    write beside it: a prepared cache, a digested model)."""
    import shutil

    dst = tmp_path / "m"
    shutil.copytree(small_llm_path.parent, dst)
    return dst / small_llm_path.name


def keep_tensor_digest(model_path: Path, key: str) -> None:
    """Rewrite the model at ``model_path`` so each initializer records only its per-tensor
    digest under ``key`` (``onnx_prep.sha256`` or ``onnx_prep.xxh3``), the other removed."""
    import onnx

    m = onnx.load(str(model_path), load_external_data=False)
    for t in m.graph.initializer:
        kept = [(p.key, p.value) for p in t.metadata_props if p.key == key]
        del t.metadata_props[:]
        for k, value in kept:
            t.metadata_props.add(key=k, value=value)
    onnx.save(m, str(model_path))


def ort_or_skip():
    """ONNX Runtime is the external oracle; tests that need it skip, saying so, where absent."""
    return pytest.importorskip("onnxruntime", reason="onnxruntime not installed: oracle comparison skipped")


def strip_digests(model: Path) -> dict[str, list[tuple[str, str]]]:
    """Rewrite ``model`` as most exporters write it: no per-tensor digest, no data-file
    checksum. Returns each initializer's removed digest entries (to put back)."""
    import onnx

    from onnx_prep.core.model.weights import TENSOR_DIGEST_KEY, TENSOR_FAST_DIGEST_KEY

    m = onnx.load(str(model), load_external_data=False)
    removed = {}
    for t in m.graph.initializer:
        keys = (TENSOR_DIGEST_KEY, TENSOR_FAST_DIGEST_KEY)
        removed[t.name] = [(p.key, p.value) for p in t.metadata_props if p.key in keys]
        keep = [p for p in t.metadata_props if p.key not in keys]
        del t.metadata_props[:]
        t.metadata_props.extend(keep)
        ext = [p for p in t.external_data if p.key != "checksum"]
        del t.external_data[:]
        t.external_data.extend(ext)
    onnx.save(m, str(model))
    return removed


def real_export(name: str) -> Path:
    """A real export (fixtures/real_exports.py) from the fixture cache, generated once per
    machine; skips, saying which tools are missing, where the ``exports`` extra is absent."""
    from onnx_prep.fixtures import real_exports

    missing = real_exports.missing_tools()
    if missing:
        pytest.skip(f"real exports need the 'exports' extra ({', '.join(missing)} not installed)")
    return real_exports.ensure_export(name)


def _export_names(tool: str) -> list[str]:
    from onnx_prep.fixtures.real_exports import EXPORTS

    return sorted(n for n, spec in EXPORTS.items() if spec.tool == tool)


@pytest.fixture(scope="session", params=_export_names("builder"))
def builder_export(request) -> Path:
    """Each onnxruntime-genai builder export (GroupQueryAttention, genai_config.json)."""
    return real_export(request.param)


@pytest.fixture(scope="session", params=_export_names("quantizer"))
def quantizer_export(request) -> Path:
    """Each torch-exported Llama quantized by ONNX Runtime's MatMulNBitsQuantizer."""
    return real_export(request.param)


@pytest.fixture(scope="session", params=_export_names("builder") + _export_names("quantizer"))
def any_export(request) -> Path:
    """Each real export, of both tools (fixtures/real_exports.py ``EXPORTS``)."""
    return real_export(request.param)
