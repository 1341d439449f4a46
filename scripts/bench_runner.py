"""Decode speed of the serve runtime's ModelRunner against plain transformers `generate`, one run.

For each source: prefill `--batch` random prompts of `--prompt-len` tokens, then time `--steps`
decode steps of `ModelRunner.execute` (the model step the engine calls: flat batch, paged KV
cache, logits of the last tokens) plus a greedy argmax. transformers is timed on the baseline
source (default: the first one) with `generate(max_new_tokens=N)`: ms/step = (time for N+1 new
tokens - time for 1) / N, so its prefill is excluded too. Medians of `--repeats` runs; ratios are
transformers ms/step divided by ours.

    python scripts/bench_runner.py smollm2-135m out/w4a16 --threads 1 --batch 1 8 --steps 32
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402

from llmopt.stages.serve.batch import StepInput  # noqa: E402
from llmopt.stages.serve.loader import load_runtime  # noqa: E402
from llmopt.stages.serve.runner import ModelRunner  # noqa: E402

BLOCK = 16


def step_input(lengths: list[int], new: list[int], tokens: torch.Tensor, blocks_per_seq: int) -> StepInput:
    """Sequences b own blocks [b * blocks_per_seq, ...); each brings new[b] tokens after lengths[b]."""
    pos = torch.cat([torch.arange(n0, n0 + n) for n0, n in zip(lengths, new)])
    seq = torch.cat([torch.full((n,), b) for b, n in enumerate(new)])
    cu = torch.tensor([0] + new).cumsum(0).to(torch.int32)
    tables = torch.arange(len(new) * blocks_per_seq, dtype=torch.int32).view(len(new), blocks_per_seq)
    slots = tables[seq, pos // BLOCK].long() * BLOCK + pos % BLOCK
    return StepInput(tokens, pos, cu, torch.tensor(lengths, dtype=torch.int32) + torch.tensor(new, dtype=torch.int32),
                     tables, slots, max(new), cu[1:].long() - 1)


def time_runner(runner: ModelRunner, batch: int, prompt_len: int, steps: int, repeats: int) -> float:
    """Median ms per decode step."""
    blocks = -(-(prompt_len + steps + 1) // BLOCK)
    g = torch.Generator().manual_seed(0)
    results = []
    for _ in range(repeats):
        prompt = torch.randint(0, runner.runtime.spec.vocab_size, (batch * prompt_len,), generator=g)
        logits = runner.execute(step_input([0] * batch, [prompt_len] * batch, prompt, blocks))
        start = time.perf_counter()
        for i in range(steps):
            nxt = logits.argmax(-1)
            logits = runner.execute(step_input([prompt_len + i] * batch, [1] * batch, nxt, blocks))
        results.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(results)


def time_transformers(source: str, batch: int, prompt_len: int, steps: int, repeats: int) -> float:
    """Median ms per decode step of plain transformers generate (greedy, fp32 as loaded)."""
    from llmopt.stages.source import load

    model = load(source).model
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))

    def run(n):
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    run(2)
    return statistics.median((run(steps + 1) - run(1)) / steps * 1e3 for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sources", nargs="+")
    parser.add_argument("--baseline", help="source for the transformers run (default: the first)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", nargs="+", default=["auto"],
                        help="runtime dtype(s) to measure each source in: auto (as stored), fp32, bf16")
    parser.add_argument("--no-transformers", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), prompt {args.prompt_len}, "
          f"{args.steps} decode steps, median of {args.repeats}")
    base = {}
    if not args.no_transformers:
        for b in args.batch:
            base[b] = time_transformers(args.baseline or args.sources[0], b, args.prompt_len, args.steps, args.repeats)
            print(f"transformers generate  batch {b:2d}: {base[b]:7.2f} ms/step  ({b * 1e3 / base[b]:6.1f} tok/s)")
    for source in args.sources:
        for dtype in args.dtype:
            runtime, _, _ = load_runtime(source, dtype=None if dtype == "auto" else dtype)
            for b in args.batch:
                blocks = b * -(-(args.prompt_len + args.steps + 1) // BLOCK)
                ms = time_runner(ModelRunner(runtime, blocks, BLOCK), b, args.prompt_len, args.steps, args.repeats)
                ratio = f"  {base[b] / ms:5.2f}x transformers" if b in base else ""
                print(f"runner {source} [{dtype}] batch {b:2d}: {ms:7.2f} ms/step  ({b * 1e3 / ms:6.1f} tok/s){ratio}")


if __name__ == "__main__":
    main()
