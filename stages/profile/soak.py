"""`llmopt profile SOURCE --soak N`: the serve engine's memory over many short requests. Every KV block
must come back and RSS must stay flat.

N short requests through one `LLMEngine`: ShareGPT prompt slices of 8-64 tokens (the first 200
records), 4-16 new tokens each at temperature 0.8, at most --soak-in-flight running at once, and every
fifth aborted after its first token (as a client disconnect would). RSS and the number of Python
objects the garbage collector tracks are read after a collection: once after WARMUP requests have run
to completion (the reference), then every READ_EVERY of the N that follow (fewer for a short soak:
WARMUP and READ_EVERY are capped at N and N/10). The warm-up ends drained, so it has seen every batch size from --soak-in-flight down to 1:
the oneDNN primitives built once per matmul shape and allocator pools filled once do not count as
growth. It fails when a block is still in use at the end or RSS's trend over the readings, the median
of the slopes between every pair of them (Theil-Sen) times the requests read, is more than
--max-rss-growth-mib: a leak grows with the requests, while one late first-time allocation (a prompt
length the warm-up never drew) is a single step most pairs do not straddle.
"""
from __future__ import annotations

import gc
import random
import statistics
import time
from dataclasses import dataclass, field

from ..progress import StageHooks
from .config import ProfileConfig
from .tables import TableData

WARMUP, READ_EVERY, ABORT_EVERY = 200, 200, 5
PROMPT_RECORDS, PROMPT_TOKENS, NEW_TOKENS, TEMPERATURE = 200, (8, 64), (4, 16), 0.8


