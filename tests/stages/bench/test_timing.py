"""TTFT, TPOT, ITL, e2e and their percentiles, checked exactly against a scripted stub server."""
import math

import numpy as np
import pytest

from llmopt.stages.bench.config import BenchConfig
from llmopt.stages.bench.dataset import BenchRequest
from llmopt.stages.bench.metrics import percentile, summarize
from llmopt.stages.bench.runner import arrival_offsets, run_bench
from tests.stages.bench.stub import FakeClock, Script, scripted_transport

# Offsets are multiples of 1/64 s, so every sum below is exact in binary floating point.
SCRIPTS = {
    "a": Script(events=(0.25, 0.375, 0.5, 0.75), end=0.8125, usage_tokens=4, prompt_tokens=10),
    "b": Script(events=(0.125, 0.1875), end=0.25, usage_tokens=2, prompt_tokens=20),
    "c": Script(events=(0.5,), end=0.5, usage_tokens=1, prompt_tokens=30),
    # two tokens arrive in one event: usage (5) counts tokens, the four events give three gaps
    "d": Script(events=(0.0625, 0.125, 0.25, 1.0), end=1.0625, usage_tokens=5, prompt_tokens=40),
    "e": Script(events=(), end=0.0, status=503),
    "z": Script(events=(0.0,), end=0.0),  # takes no time: only the arrival schedule moves the clock
    # the model stopped at once: a finish reason, no text
    "s": Script(events=(), end=0.125, usage_tokens=0, prompt_tokens=7, finish_reason="stop"),
    "n": Script(events=(), end=0.125),  # neither text nor a finish reason
}
DURATION = 0.8125 + 0.25 + 0.5 + 1.0625  # sequential: one request at a time, back to back


def _run(prompts, clock=None, **overrides):
    clock = clock or FakeClock()
    seen = []
    config = BenchConfig(url="http://stub", max_concurrency=1, warmup=0, **overrides)
    requests = [BenchRequest(p, None, 16) for p in prompts]
    run = run_bench(config, requests, transport=scripted_transport(clock, SCRIPTS, seen), clock=clock)
    return run, seen


def test_per_request_timings_are_exact():
    run, seen = _run("abcd")
    by_prompt = dict(zip("abcd", run.results))
    a, d = by_prompt["a"], by_prompt["d"]
    assert (a.ttft, a.itl, a.e2e, a.output_tokens, a.prompt_len) == (0.25, [0.125, 0.125, 0.25], 0.8125, 4, 10)
    assert a.tpot == (0.8125 - 0.25) / 3
    assert (d.ttft, d.itl, d.output_tokens) == (0.0625, [0.0625, 0.125, 0.75], 5)
    assert d.tpot == (1.0625 - 0.0625) / 4
    assert by_prompt["c"].tpot is None  # one token: no time per output token
    assert [r.start for r in run.results] == [0.0, 0.8125, 0.8125 + 0.25, 0.8125 + 0.25 + 0.5]
    assert run.duration == DURATION
    assert seen[0]["model"] == "stub-model" and seen[0]["stream"] is True and seen[0]["max_tokens"] == 16


def test_report_metrics_are_exact():
    run, _ = _run("abcde")
    m = summarize(run.results, run.duration)
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (4, 1, 100, 12)
    assert m["duration"] == DURATION
    assert m["request_throughput"] == 4 / DURATION
    assert m["output_throughput"] == 12 / DURATION
    assert m["total_token_throughput"] == 112 / DURATION
    ttft = [0.25, 0.125, 0.5, 0.0625]
    tpot = [(0.8125 - 0.25) / 3, (0.25 - 0.125) / 1, (1.0625 - 0.0625) / 4]
    itl = [0.125, 0.125, 0.25, 0.0625, 0.0625, 0.125, 0.75]
    e2e = [0.8125, 0.25, 0.5, 1.0625]
    for name, values in {"ttft": ttft, "tpot": tpot, "itl": itl, "e2el": e2e}.items():
        ms = np.array(values) * 1000
        assert m[f"mean_{name}_ms"] == pytest.approx(ms.mean(), rel=1e-12, abs=0)
        assert m[f"median_{name}_ms"] == pytest.approx(np.median(ms), rel=1e-12, abs=0)
        assert m[f"std_{name}_ms"] == pytest.approx(ms.std(), rel=1e-12, abs=1e-12)
        for q in (90, 99):
            assert m[f"p{q}_{name}_ms"] == pytest.approx(np.percentile(ms, q), rel=1e-12, abs=0)
    # by hand, for one: ITL sorted [62.5, 62.5, 125, 125, 125, 250, 750]; p90 at rank 5.4 -> 250 + 0.4 * 500
    assert m["p90_itl_ms"] == pytest.approx(450.0, rel=1e-12)
    assert m["median_ttft_ms"] == (125 + 250) / 2


