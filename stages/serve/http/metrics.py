"""The server's metrics (names prefixed `llmopt:`) and the per-sequence trace that feeds them."""
from __future__ import annotations

import time

from . import prometheus as prom

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0, 600.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
FINISH_REASONS = ("stop", "length", "abort")
REJECT_REASONS = ("queue_full", "queue_tokens_full", "draining", "too_many_connections")


class ServerMetrics:
    def __init__(self):
        p = "llmopt:"
        self.ttft = prom.Histogram(p + "time_to_first_token_seconds", "Arrival to first output token.", LATENCY_BUCKETS)
        self.itl = prom.Histogram(p + "inter_token_latency_seconds", "Time between a sequence's output tokens, as "
                                  "the server receives them.", LATENCY_BUCKETS)
        self.e2e = prom.Histogram(p + "e2e_request_latency_seconds", "Arrival to finish, per sequence.", E2E_BUCKETS)
        self.queue = prom.Histogram(p + "request_queue_time_seconds", "Arrival to first scheduling, per sequence.",
                                    LATENCY_BUCKETS)
        self.prompt_len = prom.Histogram(p + "request_prompt_tokens", "Prompt length per sequence.", TOKEN_BUCKETS)
        self.gen_len = prom.Histogram(p + "request_generation_tokens", "Tokens generated per sequence.",
                                      TOKEN_BUCKETS)
        self.prompt_tokens = prom.Counter(p + "prompt_tokens_total", "Prompt tokens of finished sequences.")
        self.generation_tokens = prom.Counter(p + "generation_tokens_total", "Tokens generated.")
        self.histograms = (self.ttft, self.itl, self.e2e, self.queue, self.prompt_len, self.gen_len)

    def render(self, stats, rejected: dict[str, int], healthy: bool) -> str:
        """The Prometheus text for these metrics plus the engine's `stats` (None while loading)."""
        p, lines = "llmopt:", []
        lines += prom.gauge(p + "server_ready", "1 when the engine is loaded and running.", float(healthy))
        if stats is not None:
            lines += prom.gauge(p + "num_requests_running", "Sequences in the running batch.", stats.num_running)
            lines += prom.gauge(p + "num_requests_waiting", "Sequences waiting for the batch (incl. preempted).",
                                stats.num_waiting)
            lines += prom.gauge(p + "kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1).",
                                stats.kv_cache_usage)
            lines += prom.counter_snapshot(p + "request_finished_total", "Finished sequences by reason.",
                                           {r: stats.finished.get(r, 0) for r in FINISH_REASONS}, "finished_reason")
            lines += prom.counter_snapshot(p + "num_preemptions_total", "Sequences preempted for lack of KV blocks.",
                                           stats.num_preemptions)
            lines += prom.counter_snapshot(p + "prefix_cache_queries_total", "Prompt tokens looked up in the prefix "
                                           "cache.", stats.prefix_cache_queries)
            lines += prom.counter_snapshot(p + "prefix_cache_hits_total", "Prompt tokens served from the prefix cache.",
                                           stats.prefix_cache_hits)
            lines += _spec_decode(p, stats)
        lines += prom.counter_snapshot(p + "requests_rejected_total", "Requests refused with 503: the queue bounds, "
                                       "a drain, too many connections.",
                                       {k: rejected.get(k, 0) for k in REJECT_REASONS}, "reason")
        lines += self.prompt_tokens.render() + self.generation_tokens.render()
        for histogram in self.histograms:
            lines += histogram.render()
        return "\n".join(lines) + "\n"


def _spec_decode(p: str, stats) -> list[str]:
    """Speculative decoding's counts under vLLM's names (acceptance rate = accepted / draft tokens; mean
    accepted length = 1 + accepted / drafts); nothing when the engine does not speculate."""
    spec = getattr(stats, "spec", None)
    if spec is None or not spec.num_drafts:
        return []
    return (prom.counter_snapshot(p + "spec_decode_num_drafts_total", "Verify steps of a sequence with drafts.",
                                  spec.num_drafts)
            + prom.counter_snapshot(p + "spec_decode_num_draft_tokens_total", "Draft tokens proposed.",
                                    spec.num_draft_tokens)
            + prom.counter_snapshot(p + "spec_decode_num_accepted_tokens_total", "Draft tokens accepted.",
                                    spec.num_accepted_tokens))


class SequenceTrace:
    """Observes one sequence's outputs as they arrive and records its metrics."""
    __slots__ = ("metrics", "last_token_at", "started")

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.last_token_at: float | None = None
        self.started = False

    def observe(self, out) -> None:
        m, now = self.metrics, time.perf_counter()
        if out.token_ids:
            m.generation_tokens.inc(len(out.token_ids))
            if self.last_token_at is None and out.first_token_time is not None:
                m.ttft.observe(max(0.0, out.first_token_time - out.arrival_time))
            elif self.last_token_at is not None:
                m.itl.observe(now - self.last_token_at)
            self.last_token_at = now
        if not self.started and out.first_scheduled_time is not None:
            self.started = True
            m.queue.observe(max(0.0, out.first_scheduled_time - out.arrival_time))
        if out.finished:
            m.prompt_tokens.inc(out.num_prompt_tokens)
            m.prompt_len.observe(out.num_prompt_tokens)
            m.gen_len.observe(out.num_output_tokens)
            if out.finish_time is not None:
                m.e2e.observe(max(0.0, out.finish_time - out.arrival_time))
