"""Latency sweeps on a ModelRunner: prefill by prompt length, decode by batch size and by context.

Every point is `ModelRunner.execute` on a StepInput, the call the engine's step makes. The
roofline columns follow one formula, kept in the rows so it can be checked by hand:
share = (weight_bytes / step_seconds) / copy_bytes_per_s.

Every point keeps the spread of its timings (`ms_min`, `ms_median` = `ms`, `ms_max`). Decode points
are timed in `SWEEP_ROUNDS` passes over the sweep, so a burst of load on a shared machine lands in one
pass of every point rather than in every step of one, and shows as spread instead of as a slow point.
"""
from __future__ import annotations

import statistics

from ..serve.batch import StepInput
from ..serve.runner import ModelRunner
from .costs import decode_flops, prefill_flops
from .steps import prefill_step, time_step

CHEAP_WARMUP_TOKENS = 512  # longer prompts are timed without a warm-up call: it would double their cost
SWEEP_ROUNDS = 3  # interleaved passes over the decode points (the steps per point are split between them)
# The roofline's own batch-1 timing: back-to-back steps, as a server at concurrency 1 runs them. In the sweep a
# batch-1 step follows larger batches' steps, whose after-effects (on this Xeon, a batch-16 step on the AMX
# matmuls) slow the next three batch-1 steps by 17-28% (2026-12-06: 6.90, 6.80, 6.35 ms against 5.4 back to back).
STEADY_WARMUP = 5  # untimed steps first
STEADY_STEPS = 16  # timed steps at least (more when --decode-steps asks for more)


def spread_ms(seconds: list[float]) -> dict:
    """The median (a point's `ms`) and the range of its timings, in ms."""
    ms = [s * 1e3 for s in seconds]
    return {"ms": statistics.median(ms), "ms_min": min(ms), "ms_median": statistics.median(ms), "ms_max": max(ms)}


def prefill_point(runner: ModelRunner, prompt_len: int, repeats: int) -> dict:
    """Latency (median and spread), tokens/s and FLOP/s of one prompt prefilled in one step."""
    warmup = 1 if prompt_len <= CHEAP_WARMUP_TOKENS else 0
    timing = spread_ms(time_step(runner, prefill_step(runner, prompt_len), repeats, warmup))
    ms, flops = timing["ms"], prefill_flops(runner.runtime.spec, prompt_len)
    return {"prompt_len": prompt_len, **timing, "tokens_per_s": prompt_len / ms * 1e3, "flops": flops,
            "flops_per_s": flops / ms * 1e3, "repeats": repeats}


def interleaved_seconds(runner: ModelRunner, steps: dict, count: int, rounds: int = SWEEP_ROUNDS) -> dict:
    """Seconds per call of each StepInput in `steps` ({key: step}), `count` calls each, timed in
    `rounds` passes over all of them (a warm-up call per step in the first pass only)."""
    rounds = max(1, min(rounds, count))
    seconds = {key: [] for key in steps}
    for r in range(rounds):
        calls = count // rounds + (r < count % rounds)
        for key, step in steps.items():
            seconds[key] += time_step(runner, step, calls, warmup=1 if r == 0 else 0)
    return seconds


def steady_seconds(runner: ModelRunner, step: StepInput, count: int) -> list[float]:
    """Seconds per call of `step` run back to back, `max(count, STEADY_STEPS)` calls after STEADY_WARMUP."""
    return time_step(runner, step, max(count, STEADY_STEPS), warmup=STEADY_WARMUP)


def decode_point(runner: ModelRunner, step: StepInput, seconds: list[float], weight_bytes: int,
                 copy_bytes_per_s: float, kv_per_token: int) -> dict:
    """One decode step of its batch at its context, from its timings, with its roofline figures."""
    batch, context = len(step.context_lens), int(step.context_lens[0])
    timing = spread_ms(seconds)
    ms, spec = timing["ms"], runner.runtime.spec
    kv_read = batch * context * kv_per_token
    return {"batch": batch, "context": context, **timing, "tokens_per_s": batch / ms * 1e3,
            "weight_bytes": weight_bytes, "weight_bytes_per_s": weight_bytes / ms * 1e3,
            "bandwidth_share": weight_bytes / ms * 1e3 / copy_bytes_per_s,
            "kv_bytes_read": kv_read, "total_bytes_per_s": (weight_bytes + kv_read) / ms * 1e3,
            "flops": decode_flops(spec, batch, context), "flops_per_s": decode_flops(spec, batch, context) / ms * 1e3,
            "steps": len(seconds)}


def roofline(point: dict, copy: dict, sweep: dict | None = None) -> dict:
    """The batch-1 decode roofline with every term of its arithmetic spelled out.

    `point`: the batch-1 step timed back to back (`steady_seconds`); `sweep`: the same step's point in the
    interleaved sweep, whose time and read share are kept beside it (`sweep_step_ms`, `sweep_read_share`).
    Two shares of the machine's copy bandwidth (`machine.copy.bytes_per_s`, STREAM: bytes read + written
    per second): `bandwidth_share` counts the weights only; `read_share` counts every byte a token's
    step reads (the weights and this context's KV cache rows), per token: the figure the decode work
    aims to raise.
    """
    seconds = point["ms"] / 1e3
    achieved = point["weight_bytes"] / seconds
    per_token = (point["weight_bytes"] + point["kv_bytes_read"]) / point["batch"]
    ms_per_token = point["ms"] / point["batch"]
    return {"batch": point["batch"], "context": point["context"], "weight_bytes": point["weight_bytes"],
            "step_ms": point["ms"], "achieved_bytes_per_s": achieved, "copy_bytes_per_s": copy["bytes_per_s"],
            "bandwidth_share": achieved / copy["bytes_per_s"],
            "formula": "bandwidth_share = (weight_bytes / (step_ms / 1000)) / copy_bytes_per_s",
            "ideal_step_ms": point["weight_bytes"] / copy["bytes_per_s"] * 1e3,
            "kv_bytes_read": point["kv_bytes_read"], "bytes_read_per_token": per_token,
            "ms_per_token": ms_per_token, "read_bytes_per_s": per_token / ms_per_token * 1e3,
            "read_share": per_token / ms_per_token * 1e3 / copy["bytes_per_s"],
            "read_formula": "read_share = ((weight_bytes + kv_bytes_read) / batch / (ms_per_token / 1000)) "
                            "/ copy_bytes_per_s",
            "note": "copy bandwidth counts bytes read + written (STREAM); decode reads the weights once per step",
            "timing": f"{point['steps']} batch-1 steps back to back after {STEADY_WARMUP} untimed ones (median)",
            **({"sweep_step_ms": sweep["ms"],
                "sweep_read_share": (sweep["weight_bytes"] + sweep["kv_bytes_read"]) / sweep["batch"]
                / (sweep["ms"] / sweep["batch"] / 1e3) / copy["bytes_per_s"]} if sweep else {})}


def context_slope(points: list[dict]) -> float:
    """Least-squares ms per extra cached token per sequence, from the batch-1 context sweep."""
    if len(points) < 2:
        return 0.0
    xs, ys = [p["context"] for p in points], [p["ms"] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var else 0.0
