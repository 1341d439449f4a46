#!/usr/bin/env bash
# `make demo`: the pipeline on the embedded SmolLM2-135M. Later stages extend it.
set -euo pipefail
cd "$(dirname "$0")/.."
LLMOPT=".venv/bin/llmopt"
OUT="${DEMO_OUT:-out/demo}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

echo "== 1. import the embedded model (first run dequantizes the GGUF, ~30 s; later runs read the cache)"
$LLMOPT import smollm2-135m -o "$OUT/smollm2-135m" --force
echo
echo "== 2. inspect the artifact"
$LLMOPT inspect "$OUT/smollm2-135m"
echo
echo "== 3. perplexity on 4 windows of WikiText-2 test (seqlen 2048)"
$LLMOPT eval "$OUT/smollm2-135m" --text wikitext2 --seqlen 2048 --max-windows 4
