"""Summarize `make bench` reports: one row per run and concurrency, with ratios to a baseline.

Reads DIR/NAME-cC.json (written by `llmopt bench --json`), prints a Markdown table and writes it
to DIR/summary.md. "x baseline" is the run's output throughput divided by the baseline run's
(--baseline NAME) at the same concurrency.

    python scripts/bench_summary.py bench-results --baseline hf-base
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

NAME = re.compile(r"^(?P<name>.+)-c(?P<c>\d+)\.json$")
COLUMNS = ("run", "concurrency", "ok/failed", "output tok/s", "req/s", "median TTFT ms", "p99 TTFT ms",
           "median TPOT ms", "median ITL ms", "median e2e ms", "x baseline")


def load(directory: Path) -> dict[tuple[str, int], dict]:
    reports = {}
    for path in sorted(directory.glob("*.json")):
        match = NAME.match(path.name)
        if match:
            reports[(match["name"], int(match["c"]))] = json.loads(path.read_text())
    return reports


def fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def row(name: str, c: int, r: dict, base: dict | None) -> list[str]:
    ratio = None
    if base and base.get("output_throughput") and r.get("output_throughput") is not None:
        ratio = r["output_throughput"] / base["output_throughput"]
    return [name, str(c), f"{r['completed']}/{r['failed']}", fmt(r.get("output_throughput")),
            fmt(r.get("request_throughput"), 2), fmt(r.get("median_ttft_ms")), fmt(r.get("p99_ttft_ms")),
            fmt(r.get("median_tpot_ms")), fmt(r.get("median_itl_ms")), fmt(r.get("median_e2el_ms")),
            "-" if ratio is None else f"{ratio:.1f}x"]


def table(reports: dict[tuple[str, int], dict], baseline: str) -> str:
    names = sorted({n for n, _ in reports}, key=lambda n: (n != baseline, n))
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for name in names:
        for c in sorted(c for n, c in reports if n == name):
            lines.append("| " + " | ".join(row(name, c, reports[(name, c)], reports.get((baseline, c)))) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--baseline", default="hf-base", help="run name the ratios divide by")
    args = parser.parse_args()
    reports = load(args.directory)
    if not reports:
        raise SystemExit(f"no NAME-cC.json reports in {args.directory}")
    any_report = next(iter(reports.values()))
    text = (f"{table(reports, args.baseline)}\n\n{any_report.get('dataset')}, {any_report.get('num_prompts')} prompts, "
            f"max_tokens {any_report.get('output_len')} (ignore_eos), request rate {any_report.get('request_rate')}\n")
    (args.directory / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
