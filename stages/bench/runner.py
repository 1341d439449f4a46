"""Drive the load: warm-up, arrivals (Poisson or gamma), a concurrency cap, and results as they finish.

The load is the same over either protocol: the run opens one session (client.http_session, or
grpc_client.grpc_session with --grpc) and sends every request, warm-up included, through it.

An interruption (Ctrl-C, SIGTERM) ends the run early and returns what finished so far, marked
`interrupted`, so the caller can still report it.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from typing import AsyncContextManager, Callable

import httpx

from ..errors import ConfigError
from .client import RequestResult, Session, http_session
from .config import GRPC_AUTO, BenchConfig
from .dataset import BenchRequest

WARMUP_MAX_TOKENS = 16


class Clock:
    """Where the bench reads time and waits; tests pass a scripted one."""

    def now(self) -> float:
        return time.perf_counter()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@dataclass
class BenchRun:
    planned: int
    results: list[RequestResult] = field(default_factory=list)  # finished requests, in finish order
    duration: float = 0.0  # seconds from the first send to the last finish (or the interruption)
    interrupted: bool = False
    model: str | None = None
    warmup_failed: int = 0
    warmup_error: str | None = None


OnResult = Callable[[RequestResult, int, int], None]  # (result, finished, planned)


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times in seconds after the start: the first at 0, then gamma-distributed gaps with mean
    1/rate and shape `burstiness` (1: exponential, a Poisson process; <1 burstier; >1 more even)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return offsets


def run_bench(config: BenchConfig, requests: list[BenchRequest], on_result: OnResult | None = None,
              transport: httpx.AsyncBaseTransport | None = None, clock: Clock | None = None) -> BenchRun:
    """Send `requests` to the server in `config` (over gRPC when `config.grpc` is set, else HTTP, where
    `transport` can stand in for the network) and time each; returns even when interrupted."""
    config.validate()
    if not (config.url or config.grpc) or config.grpc == GRPC_AUTO:
        raise ConfigError("no server to bench: give --url URL (or --grpc HOST:PORT) of a running server, "
                          "or --server SOURCE")
    clock = clock or Clock()
    run = BenchRun(planned=len(requests))
    started: list[float] = []
    loop = asyncio.new_event_loop()
    main = loop.create_task(_main(config, requests, run, started, on_result, transport, clock))
    try:
        loop.run_until_complete(main)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM, wherever it lands: keep what finished
        run.interrupted = True
        run.duration = clock.now() - started[0] if started else 0.0
        _cancel_all(loop, main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
    return run


def _cancel_all(loop: asyncio.AbstractEventLoop, main: asyncio.Task) -> None:
    """Cancel the requests in flight and let them close their connections."""
    for _ in range(3):  # an interrupt can surface again from a task that is unwinding
        tasks = asyncio.all_tasks(loop)
        if not tasks:
            break
        for task in tasks:
            task.cancel()
        try:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        except KeyboardInterrupt:
            continue
    if main.done() and not main.cancelled():
        main.exception()  # retrieved: no "exception was never retrieved" at exit


def _session(config: BenchConfig, transport, clock: Clock) -> AsyncContextManager[Session]:
    if config.grpc:
        from .grpc_client import grpc_session  # here: grpc loads only for a run over gRPC

        return grpc_session(config, clock.now)
    return http_session(config, clock.now, transport)


async def _main(config: BenchConfig, requests: list[BenchRequest], run: BenchRun, started: list[float],
                on_result: OnResult | None, transport, clock: Clock) -> None:
    async with _session(config, transport, clock) as session:
        run.model = session.model
        await _warmup(session, requests, config.warmup, run)
        gate = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None

        async def one(request: BenchRequest) -> None:
            if gate is None:
                result = await session.send(request, started[0])
            else:
                async with gate:
                    result = await session.send(request, started[0])
            run.results.append(result)
            if on_result:
                on_result(result, len(run.results), run.planned)

        started.append(clock.now())
        tasks = []
        for request, at in zip(requests, arrival_offsets(len(requests), config.request_rate,
                                                         config.burstiness, config.seed)):
            delay = started[0] + at - clock.now()
            if delay > 0:
                await clock.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        await asyncio.gather(*tasks)
        run.duration = clock.now() - started[0]


async def _warmup(session: Session, requests: list[BenchRequest], count: int, run: BenchRun) -> None:
    """A few untimed requests first (short replies), so start-up costs stay out of the numbers."""
    for i in range(min(count, len(requests)) if requests else 0):
        request = requests[i]
        short = BenchRequest(request.prompt, request.prompt_len, min(request.output_len, WARMUP_MAX_TOKENS))
        result = await session.send(short, 0.0)
        if not result.ok:
            run.warmup_failed += 1
            run.warmup_error = f"{result.error}: {result.detail}"