@dataclass
class Soak:
    """The engine, the request source, and what has happened so far."""

    engine: object
    pool: list[list[int]]
    rng: random.Random
    in_flight: int
    counts: dict = field(default_factory=lambda: dict.fromkeys(("submitted", "finished", "aborted", "tokens"), 0))
    readings: list = field(default_factory=list)  # (finished requests after the warm-up, RSS bytes, objects)

    def prompt(self) -> list[int]:
        ids = self.rng.choice(self.pool)
        n = self.rng.randint(PROMPT_TOKENS[0], min(PROMPT_TOKENS[1], len(ids)))
        start = self.rng.randint(0, len(ids) - n)
        return ids[start:start + n]

    def read(self, mark: int, status) -> None:
        import torch

        from .machine import resident_bytes

        gc.collect()
        self.readings.append((mark, resident_bytes(torch.device("cpu")), len(gc.get_objects())))
        stats = self.engine.stats()
        status(f"{mark:>6} requests: RSS {self.readings[-1][1] / 2**20:.1f} MiB, {self.readings[-1][2]:,} Python "
               f"objects, free blocks {stats.num_free_blocks}/{stats.num_blocks}")

    def submit(self, last: int, to_abort: set) -> None:
        """Top the running set up to `in_flight` requests (stopping at request number `last`)."""
        from ..serve.engine.config import SamplingParams

        c = self.counts
        while c["submitted"] < last and c["submitted"] - c["finished"] < self.in_flight:
            i = c["submitted"]
            ids = self.prompt()  # the prompt's draws before the length's: one seed, one request mix
            params = SamplingParams(max_tokens=self.rng.randint(*NEW_TOKENS), temperature=TEMPERATURE, seed=i,
                                    ignore_eos=True)
            self.engine.add_request(f"r{i}", prompt_token_ids=ids, params=params)
            if i % ABORT_EVERY == ABORT_EVERY - 1:
                to_abort.add(f"r{i}")
            c["submitted"] += 1

    def run(self, n: int, every: int | None, status) -> None:
        """Send n more requests and step until every one has finished (read memory every `every`)."""
        c, to_abort = self.counts, set()
        last, first = c["submitted"] + n, c["finished"]
        while c["finished"] < last:
            self.submit(last, to_abort)
            before = c["finished"] - first
            for out in self.engine.step():
                c["tokens"] += len(out.token_ids)
                if out.finished:
                    c["finished"] += 1
                elif out.request_id in to_abort and out.num_output_tokens >= 1:
                    to_abort.discard(out.request_id)
                    if self.engine.abort(out.request_id) is not None:
                        c["finished"], c["aborted"] = c["finished"] + 1, c["aborted"] + 1
            done = c["finished"] - first
            if every and done // every != before // every:
                self.read(done // every * every, status)


def run_soak(source: str, config: ProfileConfig, hooks: StageHooks | None = None) -> dict:
    """The soak on `source`; the report says whether it passed (`passed`, and `problems` if not)."""
    from ..bench.dataset import DatasetConfig, load_requests
    from ..model_io import parse_dtype
    from ..serve.build import build_engine
    from ..serve.engine.config import EngineConfig

    hooks = hooks or StageHooks()
    engine = build_engine(source, EngineConfig(max_num_seqs=config.soak_in_flight), device=config.device,
                          dtype=parse_dtype(config.dtype), backend=config.backend)
    texts = [r.prompt for r in load_requests(DatasetConfig("sharegpt", PROMPT_RECORDS, shuffle=False))]
    pool = [ids for ids in map(engine.tokenizer.encode, texts) if len(ids) >= PROMPT_TOKENS[0]]
    soak = Soak(engine, pool, random.Random(0), config.soak_in_flight)
    start = time.perf_counter()
    soak.run(min(WARMUP, config.soak), None, hooks.status)  # drained: every batch size up to in_flight seen
    soak.read(0, hooks.status)
    warm = dict(soak.counts)
    soak.run(config.soak, min(READ_EVERY, max(1, config.soak // 10)), hooks.status)
    return soak_report(source, config, soak, warm, time.perf_counter() - start)


def rss_trend(readings: list) -> float:
    """MiB that RSS grows over the readings' span of requests, from the median slope between every pair
    of readings (Theil-Sen): a steady leak shows in most pairs, a single step in few."""
    slopes = [(r1 - r0) / (n1 - n0) for i, (n0, r0, _) in enumerate(readings)
              for n1, r1, _ in readings[i + 1:] if n1 != n0]
    return statistics.median(slopes) * (readings[-1][0] - readings[0][0]) / 2**20 if slopes else 0.0


def soak_report(source: str, config: ProfileConfig, soak: Soak, warm: dict, seconds: float) -> dict:
    stats = soak.engine.stats()
    growth = rss_trend(soak.readings)
    problems = []
    if stats.num_free_blocks != stats.num_blocks or stats.num_running or stats.num_waiting:
        problems.append(f"blocks still in use: {stats.num_blocks - stats.num_free_blocks} of {stats.num_blocks}")
    if growth > config.max_rss_growth_mib:
        problems.append(f"RSS grew {growth:.1f} MiB after the warm-up, its trend over {len(soak.readings)} "
                        f"readings (bound {config.max_rss_growth_mib:g} MiB)")
    done = {k: soak.counts[k] - warm[k] for k in ("finished", "aborted", "tokens")}
    return {"tool": "llmopt profile --soak", "source": source, "requests": done["finished"],
            "aborted": done["aborted"], "output_tokens": done["tokens"], "seconds": seconds,
            "free_blocks": stats.num_free_blocks, "total_blocks": stats.num_blocks, "running": stats.num_running,
            "waiting": stats.num_waiting, "rss_mib": [[n, r / 2**20] for n, r, _ in soak.readings],
            "rss_growth_mib": growth, "rss_change_mib": (soak.readings[-1][1] - soak.readings[0][1]) / 2**20,
            "python_objects": [[n, o] for n, _, o in soak.readings],
            "passed": not problems, "problems": problems, "config": config.to_dict()}


def soak_tables(report: dict) -> list[TableData]:
    t = TableData("soak", f"soak: {report['requests']:,} requests on {report['source']} "
                          f"({report['aborted']} aborted after their first token)", ["after requests", "RSS MiB",
                                                                                     "Python objects"])
    t.rows = [[f"{n:,}", f"{r:,.1f}", f"{o:,}"] for (n, r), (_, o) in zip(report["rss_mib"], report["python_objects"])]
    t.note = (f"free blocks {report['free_blocks']}/{report['total_blocks']}; RSS trend after the warm-up "
              f"{report['rss_growth_mib']:+.1f} MiB (last reading {report.get('rss_change_mib', 0.0):+.1f}); {report['output_tokens']:,} tokens in {report['seconds']:.0f} s; "
              + ("passed" if report["passed"] else "FAILED: " + "; ".join(report["problems"])))
    return [t]
