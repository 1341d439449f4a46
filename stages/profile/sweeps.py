"""Latency sweeps on a ModelRunner: prefill by prompt length, decode by batch size and by context.

Every point is `ModelRunner.execute` on a StepInput, the call the engine's step makes. The
roofline columns follow one formula, kept in the rows so it can be checked by hand:
share = (weight_bytes / step_seconds) / copy_bytes_per_s.
"""
from __future__ import annotations

from ..serve.model import ModelSpec
from ..serve.runner import ModelRunner
from .costs import decode_flops, prefill_flops
from .steps import decode_step, median_ms, prefill_step, time_step

CHEAP_WARMUP_TOKENS = 512  # longer prompts are timed without a warm-up call: it would double their cost


def prefill_point(runner: ModelRunner, prompt_len: int, repeats: int) -> dict:
    """Latency, tokens/s and FLOP/s of one prompt prefilled in one step."""
    warmup = 1 if prompt_len <= CHEAP_WARMUP_TOKENS else 0
    ms = median_ms(time_step(runner, prefill_step(runner, prompt_len), repeats, warmup))
    flops = prefill_flops(runner.runtime.spec, prompt_len)
    return {"prompt_len": prompt_len, "ms": ms, "tokens_per_s": prompt_len / ms * 1e3, "flops": flops,
            "flops_per_s": flops / ms * 1e3, "repeats": repeats}


def decode_point(runner: ModelRunner, batch: int, context: int, steps: int, weight_bytes: int,
                 copy_bytes_per_s: float, kv_per_token: int) -> dict:
    """Latency of one decode step of `batch` sequences at `context`, with its roofline figures."""
    ms = median_ms(time_step(runner, decode_step(runner, batch, context), steps))
    spec: ModelSpec = runner.runtime.spec
    kv_read = batch * context * kv_per_token
    return {"batch": batch, "context": context, "ms": ms, "tokens_per_s": batch / ms * 1e3,
            "weight_bytes": weight_bytes, "weight_bytes_per_s": weight_bytes / ms * 1e3,
            "bandwidth_share": weight_bytes / ms * 1e3 / copy_bytes_per_s,
            "kv_bytes_read": kv_read, "total_bytes_per_s": (weight_bytes + kv_read) / ms * 1e3,
            "flops": decode_flops(spec, batch, context), "flops_per_s": decode_flops(spec, batch, context) / ms * 1e3,
            "steps": steps}


def roofline(point: dict, copy: dict) -> dict:
    """The batch-1 decode roofline with every term of its arithmetic spelled out.

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
            "note": "copy bandwidth counts bytes read + written (STREAM); decode reads the weights once per step"}


def context_slope(points: list[dict]) -> float:
    """Least-squares ms per extra cached token per sequence, from the batch-1 context sweep."""
    if len(points) < 2:
        return 0.0
    xs, ys = [p["context"] for p in points], [p["ms"] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var else 0.0
