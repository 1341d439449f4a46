#!/usr/bin/env bash
# `make demo`: the built-in recipe smollm2-w4a16-gptq on the embedded SmolLM2-135M (quantize -> eval ->
# profile -> bench, with a comparison table), then one chat completion through `llmopt serve`.
# It works in the recipe's own workdir, out/smollm2-w4a16-gptq, so `llmopt run smollm2-w4a16-gptq
# --dry-run` afterwards shows every stage done; DEMO_OUT=DIR works elsewhere (pass -o DIR to the dry run
# then). A second run skips every finished stage (a few seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
LLMOPT="${LLMOPT:-.venv/bin/llmopt}"
PYTHON="${PYTHON:-.venv/bin/python}"
RECIPE=smollm2-w4a16-gptq
OUT="${DEMO_OUT:-out/$RECIPE}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

echo "== 1. llmopt run $RECIPE -o $OUT"
$LLMOPT run "$RECIPE" -o "$OUT"
echo
echo "== 2. a chat completion through llmopt serve on the W4A16 model ($OUT/quantize)"
"$PYTHON" scripts/demo_chat.py "$OUT/quantize"
