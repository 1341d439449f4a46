"""The bench stage's run, for `llmopt bench` and a recipe's bench stage alike: start a server on a
source (or use a running one), drive the load, build the report, and check the --fail-on bounds.

The server is always a subprocess (`llmopt serve`, or the plain-transformers baseline): the bench
imports nothing of the engine it measures.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Callable, ContextManager

from .config import GRPC_AUTO
from .dataset import BenchRequest, load_requests, load_tokenizer
from .gate import broken_bounds
from .report import build_report
from .runner import run_bench
from .server import ServerSpec, free_port, running_server
from .stage import BenchStageConfig


def _ignore(*args) -> None:
    return None


@contextmanager
def _no_progress(planned: int):
    yield None


@dataclass
class BenchHooks:
    """What the bench tells whoever watches: a line of narration, and a live display per run."""

    status: Callable[[str], None] = _ignore
    # (requests planned) -> a context yielding the runner's on_result(result, done, planned), or None
    progress: Callable[[int], ContextManager] = _no_progress


@dataclass
class BenchOutcome:
    """One run's report, and why it fails the --fail-on bounds (empty: it passes them)."""

    report: dict
    broken: list[str] = field(default_factory=list)

    @property
    def failures(self) -> list[str]:
        """Why the run fails as a gate: each broken bound, and a run that completed nothing."""
        return self.broken + ([] if self.report["completed"] else ["no request completed"])

    @property
    def passed(self) -> bool:
        """Whether the run passes as a gate (no failures)."""
        return not self.failures


def load_bench_requests(config: BenchStageConfig) -> list[BenchRequest]:
    """The stage's prompts, counted with its --tokenizer when one is given (made once for every source)."""
    tokenizer = config.dataset.tokenizer
    return load_requests(config.dataset, load_tokenizer(tokenizer) if tokenizer else None)


def _server_for(config: BenchStageConfig, source: str) -> ServerSpec:
    """The server to start on `source`: with a gRPC port of its own when the load goes over gRPC (--grpc auto)."""
    grpc_port = free_port(config.server.host) if config.load.grpc == GRPC_AUTO else None
    return replace(config.server, source=source, grpc_port=grpc_port)


def bench_source(config: BenchStageConfig, requests: list[BenchRequest], source: str | None = None,
                 hooks: BenchHooks | None = None) -> BenchOutcome:
    """Drive `requests` at a server started on `source` for the run (stopped after it; over its gRPC port
    with `--grpc auto`), or, without a source, at the running one of `config.load.url` (or `.grpc`). An
    interruption ends the run early: the report is partial and says so (`interrupted`)."""
    hooks = hooks or BenchHooks()
    server = _server_for(config, source) if source else None
    stats: dict = {}  # the started server's ready_s and peak_rss_bytes
    with running_server(server, hooks.status, stats) if server else nullcontext(config.load.url) as url:
        load = replace(config.load, url=url, grpc=server.grpc_target if server else config.load.grpc)
        hooks.status(f"{len(requests)} requests to {load.target}, rate {load.describe()['request_rate']}, "
                     f"max concurrency {load.max_concurrency or 'unlimited'}")
        with hooks.progress(len(requests)) as on_result:
            run = run_bench(load, requests, on_result=on_result)
    report = build_report(load, config.dataset, run, server=server.describe() | stats if server else None)
    return BenchOutcome(report, broken_bounds(list(config.fail_on), report))
