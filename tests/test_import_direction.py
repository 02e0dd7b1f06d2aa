"""The import direction between folders (docs/architecture.md, "Import direction").

Read from the source with ``ast``, so a forbidden import fails here even when it sits
inside a function that no other test calls."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
FAMILIES = ("model", "io", "plan", "kernels", "ops", "runtime", "cache", "decode", "profile", "cuda")

# family -> families it must never import. Everything not listed is allowed.
FORBIDDEN = {
    "core": {"cli"},  # the library never imports the commands (applies to every core.*)
    "native": {"cli", "fixtures", *(f"core.{f}" for f in FAMILIES)},
    "fixtures": {"cli", "core.runtime", "core.plan", "core.cache", "core.decode", "core.profile"},
    "core.model": {"core.plan", "core.runtime", "core.cache", "core.decode", "core.profile", "core.ops", "core.cuda"},
    "core.io": {"core.plan", "core.runtime", "core.cache", "core.decode", "core.kernels", "core.ops", "core.cuda"},
    "core.kernels": {"core.plan", "core.runtime", "core.cache", "core.decode", "core.profile", "core.cuda"},
    "core.ops": {"core.plan", "core.runtime", "core.cache", "core.decode", "core.profile", "core.kernels",
                 "core.cuda"},
    "core.plan": {"core.runtime", "core.cache", "core.decode", "core.profile", "core.cuda"},
    "core.runtime": {"core.cache", "core.decode", "core.profile", "core.cuda"},
    "core.cache": {"core.decode", "core.profile"},
    # CUDA sits beside the cache, above the runtime (its device slot pool is the runtime's
    # slot-pool interface; the runtime knows it only through that): decoding and
    # profiling reach it for --device, nothing below them does.
    "core.cuda": {"core.cache", "core.decode", "core.profile"},
}


def _family(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "onnx_prep" or len(parts) < 2:
        return None
    if parts[1] == "core" and len(parts) > 2 and parts[2] in FAMILIES:
        return f"core.{parts[2]}"
    return parts[1]


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def _sources():
    for top in ("cli", "core", "native", "fixtures"):
        for path in sorted((ROOT / top).rglob("*.py")):
            yield path, _family("onnx_prep." + ".".join(path.relative_to(ROOT).with_suffix("").parts))


def _rules(family: str) -> set[str]:
    rules = set(FORBIDDEN.get(family, ()))
    if family.startswith("core."):
        rules |= FORBIDDEN["core"]
    return rules


def test_no_forbidden_import():
    bad = []
    for path, family in _sources():
        rules = _rules(family)
        for line, module in _imports(path):
            target = _family(module)
            if target in rules:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {family} imports {module}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("family,module", [("core.kernels", "onnx_prep.core.runtime.session"),
                                           ("core.model", "onnx_prep.cli.app"),
                                           ("core.plan", "onnx_prep.core.runtime.arenas"),
                                           ("core.runtime", "onnx_prep.core.cuda.device_slot_pool"),
                                           ("core.cuda", "onnx_prep.core.decode.run_record")])
def test_the_rules_catch_a_violation(family, module):
    assert _family(module) in _rules(family)
