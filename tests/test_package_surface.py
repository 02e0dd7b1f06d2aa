"""Every family package's ``__all__`` names something that exists, and importing a
package imports none of its modules until a name is used."""
import importlib
import subprocess
import sys

import pytest

FAMILIES = ["model", "io", "plan", "kernels", "runtime", "decode", "profile"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_exported_name_resolves(family):
    pkg = importlib.import_module(f"onnx_prep.core.{family}")
    assert pkg.__all__, family
    for name in pkg.__all__:
        assert getattr(pkg, name) is not None, f"onnx_prep.core.{family}.{name}"
    with pytest.raises(AttributeError):
        getattr(pkg, "no_such_name")


def test_packages_import_lazily():
    code = ("import sys\n"
            + "".join(f"import onnx_prep.core.{f}\n" for f in FAMILIES)
            + "print(','.join(sorted(m for m in ('onnx', 'numpy') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
