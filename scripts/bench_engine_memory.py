"""Memory of the serve engine over many short requests: every KV block comes back, RSS stays flat.

Runs --requests short requests (default 2,000) through one `LLMEngine`: prompts are ShareGPT
prompt slices of 8-64 tokens, 4-16 new tokens each, at most --in-flight running at once, and every
--abort-every-th request is aborted after its first token (as a client disconnect would). RSS
(VmRSS) and the number of Python objects the garbage collector tracks are read after a collection,
once after --warmup requests have run to completion (the reference) and then every --every of the
--requests that follow, the last reading once they have all finished. The warm-up ends with a
drain, so it has seen every batch size from --in-flight down to 1: the oneDNN primitives built once
per matmul shape (`kernels.cpu_linear.on_row_buckets`) and allocator pools filled once do not count
as growth. Exits 1 when a block is still in use at the end or RSS grew by more than --max-growth-mib.

    python scripts/bench_engine_memory.py smollm2-135m --requests 2000
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
SHAREGPT = ROOT.parent / "shared/data/sharegpt/ShareGPT_V3_filtered_500.json"


def rss_mib() -> float:
    gc.collect()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--abort-every", type=int, default=5)
    parser.add_argument("--every", type=int, default=200, help="read RSS every this many finished requests")
    parser.add_argument("--warmup", type=int, default=200,
                        help="requests run to completion before the reference RSS reading")
    parser.add_argument("--max-growth-mib", type=float, default=32.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from llmopt.stages.serve.build import build_engine
    from llmopt.stages.serve.engine.config import EngineConfig, SamplingParams

    engine = build_engine(args.source, EngineConfig(max_num_seqs=args.in_flight))
    total_blocks = engine.stats().num_blocks
    rng = random.Random(args.seed)
    texts = [r["conversations"][0]["value"] for r in json.loads(SHAREGPT.read_text(encoding="utf-8"))[:200]]
    pool = [t for t in (engine.tokenizer.encode(x) for x in texts) if len(t) >= 8]

    def prompt() -> list[int]:
        ids = rng.choice(pool)
        n = rng.randint(8, min(64, len(ids)))
        start = rng.randint(0, len(ids) - n)
        return ids[start:start + n]

    counts = {"submitted": 0, "finished": 0, "aborted": 0, "tokens": 0}
    readings: list[tuple[int, float, int]] = []

    def read(mark: int) -> None:
        readings.append((mark, rss_mib(), len(gc.get_objects())))
        print(f"{mark:>6} requests: RSS {readings[-1][1]:.1f} MiB, {readings[-1][2]:,} Python objects, free "
              f"blocks {engine.stats().num_free_blocks}/{total_blocks}", file=sys.stderr, flush=True)

    def run(n: int, every: int | None) -> None:
        """Send n more requests (at most --in-flight at once) and step until every one has finished."""
        last, to_abort = counts["submitted"] + n, set()
        first = counts["finished"]
        while counts["finished"] < last:
            while counts["submitted"] < last and counts["submitted"] - counts["finished"] < args.in_flight:
                i = counts["submitted"]
                rid = f"r{i}"
                engine.add_request(rid, prompt_token_ids=prompt(),
                                   params=SamplingParams(max_tokens=rng.randint(4, 16), temperature=0.8,
                                                         seed=i, ignore_eos=True))
                if i % args.abort_every == args.abort_every - 1:
                    to_abort.add(rid)
                counts["submitted"] += 1
            before = counts["finished"] - first
            for out in engine.step():
                counts["tokens"] += len(out.token_ids)
                if out.finished:
                    counts["finished"] += 1
                elif out.request_id in to_abort and out.num_output_tokens >= 1:
                    to_abort.discard(out.request_id)
                    if engine.abort(out.request_id) is not None:
                        counts["finished"], counts["aborted"] = counts["finished"] + 1, counts["aborted"] + 1
            done = counts["finished"] - first
            if every and done // every != before // every:
                read(done // every * every)

    start = time.perf_counter()
    run(args.warmup, None)  # warm-up, drained: every batch size from 1 to --in-flight has been seen
    read(0)
    warm = dict(counts)
    run(args.requests, args.every)
    finished, aborted, tokens = (counts[k] - warm[k] for k in ("finished", "aborted", "tokens"))
    seconds = time.perf_counter() - start
    stats = engine.stats()
    growth = readings[-1][1] - readings[0][1] if readings else 0.0
    result = {"source": args.source, "requests": finished, "aborted": aborted, "output_tokens": tokens,
              "seconds": round(seconds, 1), "free_blocks": stats.num_free_blocks, "total_blocks": total_blocks,
              "running": stats.num_running, "waiting": stats.num_waiting,
              "rss_mib": [[n, round(r, 1)] for n, r, _ in readings], "rss_growth_mib": round(growth, 1),
              "python_objects": [[n, o] for n, _, o in readings]}
    print(json.dumps(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    ok = stats.num_free_blocks == total_blocks and stats.num_running == stats.num_waiting == 0
    if not ok:
        print(f"blocks still in use: {total_blocks - stats.num_free_blocks} of {total_blocks}", file=sys.stderr)
    if growth > args.max_growth_mib:
        print(f"RSS grew {growth:.1f} MiB after the warm-up (bound {args.max_growth_mib} MiB)", file=sys.stderr)
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
