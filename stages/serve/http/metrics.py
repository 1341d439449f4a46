"""The server's metrics (names prefixed `llmopt:`, vLLM's names after it, a `model_name` label on every
series) and the per-sequence trace that feeds them.

Two kinds: what the HTTP side sees per sequence (latency histograms, token counters) lives in
prometheus_client objects; what the engine owns (running, waiting, cache usage, preemptions, tokens per
step, ...) is read from its stats when /metrics is scraped (`EngineCollector`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import CollectorRegistry

from ..engine.engine import ITERATION_TOKEN_BUCKETS
from . import prometheus as prom

P = "llmopt:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0, 600.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
FINISH_REASONS = ("stop", "length", "abort")
TENANT_OUTCOMES = ("admitted", "rate_limited", "concurrency_limited")  # quota.py's
REJECT_REASONS = ("queue_full", "queue_tokens_full", "draining", "too_many_connections")


@dataclass
class Scrape:
    """What the server knows at scrape time: the engine's stats (None while loading), the 503 refusals by
    reason, health, and once loaded the KV cache's settings (`cache_config_info`'s labels)."""
    stats: object | None
    rejected: dict[str, int]
    healthy: bool
    cache_config: dict[str, str] = field(default_factory=dict)
    tenants: list = field(default_factory=list)  # quota.TenantUsage of each --api-keys-file tenant


PROTOCOLS = ("http", "grpc")  # the `protocol` label of the per-sequence series: which API the request came by


class ServerMetrics:
    """The app's registry; `read()` gives the Scrape the engine's series come from. The per-sequence series
    carry a `protocol` label beside `model_name`: `series(protocol)` gives one protocol's (made on first use,
    so a server that only ever answers HTTP shows only protocol="http")."""

    def __init__(self, model_name: str, read: Callable[[], Scrape]):
        multiproc = prom.multiprocess_dir()  # first: a missing directory fails the first Histogram made
        owned = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name", "protocol"]

        def histogram(name: str, help_text: str, buckets):
            return Histogram(P + name, help_text, labels, buckets=buckets, registry=owned)

        def counter(name: str, help_text: str):
            return Counter(P + name, help_text, labels, registry=owned)

        self.families = {
            "ttft": histogram("time_to_first_token_seconds", "Arrival to first output token.", LATENCY_BUCKETS),
            "itl": histogram("inter_token_latency_seconds", "Time between a sequence's output tokens, as the server "
                             "receives them.", LATENCY_BUCKETS),
            "e2e": histogram("e2e_request_latency_seconds", "Arrival to finish, per sequence.", E2E_BUCKETS),
            "queue": histogram("request_queue_time_seconds", "Arrival to first scheduling, per sequence.",
                               LATENCY_BUCKETS),
            "prefill": histogram("request_prefill_time_seconds", "First scheduling to first output token, per "
                                 "sequence.", E2E_BUCKETS),
            "decode": histogram("request_decode_time_seconds", "First to last output token, per sequence.",
                                E2E_BUCKETS),
            "prompt_len": histogram("request_prompt_tokens", "Prompt length per sequence.", TOKEN_BUCKETS),
            "gen_len": histogram("request_generation_tokens", "Tokens generated per sequence.", TOKEN_BUCKETS),
            "prompt_tokens": counter("prompt_tokens", "Prompt tokens of finished sequences."),
            "generation_tokens": counter("generation_tokens", "Tokens generated."),
        }
        self._series: dict[str, ProtocolSeries] = {}
        self.registry = prom.scrape_registry(owned, EngineCollector(model_name, read), multiproc)

    def series(self, protocol: str) -> ProtocolSeries:
        """The per-sequence series of requests that came by `protocol` (one of PROTOCOLS)."""
        if protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {protocol!r}")
        if protocol not in self._series:
            self._series[protocol] = ProtocolSeries(self.families, self.model_name, protocol)
        return self._series[protocol]

    def render(self) -> bytes:
        return prom.render(self.registry)


class ProtocolSeries:
    """One protocol's children of the per-sequence families (ttft, itl, e2e, queue, prefill, decode,
    prompt_len, gen_len: histograms; prompt_tokens, generation_tokens: counters)."""

    def __init__(self, families: dict, model_name: str, protocol: str):
        for name, family in families.items():
            setattr(self, name, family.labels(model_name, protocol))


class EngineCollector:
    """The series whose values the engine (or the admission) owns, made at scrape time."""

    def __init__(self, model_name: str, read: Callable[[], Scrape]):
        self.model_name, self.read = model_name, read

    def collect(self):
        scrape, m = self.read(), [self.model_name]
        yield _gauge("server_ready", "1 when the engine is loaded and running.", m, float(scrape.healthy))
        yield _labelled(CounterMetricFamily(P + "requests_rejected", "Requests refused with 503: the queue bounds, a "
                                            "drain, too many connections.", labels=["model_name", "reason"]),
                        m, {r: scrape.rejected.get(r, 0) for r in REJECT_REASONS})
        if scrape.cache_config:
            info = GaugeMetricFamily(P + "cache_config_info", "The KV cache's settings (labels); always 1.",
                                     labels=["model_name", *scrape.cache_config])
            info.add_metric(m + list(scrape.cache_config.values()), 1.0)
            yield info
        if scrape.tenants:
            yield from _tenant_series(scrape.tenants, m)
        if scrape.stats is not None:
            yield from _engine_series(scrape.stats, m)

    def describe(self):
        return []  # made at scrape time: nothing to check names against when registered


def _engine_series(stats, m: list[str]):
    yield _gauge("num_requests_running", "Sequences in the running batch.", m, stats.num_running)
    yield _gauge("num_requests_waiting", "Sequences waiting for the batch (incl. preempted).", m, stats.num_waiting)
    yield _gauge("kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1).", m, stats.kv_cache_usage)
    yield _labelled(CounterMetricFamily(P + "request_finished", "Finished sequences by reason.",
                                        labels=["model_name", "finished_reason"]),
                    m, {r: stats.finished.get(r, 0) for r in FINISH_REASONS})
    yield _counter("num_preemptions", "Sequences preempted for lack of KV blocks.", m, stats.num_preemptions)
    yield _counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", m,
                   stats.prefix_cache_queries)
    yield _counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", m, stats.prefix_cache_hits)
    yield _iteration_tokens(stats.iteration_tokens, m)
    spec = stats.spec
    if spec.num_drafts:  # vLLM's names; acceptance rate = accepted / draft tokens, mean length 1 + accepted / drafts
        yield _counter("spec_decode_num_drafts", "Verify steps of a sequence with drafts.", m, spec.num_drafts)
        yield _counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", m, spec.num_draft_tokens)
        yield _counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", m, spec.num_accepted_tokens)


def _tenant_series(tenants: list, m: list[str]):
    """New series only (every other one keeps vLLM's labels): requests by tenant and outcome, in flight, tokens."""
    requests = CounterMetricFamily(P + "tenant_requests", "Requests by tenant and outcome: admitted past the tenant's "
                                   "limits, or refused with 429.", labels=["model_name", "tenant", "outcome"])
    in_flight = GaugeMetricFamily(P + "tenant_requests_in_flight", "A tenant's requests admitted and not yet ended.",
                                  labels=["model_name", "tenant"])
    tokens = CounterMetricFamily(P + "tenant_tokens", "Prompt + generated tokens of a tenant's ended requests.",
                                 labels=["model_name", "tenant"])
    for usage in tenants:
        name = usage.tenant.name
        for outcome in TENANT_OUTCOMES:
            requests.add_metric(m + [name, outcome], usage.outcomes.get(outcome, 0))
        in_flight.add_metric(m + [name], usage.in_flight)
        tokens.add_metric(m + [name], usage.tokens)
    yield from (requests, in_flight, tokens)


def _iteration_tokens(counts, m: list[str]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(P + "iteration_tokens_total", "Tokens per engine step (prefill chunks, decodes "
                                   "and drafts).", labels=["model_name"])
    cumulative, buckets = 0, []
    for bound, count in zip([str(float(b)) for b in ITERATION_TOKEN_BUCKETS] + ["+Inf"], counts.counts):
        cumulative += count
        buckets.append((bound, cumulative))
    family.add_metric(m, buckets, counts.sum)
    return family


def _gauge(name: str, help_text: str, m: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(P + name, help_text, labels=["model_name"])
    family.add_metric(m, value)
    return family


def _counter(name: str, help_text: str, m: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(P + name, help_text, labels=["model_name"])
    family.add_metric(m, value)
    return family


def _labelled(family: CounterMetricFamily, m: list[str], values: dict[str, float]) -> CounterMetricFamily:
    for key, value in sorted(values.items()):
        family.add_metric(m + [key], value)
    return family


class SequenceTrace:
    """Observes one sequence's outputs as they arrive and records its metrics."""
    __slots__ = ("metrics", "last_token_at", "started")

    def __init__(self, metrics: ProtocolSeries):
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
            self.finish(out)

    def finish(self, out) -> None:
        """The per-sequence histograms, vLLM's phases: prefill is first scheduling to first token, decode
        first token to finish (an aborted sequence without a token has neither)."""
        m = self.metrics
        m.prompt_tokens.inc(out.num_prompt_tokens)
        m.prompt_len.observe(out.num_prompt_tokens)
        m.gen_len.observe(out.num_output_tokens)
        if out.finish_time is not None:
            m.e2e.observe(max(0.0, out.finish_time - out.arrival_time))
        if out.first_token_time is not None and out.first_scheduled_time is not None:
            m.prefill.observe(max(0.0, out.first_token_time - out.first_scheduled_time))
            if out.finish_time is not None:
                m.decode.observe(max(0.0, out.finish_time - out.first_token_time))
