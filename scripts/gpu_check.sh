#!/usr/bin/env bash
# The GPU acceptance check of llmopt: one script on one NVIDIA GPU, at most 6 minutes on an H200. Every
# measurement is an llmopt command writing a JSON report into the output folder; the last part reads them
# and prints one PASS/FAIL table against the bars (stages/profile/acceptance.py, docs/gpu.md); the exit
# status is non-zero if any row fails.
#
# Parts, each under `timeout` with its budget (seconds on the H200; never more than what is left of the whole,
# GPU_CHECK_BUDGET_S = 360):
#   setup  10  this checkout as the llmopt namespace (a PYTHONPATH shim: nothing is pip-installed); the wheels
#              in .whl/ (`make gpu-wheels`) into a scratch folder when fastapi, uvicorn, pydantic,
#              compressed-tensors, gguf, typer, rich or httpx do not import (pip under timeout 60; the rest
#              of setup sets the environment, so it runs outside `timeout`)
#   a      70  kernel tests: pytest tests/kernels                                     -> kernel-tests.xml
#   b      40  kernel speed: w4a16 / w8a16 / w8a8 at M = 1, 16, 64 on 4096x4096 and 4096x14336 against
#              cuBLAS fp16, paged decode attention batch 32 x 2048, as shares of the copy bandwidth
#              measured in the same run (profile --synthetic llama3-8b --kernel-speed) -> kernels.json
#   c     110  the engine on 32 random Llama-3-8B layers, batches 1, 32, 128 (profile --synthetic
#              llama3-8b): bf16 (40) then W4A16 RTN-quantized on the GPU (70) -> engine-bf16.json, engine-w4a16.json
#   d      80  end to end: a 2-layer synthetic Llama-3-8B artifact with a chat tokenizer (--save-model),
#              llmopt quantize --device cuda (RTN W4A16), llmopt bench --server (llmopt serve --device
#              cuda) on random prompts at concurrency 1 and 32 -> bench-c1.json, bench-c32.json
#   e      40  greedy tokens, CUDA bf16 against CPU fp32 on a tiny model (20) -> greedy.json; the
#              CUDA-graph tests, pytest tests/stages/serve -k cuda (20) -> graphs.xml
#   f      10  the verdict: llmopt profile --acceptance                           -> acceptance.json
#
# Usage: scripts/gpu_check.sh   Reports and the log (gpu_check.log) go to $OUT when set, else a new temporary
# folder. PYTHON=... picks the interpreter. GPU_CHECK_DEVICE=cpu is the smoke mode: every part on CPU with
# tiny shapes and a few kernel tests, in about a minute (tests/scripts/test_gpu_check.py runs it), so the
# check does not rot between GPU sessions; its speed rows fail there, as they should on a CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=${GPU_CHECK_DEVICE:-cuda}
# Budgets are the H200's; the smoke mode scales them (a loaded 2-core machine starts each process slower).
SCALE=${GPU_CHECK_BUDGET_SCALE:-1}
[ "$DEVICE" = cpu ] && SCALE=${GPU_CHECK_BUDGET_SCALE:-3}
BUDGET=${GPU_CHECK_BUDGET_S:-$((360 * SCALE))}
VERDICT=$((10 * SCALE))  # kept for the last part whatever the others took
REPORTS=${OUT:-$(mktemp -d)}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$REPORTS"
LOG=$REPORTS/gpu_check.log
export PYTHONUNBUFFERED=1 COLUMNS=${COLUMNS:-160} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ "$DEVICE" = cpu ]; then  # smoke mode: the same commands on tiny shapes
    SHAPE=tiny LAYERS=1 BATCHES=1,4 DECODE="--decode-context 32 --decode-steps 8"
    KSPEED="--dtype fp32 --decode-context 256 --repeats 3 --threads 1" E2E_SHAPE=tiny
    BENCH="--input-len 16 --output-len 8" C1_PROMPTS=2 C32_PROMPTS=32 KV=64MiB
    KERNEL_TESTS=${GPU_CHECK_KERNEL_TESTS:-tests/kernels/test_elementwise.py}
else
    SHAPE=llama3-8b LAYERS=32 BATCHES=1,32,128 DECODE="--decode-context 512 --decode-steps 64"
    KSPEED="--dtype fp16" E2E_SHAPE=llama3-8b
    BENCH="--input-len 128 --output-len 64" C1_PROMPTS=8 C32_PROMPTS=64 KV=4GiB
    KERNEL_TESTS=${GPU_CHECK_KERNEL_TESTS:-tests/kernels}
fi

PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

TIMES=()
# part NAME BUDGET COMMAND...: run it (a command or an exported function) under timeout, the budget or what is
# left of the whole check, and note its time; a part that fails leaves its report missing, which fails its rows.
part() {
    local name=$1 budget=$(($2 * SCALE)) left=$((BUDGET - VERDICT - SECONDS)) start=$SECONDS rc=0
    shift 2
    [ "$left" -lt "$budget" ] && budget=$left
    if [ "$budget" -le 0 ]; then
        echo "== $name: skipped, the ${BUDGET} s of the check are spent"; TIMES+=("$name: skipped"); return 0
    fi
    echo "== $name (budget $budget s, $SECONDS s so far)"
    timeout --kill-after=5 "$budget" bash -c '"$@"' "$name" "$@" || rc=$?
    [ "$rc" -eq 124 ] && echo "!! $name: stopped after $budget s"
    TIMES+=("$name: $((SECONDS - start)) s (exit $rc)")
}

