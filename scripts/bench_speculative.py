"""Speculative decoding A/B at batch 1: how the measured figures in docs/serve.md#speculative-decoding were made.

Each prompt runs alone on one engine per arm, the arms interleaved (their order alternating per prompt), greedy,
through the chat template. Per arm: decode tok/s = output tokens after the first / time of the steps after the
first (the first step holds the prefill), over all prompts, and its ratio to the first arm; the median of the
per-prompt ratios; end-to-end tok/s (prefill included); outputs token for token equal to the first arm's;
acceptance rate and mean accepted length.

Arms: `none` (plain decoding), `ngram`, `draft:PATH`, each with an optional `@K`; `reject` is the worst case,
a proposer whose every draft is rejected (what back-off saves).

    python scripts/bench_speculative.py out/bench/w4a16e8 --dataset grounded -n 12 --arms none ngram
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from llmopt.stages.bench.dataset import DatasetConfig
from llmopt.stages.offline.config import OfflineConfig
from llmopt.stages.offline.prompts import offline_prompts
from llmopt.stages.serve.build import build_engine
from llmopt.stages.serve.engine.config import EngineConfig, SamplingParams, speculative_config


class Rejected:
    """A proposer whose drafts the target never accepts (token 3 repeated: a control token no reply writes)."""

    def propose(self, requests):
        return [[3] * k for _, k in requests]

    def release(self, seq):
        pass


def make_engine(source: str, arm: str):
    method, _, k = ("ngram" if arm == "reject" else arm).partition("@")
    spec = None if arm == "none" else speculative_config(method, int(k) if k else None)
    engine = build_engine(source, EngineConfig(max_num_seqs=1, speculative=spec))
    if arm == "reject":
        engine.speculator.proposer = Rejected()
    return engine


def run_one(engine, prompt, index: int, max_output: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=min(max_output, prompt.output_len + 8))
    before = engine.stats().spec
    engine.add_request(f"r{index}", params=params, prompt_token_ids=prompt.ids)
    steps, counts, tokens, start = [], [], [], time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - t)
        counts.append(sum(len(o.token_ids) for o in outs))
        tokens += [t for o in outs for t in o.token_ids]
    after = engine.stats().spec
    return {"decode_s": sum(steps[1:]), "decode_tokens": sum(counts[1:]), "e2e_s": time.perf_counter() - start,
            "tokens": tokens, "drafts": after.num_draft_tokens - before.num_draft_tokens,
            "accepted": after.num_accepted_tokens - before.num_accepted_tokens,
            "verifies": after.num_drafts - before.num_drafts}


def summarize(runs: list[dict], first: list[dict]) -> dict:
    decode_s, decode_tokens = sum(r["decode_s"] for r in runs), sum(r["decode_tokens"] for r in runs)
    drafts, accepted, verifies = (sum(r[k] for r in runs) for k in ("drafts", "accepted", "verifies"))
    ratios = [(r["decode_tokens"] / r["decode_s"]) / (f["decode_tokens"] / f["decode_s"])
              for r, f in zip(runs, first) if r["decode_s"] > 0 and f["decode_s"] > 0]
    return {"decode_tok_s": decode_tokens / decode_s, "median_prompt_ratio": statistics.median(ratios),
            "e2e_tok_s": sum(len(r["tokens"]) for r in runs) / sum(r["e2e_s"] for r in runs),
            "output_tokens": sum(len(r["tokens"]) for r in runs),
            "identical": sum(r["tokens"] == f["tokens"] for r, f in zip(runs, first)), "prompts": len(runs),
            "acceptance_rate": accepted / drafts if drafts else None,
            "mean_accepted_length": 1 + accepted / verifies if verifies else None, "verify_steps": verifies}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("--dataset", default="grounded")
    parser.add_argument("-n", "--num-prompts", type=int, default=12)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--max-output", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", nargs="+", default=["none", "ngram"])
    parser.add_argument("--json", help="write the summary here")
    args = parser.parse_args()
    engines = {arm: make_engine(args.source, arm) for arm in args.arms}
    dataset = DatasetConfig(args.dataset, args.num_prompts, output_len=args.output_len, seed=args.seed)
    prompts = offline_prompts(OfflineConfig(dataset=dataset, endpoint="chat"), engines[args.arms[0]].tokenizer)
    for engine in engines.values():  # warm-up
        engine.generate([prompts[0].ids], SamplingParams(temperature=0, max_tokens=8))
    runs = {arm: [] for arm in args.arms}
    for i, prompt in enumerate(prompts):
        for arm in args.arms if i % 2 == 0 else args.arms[::-1]:
            runs[arm].append(run_one(engines[arm], prompt, i, args.max_output))
    first = runs[args.arms[0]]
    summary = {arm: summarize(r, first) for arm, r in runs.items()}
    for arm, s in summary.items():
        s["x_decode"] = s["decode_tok_s"] / summary[args.arms[0]]["decode_tok_s"]
        print(f"{arm:30s} decode {s['decode_tok_s']:6.1f} tok/s x{s['x_decode']:.2f} (per-prompt median "
              f"x{s['median_prompt_ratio']:.2f}), e2e {s['e2e_tok_s']:6.1f} tok/s, identical {s['identical']}/"
              f"{s['prompts']}, acceptance {s['acceptance_rate']}, mean accepted {s['mean_accepted_length']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
