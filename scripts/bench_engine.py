"""`make bench-engine`: offline throughput of the serve engine against plain transformers `generate`.

The first N ShareGPT prompts (default 100) as chat conversations, greedy, at most --max-tokens new
tokens each (default 128; a sequence ends earlier at EOS). transformers runs them in static batches
of --hf-batch (default 8, left-padded, prompt order): the whole batch waits for its longest
sequence. llmopt's engine (`LLMEngine.generate`: continuous batching, paged KV cache) gets all of
them at once. Both sides load the same source in the same dtype and count only the tokens each
sequence generated (up to and including its EOS). Output tokens/s of each, their ratio, and how many
sequences came out token-for-token identical are printed and written as JSON (--json).
Further sources (--also W8 W4 ...) run through the engine only and are reported against the same
transformers figure.

    python scripts/bench_engine.py smollm2-135m --also out/bench/w8a16 out/bench/w4a16 --json bench-results/engine.json
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

ROOT = Path(__file__).resolve().parent.parent
SHAREGPT = ROOT.parent / "shared/data/sharegpt/ShareGPT_V3_filtered_500.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load_prompts(n: int) -> list[str]:
    data = json.loads(SHAREGPT.read_text(encoding="utf-8"))
    return [row["conversations"][0]["value"] for row in data[:n]]


def model_dir(source: str) -> Path:
    from llmopt.stages.source import as_artifact, resolve

    return as_artifact(resolve(source)).path


def generated(ids: list[int], eos: set[int], limit: int) -> list[int]:
    """A generated row cut after its first EOS (and at `limit`); padding after EOS is not output."""
    out = []
    for t in ids[:limit]:
        out.append(t)
        if t in eos:
            break
    return out


def run_hf(directory: Path, prompt_ids: list[list[int]], batch: int, max_tokens: int, dtype, eos: set[int],
           pad_id: int) -> tuple[list[list[int]], float]:
    """transformers `generate` in static batches of `batch`, left-padded; (outputs, seconds)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompt_ids), batch):
        rows = prompt_ids[i:i + batch]
        width = max(map(len, rows))
        ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=sorted(eos), pad_token_id=pad_id)
        outputs += [generated(row[width:].tolist(), eos, max_tokens) for row in out]
        print(f"  transformers: {min(i + batch, len(prompt_ids))}/{len(prompt_ids)} prompts, "
              f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return outputs, time.perf_counter() - start


def run_engine(source: str, prompt_ids: list[list[int]], max_tokens: int, dtype: str | None,
               repeats: int) -> tuple[list[list[int]], list[float]]:
    """The engine on every prompt at once, `repeats` times (fresh prefix cache each); (outputs, seconds)."""
    from llmopt.stages.serve.build import build_engine
    from llmopt.stages.serve.engine.config import EngineConfig, SamplingParams

    times, outputs = [], []
    for _ in range(repeats):
        engine = build_engine(source, EngineConfig(), dtype=dtype)
        engine.generate(prompt_ids[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up, then a new engine
        engine = build_engine(source, EngineConfig(), dtype=dtype)
        start = time.perf_counter()
        outs = engine.generate(prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0))
        times.append(time.perf_counter() - start)
        outputs = [list(o.token_ids) for o in outs]
        print(f"  llmopt {source}: {times[-1]:.1f} s", file=sys.stderr, flush=True)
    return outputs, times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", default="smollm2-135m", help="model source for both sides")
    parser.add_argument("--also", nargs="*", default=[], help="further sources for the engine only (W8, W4 ...)")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="both sides (default fp32)")
    parser.add_argument("--repeats", type=int, default=1, help="engine runs per source (median reported)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from llmopt.stages.model_io import load_tokenizer
    from llmopt.stages.serve.build import eos_token_ids
    from llmopt.stages.serve.http.prompts import chat_prompt
    from llmopt.stages.serve.loader import read_config

    directory = model_dir(args.source)
    tokenizer = load_tokenizer(directory)
    prompt_ids = [chat_prompt([{"role": "user", "content": p}], tokenizer) for p in load_prompts(args.prompts)]
    eos = set(eos_token_ids(read_config(directory), tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    print(f"{len(prompt_ids)} prompts, {sum(map(len, prompt_ids))} prompt tokens, up to {args.max_tokens} new "
          f"tokens each, {args.dtype}, {torch.get_num_threads()} threads", file=sys.stderr)

    hf_out, hf_s = run_hf(directory, prompt_ids, args.hf_batch, args.max_tokens, DTYPES[args.dtype], eos, pad)
    hf_tokens = sum(map(len, hf_out))
    rows = [{"engine": f"transformers generate, static batches of {args.hf_batch}", "source": args.source,
             "output_tokens": hf_tokens, "seconds": round(hf_s, 2), "output_tok_s": round(hf_tokens / hf_s, 1),
             "x_transformers": 1.0}]
    for source in [args.source, *args.also]:
        out, times = run_engine(source, prompt_ids, args.max_tokens, args.dtype, args.repeats)
        tokens, seconds = sum(map(len, out)), statistics.median(times)
        row = {"engine": "llmopt LLMEngine", "source": source, "output_tokens": tokens, "seconds": round(seconds, 2),
               "output_tok_s": round(tokens / seconds, 1),
               "x_transformers": round((tokens / seconds) / (hf_tokens / hf_s), 2)}
        if source == args.source:  # same model, same dtype, greedy: how many sequences agree exactly
            row["identical_to_transformers"] = f"{sum(a == b for a, b in zip(out, hf_out))}/{len(out)}"
        rows.append(row)

    print(f"\n| engine | source | output tokens | seconds | output tok/s | x transformers | identical |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['source']} | {r['output_tokens']:,} | {r['seconds']} | {r['output_tok_s']} | "
              f"{r['x_transformers']}x | {r.get('identical_to_transformers', '-')} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"prompts": args.prompts, "max_tokens": args.max_tokens, "dtype": args.dtype,
                                         "hf_batch": args.hf_batch, "threads": torch.get_num_threads(),
                                         "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
