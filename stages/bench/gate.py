"""CI gating: bounds on one report (--fail-on), regressions and ratio bounds between two (compare).

`--fail-on "p99_ttft_ms>500,output_throughput<50"` lists failure conditions: the run fails when
p99 TTFT is above 500 ms or output throughput below 50 tok/s. `compare` knows which metrics are
better high (throughputs, completed) and which better low (latencies, failed). `--min-ratio
output_throughput=3` and `--max-ratio p50_ttft_ms=1` bound NEW/BASE, for a BASE measured in the same
job (a reference server on the same runner), where absolute numbers would move with the machine.
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
KNOWN_METRICS = ("request_throughput, output_throughput, total_token_throughput, request_goodput, failed, completed, "
                 "{mean,median,p50,std,p90,p99}_{ttft,tpot,itl,e2el}_ms")
DEFAULT_MAX_REGRESSION = "10%"


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


def resolve_metric(name: str) -> str:
    """The report's name for a metric: `p50_X` is `median_X` (reports spell the 50th percentile as vLLM does)."""
    return f"median_{name[4:]}" if name.startswith("p50_") else name


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
        metric = resolve_metric(metric)
        if metric not in known:
            raise ConfigError(f"--fail-on {item.strip()!r}: unknown metric {metric}; known: {KNOWN_METRICS}")
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

    @property
    def ratio(self) -> float | None:
        """new / base; None when base is 0 or either is missing."""
        numbers = isinstance(self.base, (int, float)) and isinstance(self.new, (int, float))
        return self.new / self.base if numbers and self.base else None


def compare(base: dict, new: dict, max_regression: float | None, metrics: list[str] | None = None) -> list[Row]:
    """One row per metric found in either report; a regression is a change for the worse beyond the bound
    (None: no bound, a change for the worse is only "worse")."""
    names = [resolve_metric(m) for m in metrics] if metrics else [m for m in metric_names() if m in base or m in new]
    unknown = [m for m in names if m not in metric_names()]
    if unknown:
        raise ConfigError(f"--metric {unknown[0]}: unknown metric; see llmopt bench --help for --fail-on names")
    return [_row(m, base.get(m), new.get(m), max_regression) for m in names]


def _row(metric: str, base, new, bound: float | None) -> Row:
    if not isinstance(base, (int, float)) or not isinstance(new, (int, float)):
        return Row(metric, base, new, None, "n/a")
    change = (new - base) / abs(base) if base else None
    better = direction(metric)
    if better is None or new == base:
        return Row(metric, base, new, change, "" if better is None else "same")
    worse_by = (base - new) * better  # > 0: worse
    if worse_by <= 0:
        return Row(metric, base, new, change, "better")
    if bound is None:
        return Row(metric, base, new, change, "worse")
    beyond = worse_by > bound * abs(base) if base else True
    return Row(metric, base, new, change, "REGRESSION" if beyond else "worse")


def regression_bound(text: str | None, ratio_bounds: list) -> float | None:
    """--max-regression's bound, or None when it is off: it applies when given, or when no ratio bound is
    (a ratio gate against a reference server has no use for a regression bound against that server)."""
    if text is None and ratio_bounds:
        return None
    return parse_fraction(DEFAULT_MAX_REGRESSION if text is None else text)


@dataclass(frozen=True)
class RatioBound:
    metric: str
    option: str  # "--min-ratio": NEW/BASE >= value; "--max-ratio": NEW/BASE <= value
    value: float

    def __str__(self) -> str:
        return f"{'>=' if self.option == '--min-ratio' else '<='} {self.value:g}x"

    def holds(self, ratio: float) -> bool:
        return ratio >= self.value if self.option == "--min-ratio" else ratio <= self.value


def parse_ratios(items: list[str] | None, option: str) -> list[RatioBound]:
    """['output_throughput=3,request_throughput=2', 'p50_ttft_ms=1'] -> bounds; a bad item is a one-line ConfigError."""
    known = set(metric_names())
    bounds = []
    for item in [p.strip() for text in items or () for p in text.split(",") if p.strip()]:
        metric, equals, value = (part.strip() for part in item.partition("="))
        if not equals:
            raise ConfigError(f"{option} {item!r}: write METRIC=RATIO (e.g. {option} output_throughput=3)")
        if resolve_metric(metric) not in known:
            raise ConfigError(f"{option} {item!r}: unknown metric {metric or '(none)'}; known: {KNOWN_METRICS}")
        bounds.append(RatioBound(resolve_metric(metric), option, _positive(value, option, item)))
    return bounds


def _positive(text: str, option: str, item: str) -> float:
    try:
        value = float(text[:-1] if text.lower().endswith("x") else text)
    except ValueError:
        raise ConfigError(f"{option} {item!r}: {text!r} is not a number; give NEW/BASE as a positive ratio, "
                          "e.g. 3 or 0.5") from None
    if not 0 < value < math.inf:
        raise ConfigError(f"{option} {item!r}: the ratio NEW/BASE must be a positive finite number (got {text})")
    return value


@dataclass(frozen=True)
class RatioCheck:
    bound: RatioBound
    base: float
    new: float | None  # None: the new run has no value (no completed request): the bound fails
    ratio: float | None

    @property
    def holds(self) -> bool:
        return self.ratio is not None and self.bound.holds(self.ratio)

    def __str__(self) -> str:
        """One line: the metric, both values, the ratio and the bound."""
        bound = f"{self.bound.option} {self.bound.value:g}"
        if self.ratio is None:
            return f"{self.bound.metric} {self.base:.6g} -> null (no completed request in the new run), {bound} fails"
        side = "meets" if self.holds else "below" if self.bound.option == "--min-ratio" else "above"
        return f"{self.bound.metric} {self.base:.6g} -> {self.new:.6g} = {self.ratio:.3g}x, {side} {bound}"


def check_ratios(bounds: list[RatioBound], base: dict, new: dict,
                 names: tuple[str, str] = ("BASE", "NEW")) -> list[RatioCheck]:
    """Each bound's NEW/BASE; a metric absent from a report, or null or 0 in the base, is a ConfigError
    (`names`: the reports' names for its message). A null in NEW (no completed request) fails the bound."""
    checks = []
    for bound in bounds:
        where = f"{bound.option} {bound.metric}"
        for report, name in ((base, names[0]), (new, names[1])):
            if bound.metric not in report:
                raise ConfigError(f"{where}: {name} has no {bound.metric}; bound a metric both reports hold")
        value, measured = base[bound.metric], new[bound.metric]
        if not isinstance(value, (int, float)) or not value:
            shown = "null" if value is None else f"{value:g}" if isinstance(value, (int, float)) else repr(value)
            raise ConfigError(f"{where}: {names[0]} has {bound.metric} = {shown}, so NEW/BASE is undefined; "
                              "bound a metric the base measured as non-zero")
        ratio = measured / value if isinstance(measured, (int, float)) else None
        checks.append(RatioCheck(bound, value, measured if ratio is not None else None, ratio))
    return checks
