#!/usr/bin/env bash
# `make bench`: llmopt serve on the base, W8A16 and W4A16 artifacts of smollm2-135m against the
# plain-transformers baseline (scripts/baseline_server.py, one request at a time), on the shared
# ShareGPT prompts at concurrency 1, 4 and 16. One JSON report per run and summary.md land in
# bench-results/; the summary prints each run's output throughput as a multiple of the baseline's.
#
# Knobs (environment): BENCH_PROMPTS (16), BENCH_OUTPUT_LEN (64), BENCH_CONCURRENCY ("1 4 16"),
# BENCH_RUNS ("hf:base llmopt:base llmopt:base@bf16 llmopt:w8a16 llmopt:w4a16", ENGINE:ARTIFACT[@DTYPE]:
# @bf16 serves in bf16 (`--dtype bf16`; the baseline server takes it too), reported as NAME-bf16), BENCH_SERVE_ARGS
# (extra `llmopt serve` options), BENCH_URLS ("NAME=URL ...": servers already running, e.g. llama.cpp's
# llama-server or vLLM, benched with the same load), BENCH_OUT (bench-results), BENCH_ARTIFACTS (out/bench).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${BENCH_OUT:-bench-results}
ART=${BENCH_ARTIFACTS:-out/bench}
PROMPTS=${BENCH_PROMPTS:-16}
OUTPUT_LEN=${BENCH_OUTPUT_LEN:-64}
CONCURRENCY=${BENCH_CONCURRENCY:-1 4 16}
RUNS=${BENCH_RUNS:-hf:base llmopt:base llmopt:base@bf16 llmopt:w8a16 llmopt:w4a16}
SERVE_ARGS=${BENCH_SERVE_ARGS:-}
URLS=${BENCH_URLS:-}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

llmopt() { "$PY" -m llmopt.cli.main "$@"; }

artifact() {  # NAME: build out/bench/NAME once (base: import; w8a16 / w4a16: RTN from the base)
    local name=$1 dir="$ART/$1"
    [[ -f "$dir/llmopt.json" ]] && return
    case "$name" in
        base) llmopt import smollm2-135m -o "$dir" ;;
        w8a16|w4a16) artifact base
                     llmopt quantize "$ART/base" -o "$dir" --method rtn --scheme "${name^^}" --eval-windows 0 ;;
        *) echo "bench.sh: unknown artifact $name (base, w8a16, w4a16)" >&2; exit 2 ;;
    esac
}

if [[ ${1:-} == artifacts ]]; then  # `scripts/bench.sh artifacts`: only build out/bench/* (make bench-engine)
    for name in base w8a16 w4a16; do artifact "$name"; done
    exit 0
fi

load=(--dataset sharegpt --num-prompts "$PROMPTS" --output-len "$OUTPUT_LEN" --ignore-eos --request-rate inf
      --warmup 1 --seed 0 --quiet)
mkdir -p "$OUT"
start=$SECONDS
for run in $RUNS; do
    engine=${run%%:*} name=${run#*:} dtype=
    [[ $name == *@* ]] && dtype=${name#*@} name=${name%@*}
    artifact "$name"
    extra=() label=$engine-$name${dtype:+-$dtype}
    [[ -n $dtype ]] && extra+=(--serve-args "--dtype $dtype")
    [[ $engine == llmopt && -n $SERVE_ARGS ]] && extra+=(--serve-args "$SERVE_ARGS")
    for c in $CONCURRENCY; do
        echo "== $engine on $name${dtype:+ in $dtype}, concurrency $c ($((SECONDS - start)) s so far)" >&2
        llmopt bench --server "$ART/$name" --engine "$engine" "${extra[@]}" "${load[@]}" --max-concurrency "$c" \
            --json "$OUT/$label-c$c.json" > "$OUT/$label-c$c.txt"
    done
done
for entry in $URLS; do
    for c in $CONCURRENCY; do
        echo "== ${entry%%=*} at ${entry#*=}, concurrency $c" >&2
        llmopt bench --url "${entry#*=}" "${load[@]}" --max-concurrency "$c" \
            --json "$OUT/${entry%%=*}-c$c.json" > "$OUT/${entry%%=*}-c$c.txt"
    done
done
"$PY" scripts/bench_summary.py "$OUT" --baseline hf-base
echo "make bench: $((SECONDS - start)) s; reports in $OUT/" >&2
