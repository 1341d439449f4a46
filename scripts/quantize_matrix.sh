#!/usr/bin/env bash
# The quantize issue's acceptance measurements on smollm2-135m (WikiText-2 test, seqlen 2048, the
# first $WINDOWS windows). Writes one JSON per run under $OUT and a summary table at the end.
#   scripts/quantize_matrix.sh [OUT] ; WINDOWS=32 NSAMPLES=128 by default. Takes about an hour here.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench-results/quantize}"
WINDOWS="${WINDOWS:-32}"
NSAMPLES="${NSAMPLES:-128}"
LLMOPT=.venv/bin/llmopt
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

run() {  # name, then quantize options
  local name=$1; shift
  [ -f "$OUT/$name.json" ] && { echo "skip $name (done)"; return; }
  echo "== $name: $*"
  local start=$SECONDS
  $LLMOPT quantize smollm2-135m -o "$OUT/$name" --force --eval-windows "$WINDOWS" --json "$@" > "$OUT/$name.tmp"
  python3 - "$OUT/$name.tmp" "$((SECONDS - start))" > "$OUT/$name.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); d["wall_seconds"] = int(sys.argv[2]); print(json.dumps(d))
PY
  rm "$OUT/$name.tmp"
}

$LLMOPT eval smollm2-135m --max-windows "$WINDOWS" --json > "$OUT/base-eval.json"
run rtn-w4-asym-g32 --method rtn --asym --group-size 32
run rtn-w8a16 --method rtn --scheme W8A16
run rtn-w4-g64 --method rtn --group-size 64
run gptq-w4-g64 --method gptq --group-size 64 --nsamples "$NSAMPLES"
run awq-w4-g64 --method awq --group-size 64 --nsamples "$NSAMPLES"
run smoothquant-w8a8 --method smoothquant --scheme W8A8 --nsamples "$NSAMPLES"

python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
base = json.load(open(out / "base-eval.json"))["perplexity"]
print(f"{'run':24} {'ppl':>9} {'vs base':>9} {'weights MiB':>12} {'quantize s':>11}")
print(f"{'base (fp32)':24} {base:9.4f}")
for f in sorted(out.glob("*.json")):
    if f.name == "base-eval.json":
        continue
    m = json.load(open(f))["metrics"]
    after = m["perplexity_before_after"]["after"]
    print(f"{f.stem:24} {after:9.4f} {100 * (after / base - 1):+8.2f}% {m['size_bytes'] / 2**20:12.1f} "
          f"{m.get('quantize_seconds', 0):11.1f}")
PY
