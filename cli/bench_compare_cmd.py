"""llmopt bench compare BASE NEW: two bench reports side by side; exit 1 on a regression beyond the bound,
or on a NEW/BASE ratio outside --min-ratio / --max-ratio."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from . import bench_view
from .ui import err, note, out

SAME_RUN = ("dataset", "num_prompts", "request_rate", "max_concurrency", "endpoint")  # else the numbers do not compare
RATIO_HELP = "NEW/BASE must be {} this, METRIC=RATIO (repeatable or comma-separated), e.g. {}."


def run(base: Annotated[Path, typer.Argument(help="The reference report (JSON).")],
        new: Annotated[Path, typer.Argument(help="The report to check (JSON).")],
        max_regression: Annotated[Optional[str], typer.Option(
            "--max-regression", help="Allowed change for the worse, e.g. 10% (default 10%; off when only ratio "
                                     "bounds are given).")] = None,
        metric: Annotated[Optional[list[str]], typer.Option(
            "--metric", help="Only these metrics (repeatable).")] = None,
        min_ratio: Annotated[Optional[list[str]], typer.Option(
            "--min-ratio", help=RATIO_HELP.format("at least", "output_throughput=3"))] = None,
        max_ratio: Annotated[Optional[list[str]], typer.Option(
            "--max-ratio", help=RATIO_HELP.format("at most", "p50_ttft_ms=1.0"))] = None) -> None:
    from llmopt.stages.bench.gate import check_ratios, parse_ratios, regression_bound
    from llmopt.stages.bench.gate import compare as compare_reports
    from llmopt.stages.bench.report import load_report

    ratios = parse_ratios(min_ratio, "--min-ratio") + parse_ratios(max_ratio, "--max-ratio")
    bound = regression_bound(max_regression, ratios)
    old_report, new_report = load_report(base), load_report(new)
    checks = check_ratios(ratios, old_report, new_report, (base.name, new.name))
    shown = metric and [*metric, *(r.metric for r in ratios)]  # a bounded ratio is always in the table
    rows = compare_reports(old_report, new_report, bound, list(dict.fromkeys(shown)) if shown else None)
    bench_view.render_compare(rows, base.name, new.name, bound, checks)
    for key in SAME_RUN:
        if old_report.get(key) != new_report.get(key):
            note(f"the runs differ in {key}: {old_report.get(key)} vs {new_report.get(key)}")
    failed = _report_failures(rows, bound, checks)
    raise typer.Exit(1 if failed else 0)


def _report_failures(rows, bound: float | None, checks) -> bool:
    """One line per broken bound on stderr, or one summary line on stdout; whether any broke."""
    regressions = [r for r in rows if r.verdict == "REGRESSION"]
    for r in regressions:
        err.print(f"[bold red]regression:[/bold red] {r.metric} {r.base:.6g} -> {r.new:.6g} "
                  f"({'' if r.change is None else f'{r.change:+.1%}, '}bound {bound:.0%})", highlight=False)
    broken = [c for c in checks if not c.holds]
    for c in broken:
        err.print(f"[bold red]ratio:[/bold red] {c}", highlight=False)
    if bound is not None and not regressions:
        out.print(f"no regression beyond {bound:.0%}")
    if checks and not broken:
        out.print(f"ratio bounds hold: {'; '.join(str(c) for c in checks)}", highlight=False)
    return bool(regressions or broken)
