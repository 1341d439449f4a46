"""Batch-1 decode speed: the serve engine, one request at a time, against plain transformers `generate`.

For each of the first --prompts ShareGPT prompts (as chat), each side generates --tokens new tokens
greedily with EOS ignored, so both produce the same number. transformers: ms per token =
(time of generate(N + 1 tokens) - time of generate(1 token)) / N, so the prefill is excluded.
The engine: one request in an otherwise idle LLMEngine, `step()` timed one by one; ms per token is the
median step after the first (which holds the prefill). A step is everything a decode step costs in
the engine: scheduling, the model, sampling, detokenisation. Medians over prompts; ratios are
transformers ms/token divided by the engine's, both measured in this run. Sources after the first
run through the engine only and are reported against the same transformers figure.

    python scripts/bench_decode.py out/bench/base out/bench/w8a16 out/bench/w4a16 --json bench-results/decode.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import DTYPES, load_prompts, model_dir  # noqa: E402


def hf_ms_per_token(directory: Path, prompt_ids: list[list[int]], tokens: int, dtype) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()

    def run(ids: torch.Tensor, n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    run(torch.tensor([prompt_ids[0]]), 4)  # warm-up
    per_prompt = []
    for p in prompt_ids:
        ids = torch.tensor([p])
        per_prompt.append((run(ids, tokens + 1) - run(ids, 1)) / tokens * 1e3)
    return statistics.median(per_prompt)


def engine_ms_per_token(source: str, prompt_ids: list[list[int]], tokens: int, dtype: str | None) -> float:
    from llmopt.stages.serve.build import build_engine
    from llmopt.stages.serve.engine.config import EngineConfig, SamplingParams

    engine = build_engine(source, EngineConfig(), dtype=dtype)
    params = SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True)
    engine.generate([prompt_ids[0]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    per_prompt = []
    for i, p in enumerate(prompt_ids):
        engine.add_request(f"decode-{i}", params=params, prompt_token_ids=p)
        steps = []
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
        per_prompt.append(statistics.median(steps[1:]) * 1e3)
    return statistics.median(per_prompt)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="*", default=["smollm2-135m"],
                        help="model sources; the first is also run through transformers")
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="both sides (default fp32)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from llmopt.stages.model_io import load_tokenizer
    from llmopt.stages.serve.http.prompts import chat_prompt

    directory = model_dir(args.sources[0])
    tokenizer = load_tokenizer(directory)
    prompt_ids = [chat_prompt([{"role": "user", "content": p}], tokenizer) for p in load_prompts(args.prompts)]
    print(f"{len(prompt_ids)} prompts ({min(map(len, prompt_ids))}-{max(map(len, prompt_ids))} tokens), "
          f"{args.tokens} new tokens each, batch 1, {args.dtype}, {torch.get_num_threads()} threads", file=sys.stderr)
    hf = hf_ms_per_token(directory, prompt_ids, args.tokens, DTYPES[args.dtype])
    rows = [{"engine": "transformers generate", "source": args.sources[0], "ms_per_token": round(hf, 2),
             "tok_s": round(1e3 / hf, 1), "x_transformers": 1.0}]
    for source in args.sources:
        ms = engine_ms_per_token(source, prompt_ids, args.tokens, args.dtype)
        rows.append({"engine": "llmopt LLMEngine", "source": source, "ms_per_token": round(ms, 2),
                     "tok_s": round(1e3 / ms, 1), "x_transformers": round(hf / ms, 2)})
        print(f"  {source}: {ms:.2f} ms/token", file=sys.stderr, flush=True)
    print("\n| engine | source | ms/token | tok/s | x transformers |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['source']} | {r['ms_per_token']} | {r['tok_s']} | {r['x_transformers']}x |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"prompts": args.prompts, "tokens": args.tokens, "dtype": args.dtype,
                                         "threads": torch.get_num_threads(), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
