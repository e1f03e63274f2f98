# The two set-up commands (README): `make demo` runs the main job on the shipped model,
# `make test` runs the test suite. Each creates .venv with pinned dependencies first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
MODEL  := recipes/tiny-gdn-hybrid
OUT    := out/tiny
# onnx,dev: everything (export, train, tests). EXTRAS=runtime: a torch-free venv that validates,
# benches and runs exported folders (what an edge device installs: pip install 'edgelin[runtime]').
# --no-compile: no bytecode for all of torch and the rest up front (measured: torch's install 38 -> 11 s);
# Python compiles a module the first time it is imported instead.
EXTRAS ?= onnx,dev

.PHONY: demo test test-all test-arm test-serve serve-env lint install clean peers-setup

install: $(VENV)/.installed

# `pip install -e` runs the CMake build (CMakeLists.txt: the CPU kernel library, the device profiles) through
# scikit-build-core, with cmake and ninja from PyPI; a change to the C sources needs `make install` again (until
# then the runner compiles the changed sources at first use: edgelin.ortops.packaged). docs/development.md.
$(VENV)/.installed: pyproject.toml constraints.txt CMakeLists.txt edgelin/ortops/CMakeLists.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(if $(findstring onnx,$(EXTRAS)),$(BIN)/python -m pip install -q --no-compile torch==2.13.0)
	$(BIN)/python -m pip install -q --no-compile -c constraints.txt -e ".[$(EXTRAS)]"
	touch $@

demo: install
	$(BIN)/edgelin families
	$(BIN)/edgelin export onnx $(MODEL) --out $(OUT) --force --baseline kv
	$(BIN)/edgelin validate $(OUT)
	$(BIN)/edgelin validate $(OUT) --against $(MODEL) --steps 512 --json > $(OUT)-validate.json
	$(BIN)/edgelin bench $(OUT) --positions 1,1024,8192,32768 --baseline kv --json > $(OUT)-bench.json
	$(BIN)/edgelin generate $(OUT) --prompt "def main(" --max-new-tokens 200
	$(BIN)/edgelin report $(OUT)-bench.json $(OUT)-validate.json --out $(OUT)-report --force

# `make test` is CI's tier (tests/conftest.py: CI_KEEPS and the slow marks say what waits for the full run);
# `make test-all` runs every test (~23 min on the 2-core machine).
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

test: install
	$(PYTEST) -m "not slow and not server"

test-all: install
	$(PYTEST) -m "not server"

# The serving environment (docs/serving.md): Triton Inference Server from the nvidia-pytriton wheel, whose Python
# backend needs numpy < 2, so a venv of its own beside .venv, with edgelin installed editable (the same checkout).
SERVE_VENV := .serve-venv
serve-env: $(SERVE_VENV)/.installed

$(SERVE_VENV)/.installed: pyproject.toml constraints-serve.txt CMakeLists.txt edgelin/ortops/CMakeLists.txt
	$(PYTHON) -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/python -m pip install -q --no-compile -c constraints-serve.txt -e ".[runtime,server]"
	touch $@

# The server tier (CI runs it after `make test`): a real tritonserver serving exports to concurrent clients,
# and its faults (tests/serve/test_triton_server.py; ~3 min).
test-serve: install serve-env
	EDGELIN_SERVE_ENV=$(SERVE_VENV) $(BIN)/python -m pytest -q -m server tests/serve

# The ARM tier (CI runs it after `make test`): edgelin's cross-built aarch64 wheel under qemu-user, every kernel path
# on emulated Cortex-A72 / A76 / max and the shipped model's exports validated there (docs/arm.md; ~5-8 min).
test-arm: install
	.ci/arm/run

# ruff: the rules in pyproject.toml [tool.ruff] (pyflakes, syntax errors), on the whole tree; run by .ci/run first.
lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(SERVE_VENV) out .pytest_cache build dist

# The CPU peers benchmark's own environments (bench/peers.md; never part of `make test` or CI):
# llama-cpp-python built from source, ExecuTorch, each in a venv outside the repo ($(PEERS)).
PEERS ?= /work/peers
peers-setup:
	mkdir -p $(PEERS)/dl $(PEERS)/src
	$(PYTHON) -m venv $(PEERS)/venv-llama
	$(PEERS)/venv-llama/bin/pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d $(PEERS)/dl
	tar xzf $(PEERS)/dl/llama_cpp_python-0.3.36.tar.gz -C $(PEERS)/src
	CMAKE_BUILD_PARALLEL_LEVEL=2 nice -n 19 $(PEERS)/venv-llama/bin/pip install -q $(PEERS)/dl/llama_cpp_python-0.3.36.tar.gz
	$(PEERS)/venv-llama/bin/pip install -q torch==2.13.0
	$(PEERS)/venv-llama/bin/pip install -q transformers==5.24.0 sentencepiece safetensors gguf==0.19.0 torch==2.13.0
	$(PYTHON) -m venv $(PEERS)/venv-et
	$(PEERS)/venv-et/bin/pip install -q torch==2.13.0
	$(PEERS)/venv-et/bin/pip install -q executorch==1.5.1 transformers==5.24.0 'numpy<2.4' safetensors torch==2.13.0
