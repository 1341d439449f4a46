"""Tensor-parallel acceptance on this machine: greedy tokens of TP=2 and TP=4 against TP=1, and the
decode speed of TP=1 vs TP=2 with the share of rank 0's step time spent in collectives.

    python scripts/tp_check.py smollm2-135m --out /tmp/tp --tp 2 4 --prompts 10 --tokens 32
    python scripts/tp_check.py /tmp/w4a16 --out /tmp/tp-w4 --tp 2 4

Prompts: the first N of the shared ShareGPT file (chat template). A token that differs from TP=1 is
accepted only at a near-tie: TP=1's top two log-probabilities at that position within --tie (the
summation order of an all-reduce differs from one process's matmul), and the comparison of that
prompt stops there. Speed: one sequence, decode steps after its prefill, median of --repeats runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from llmopt.stages.serve.build import build_engine  # noqa: E402
from llmopt.stages.serve.engine.config import EngineConfig, SamplingParams  # noqa: E402
from llmopt.stages.shard.config import ShardConfig  # noqa: E402
from llmopt.stages.shard.run import run_shard  # noqa: E402

COLLECTIVE_S = [0.0]


def _timed(fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            COLLECTIVE_S[0] += time.perf_counter() - start
    return wrapper


def prompts(tokenizer, n: int) -> list[list[int]]:
    from llmopt.stages.data import resolve_file

    out = []
    for record in json.loads(resolve_file("sharegpt").read_text()):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": record["conversations"][0]["value"]}],
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
        if len(ids) <= 160:
            out.append(list(ids))
        if len(out) == n:
            break
    return out


def run_engine(ref: str, n: int, tokens: int, repeats: int):
    engine = build_engine(ref, EngineConfig(max_num_seqs=16, kv_cache_memory="1GiB"), "cpu", torch.float32)
    try:
        ids = prompts(engine.tokenizer, n)
        outs = engine.generate(ids, SamplingParams(temperature=0, max_tokens=tokens, logprobs=2, ignore_eos=True))
        return outs, decode_ms(engine, ids[0], repeats)
    finally:
        ranks = getattr(engine.runner, "ranks", None)
        if ranks is not None:
            ranks.close()


def decode_ms(engine, prompt_ids, repeats: int, steps: int = 48) -> tuple[float, float]:
    """(median ms per decode step, share of it spent in collectives on rank 0)."""
    per_step, shares = [], []
    for r in range(repeats):
        engine.add_request(f"speed-{r}", prompt_token_ids=prompt_ids,
                           params=SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
        engine.step()  # the prefill
        COLLECTIVE_S[0] = 0.0
        start = time.perf_counter()
        n = 0
        while engine.has_unfinished():
            engine.step()
            n += 1
        elapsed = time.perf_counter() - start
        per_step.append(1000 * elapsed / n)
        shares.append(COLLECTIVE_S[0] / elapsed)
    return statistics.median(per_step), statistics.median(shares)


def compare(reference, outputs, tie: float) -> dict:
    """Per prompt: identical, a near-tie (TP=1's top-2 gap <= tie where they first differ), or a
    divergence with its position and gap."""
    same, ties, diverged = 0, 0, []
    for p, (ref, got) in enumerate(zip(reference, outputs)):
        for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)):
            if a != b:
                top = [lp for _, lp in ref.logprobs[i].top]
                gap = abs(top[0] - top[1]) if len(top) > 1 else float("inf")
                if gap <= tie:
                    ties += 1
                else:
                    diverged.append((p, i, gap))
                break
        else:
            same += 1
    return {"identical": same, "near_ties": ties, "diverged": diverged}


def describe(result: dict, n: int, tokens: int) -> str:
    text = f"{result['identical']}/{n} prompts identical x {tokens} tokens, {result['near_ties']} near-ties"
    if result["diverged"]:
        text += ", DIVERGED " + ", ".join(f"prompt {p} at token {i} (top-2 gap {g:.4f})" for p, i, g in result["diverged"])
    return text


def one_at_a_time(ref: str, n: int, tokens: int):
    """TP=1 with each prompt alone: how far batching alone moves the tokens (the noise floor)."""
    engine = build_engine(ref, EngineConfig(max_num_seqs=16, kv_cache_memory="1GiB"), "cpu", torch.float32)
    params = SamplingParams(temperature=0, max_tokens=tokens, logprobs=2, ignore_eos=True)
    return [engine.generate([ids], params)[0] for ids in prompts(engine.tokenizer, n)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("source")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tie", type=float, default=1e-3)
    parser.add_argument("--noise-floor", action="store_true",
                        help="also compare TP=1 one prompt at a time against TP=1 batched")
    args = parser.parse_args()
    for name in ("all_reduce", "all_gather", "broadcast"):
        setattr(dist, name, _timed(getattr(dist, name)))
    reference, (ms1, _) = run_engine(args.source, args.prompts, args.tokens, args.repeats)
    print(f"TP=1: {ms1:.1f} ms/decode step ({1000 / ms1:.1f} tok/s)", flush=True)
    failed = False
    if args.noise_floor:
        floor = compare(reference, one_at_a_time(args.source, args.prompts, args.tokens), args.tie)
        print(f"TP=1 one prompt at a time vs batched: {describe(floor, len(reference), args.tokens)}", flush=True)
    for tp in args.tp:
        art = run_shard(args.source, f"{args.out}/tp{tp}", ShardConfig(tp), force=True)
        outputs, (ms, share) = run_engine(str(art.path), args.prompts, args.tokens, args.repeats)
        sizes = ", ".join(f"{b / 2**20:.1f} MiB" for b in art.manifest["metrics"]["rank_bytes"])
        result = compare(reference, outputs, args.tie)
        failed |= bool(result["diverged"])
        print(f"TP={tp}: {describe(result, len(reference), args.tokens)}; {ms:.1f} ms/decode step ({1000 / ms:.1f} tok/s, "
              f"{ms1 / ms:.2f}x TP=1); collectives {share:.0%} of rank 0's step; rank weights: {sizes}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
