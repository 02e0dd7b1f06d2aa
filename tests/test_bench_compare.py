"""scripts/bench_compare.py drives two checkouts' real `onnx-prep run` and pairs them.

Run here with the same checkout on both sides: the tokens must match and every figure
must be printed for A, B and the paired difference."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "onnx-prep").exists(),
                    reason="needs the checkout's own .venv (make install)")
def test_same_checkout_on_both_sides(tiny_llm_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_compare.py"), "--a", str(ROOT),
                          "--b", str(ROOT), "--model", str(tiny_llm_path), "--tokens", "3",
                          "--repeats", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith("CPU ")
    for figure in ("open_ms", "first_output_ms", "decode_ms", "spawn_to_exit_ms", "peak_rss_mib"):
        for side in ("A", "B", "B-A"):
            assert re.search(rf"^{figure}\s+{re.escape(side)}\s+-?[\d.]+\s+-?[\d.]+\s+-?[\d.]+$", text, re.M), \
                (figure, side, text)
    assert "tokens identical across all runs: yes" in text
    rss = re.search(r"^peak_rss_mib\s+A\s+([\d.]+)", text, re.M)
    assert 20 < float(rss.group(1)) < 4096  # the child's own peak RSS, in MiB
