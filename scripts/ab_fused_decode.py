#!/usr/bin/env python3
"""Batch-1 decode step time with the backend's fused decode step against the per-layer path, same process.

Two engines on the same source (one with its fused step switched off), interleaved rounds: each round one
40-token prompt then 64 greedy steps per engine, the median step; the median over rounds is printed.

    python scripts/ab_fused_decode.py SOURCE [--dtype fp32|bf16] [--rounds 4] [--threads 2]
"""
import argparse
import statistics
import time

import torch

from llmopt.stages.model_io import parse_dtype
from llmopt.stages.serve.build import build_engine
from llmopt.stages.serve.engine.config import EngineConfig, SamplingParams


def round_ms(engine, rid: str, prompt: list[int], steps: int) -> float:
    engine.add_request(rid, params=SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True),
                       prompt_token_ids=prompt)
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engines = {}
    for arm in ("per-layer", "fused"):
        engine = build_engine(args.source, EngineConfig(block_size=16, num_blocks=256, max_num_seqs=1),
                              dtype=parse_dtype(args.dtype))
        if arm == "per-layer":
            engine.runner.fused_decode = None
        engines[arm] = engine
    if engines["fused"].runner.fused_decode is None:
        raise SystemExit("the backend builds no fused decode step for this model: nothing to compare")
    prompt = list(range(100, 140))
    times = {arm: [] for arm in engines}
    for r in range(args.rounds):
        for arm, engine in engines.items():
            times[arm].append(round_ms(engine, f"{arm}-{r}", prompt, 64))
    for arm, values in times.items():
        print(f"{arm}: {statistics.median(values):.2f} ms per step (rounds: {', '.join(f'{v:.2f}' for v in values)})")
    print(f"fused / per-layer: {statistics.median(times['per-layer']) / statistics.median(times['fused']):.2f}x faster")


if __name__ == "__main__":
    main()
