# Two entry points (see README): `make demo` runs the main job on the embedded
# default model; `make test` runs the whole suite. Both create .venv and install
# the package (with its cffi native module) from this checkout first.
# `make check-wheel` checks the install users get (CI runs it after `make test`).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
NATIVE_SRC := $(wildcard native/*.c native/*.h native/build_native.py)
# `make test` also installs the `exports` extra: the tools behind the real-export tests
# (torch CPU, transformers, onnxruntime-genai; ~1 GB, once), so the README's test command
# runs them, as CI does. `make test EXTRAS=test` skips them, each saying so.
EXTRAS ?= test,exports
comma := ,
TEST_STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: demo test install check-wheel sanitize bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Editable install: Python edits take effect at once; a change to the C sources
# re-runs this rule, which rebuilds the native module in place.
$(STAMP): $(BIN)/python pyproject.toml setup.py $(NATIVE_SRC)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS)]'
	touch $(TEST_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/onnx-prep demo

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q

# The install users get, checked end to end: build the sdist and, from it, the wheel
# (as pip does from a registry), install the wheel into a fresh venv, run the main job
# from there (a missing schema, header or fixture module fails here), then the whole
# suite against that install. Run from this folder, the suite must import the installed
# package, not the checkout's folders: the one-line check before it says which it got.
WHEEL_DIR  := build/wheel
WHEEL_VENV := build/wheel-venv

check-wheel: $(BIN)/python
	rm -rf $(WHEEL_DIR) $(WHEEL_VENV)
	$(BIN)/python -m pip install -q build
	$(BIN)/python -m build -q --outdir $(WHEEL_DIR) .
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q "$$(ls $(WHEEL_DIR)/*.whl)[test]"
	ONNX_PREP_CACHE=$(abspath $(WHEEL_DIR))/cache $(WHEEL_VENV)/bin/onnx-prep demo
	$(WHEEL_VENV)/bin/python -c 'import onnx_prep.core as c, sys; \
		sys.exit(0 if "/site-packages/" in c.__file__ else f"not the installed package: {c.__file__}")'
	$(WHEEL_VENV)/bin/python -m pytest -q

# The native module's tests again, the C built with AddressSanitizer and UBSan into
# build/sanitize (scripts/sanitize_native.py; ~4 minutes on 2 vCPUs, most of it the
# build). CI runs it after `make test`.
sanitize: $(TEST_STAMP)
	$(BIN)/python scripts/sanitize_native.py

# The benchmarks behind the kernel and load targets (docs/kernels.md, docs/runtime.md),
# ~6 minutes on 2 vCPUs; each ends with a line saying which targets it met.
bench: $(STAMP)
	$(BIN)/python scripts/bench_kernels.py
	$(BIN)/python scripts/bench_load.py --preset medium
	$(BIN)/python scripts/bench_load.py --preset medium --warm-cache

clean:
	rm -rf $(VENV) build *.egg-info native/_native*.so native/_native.c
