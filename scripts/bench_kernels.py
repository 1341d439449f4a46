"""CPU benchmark of the quantized linears on SmolLM2-135M's shapes (`make bench-kernels`).

For every linear of one decode step (30 layers x q,k,v,o,gate,up,down, plus the tied lm_head
576x49152) this times dense F.linear (fp32, bf16) against the CPU paths the quantized layers
use (W8A16: int8 weight-only, W8A8: fbgemm per-token int8, W4A16: int4 weight-only, group 64).
Every layer gets its own weights, as in a real step, so they stream from memory rather than
cache. Prints per-shape medians with achieved weight GB/s (weight bytes / time), the summed
step, the machine's copy/read bandwidth measured in the same run, and the accuracy of each
path against an fp64 reference.

    python scripts/bench_kernels.py [--layers 30] [--batch 1 8 32] [--threads N] [--repeats 7]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from llmopt.kernels import select_backend

HIDDEN, INTER, KV, VOCAB = 576, 1536, 192, 49152
# name: (K, N, calls per layer)
LAYER_SHAPES = {"q/o": (HIDDEN, HIDDEN, 2), "k/v": (HIDDEN, KV, 2), "gate/up": (HIDDEN, INTER, 2),
                "down": (INTER, HIDDEN, 1)}
PATHS = ("fp32", "bf16", "w8a16", "w8a8", "w4a16")
TORCH_CPU = select_backend("cpu-torch")  # the quantized paths: torch's packed CPU kernels
GROUP = 64


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bandwidth(repeats: int) -> tuple[float, float]:
    """(copy GB/s counting the copied bytes once, read GB/s of a streaming sum) on 256 MiB."""
    src = torch.rand(64 * 2**20)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    copy = nbytes / median_s(lambda: dst.copy_(src), repeats) / 1e9
    read = nbytes / median_s(lambda: src.sum(), repeats) / 1e9
    return copy, read


def quantize(w: torch.Tensor) -> dict:
    """Symmetric int4 (group 64, pack-quantized) and int8 (channel) tensors for w [N, K]."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    n, k = w.shape
    s4 = w.view(n, k // GROUP, GROUP).abs().amax(-1) / 7.5
    q4 = (w.view(n, k // GROUP, GROUP) / s4[..., None]).round().clamp(-8, 7).view(n, k).to(torch.int8)
    s8 = w.abs().amax(-1, keepdim=True) / 127
    q8 = (w / s8).round().clamp(-127, 127).to(torch.int8)
    return {"w4": {"weight_packed": pack_to_int32(q4, 4), "weight_scale": s4, "weight_shape": torch.tensor([n, k])},
            "w8": {"weight": q8, "weight_scale": s8}}


def build(k: int, n: int, count: int) -> dict[str, list]:
    """`count` independent layers of shape [n, k] for every path: callables x -> y."""
    layers = {p: [] for p in PATHS}
    for _ in range(count):
        w = torch.randn(n, k) * 0.02
        t = quantize(w)
        layers["fp32"].append(lambda x, w=w: F.linear(x, w))
        layers["bf16"].append(lambda x, w=w.bfloat16(): F.linear(x.bfloat16(), w).float())
        layers["w8a16"].append(TORCH_CPU.quantized_linear("w8a16", t["w8"]))
        layers["w8a8"].append(TORCH_CPU.quantized_linear("w8a8", t["w8"]))
        layers["w4a16"].append(TORCH_CPU.quantized_linear("w4a16", t["w4"], GROUP))
    return layers


WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "w8a16": 1.0, "w8a8": 1.0, "w4a16": 0.5 + 2 / GROUP}


def per_call_us(layers, x, repeats):
    return median_s(lambda: [layer(x) for layer in layers], repeats) / len(layers) * 1e6


def shape_table(shapes, batches, repeats):
    """Rows: (name, k, n, m, {path: us}); plus the step sum per batch size."""
    rows, step = [], {m: dict.fromkeys(PATHS, 0.0) for m in batches}
    for name, (k, n, per_step, layers) in shapes.items():
        for m in batches:
            x = torch.randn(m, k)
            times = {p: per_call_us(layers[p], x, repeats) for p in PATHS}
            rows.append((name, k, n, m, times))
            for p in PATHS:
                step[m][p] += times[p] * per_step
    return rows, step


def accuracy(k=HIDDEN, n=INTER, m=8):
    """Per path: relative error vs fp64 x @ W.T of the float weight, and vs fp64 x @ Wq.T of the
    path's own quantized weight (what the kernel adds on top of weight quantization)."""
    from llmopt.kernels import w4a16_dequantize

    w, x = torch.randn(n, k) * 0.02, torch.randn(m, k)
    t = quantize(w)
    x64 = x.double()
    w8 = t["w8"]["weight"].double() * t["w8"]["weight_scale"].double()
    w4 = w4a16_dequantize(t["w4"]["weight_packed"], t["w4"]["weight_scale"], k, None, GROUP, torch.float64)
    exact = x64 @ w.double().t()
    own = {"fp32": exact, "bf16": exact, "w8a16": x64 @ w8.t(), "w8a8": x64 @ w8.t(), "w4a16": x64 @ w4.t()}
    layers = {"fp32": lambda x: F.linear(x, w), "bf16": lambda x: F.linear(x.bfloat16(), w.bfloat16()).float(),
              "w8a16": TORCH_CPU.quantized_linear("w8a16", t["w8"]), "w8a8": TORCH_CPU.quantized_linear("w8a8", t["w8"]),
              "w4a16": TORCH_CPU.quantized_linear("w4a16", t["w4"], GROUP)}
    rel = lambda y, r: ((y.double() - r).norm() / r.norm()).item()  # noqa: E731
    return {p: (rel(layer(x), exact), rel(layer(x), own[p])) for p, layer in layers.items()}


def print_report(rows, step, copy_bw, read_bw, acc, args):
    gb = lambda k, n, p, us: k * n * WEIGHT_BYTES[p] / (us * 1e-6) / 1e9  # noqa: E731
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, {args.layers} layers; "
          f"copy {copy_bw:.1f} GB/s (bytes copied / time), streaming read {read_bw:.1f} GB/s; "
          f"load average at start {args.load:.1f}\n")
    print("| shape (K x N) | M | " + " | ".join(f"{p} us (GB/s)" for p in PATHS) + " |")
    print("|---|---|" + "---|" * len(PATHS))
    for name, k, n, m, t in rows:
        cells = " | ".join(f"{t[p]:.0f} ({gb(k, n, p, t[p]):.1f})" for p in PATHS)
        print(f"| {name} {k}x{n} | {m} | {cells} |")
    print("\nOne decode step, all linears (sum of per-shape medians x count per step):\n")
    print("| M | " + " | ".join(f"{p} ms" for p in PATHS) + " | w8a16/fp32 | w8a8/fp32 | w4a16/fp32 |")
    print("|---|" + "---|" * (len(PATHS) + 3))
    for m, s in step.items():
        ratios = " | ".join(f"{s[p] / s['fp32']:.2f}" for p in ("w8a16", "w8a8", "w4a16"))
        print(f"| {m} | " + " | ".join(f"{s[p] / 1e3:.2f}" for p in PATHS) + f" | {ratios} |")
    print("\nAccuracy at 576x1536, M=8 (relative Frobenius error; vs W: against fp64 x @ W.T of the float weight;"
          " vs own: against fp64 with the path's own quantized weight):\n")
    print("| path | vs W | vs own |\n|---|---|---|")
    for p, (vs_w, vs_own) in acc.items():
        print(f"| {p} | {vs_w:.2e} | {vs_own:.2e} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.load = os.getloadavg()[0]
    if args.load > 0.5 and torch.get_num_threads() > 1:
        # A busy core makes every multi-threaded op wait for a time slice (~8 ms stalls here).
        print(f"warning: load average {args.load:.1f}: other processes compete; consider --threads 1")
    torch.manual_seed(0)
    copy_bw, read_bw = bandwidth(args.repeats)
    # (K, N, calls per decode step, independent layers to cycle through)
    shapes = {name: (k, n, per * args.layers, build(k, n, args.layers)) for name, (k, n, per) in LAYER_SHAPES.items()}
    shapes["lm_head"] = (HIDDEN, VOCAB, 1, build(HIDDEN, VOCAB, 3))  # 3 copies: > the 32 MiB L3
    with torch.inference_mode():
        rows, step = shape_table(shapes, args.batch, args.repeats)
        acc = accuracy()
    print_report(rows, step, copy_bw, read_bw, acc, args)


if __name__ == "__main__":
    main()
