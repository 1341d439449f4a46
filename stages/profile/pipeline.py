"""`llmopt profile PP_ARTIFACT`: where a pipeline-parallel model's time goes, stage by stage.

The engine serves a decode load on the artifact's own rank processes, as `llmopt serve` would: B sequences
(the largest --batch-sizes value, at most --max-num-seqs) of PROMPT_TOKENS random prompt tokens (fixed seed),
NEW_TOKENS greedy tokens each (or --decode-steps, if larger). A short warm-up first builds what a first step
builds; then every rank's clock is reset and the load runs with the engine's micro-batches in flight.

Each rank's clock (serve/pp/runner.py) splits its wall time into busy (its layers, and rank 0 also its sends
down the pipeline), waiting for its input (a later stage: the step's metadata and the stage before's hidden
state; rank 0: the last stage's logits) and the rest (rank 0: scheduling, sampling and the engine's Python; a
later stage: messages). The bubble is the waiting share: the part of a step a stage sat idle. With balanced
stages and enough sequences for every stage to have a micro-batch, it is small; at batch 1 it is most of it.
"""
from __future__ import annotations

import random
import time

from ..errors import ConfigError, LlmoptError
from ..progress import StageHooks
from .config import ProfileConfig
from .tables import TableData

PROMPT_TOKENS, NEW_TOKENS, WARMUP_TOKENS, SEED = 32, 64, 4, 0


def pipeline_artifact(ref: str):
    """The pipeline-sharded artifact behind `ref`, or None (any other source, or one that does not resolve)."""
    from ..serve.loader import sharded_artifact

    try:
        art = sharded_artifact(ref)
    except LlmoptError:  # not a source at all: the sweep's own checks say so
        return None
    return art if art is not None and art.pipeline_parallel else None


def run_pipeline(ref: str, config: ProfileConfig, hooks: StageHooks | None = None) -> dict:
    """The report: the load, each rank's clock and shares, the output throughput."""
    from ..artifact import now_iso, tool_version
    from ..model_io import parse_dtype
    from ..serve.build import build_engine
    from ..serve.engine.config import EngineConfig, SamplingParams

    hooks = hooks or StageHooks()
    art = pipeline_artifact(ref)
    if art is None:
        raise ConfigError(f"{ref} is not a pipeline-parallel artifact (llmopt shard --pp N)")
    if config.device != "cpu":
        raise ConfigError("profile of a pipeline-parallel artifact runs on --device cpu here; on CUDA serve it "
                          "and read its per-stage clocks with the same command on that machine")
    plan = art.pipeline_parallel
    batch = min(max(config.batch_sizes), config.max_num_seqs)
    new_tokens = max(NEW_TOKENS, config.decode_steps)
    dtype = None if config.dtype in (None, "auto") else parse_dtype(config.dtype)
    hooks.status(f"starting {plan['world_size']} ranks of {ref}")
    engine = build_engine(str(art.path), EngineConfig(block_size=config.block_size, max_num_seqs=batch,
                                                      max_model_len=PROMPT_TOKENS + new_tokens + WARMUP_TOKENS),
                          "cpu", dtype, config.backend)
    try:
        rng = random.Random(SEED)
        vocab = engine.runner.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]
        hooks.status(f"warm-up: {batch} sequences x {WARMUP_TOKENS} tokens")
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS, ignore_eos=True))
        engine.runner.stage_clocks(reset=True)
        hooks.status(f"{batch} sequences x {PROMPT_TOKENS} prompt + {new_tokens} new tokens through {plan['pp']} "
                     f"stages")
        start = time.perf_counter()
        outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
        seconds = time.perf_counter() - start
        clocks = engine.runner.stage_clocks()
    finally:
        engine.runner.ranks.close()
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"tool": "llmopt profile (pipeline)", "version": tool_version(), "created_at": now_iso(),
            "source": ref, "pp": plan["pp"], "tp": plan["tp"], "config": config.to_dict(),
            "load": {"sequences": batch, "prompt_tokens": PROMPT_TOKENS, "new_tokens": new_tokens,
                     "micro_batches_in_flight": engine.pipeline_depth},
            "seconds": seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds,
            "ranks": [_shares(c, plan) for c in clocks], "stages": _stage_rows(clocks, plan)}


def _shares(clock: dict, plan: dict) -> dict:
    wall = clock["wall_s"] or 1e-9
    layers = plan["stages"][clock["stage"]]["layers"]
    return {**clock, "layers": layers, "busy_share": clock["busy_s"] / wall, "bubble_share": clock["wait_s"] / wall,
            "other_share": max(0.0, 1 - (clock["busy_s"] + clock["wait_s"]) / wall),
            "busy_ms_per_step": 1000 * clock["busy_s"] / clock["steps"] if clock["steps"] else None}


def _stage_rows(clocks: list[dict], plan: dict) -> list[dict]:
    """Per stage: its tensor rank 0's shares (every rank of a stage runs the same layers in lockstep)."""
    first = {}
    for c in clocks:
        first.setdefault(c["stage"], _shares(c, plan))
    return [first[s["stage"]] for s in plan["stages"]]


def pipeline_tables(report: dict) -> list[TableData]:
    load = report["load"]
    t = TableData("pipeline", f"pipeline stages of {report['source']} (pp {report['pp']} x tp {report['tp']}): "
                              f"{load['sequences']} sequences x {load['new_tokens']} tokens, "
                              f"{report['output_tokens_per_s']:.1f} output tok/s",
                  ["stage", "layers", "steps", "busy ms/step", "busy", "bubble (waiting)", "other"])
    for r in report["stages"]:
        a, b = r["layers"]
        t.rows.append([str(r["stage"]), f"{a}-{b - 1}", str(r["steps"]),
                       "-" if r["busy_ms_per_step"] is None else f"{r['busy_ms_per_step']:.1f}",
                       f"{r['busy_share']:.0%}", f"{r['bubble_share']:.0%}", f"{r['other_share']:.0%}"])
    t.note = ("busy: the stage's layers (stage 0: and its sends); bubble: waiting for its input (stage 0: for the "
              "last stage's logits); other: stage 0's scheduling and sampling, a later stage's messages")
    return [t]
