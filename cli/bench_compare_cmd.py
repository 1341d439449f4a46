"""llmopt bench compare BASE NEW: two bench reports side by side; exit 1 on a regression beyond the bound."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from . import bench_view
from .ui import err, note, out

SAME_RUN = ("dataset", "num_prompts", "request_rate", "max_concurrency", "endpoint")  # else the numbers do not compare


def run(base: Annotated[Path, typer.Argument(help="The reference report (JSON).")],
        new: Annotated[Path, typer.Argument(help="The report to check (JSON).")],
        max_regression: Annotated[str, typer.Option("--max-regression", help="Allowed change for the worse, e.g. 10%.")] = "10%",
        metric: Annotated[Optional[list[str]], typer.Option("--metric", help="Only these metrics (repeatable).")] = None) -> None:
    from llmopt.stages.bench.gate import compare as compare_reports
    from llmopt.stages.bench.gate import parse_fraction
    from llmopt.stages.bench.report import load_report

    bound = parse_fraction(max_regression)
    old_report, new_report = load_report(base), load_report(new)
    rows = compare_reports(old_report, new_report, bound, metric)
    bench_view.render_compare(rows, base.name, new.name, bound)
    for key in SAME_RUN:
        if old_report.get(key) != new_report.get(key):
            note(f"the runs differ in {key}: {old_report.get(key)} vs {new_report.get(key)}")
    regressions = [r for r in rows if r.verdict == "REGRESSION"]
    for r in regressions:
        err.print(f"[bold red]regression:[/bold red] {r.metric} {r.base:.6g} -> {r.new:.6g} "
                  f"({'' if r.change is None else f'{r.change:+.1%}, '}bound {bound:.0%})", highlight=False)
    if not regressions:
        out.print(f"no regression beyond {bound:.0%}")
    raise typer.Exit(1 if regressions else 0)
