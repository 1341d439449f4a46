"""The registry /metrics renders, through prometheus_client.

One CollectorRegistry per app (tests run several apps in one process; the global REGISTRY would
refuse the second app's names), holding the process, platform and gc collectors beside ours.

Multiprocess mode: with $PROMETHEUS_MULTIPROC_DIR set before the server starts, prometheus_client
keeps the counters and histograms of every process that uses them in files there, and /metrics
sums them (MultiProcessCollector). The values the engine owns are read at scrape time by the serve
process, which owns the engine, so they are never in the files.
"""
from __future__ import annotations

import os

from prometheus_client import (CONTENT_TYPE_PLAIN_0_0_4, GCCollector, PlatformCollector, ProcessCollector,
                               disable_created_metrics, generate_latest)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from ...errors import ConfigError

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # the text format generate_latest writes
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

disable_created_metrics()  # no `_created` series beside each counter and histogram, as vLLM


def multiprocess_dir() -> str | None:
    """The multiprocess directory, or None when the variable is unset; a ConfigError if it is no directory."""
    path = os.environ.get(MULTIPROC_ENV) or os.environ.get(MULTIPROC_ENV.lower())
    if path and not os.path.isdir(path):
        raise ConfigError(f"${MULTIPROC_ENV} is {path!r}, which is not a directory: create it (empty) "
                          f"before starting the server, or unset the variable")
    return path or None


def scrape_registry(owned: CollectorRegistry, live: Collector, multiproc: str | None) -> CollectorRegistry:
    """What /metrics renders: `owned` (our counters and histograms) or, in multiprocess mode (`multiproc`, the
    directory), every process's values from the directory; plus `live` (read at scrape time) and the runtime
    collectors."""
    registry = owned
    if multiproc is not None:
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
    registry.register(live)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)  # registers nothing in multiprocess mode (prometheus_client's rule)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
