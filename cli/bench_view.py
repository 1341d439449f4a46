"""How `llmopt bench` looks: the live progress line, the report tables, the offline table and the comparison table."""
from __future__ import annotations

from contextlib import contextmanager

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .ui import err, out

LATENCY_ROWS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "end-to-end"}
VERDICT_STYLE = {"better": "green", "worse": "yellow", "REGRESSION": "bold red", "same": "dim", "n/a": "dim"}


@contextmanager
def live_progress(total: int, quiet: bool = False):
    """Yields the runner's on_result callback, drawing requests done, failures and output tokens/s."""
    if quiet:
        yield None
        return
    columns = (TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[info]}"))
    tokens = failed = 0
    with Progress(*columns, console=err, transient=False) as progress:
        task = progress.add_task("bench", total=total, info="")

        def on_result(result, done: int, planned: int) -> None:
            nonlocal tokens, failed
            tokens += result.output_tokens
            failed += not result.ok
            rate = tokens / progress.tasks[0].elapsed if progress.tasks[0].elapsed else 0.0
            progress.update(task, completed=done, info=f"failed {failed}  output {rate:,.1f} tok/s")

        yield on_result


def render_report(report: dict) -> None:
    out.print(f"[bold]bench[/bold] {_target(report)}, model {report.get('model_id') or '(server default)'}, "
              f"{report.get('dataset')}", highlight=False)
    summary = Table(show_header=False)
    summary.add_column("metric")
    summary.add_column("value", justify="right")
    for label, value in _summary_rows(report):
        summary.add_row(label, value)
    out.print(summary)
    latency = Table(title="latency (ms)", title_justify="left")
    for column in ("", "mean", "median", "p90", "p99"):
        latency.add_column(column, justify="right" if column else "left")
    for key, label in LATENCY_ROWS.items():
        latency.add_row(label, *(_num(report.get(f"{stat}_{key}_ms")) for stat in ("mean", "median", "p90", "p99")))
    out.print(latency)


def _target(report: dict) -> str:
    """Where the requests went, and how: `http://HOST:PORT/v1/completions over HTTP`, or over gRPC the
    GenerateStream call with the fields of that endpoint."""
    if report.get("protocol") == "grpc":
        return f"{report.get('base_url')} GenerateStream ({report.get('endpoint')} fields) over gRPC"
    return f"{report.get('base_url')}{report.get('endpoint')} over HTTP"


def _summary_rows(report: dict) -> list[tuple[str, str]]:
    rows = [("completed / planned", f"{report['completed']} / {report.get('planned', '?')}"),
            ("failed", str(report["failed"]))]
    rows += [(f"  {kind}", str(n)) for kind, n in (report.get("failures") or {}).items()]
    rows += [("duration", f"{_num(report['duration'])} s"),
             ("request throughput", f"{_num(report['request_throughput'])} req/s")]
    if report.get("slo"):
        slo = ", ".join(f"{k}<={v:g}" for k, v in report["slo"].items())
        rows.append((f"goodput ({slo})", f"{_num(report['request_goodput'])} req/s "
                                         f"({report['goodput_completed']} good)"))
    rows += [("output throughput", f"{_num(report['output_throughput'])} tok/s"),
             ("total token throughput", f"{_num(report['total_token_throughput'])} tok/s"),
             ("input / output tokens", f"{report['total_input_tokens']:,} / {report['total_output_tokens']:,}")]
    return rows


def notes(report: dict) -> list[str]:
    """Things a reader should know about this run, one line each."""
    lines = []
    if report.get("warmup_failed"):
        lines.append(f"warm-up: {report['warmup_failed']} of {report.get('warmup')} requests failed "
                     f"({report.get('warmup_error')})")
    if report.get("unknown_input_lens"):
        lines.append(f"input tokens unknown for {report['unknown_input_lens']} requests (the server reported no "
                     "usage): pass --tokenizer SOURCE to count them")
    if report["completed"] == 0 and report["failed"]:
        kind = next(iter(report["failures"]))
        lines.append(f"every request failed ({kind}); first error: {next(e for e in report['errors'] if e)}")
    return lines


def render_compare(rows, base_name: str, new_name: str, bound: float | None, checks=()) -> None:
    """The comparison table; with ratio bounds (`checks`), NEW/BASE of every row and each bound's verdict."""
    title = "compare (no regression bound)" if bound is None else f"compare (regression bound {bound:.0%})"
    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    for column in (base_name, new_name, "change", "", *(("ratio", "ratio bound") if checks else ())):
        table.add_column(column, justify="right")
    for row in rows:
        change = "" if row.change is None else f"{row.change:+.1%}"
        style = VERDICT_STYLE.get(row.verdict, "")
        cells = [row.metric, _num(row.base), _num(row.new), change,
                 f"[{style}]{row.verdict}[/{style}]" if style else row.verdict]
        if checks:
            cells += ["" if row.ratio is None else f"{row.ratio:.3g}x", _ratio_verdicts(row.metric, checks)]
        table.add_row(*cells)
    out.print(table)


def _ratio_verdicts(metric: str, checks) -> str:
    """'>= 3x ok', '<= 1x FAIL', both for a metric bounded both ways."""
    return ", ".join(f"{c.bound} ok" if c.holds else f"{c.bound} [bold red]FAIL[/bold red]"
                     for c in checks if c.bound.metric == metric)


def render_offline(report: dict) -> None:
    """`llmopt bench --offline`'s table: one row per engine and source."""
    batch1 = report["mode"] == "batch-1 decode"
    title = (f"offline {report['mode']}: {report['dataset']}, {report['num_prompts']} prompts, {report['dtype']}, "
             f"{report['threads']} thread(s)")
    table = Table(title=title, title_justify="left")
    columns = (["engine", "source", "ms/token", "tok/s", "x transformers"] if batch1 else
               ["engine", "source", "output tokens", "seconds", "output tok/s", "x transformers", "identical",
                "median TTFT ms", "median TPOT ms"])
    for column in columns:
        table.add_column(column, justify="left" if column in ("engine", "source") else "right")
    for row in report["rows"]:
        ratio = "-" if row["x_transformers"] is None else f"{row['x_transformers']:.2f}x"
        if batch1:
            table.add_row(row["engine"], row["source"], _num(row["ms_per_token"]), _num(row["tok_s"]), ratio)
            continue
        table.add_row(row["engine"], row["source"], _num(row["output_tokens"]), _num(row["seconds"]),
                      _num(row["output_tok_s"]), ratio, _identical(row, report["num_prompts"]),
                      _num(row.get("median_ttft_ms")), _num(row.get("median_tpot_ms")))
    out.print(table)
    for row in report["rows"]:
        if row.get("spec_acceptance_rate") is not None:
            out.print(f"speculative ({report.get('speculative')}) on {row['source']}: "
                      f"{row['spec_acceptance_rate']:.0%} of drafts accepted, "
                      f"{row['spec_mean_accepted_length']:.2f} tokens per verify step")


def _identical(row: dict, total: int) -> str:
    """Sequences identical to transformers' (and, after the first source, to the first source's)."""
    parts = []
    if row.get("identical_to_transformers") is not None:
        parts.append(f"{row['identical_to_transformers']}/{total}")
    if row.get("identical_to_first") is not None:
        parts.append(f"{row['identical_to_first']}/{total} vs first")
    return ", ".join(parts) or "-"


def _num(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.2f}" if isinstance(value, float) else str(value)
