"""`make demo`, last step: one chat completion through `llmopt serve` on the model the recipe wrote.

Starts the server on MODEL (as `llmopt bench --server` does), sends one OpenAI chat completion, prints
the reply with its usage and timing, and stops the server however the script ends.
"""
from __future__ import annotations

import argparse
import sys
import time

import httpx

from llmopt.stages.bench.server import ServerSpec, running_server

QUESTION = "In one sentence: why does quantizing a model's weights to 4 bits make decoding faster?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="model source to serve (an artifact directory)")
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    with running_server(ServerSpec(args.model), lambda m: print(m, file=sys.stderr)) as url:
        body = {"model": httpx.get(f"{url}/v1/models").json()["data"][0]["id"],
                "messages": [{"role": "user", "content": args.question}],
                "max_tokens": args.max_tokens, "temperature": 0.0}
        start = time.perf_counter()
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        seconds = time.perf_counter() - start
    response.raise_for_status()
    data = response.json()
    usage = data["usage"]
    print(f"POST {url}/v1/chat/completions  (model {body['model']}, temperature 0)")
    print(f"user:      {args.question}")
    print(f"assistant: {data['choices'][0]['message']['content'].strip()}")
    print(f"[{usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens in {seconds:.2f} s, "
          f"finish_reason {data['choices'][0]['finish_reason']}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