llmopt() { "$PY" -m llmopt.cli.main "$@"; }

# The wheels of `make gpu-wheels` for the imports that fail, into a scratch folder ahead on PYTHONPATH.
install_wheels() {
    local missing=() nodeps=() mod dist
    for pair in fastapi:fastapi uvicorn:uvicorn pydantic:pydantic typer:typer rich:rich httpx:httpx \
                compressed_tensors:compressed-tensors gguf:gguf; do
        mod=${pair%%:*} dist=${pair#*:}
        "$PY" -c "import $mod" 2>/dev/null && continue
        case $dist in
            compressed-tensors) nodeps+=("$dist" loguru psutil) ;;  # torch and transformers are there
            gguf) nodeps+=("$dist") ;;
            *) missing+=("$dist") ;;
        esac
    done
    [ ${#missing[@]} -eq 0 ] && [ ${#nodeps[@]} -eq 0 ] && { echo "every package imports"; return 0; }
    echo "installing from .whl/: ${missing[*]} ${nodeps[*]}"
    if [ ! -d .whl ]; then echo "!! no .whl/ folder: run make gpu-wheels on a machine with an index"; return 1; fi
    local site=$WORK/site
    if [ ${#missing[@]} -gt 0 ]; then
        timeout 60 "$PY" -m pip install -q --no-index --find-links .whl --target "$site" "${missing[@]}" || return 1
    fi
    if [ ${#nodeps[@]} -gt 0 ]; then
        timeout 60 "$PY" -m pip install -q --no-index --no-deps --find-links .whl --target "$site" "${nodeps[@]}" ||
            return 1
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
}

setup() {
    # This checkout's folders as the llmopt namespace (as setup.py maps them), ahead of any installed llmopt.
    mkdir -p "$WORK/shim/llmopt"
    for p in cli stages kernels recipes; do ln -s "$PWD/$p" "$WORK/shim/llmopt/$p"; done
    export PYTHONPATH="$WORK/shim:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    install_wheels || return 1
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.memory \
        --format=csv
    "$PY" -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', \
torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'cuda', \
torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
}

engine() {  # engine DTYPE-LABEL [--quantize SCHEME]
    local label=$1
    shift
    llmopt profile --synthetic "$SHAPE" --layers "$LAYERS" --device "$DEVICE" --dtype bf16 --batch-sizes "$BATCHES" \
        $DECODE "$@" --json "$REPORTS/engine-$label.json"
}

end_to_end() {
    llmopt profile --synthetic "$E2E_SHAPE" --layers 2 --device "$DEVICE" --save-model "$WORK/synthetic" || return 1
    llmopt quantize "$WORK/synthetic" -o "$WORK/w4a16" --method rtn --scheme W4A16 --device "$DEVICE" \
        --eval-windows 0 || return 1
    local c n
    for c in 1 32; do
        n=$C1_PROMPTS; [ "$c" = 32 ] && n=$C32_PROMPTS
        llmopt bench --server "$WORK/w4a16" --server-timeout 60 \
            --serve-args "--device $DEVICE --max-num-seqs 32 --kv-cache-memory $KV" \
            --dataset random $BENCH --ignore-eos --num-prompts "$n" --max-concurrency "$c" --request-rate inf \
            --seed 0 --quiet --json "$REPORTS/bench-c$c.json"
    done
}

export PY DEVICE SHAPE LAYERS BATCHES DECODE E2E_SHAPE BENCH C1_PROMPTS C32_PROMPTS KV REPORTS WORK
export -f llmopt engine end_to_end
{
    echo "== setup ($SECONDS s so far)"
    setup || echo "!! setup failed: the parts below will say what is missing"
    TIMES+=("setup: $SECONDS s")
    part "a kernel tests" 70 "$PY" -m pytest -q -p no:cacheprovider $KERNEL_TESTS --junitxml "$REPORTS/kernel-tests.xml"
    part "b kernel speed" 40 llmopt profile --synthetic "$SHAPE" --kernel-speed --device "$DEVICE" $KSPEED \
        --json "$REPORTS/kernels.json"
    part "c engine bf16" 40 engine bf16
    part "c engine W4A16" 70 engine w4a16 --quantize w4a16
    part "d end to end" 80 end_to_end
    part "e greedy" 20 llmopt profile --synthetic tiny --check-greedy --device "$DEVICE" --dtype bf16 \
        --json "$REPORTS/greedy.json"
    part "e CUDA graphs" 20 "$PY" -m pytest -q -p no:cacheprovider tests/stages/serve -k cuda \
        --junitxml "$REPORTS/graphs.xml"
    printf '== part times:'; printf ' %s;' "${TIMES[@]}"; echo
    status=0
    timeout "$VERDICT" "$PY" -m llmopt.cli.main profile --acceptance "$REPORTS" --json "$REPORTS/acceptance.json" || status=$?
    echo "gpu_check: $SECONDS s, exit status $status; reports in $REPORTS"
    exit "$status"
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
