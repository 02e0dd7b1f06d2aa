#!/usr/bin/env bash
# The GPU check in one command, for a machine with a CUDA device (docs/cuda.md):
#
#   bash scripts/gpu_check.sh [OUT_DIR]     (default build/gpu-check)
#
# Installs the package with its `test` and `cuda` extras into .venv (building the native
# module), or, where .whl/ holds the wheels scripts/gpu_wheels.sh downloads (a machine
# that reaches no package index), into a folder on PYTHONPATH beside that machine's own
# packages, records what discovery finds (`onnx-prep devices --json`), runs the CUDA
# tests (tests/test_cuda_*.py: the fake-driver ones and the GPU ones, which run only
# where a device is usable: test_cuda_gpu*.py, the stable-VA slots, the NVRTC-compiled
# INT4 matmul against the CPU kernel, a graph replayed after a weight's memory was
# swapped), and writes OUT_DIR/results.json: the discovery record, each test's outcome
# and skip reason, and whether the GPU tests ran and passed; then a batch sweep on the
# device beside the CPU's (the medium-gqa fixture: medium's shape with GroupQueryAttention
# over 8 KV heads, whose KV the device keeps so its decode steps are captured and
# replayed; N = 1, 2, 4, 8, the packed weights held to half of what they commit:
# `profile --batch-sweep --device cuda`), its rows in
# results.json's "sweep". Exit 0 only when the GPU tests ran and passed. Minutes on one
# GPU (the sweep is capped at 4), within the 8 the issue allows.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build/gpu-check}
mkdir -p "$OUT"

if [ -d .whl ]; then
    # Offline (a lent GPU machine reaches no package index): that machine's python3
    # (GPU_PYTHON) has numpy, onnx, onnxruntime, pytest and the cuda extra's parts; the
    # rest comes from the wheels scripts/gpu_wheels.sh put in .whl/. Everything goes into
    # one folder on PYTHONPATH (GPU_SITE), this package built there with the carried
    # setuptools and cffi.
    PY=${GPU_PYTHON:-python3}
    SITE=${GPU_SITE:-/tmp/onnx-prep-site}
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    if ! { "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
               .whl/*.whl &&
           "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
               --target "$SITE" .; } >"$OUT/install.log" 2>&1; then
        echo "gpu_check: the offline install failed; see $OUT/install.log" >&2
        exit 2
    fi
    ONNX_PREP=("$PY" -m onnx_prep)
else
    if ! { make install && .venv/bin/python -m pip install -q -e '.[test,cuda]'; } >"$OUT/install.log" 2>&1; then
        echo "gpu_check: the install failed; see $OUT/install.log" >&2
        exit 2
    fi
    PY=.venv/bin/python
    ONNX_PREP=(.venv/bin/onnx-prep)
fi
"${ONNX_PREP[@]}" devices --json >"$OUT/devices.json" 2>"$OUT/devices.err"
"$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_*.py --junitxml "$OUT/cuda-tests.xml" \
    >"$OUT/cuda-tests.log" 2>&1
tests_rc=$?
# The batch sweep on the device beside the CPU's: the medium-gqa fixture (generated here, ~0.5 GB;
# GroupQueryAttention, so the device keeps its KV and captures its decode steps: the standard-op
# medium's fused attention keeps its KV on the host and shows captures 0) with the packed weights
# held to half of what they commit, so they stream every step.
timeout 240 "${ONNX_PREP[@]}" profile "$("$PY" -c 'from onnx_prep.fixtures import FixtureConfig, ensure_cached
print(ensure_cached(FixtureConfig.preset("medium-gqa")))')" --batch-sweep 1,2,4,8 --budget 50% --tokens 8 --repeat 2 \
    --device cuda --format json >"$OUT/sweep.json" 2>"$OUT/sweep.err"
sweep_rc=$?

"$PY" - "$OUT" "$tests_rc" "$sweep_rc" <<'EOF'
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, tests_rc, sweep_rc = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
try:
    devices = json.loads((out / "devices.json").read_text())
except (OSError, ValueError) as exc:
    devices = {"error": f"onnx-prep devices --json gave no record ({exc}); see devices.err"}
cases = []
for case in ET.parse(out / "cuda-tests.xml").getroot().iter("testcase"):
    outcome, detail = "passed", None
    for tag in ("failure", "error", "skipped"):
        node = case.find(tag)
        if node is not None:
            outcome, detail = tag, node.get("message")
    cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome, "detail": detail,
                  "seconds": float(case.get("time") or 0)})
# the GPU tests: their own files, and the tests named for a device in the others (marker gpu)
gpu = [c for c in cases if "test_cuda_gpu" in c["test"] or "::test_on_a_device" in c["test"]]
try:
    sweep = json.loads((out / "sweep.json").read_text())
    sweep = {"device": sweep["device"], "rows": [{"batch": r["batch"], "cpu_tokens_per_s": r["tokens_per_s"],
                                                  "cpu_bytes_paged_per_token": r["bytes_paged_per_token"],
                                                  **{f"device_{k}": v for k, v in r["device"].items()}}
                                                 for r in sweep["rows"]]}
except (OSError, ValueError, KeyError, TypeError) as exc:
    sweep = {"error": f"the batch sweep gave no record (exit {sweep_rc}: {exc}); see sweep.err"}
gpu_ok = bool(gpu) and all(c["outcome"] == "passed" for c in gpu)
results = {"devices": devices, "tests_exit_code": tests_rc, "gpu_tests_passed": gpu_ok, "sweep": sweep,
           "counts": {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failure", "error", "skipped")},
           "tests": cases}
(out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
print(f"gpu_check: {(devices.get('summary') or devices.get('error'))}")
print(f"gpu_check: {results['counts']}; GPU tests {'passed' if gpu_ok else 'did NOT all pass'}; "
      f"results in {out / 'results.json'}")
sys.exit(0 if gpu_ok and tests_rc == 0 else 1)
EOF
