#!/usr/bin/env python3
"""Batch-1 greedy decode speed with plain transformers on CPU: a base model against its
structured-pruned artifact (e.g. `--structured mlp --ratio 0.25`), in one process.

Runs alternate (base, pruned, base, ...) so that load on a shared machine hits both alike; each
run times `--tokens` decode steps after a short prefill; the median per model is reported, and the
ratio base / pruned (> 1: the pruned model decodes faster).

    llmopt prune smollm2-135m -o /tmp/mlp25 --structured mlp --ratio 0.25
    .venv/bin/python scripts/bench_prune_decode.py smollm2-135m /tmp/mlp25 [--runs 7] [--tokens 64] [--json]
"""
import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def model_dir(ref: str) -> Path:
    """Any llmopt source as a plain HF directory (a GGUF alias goes through the import cache)."""
    from llmopt.stages.source import as_artifact, resolve

    source = resolve(ref)
    art = as_artifact(source)
    return art.path if art else source.path


def load(ref: str):
    import torch
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(model_dir(ref), dtype=torch.float32).eval()


def decode_seconds_per_token(model, prompt, tokens: int) -> float:
    """Seconds per decode step (batch 1, greedy, KV cache), prefill excluded."""
    import torch

    with torch.inference_mode():
        out = model(input_ids=prompt, use_cache=True)
        cache, nxt = out.cache, out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(tokens):
            out = model(input_ids=nxt, cache=cache, use_cache=True)
            cache, nxt = out.cache, out.logits[:, -1:].argmax(-1)
        return (time.perf_counter() - start) / tokens


def measure(models: dict, runs: int, tokens: int, prompt_len: int) -> dict[str, list[float]]:
    import torch

    prompt = torch.arange(1, prompt_len + 1).unsqueeze(0) % 100 + 1  # [1, P], any valid ids
    for model in models.values():  # warm-up: first-call allocations and kernel selection
        decode_seconds_per_token(model, prompt, 4)
    times = {name: [] for name in models}
    for _ in range(runs):
        for name, model in models.items():
            times[name].append(decode_seconds_per_token(model, prompt, tokens))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base")
    parser.add_argument("pruned")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    models = {"base": load(args.base), "pruned": load(args.pruned)}
    times = measure(models, args.runs, args.tokens, args.prompt_len)
    median = {name: statistics.median(t) for name, t in times.items()}
    report = {"runs": args.runs, "tokens_per_run": args.tokens, "threads": torch.get_num_threads(),
              "parameters": {n: sum(p.numel() for p in m.parameters()) for n, m in models.items()},
              "ms_per_token_median": {n: 1000 * s for n, s in median.items()},
              "ms_per_token_all": {n: [round(1000 * s, 3) for s in t] for n, t in times.items()},
              "speedup_base_over_pruned": median["base"] / median["pruned"]}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for name in models:
        print(f"{name:7s} {report['parameters'][name]:>12,} params  {report['ms_per_token_median'][name]:8.2f} ms/token "
              f"({1 / median[name]:.1f} tok/s, median of {args.runs})")
    print(f"speedup (base / pruned): {report['speedup_base_over_pruned']:.3f}x")


if __name__ == "__main__":
    main()