def test_goodput_counts_requests_meeting_every_slo():
    run, _ = _run("abcde")
    m = summarize(run.results, run.duration, {"ttft_ms": 300, "e2el_ms": 900})
    assert m["goodput_completed"] == 2  # a (250 ms, 812.5 ms) and b; c's TTFT and d's e2e miss
    assert m["request_goodput"] == 2 / DURATION
    m = summarize(run.results, run.duration, {"tpot_ms": 150})
    assert m["goodput_completed"] == 2  # b (125 ms) and c (one token, no TPOT to miss)


def test_chat_endpoint_reads_deltas():
    run, seen = _run("ab", endpoint="chat")
    assert [r.ok for r in run.results] == [True, True]
    assert seen[0]["messages"] == [{"role": "user", "content": "a"}] and "prompt" not in seen[0]
    assert run.results[0].itl == [0.125, 0.125, 0.25]


def test_failures_are_counted_by_kind():
    run, _ = _run("eae")
    assert [(r.ok, r.error) for r in run.results] == [(False, "HTTP 503"), (True, None), (False, "HTTP 503")]
    assert "scripted failure" in run.results[0].detail


def test_interrupt_returns_the_finished_requests():
    clock = FakeClock()
    config = BenchConfig(url="http://stub", max_concurrency=1, warmup=0)

    def stop_after_two(result, done, planned):
        if done == 2:
            raise KeyboardInterrupt

    run = run_bench(config, [BenchRequest(p, None, 8) for p in "abcd"], on_result=stop_after_two,
                    transport=scripted_transport(clock, SCRIPTS), clock=clock)
    assert run.interrupted and run.planned == 4 and len(run.results) == 2
    assert run.duration == 0.8125 + 0.25


def test_arrivals_follow_the_rate_and_are_seeded():
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets(4001, 8.0, 1.0, seed=3)
    assert offsets == arrival_offsets(4001, 8.0, 1.0, seed=3) and offsets[0] == 0.0
    gaps = np.diff(offsets)
    assert gaps.mean() == pytest.approx(1 / 8, rel=0.05)
    assert gaps.std() == pytest.approx(1 / 8, rel=0.08)  # exponential: std == mean
    bursty = np.diff(arrival_offsets(4001, 8.0, 0.25, seed=3))
    assert bursty.mean() == pytest.approx(1 / 8, rel=0.1) and bursty.std() > 1.5 / 8  # gamma shape 1/4: std 2x mean


def test_rate_limited_run_waits_for_each_arrival():
    clock = FakeClock()
    config = BenchConfig(url="http://stub", request_rate=2.0, warmup=0, seed=1)
    run = run_bench(config, [BenchRequest("z", None, 8)] * 3, transport=scripted_transport(clock, SCRIPTS), clock=clock)
    starts = [r.start for r in run.results]
    assert starts == pytest.approx(arrival_offsets(3, 2.0, 1.0, 1), abs=1e-9)


def test_percentile_matches_numpy():
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-15)
    assert percentile([], 50) is None


def test_a_stream_that_stops_at_once_is_completed_with_no_tokens():
    run, _ = _run("sna")
    s, n, a = run.results
    assert (s.ok, s.output_tokens, s.ttft, s.itl, s.e2e, s.prompt_len, s.tpot) == (True, 0, None, [], 0.125, 7, None)
    assert (n.ok, n.error) == (False, "no tokens")
    metrics = summarize(run.results, run.duration)
    assert (metrics["completed"], metrics["failed"], metrics["total_output_tokens"]) == (2, 1, 4)
    assert metrics["mean_ttft_ms"] == a.ttft * 1000  # the empty reply has no time to a first token
    assert metrics["mean_e2el_ms"] == (0.125 + 0.8125) / 2 * 1000
