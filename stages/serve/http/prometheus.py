"""A small Prometheus text-format writer: counters, gauges and histograms with optional labels.

Everything is updated from the server's event loop, so there is no locking; values the engine
owns (running, waiting, cache usage, preemptions, ...) are read at scrape time instead.
"""
from __future__ import annotations

import math
from bisect import bisect_left


def _labels(pairs: dict[str, str]) -> str:
    if not pairs:
        return ""
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in pairs.items())
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def header(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def sample(name: str, value: float, labels: dict[str, str] | None = None) -> str:
    return f"{name}{_labels(labels or {})} {_number(value)}"


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help = name, help_text
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines, cumulative = header(self.name, "histogram", self.help), 0
        for bound, count in zip(self.buckets + (math.inf,), self.counts):
            cumulative += count
            lines.append(sample(f"{self.name}_bucket", cumulative, {"le": _number(bound)}))
        lines += [sample(f"{self.name}_sum", self.sum), sample(f"{self.name}_count", self.count)]
        return lines


class Counter:
    """A counter with an optional label: `inc(1, "stop")` for the label value "stop"."""

    def __init__(self, name: str, help_text: str, label: str | None = None):
        self.name, self.help, self.label = name, help_text, label
        self.values: dict[str | None, float] = {} if label else {None: 0.0}

    def inc(self, amount: float = 1.0, label_value: str | None = None) -> None:
        self.values[label_value] = self.values.get(label_value, 0.0) + amount

    def render(self) -> list[str]:
        return header(self.name, "counter", self.help) + [
            sample(self.name, v, {self.label: k} if self.label else None) for k, v in sorted(
                self.values.items(), key=lambda kv: str(kv[0]))]


def gauge(name: str, help_text: str, value: float) -> list[str]:
    return header(name, "gauge", help_text) + [sample(name, value)]


def counter_snapshot(name: str, help_text: str, values: dict[str, float] | float,
                     label: str | None = None) -> list[str]:
    """A counter whose value is owned elsewhere (the engine) and read at scrape time."""
    if label is None:
        return header(name, "counter", help_text) + [sample(name, values)]
    return header(name, "counter", help_text) + [sample(name, v, {label: k}) for k, v in sorted(values.items())]
