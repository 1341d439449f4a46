"""The numbers of a run, named as vLLM's benchmark_serving names them where the two overlap.

Latencies are in milliseconds: for each of ttft, tpot, itl and e2el the mean, median, std, p90 and
p99 (`mean_ttft_ms`, `p99_itl_ms`, ...). Percentiles interpolate linearly between order statistics
(numpy's default). A statistic of an empty sample is None (vLLM writes 0).
"""
from __future__ import annotations

import math
from collections import Counter

from .client import RequestResult

LATENCIES = {"ttft": "time to first token", "tpot": "time per output token (after the first)",
             "itl": "inter-token latency", "e2el": "end-to-end latency"}
STATS = ("mean", "median", "std", "p90", "p99")
THROUGHPUTS = ("request_throughput", "request_goodput", "output_throughput", "total_token_throughput")
COUNTS = ("completed", "failed", "total_input_tokens", "total_output_tokens")


def metric_names() -> list[str]:
    """Every scalar metric a report holds, in report order (what --fail-on and compare accept)."""
    latency = [f"{stat}_{name}_ms" for name in LATENCIES for stat in STATS]
    return ["duration", *COUNTS, *THROUGHPUTS, "goodput_completed", *latency]


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between the closest ranks."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def describe(values_s: list[float]) -> dict[str, float | None]:
    """mean, median, std (population), p90, p99 of seconds, in milliseconds."""
    if not values_s:
        return dict.fromkeys(STATS)
    ms = [v * 1000.0 for v in values_s]
    mean = sum(ms) / len(ms)
    return {"mean": mean, "median": percentile(ms, 50), "std": math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms)),
            "p90": percentile(ms, 90), "p99": percentile(ms, 99)}


def is_good(result: RequestResult, slo: dict[str, float]) -> bool:
    """A completed request meets every SLO given (a one-token reply has no TPOT to miss)."""
    measured = {"ttft_ms": result.ttft, "tpot_ms": result.tpot, "e2el_ms": result.e2e}
    return result.ok and all(measured[key] is None or measured[key] * 1000.0 <= bound for key, bound in slo.items())


def summarize(results: list[RequestResult], duration: float, slo: dict[str, float] | None = None) -> dict:
    """The report's metrics from finished requests and the run's duration in seconds."""
    done = [r for r in results if r.ok]
    total_in = sum(r.prompt_len or 0 for r in done)
    total_out = sum(r.output_tokens for r in done)
    good = sum(is_good(r, slo) for r in done) if slo else None
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: None)
    metrics = {"duration": duration, "completed": len(done), "failed": len(results) - len(done),
               "total_input_tokens": total_in, "total_output_tokens": total_out,
               "request_throughput": per_s(len(done)), "request_goodput": per_s(good) if slo else None,
               "output_throughput": per_s(total_out), "total_token_throughput": per_s(total_in + total_out),
               "goodput_completed": good}
    samples = {"ttft": [r.ttft for r in done if r.ttft is not None],  # None: a reply of no tokens
               "tpot": [r.tpot for r in done if r.tpot is not None],
               "itl": [gap for r in done for gap in r.itl], "e2el": [r.e2e for r in done]}
    for name, values in samples.items():
        for stat, value in describe(values).items():
            metrics[f"{stat}_{name}_ms"] = value
    return metrics


def failures(results: list[RequestResult]) -> dict[str, int]:
    """Failed requests by kind ("HTTP 503", "connect error", ...), most frequent first."""
    return dict(Counter(r.error for r in results if not r.ok).most_common())


def unknown_input_lengths(results: list[RequestResult]) -> int:
    """Completed requests whose prompt length nobody knew (no tokenizer, no usage from the server)."""
    return sum(1 for r in results if r.ok and r.prompt_len is None)
