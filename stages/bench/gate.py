"""CI gating: bounds on one report (--fail-on) and regressions between two (compare).

`--fail-on "p99_ttft_ms>500,output_throughput<50"` lists failure conditions: the run fails when
p99 TTFT is above 500 ms or output throughput below 50 tok/s. `compare` knows which metrics are
better high (throughputs, completed) and which better low (latencies, failed).
"""
from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass

from ..errors import ConfigError
from .metrics import THROUGHPUTS, metric_names

OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
_BOUND = re.compile(r"^\s*([A-Za-z0-9_]+)\s*(>=|<=|>|<)\s*([-+0-9.eE]+|inf)\s*$")
HIGHER_IS_BETTER = {*THROUGHPUTS, "completed", "goodput_completed"}


def direction(metric: str) -> int | None:
    """+1 when higher is better, -1 when lower is better, None when neither (counts, duration)."""
    if metric in HIGHER_IS_BETTER:
        return 1
    if metric == "failed" or metric.endswith("_ms"):
        return -1
    return None


@dataclass(frozen=True)
class Bound:
    metric: str
    op: str
    value: float

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value:g}"

    def broken_by(self, report: dict) -> str | None:
        """Why this bound fails on `report`, or None when it holds."""
        measured = report.get(self.metric)
        if measured is None:
            return f"{self.metric} is not available in this run (no completed requests, or no --slo), so {self} fails"
        if OPS[self.op](measured, self.value):
            return f"{self.metric} = {measured:.6g} {self.op} {self.value:g}"
        return None


def parse_fail_on(text: str | None) -> list[Bound]:
    """'p99_ttft_ms>500,output_throughput<50' -> bounds; a bad item is a one-line ConfigError."""
    known = set(metric_names())
    bounds = []
    for item in [p for p in (text or "").split(",") if p.strip()]:
        match = _BOUND.match(item)
        if not match:
            raise ConfigError(f"--fail-on {item.strip()!r}: write METRIC>VALUE or METRIC<VALUE "
                              "(e.g. --fail-on 'p99_ttft_ms>500,output_throughput<50')")
        metric, op, value = match.groups()
        if metric not in known:
            raise ConfigError(f"--fail-on {item.strip()!r}: unknown metric {metric}; known: request_throughput, "
                              "output_throughput, total_token_throughput, request_goodput, failed, completed, "
                              "{mean,median,std,p90,p99}_{ttft,tpot,itl,e2el}_ms")
        try:
            bounds.append(Bound(metric, op, float(value)))
        except ValueError:
            raise ConfigError(f"--fail-on {item.strip()!r}: {value!r} is not a number") from None
    return bounds


def broken_bounds(bounds: list[Bound], report: dict) -> list[str]:
    return [why for why in (b.broken_by(report) for b in bounds) if why]


def parse_fraction(text: str) -> float:
    """'10%' or '0.1' -> 0.1."""
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100.0 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ConfigError(f"--max-regression {text!r}: give a percentage like 10%") from None
    if not 0 <= value < math.inf or (not raw.endswith("%") and value > 1):
        raise ConfigError(f"--max-regression {text!r}: give a percentage like 10% (or a fraction like 0.1)")
    return value


@dataclass(frozen=True)
class Row:
    metric: str
    base: float | None
    new: float | None
    change: float | None  # (new - base) / base; None when base is 0 or either is missing
    verdict: str  # "better", "worse", "REGRESSION", "same", "" (no direction), "n/a"


def compare(base: dict, new: dict, max_regression: float, metrics: list[str] | None = None) -> list[Row]:
    """One row per metric found in both reports; a regression is a change for the worse beyond the bound."""
    names = metrics or [m for m in metric_names() if m in base or m in new]
    unknown = [m for m in names if m not in metric_names()]
    if unknown:
        raise ConfigError(f"--metric {unknown[0]}: unknown metric; see llmopt bench --help for --fail-on names")
    return [_row(m, base.get(m), new.get(m), max_regression) for m in names]


def _row(metric: str, base, new, bound: float) -> Row:
    if not isinstance(base, (int, float)) or not isinstance(new, (int, float)):
        return Row(metric, base, new, None, "n/a")
    change = (new - base) / abs(base) if base else None
    better = direction(metric)
    if better is None or new == base:
        return Row(metric, base, new, change, "" if better is None else "same")
    worse_by = (base - new) * better  # > 0: worse
    if worse_by <= 0:
        return Row(metric, base, new, change, "better")
    beyond = worse_by > bound * abs(base) if base else True
    return Row(metric, base, new, change, "REGRESSION" if beyond else "worse")
