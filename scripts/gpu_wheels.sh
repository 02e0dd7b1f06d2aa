#!/usr/bin/env bash
# The wheels the GPU check needs on a machine that cannot reach a package index
# (docs/cuda.md, "The GPU check"), downloaded here into .whl/ for that machine's Python:
#
#   bash scripts/gpu_wheels.sh [PYTHON_VERSION]     (default 3.12)
#
# The lent GPU machines run an image that already holds numpy, onnx, onnxruntime, rich,
# pytest, hypothesis, xxhash, cuda-bindings and NVRTC (the `cuda` extra's parts), but not
# what builds this package's native module (cffi) nor a few of its and its tests' other
# needs. Each is fetched without its dependencies, at the version this checkout's .venv
# runs where it has one, so the GPU run imports what the suite was run with here.
# .whl/ is ignored by git (added to .git/info/exclude) and is what the device call
# carries; scripts/gpu_check.sh installs from it when it is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
NAMES="cffi pycparser zstandard typer jsonschema jsonschema-specifications referencing rpds-py pytest-timeout"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir .whl
freeze=$(.venv/bin/python -m pip freeze 2>/dev/null || true)
specs="setuptools>=77"
for n in $NAMES; do
    pinned=$(printf '%s\n' "$freeze" | grep -i "^${n//-/[-_]}==" || true)
    specs="$specs ${pinned:-$n}"
done
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl $specs
du -sh .whl
ls .whl
