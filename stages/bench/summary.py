"""`llmopt bench summary DIR`: one Markdown table of the reports `make bench` writes (DIR/NAME-cC.json,
one per run and concurrency), with the protocol each ran over (http or grpc), each run's output throughput as a
multiple of a baseline run's at the same concurrency, and, for servers the bench started itself, their
start-up time and peak memory."""
from __future__ import annotations

import re
from pathlib import Path

from ..errors import DataError
from .report import load_report

NAME = re.compile(r"^(?P<name>.+)-c(?P<c>\d+)\.json$")
COLUMNS = ("run", "protocol", "concurrency", "ok/failed", "output tok/s", "req/s", "median TTFT ms", "p99 TTFT ms",
           "median TPOT ms", "median ITL ms", "median e2e ms", "x baseline", "ready s", "peak RSS MiB")


def load_reports(directory: Path) -> dict[tuple[str, int], dict]:
    """{(run name, concurrency): report} of every NAME-cC.json in `directory`."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"{directory}: no such directory of bench reports")
    reports = {}
    for path in sorted(directory.glob("*.json")):
        match = NAME.match(path.name)
        if match:
            reports[(match["name"], int(match["c"]))] = load_report(path)
    if not reports:
        raise DataError(f"{directory}: no NAME-cC.json reports (write them with llmopt bench --json DIR/NAME-cC.json)")
    return reports


def ratio(report: dict, base: dict | None) -> float | None:
    """The report's output throughput over the baseline's; None when either is missing."""
    if not base or not base.get("output_throughput") or report.get("output_throughput") is None:
        return None
    return report["output_throughput"] / base["output_throughput"]


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _row(name: str, c: int, r: dict, base: dict | None) -> list[str]:
    x = ratio(r, base)
    server = r.get("server") or {}
    rss = server.get("peak_rss_bytes")
    protocol = r.get("protocol") or "http"  # none: an older llmopt report, or vLLM's, both over HTTP
    return [name, protocol, str(c), f"{r['completed']}/{r['failed']}", _fmt(r.get("output_throughput")),
            _fmt(r.get("request_throughput"), 2), _fmt(r.get("median_ttft_ms")), _fmt(r.get("p99_ttft_ms")),
            _fmt(r.get("median_tpot_ms")), _fmt(r.get("median_itl_ms")), _fmt(r.get("median_e2el_ms")),
            "-" if x is None else f"{x:.1f}x", _fmt(server.get("ready_s"), 2), _fmt(rss and rss / 2**20, 0)]


def summary_table(reports: dict[tuple[str, int], dict], baseline: str) -> str:
    """The Markdown table: the baseline's rows first, then every run by name and concurrency."""
    names = sorted({n for n, _ in reports}, key=lambda n: (n != baseline, n))
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for name in names:
        for c in sorted(c for n, c in reports if n == name):
            lines.append("| " + " | ".join(_row(name, c, reports[(name, c)], reports.get((baseline, c)))) + " |")
    return "\n".join(lines)


def write_summary(directory: Path, baseline: str) -> str:
    """The table and a line on the load, written to DIR/summary.md; returns the text."""
    reports = load_reports(directory)
    first = next(iter(reports.values()))
    text = (f"{summary_table(reports, baseline)}\n\n{first.get('dataset')}, {first.get('num_prompts')} prompts, "
            f"max_tokens {first.get('output_len')} (ignore_eos), request rate {first.get('request_rate')}\n")
    if baseline not in {n for n, _ in reports}:  # a table without ratios is still a summary
        text += f"no run named {baseline} (--baseline): no ratios\n"
    (Path(directory) / "summary.md").write_text(text)
    return text
