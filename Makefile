# The two set-up commands (README): `make demo` runs the main job on the shipped model,
# `make test` runs the test suite. Each creates .venv with pinned dependencies first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
MODEL  := recipes/tiny-gdn-hybrid
OUT    := out/tiny
# onnx,dev: everything (export, train, tests). EXTRAS=runtime: a torch-free venv that validates,
# benches and runs exported folders (what an edge device installs: pip install 'edgelin[runtime]').
EXTRAS ?= onnx,dev

.PHONY: demo test install clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(if $(findstring onnx,$(EXTRAS)),$(BIN)/python -m pip install -q torch==2.13.0)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[$(EXTRAS)]"
	touch $@

demo: install
	$(BIN)/edgelin families
	$(BIN)/edgelin export $(MODEL) --target onnx --out $(OUT) --force --baseline kv
	$(BIN)/edgelin validate $(OUT)
	$(BIN)/edgelin validate $(OUT) --against $(MODEL) --steps 512
	$(BIN)/edgelin bench $(OUT) --positions 1,1024,8192,32768 --baseline kv
	$(BIN)/edgelin generate $(OUT) --prompt "def main(" --max-new-tokens 200

test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25

clean:
	rm -rf $(VENV) out .pytest_cache
