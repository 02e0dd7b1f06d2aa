# Two entry points (see README): `make demo` runs the main job on the embedded
# default model; `make test` runs the whole suite. Both create .venv and install
# the package (with its cffi native module) from this checkout first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
NATIVE_SRC := $(wildcard native/*.c native/*.h native/build_native.py)

.PHONY: demo test install bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Editable install: Python edits take effect at once; a change to the C sources
# re-runs this rule, which rebuilds the native module in place.
$(STAMP): $(BIN)/python pyproject.toml setup.py $(NATIVE_SRC)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/onnx-prep demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The benchmarks behind the kernel and load targets (docs/kernels.md, docs/runtime.md),
# ~6 minutes on 2 vCPUs; each ends with a line saying which targets it met.
bench: $(STAMP)
	$(BIN)/python scripts/bench_kernels.py
	$(BIN)/python scripts/bench_load.py --preset medium
	$(BIN)/python scripts/bench_load.py --preset medium --warm-cache

clean:
	rm -rf $(VENV) build *.egg-info native/_native*.so native/_native.c
