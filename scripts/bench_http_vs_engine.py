"""Aggregate output tokens/s: 16 concurrent streaming HTTP clients vs the offline engine, same prompts.

    python scripts/bench_http_vs_engine.py [--model smollm2-135m] [--prompts 32] [--concurrency 16]
        [--max-tokens 64] [--rounds 2] [--threads N] [--dtype auto|fp32|bf16]

Both sides run the first N ShareGPT prompts as chat conversations, greedy, `ignore_eos`, so every
request makes exactly --max-tokens tokens and the two token counts are equal. The offline engine
runs in this process; the server is `llmopt serve` in a subprocess with the same engine options,
driven by asyncio httpx clients in a closed loop (each client sends its next prompt when the last
one ends). Rounds alternate offline / HTTP, and the median of each is reported, because timings
on a shared machine are noisy.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAREGPT = ROOT.parent / "shared/data/sharegpt/ShareGPT_V3_filtered_500.json"


def load_prompts(n: int) -> list[str]:
    data = json.loads(SHAREGPT.read_text(encoding="utf-8"))
    return [row["conversations"][0]["value"] for row in data[:n]]


def offline_tokens_per_s(engine, prompt_ids: list[list[int]], params) -> tuple[float, int]:
    start = time.perf_counter()
    outs = engine.generate(prompt_ids, params)
    seconds = time.perf_counter() - start
    tokens = sum(o.num_output_tokens for o in outs)
    return tokens / seconds, tokens


async def http_tokens_per_s(base_url: str, model: str, prompts: list[str], concurrency: int,
                            max_tokens: int) -> tuple[float, int]:
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    counts: list[int] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                last = None
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        last = line
                counts.append(json.loads(last[6:])["usage"]["completion_tokens"])

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return sum(counts) / seconds, sum(counts)


def start_server(model: str, port: int, engine_args: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "llmopt.cli.main", "serve", model, "--port", str(port),
               "--served-model-name", "bench", *engine_args]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not become healthy in time")


def alternate_rounds(args, engine, prompt_ids, params, base_url: str, prompts: list[str]) -> tuple[float, float]:
    """Median tokens/s of the offline engine and of HTTP, measured in alternating rounds."""
    offline, http = [], []
    for round_ in range(args.rounds):
        offline.append(offline_tokens_per_s(engine, prompt_ids, params))
        http.append(asyncio.run(http_tokens_per_s(base_url, "bench", prompts, args.concurrency, args.max_tokens)))
        print(f"round {round_ + 1}: offline {offline[-1][0]:.1f} tok/s ({offline[-1][1]} tokens), "
              f"HTTP {http[-1][0]:.1f} tok/s ({http[-1][1]} tokens)", flush=True)
    return statistics.median(r[0] for r in offline), statistics.median(r[0] for r in http)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None, help="torch threads on both sides (default: torch's)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                        help="serving dtype on both sides (auto: the checkpoint's)")
    args = parser.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the server subprocess inherits it
        import torch

        torch.set_num_threads(args.threads)

    from llmopt.stages.serve.build import build_engine
    from llmopt.stages.serve.engine.config import EngineConfig, SamplingParams
    from llmopt.stages.serve.http.prompts import chat_prompt

    prompts = load_prompts(args.prompts)
    config = EngineConfig(max_num_seqs=args.concurrency, max_model_len=args.max_model_len)
    engine = build_engine(args.model, config, dtype=None if args.dtype == "auto" else args.dtype)
    prompt_ids = [chat_prompt([{"role": "user", "content": p}], engine.tokenizer) for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    engine.generate(prompt_ids[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    server = start_server(args.model, port, ["--max-num-seqs", str(args.concurrency),
                                             "--max-model-len", str(args.max_model_len), "--dtype", args.dtype])
    try:
        wait_healthy(base_url, server)
        asyncio.run(http_tokens_per_s(base_url, "bench", prompts[:2], 2, 4))  # warm-up
        off, web = alternate_rounds(args, engine, prompt_ids, params, base_url, prompts)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    print(json.dumps({"model": args.model, "prompts": args.prompts, "concurrency": args.concurrency,
                      "max_tokens": args.max_tokens, "dtype": args.dtype,
                      "torch_threads": os.environ.get("OMP_NUM_THREADS", "default"),
                      "offline_tok_s": round(off, 1), "http_tok_s": round(web, 1), "ratio": round(web / off, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
