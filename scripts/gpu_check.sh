#!/usr/bin/env bash
# GPU check for llmopt.kernels on one NVIDIA GPU (sized for an H200: well under 5 minutes).
#   1. correctness: tests/kernels on CUDA (fp32, fp16, bf16 against the torch twins; the CPU
#      interpreter cases run too)
#   2. triton.testing.do_bench medians: w4a16 / w8a16 / w8a8 at M in {1, 16, 64} on 4096x4096
#      and 4096x14336 against cuBLAS fp16, and paged decode attention (batch 32, context 2048)
#      as a share of the HBM bandwidth measured in the same run.
#   3. the serve engine (`llmopt profile --synthetic llama3-8b`) on a synthetic Llama-3-8B-shaped model
#      of 4 random layers, built in memory: decode tokens/s at batch 1 and 32 and the share of the
#      copy bandwidth its bytes per step reach.
# Usage: scripts/gpu_check.sh            (PYTHON=... to pick the interpreter; the log also goes
#        to $OUT/gpu_check.log when OUT is set)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch,sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null
    then PY=.venv/bin/python; else PY=python3; fi
fi
# Without an install, map the folders onto the llmopt namespace as setup.py does (the CLI needs typer
# and rich besides torch, triton and transformers).
if ! "$PY" -c "import llmopt.cli.main" 2>/dev/null; then
    SHIM=$(mktemp -d)
    mkdir -p "$SHIM/llmopt"
    for p in cli stages kernels recipes; do ln -s "$PWD/$p" "$SHIM/llmopt/$p"; done
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG=${OUT:-$(mktemp -d)}/gpu_check.log

{
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
echo "== correctness: pytest tests/kernels =="
status=0
timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/kernels || status=$?
echo "== speed =="
timeout 150 "$PY" - <<'EOF' || status=$?
import torch
import torch.nn.functional as F
from triton.testing import do_bench

from llmopt.kernels import paged_attention_decode, w4a16_matmul, w8a8_matmul, w8a16_matmul

dev, torch_dtype, group = "cuda", torch.float16, 128
buf = torch.empty(2**30, dtype=torch.uint8, device=dev)
hbm = 2 * buf.numel() / (do_bench(lambda: buf.clone()) * 1e-3) / 1e9  # read + write
print(f"HBM copy bandwidth (read + write): {hbm:.0f} GB/s\n")
del buf

print("| K x N | M | cuBLAS fp16 us | w4a16 us (x cuBLAS, % HBM) | w8a16 us (x cuBLAS, % HBM) | w8a8 us (x cuBLAS) |")
print("|---|---|---|---|---|---|")
for k, n in ((4096, 4096), (4096, 14336)):
    w16 = torch.randn(n, k, device=dev, dtype=torch_dtype) * 0.02
    packed = torch.randint(-2**31, 2**31 - 1, (n, k // 8), device=dev, dtype=torch.int32)
    s4 = torch.rand(n, k // group, device=dev, dtype=torch_dtype) * 0.01
    q8 = torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8)
    s8 = torch.rand(n, 1, device=dev, dtype=torch_dtype) * 0.01
    for m in (1, 16, 64):
        x = torch.randn(m, k, device=dev, dtype=torch_dtype)
        t16 = do_bench(lambda: F.linear(x, w16)) * 1e3
        t4 = do_bench(lambda: w4a16_matmul(x, packed, s4, None, group)) * 1e3
        t8 = do_bench(lambda: w8a16_matmul(x, q8, s8)) * 1e3
        t88 = do_bench(lambda: w8a8_matmul(x, q8, s8)) * 1e3
        pct = lambda nbytes, us: 100 * nbytes / (us * 1e-6) / 1e9 / hbm  # noqa: E731
        print(f"| {k}x{n} | {m} | {t16:.1f} | {t4:.1f} ({t16 / t4:.2f}x, {pct(k * n / 2 + s4.nbytes, t4):.0f}%) | "
              f"{t8:.1f} ({t16 / t8:.2f}x, {pct(k * n, t8):.0f}%) | {t88:.1f} ({t16 / t88:.2f}x) |")

batch, ctx, hq, hk, d, bs = 32, 2048, 32, 8, 128, 16
blocks = batch * ctx // bs
k_cache = torch.randn(blocks, bs, hk, d, device=dev, dtype=torch_dtype)
v_cache = torch.randn_like(k_cache)
tables = torch.randperm(blocks, device=dev, dtype=torch.int32).view(batch, ctx // bs)
lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
q = torch.randn(batch, hq, d, device=dev, dtype=torch_dtype)
t = do_bench(lambda: paged_attention_decode(q, k_cache, v_cache, tables, lens, d ** -0.5)) * 1e3
kv_bytes = 2 * k_cache.nbytes
print(f"\npaged decode attention, batch {batch}, context {ctx}, {hq}/{hk} heads x {d}, block {bs}, fp16: "
      f"{t:.1f} us, {kv_bytes / (t * 1e-6) / 1e9:.0f} GB/s = {100 * kv_bytes / (t * 1e-6) / 1e9 / hbm:.0f}% of HBM")
EOF
echo "== engine: synthetic Llama-3-8B shapes, 4 layers, bf16 =="
COLUMNS=160 timeout 150 "$PY" -m llmopt.cli.main profile --synthetic llama3-8b --layers 4 --device cuda --dtype bf16 \
    --batch-sizes 1,32 --decode-context 512 --decode-steps 64 --json "${OUT:-/tmp}/gpu_engine_check.json" || status=$?
echo "gpu_check exit status: $status"
exit "$status"
} 2>&1 | tee "$LOG"
