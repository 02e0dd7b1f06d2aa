"""The public surface of ``import onnx_prep``: the names it promises, each resolving to
the object the rest of the project uses, and the program docs/api.md shows."""
import re
import subprocess
import sys
from pathlib import Path

import onnx_prep

API = {
    "__version__", "resolve_model", "ResolvedModel", "WeightDescriptor", "PrepackRequest",
    "build_prepared_execution_plan", "PreparedExecutionPlan", "Session", "SessionOptions",
    "RuntimeContext",
    "Workspace", "MemoryBudget", "ExecutionHandle", "ExecutionStatus", "RuntimeStats", "greedy_decode",
    "DecoderIO", "default_model_path", "generate", "OnnxPrepError", "ModelFormatError",
    "ExternalDataError", "UnsafePathError", "DigestError", "UnsupportedOpError",
    "NativeError", "ModelIOError", "BudgetError", "TaskFailedError", "CancelledError",
    "UsageError", "Where",
}
DOC = Path(__file__).parents[1] / "docs" / "api.md"


def test_surface_is_exactly_the_documented_names():
    assert set(onnx_prep.__all__) == API
    documented = set(re.findall(r"`(\w+)", DOC.read_text()))
    subclasses = {n for n in API if n.endswith("Error") and n != "OnnxPrepError"}
    assert API - subclasses <= documented  # the subclasses are "OnnxPrepError and its subclasses"

def test_every_name_is_the_object_the_project_uses():
    from onnx_prep.core import errors
    from onnx_prep.core.model.resolution import resolve_model
    from onnx_prep.core.runtime.session import Session

    assert onnx_prep.resolve_model is resolve_model
    assert onnx_prep.Session is Session
    assert onnx_prep.UsageError is errors.UsageError
    for name in API:
        assert getattr(onnx_prep, name) is not None, name
    assert isinstance(onnx_prep.__version__, str) and onnx_prep.__version__


def test_import_is_cheap():
    code = "import sys, onnx_prep; print(sorted(m for m in ('onnx', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_documented_program_runs(tmp_path, monkeypatch):
    program = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    monkeypatch.setenv("ONNX_PREP_CACHE", str(tmp_path))
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert re.fullmatch(r"44 weights, \d+ payload bytes", lines[0])  # the tied embedding's scales unread
    assert re.fullmatch(r"\[(\d+, ){7}\d+\] first output after [\d.]+ ms", lines[1])
