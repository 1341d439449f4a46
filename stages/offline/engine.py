"""The llmopt side: `LLMEngine` in this process, timed as a whole run (throughput) or step by step
(batch-1 decode), with TTFT and TPOT from the engine's own timestamps."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

from .config import OfflineConfig
from .prompts import Prompt

WARMUP_PROMPTS, WARMUP_TOKENS = 2, 4  # throughput: on a throwaway engine (process warm, timed prefix cache empty)
DECODE_WARMUP_TOKENS = 8  # batch-1: one request first, on the timed engine


@dataclass
class EngineRun:
    """One throughput run: every prompt's output tokens, the wall time, and per-request timestamps."""

    outputs: list[list[int]]
    seconds: float
    ttfts: list[float]  # seconds from arrival to the first token
    tpots: list[float]  # seconds per output token after the first (requests with two or more)


def build(source: str, config: OfflineConfig, max_num_seqs: int):
    """The serve engine on `source`, as `llmopt serve` builds it, with this running-batch limit."""
    from ..model_io import parse_dtype
    from ..serve.build import build_engine
    from ..serve.engine.config import EngineConfig

    engine_config = EngineConfig(max_num_seqs=max_num_seqs, speculative=config.speculative_config())
    return build_engine(source, engine_config, device=config.device, dtype=parse_dtype(config.dtype),
                        backend=config.backend)


def release(engine) -> None:
    """Stop a tensor-parallel engine's ranks and leave its process group, so the next engine (the timed
    one after the warm-up, the next source) can form its own; nothing to do for one process."""
    ranks = getattr(engine.runner, "ranks", None)
    if ranks is not None:
        ranks.close()


def params(config: OfflineConfig, max_tokens: int, index: int, ignore_eos: bool | None = None):
    """Request `index`'s sampling: the run's temperature (seeded per request when sampling), its EOS rule."""
    from ..serve.engine.config import SamplingParams

    seed = config.dataset.seed + index if config.temperature > 0 else None
    return SamplingParams(max_tokens=max_tokens, temperature=config.temperature, seed=seed,
                          ignore_eos=config.ignore_eos if ignore_eos is None else ignore_eos)


def running_limit(config: OfflineConfig, prompts: list[Prompt]) -> int:
    """--max-concurrency, else every prompt at once (up to the engine's per-step token budget)."""
    from ..serve.engine.config import EngineConfig

    return config.max_concurrency or min(len(prompts), EngineConfig.max_num_batched_tokens)


def throughput(source: str, prompts: list[Prompt], config: OfflineConfig) -> EngineRun:
    """Every prompt submitted at once to a fresh engine (empty prefix cache), stepped to the end."""
    limit = running_limit(config, prompts)
    engine = build(source, config, limit)
    engine.generate([p.ids for p in prompts[:WARMUP_PROMPTS]], params(config, WARMUP_TOKENS, 0))
    release(engine)
    engine = build(source, config, limit)
    try:
        start = time.perf_counter()
        finals = run_to_end(engine, prompts, config)
        seconds = time.perf_counter() - start
    finally:
        release(engine)
    ttfts = [o.first_token_time - o.arrival_time for o in finals if o.first_token_time is not None]
    tpots = [(o.finish_time - o.first_token_time) / (len(o.token_ids) - 1) for o in finals if len(o.token_ids) > 1]
    return EngineRun([list(o.token_ids) for o in finals], seconds, ttfts, tpots)


def run_to_end(engine, prompts: list[Prompt], config: OfflineConfig) -> list:
    """Submit every prompt (each with its own max_tokens), step until all finish; the final outputs in
    prompt order, each holding all its tokens."""
    requests = [engine.make_request(f"offline-{i}", params=params(config, p.output_len, i), prompt_token_ids=p.ids)
                for i, p in enumerate(prompts)]
    for request in requests:
        engine.submit(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.finished:
                finals[out.request_id] = out
    return [replace(finals[r.request_id], token_ids=tokens[r.request_id]) for r in requests]


def decode_ms_per_token(source: str, prompts: list[Prompt], config: OfflineConfig):
    """Batch-1 decode: each prompt alone in an otherwise idle engine, `step()` timed one by one, EOS
    ignored; per prompt, the median step after the first (which holds the prefill), in ms. A step is
    all a decode step costs in the engine: scheduling, the model, sampling, detokenization. With
    speculative decoding a step may bring several tokens: then the steps' time over their tokens.
    Returns (ms per token per prompt, the engine's speculative counts)."""
    engine = build(source, config, 1)
    try:
        return _decode_each(engine, prompts, config), engine.stats().spec
    finally:
        release(engine)


def _decode_each(engine, prompts: list[Prompt], config: OfflineConfig) -> list[float]:
    engine.generate([prompts[0].ids], params(config, DECODE_WARMUP_TOKENS, 0, ignore_eos=True))
    per_prompt = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"decode-{i}", params=params(config, prompt.output_len + 1, i, ignore_eos=True),
                           prompt_token_ids=prompt.ids)
        steps, tokens = [], []
        while engine.has_unfinished():
            start = time.perf_counter()
            outs = engine.step()
            steps.append(time.perf_counter() - start)
            tokens.append(sum(len(o.token_ids) for o in outs))
        if max(tokens[1:]) > 1:  # speculative steps: time per token over all the decode steps
            per_prompt.append(sum(steps[1:]) / sum(tokens[1:]) * 1e3)
        else:
            per_prompt.append(statistics.median(steps[1:]) * 1e3)
    return per_prompt
