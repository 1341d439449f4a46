#!/usr/bin/env bash
# `make demo`: the built-in recipe smollm2-w4a16-gptq on the embedded SmolLM2-135M (quantize -> eval ->
# profile -> bench, with a comparison table), then one chat completion through `llmopt serve`.
# A second run skips every finished stage (a few seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
LLMOPT=".venv/bin/llmopt"
OUT="${DEMO_OUT:-out/demo}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

echo "== 1. llmopt run recipes/smollm2-w4a16-gptq.yaml -o $OUT"
$LLMOPT run recipes/smollm2-w4a16-gptq.yaml -o "$OUT"
echo
echo "== 2. a chat completion through llmopt serve on the W4A16 model ($OUT/quantize)"
.venv/bin/python scripts/demo_chat.py "$OUT/quantize"
