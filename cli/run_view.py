"""How `llmopt run` looks: each stage's progress and result, the dry run's plan, the final comparison."""
from __future__ import annotations

from contextlib import contextmanager

from rich.table import Table

from .ui import err, human_bytes, layer_progress, note, out, progress_bar


class ConsoleView:
    """Progress on stderr: a rule per stage, the stage's own live display, its result table (stdout;
    left out with --json, where stdout carries only the final JSON)."""

    def __init__(self, show_results: bool = True):
        self.show_results = show_results

    def stage_start(self, index: int, total: int, spec, refs: list[str], output) -> None:
        err.rule(f"[bold][{index}/{total}] {spec.name}[/bold]: {'; '.join(commands(spec, refs, output))}", align="left")

    def stage_skip(self, index: int, total: int, spec, why: str) -> None:
        err.print(f"[dim][{index}/{total}] {spec.name}: skipped ({why})[/dim]")

    def stage_done(self, spec, seconds: float) -> None:
        note(f"{spec.name} finished in {seconds:.1f} s")

    def note(self, message: str) -> None:
        note(message)

    def artifact(self, spec, art) -> None:
        if not self.show_results:
            return
        from . import prune_cmd, quantize_cmd, shard_cmd

        render = {"quantize": quantize_cmd.render, "prune": prune_cmd.render, "shard": shard_cmd.render}[spec.kind]
        render(art, art.manifest["metrics"])

    def evaluated(self, ref: str, results: dict) -> None:
        if not self.show_results:
            return
        from .eval_cmd import render

        render(ref, results)

    def profiled(self, report: dict) -> None:
        if not self.show_results:
            return
        from llmopt.stages.profile.tables import comparison_table

        t = comparison_table(report)
        table = Table(*t.columns, title=t.title, title_justify="left", caption=t.note or None, caption_justify="left")
        for row in t.rows:
            table.add_row(*row)
        out.print(table)

    def benched(self, report: dict) -> None:
        if not self.show_results:
            return
        from .bench_view import render_report

        render_report(report)

    @contextmanager
    def hooks(self, spec):
        from llmopt.stages.progress import StageHooks

        if spec.kind in ("eval", "profile"):  # no layers to count: one bar for windows / measurements
            with progress_bar(spec.kind) as update:
                yield StageHooks(status=note, window=update)
            return
        with layer_progress(spec.kind) as (status, on_layer, on_window):
            yield StageHooks(status=status, layer=on_layer, window=on_window)

    @contextmanager
    def bench_progress(self, total: int):
        from .bench_view import live_progress

        with live_progress(total, False) as on_result:
            yield on_result


def render_plan(runner, plan, workdir_from: str) -> None:
    """The plan as a table, then the equivalent commands one per line, never wrapped or cut: pasteable."""
    table = Table(title=f"{runner.recipe.name}: plan (dry run) -> {runner.workdir}", title_justify="left")
    for col in ("#", "stage", "output", "action"):
        table.add_column(col)
    for i, p in enumerate(plan, 1):
        action = "[green]skip[/green]" if p.action == "skip" else "[yellow]run[/yellow]"
        table.add_row(str(i), p.spec.name, str(runner.output(p.spec)), f"{action} ({p.why})")
    out.print(table)
    note(f"finished stages are looked for in {runner.workdir} ({workdir_from}; -o DIR for another)")
    out.print("equivalent commands:", style="bold")
    for i, p in enumerate(plan, 1):
        for line in commands(p.spec, [runner.ref(n) for n in p.spec.inputs], runner.output(p.spec)):
            out.print(f"{line}  # {i}. {p.spec.name}", soft_wrap=True, highlight=False, markup=False)


def commands(spec, refs: list[str], output) -> list[str]:
    """The stage as commands a person can paste, one per model where the command reads one: what the run
    does, flags spelled as the subcommand takes them. An artifact stage writes to `output` (--force: the
    run replaces a stale artifact); eval and bench measure each input on its own (bench: a server each)."""
    import shlex

    from llmopt.stages.options import flag

    options = []
    for key, value in spec.given.items():
        if isinstance(value, bool):  # every stage's flag is off by default: false is no flag
            options += [flag(key)] if value else []
        elif isinstance(value, list):
            options += [a for v in value for a in (flag(key), str(v))]
        else:
            options += [flag(key), str(value)]
    if spec.writes_artifact:
        runs = [[*refs, "-o", str(output), "--force"]]
    elif spec.kind == "profile":
        runs = [list(refs)]
    elif spec.kind == "bench":
        runs = [["--server", ref] for ref in refs]
    else:
        runs = [[ref] for ref in refs]
    return [shlex.join(["llmopt", spec.kind, *run, *options]) for run in runs]


def render_summary(summary: dict) -> None:
    table = Table(title=f"comparison ({summary['workdir']})", title_justify="left")
    # a column for each other text some row was measured on (code, chat), after the first text's ppl
    sets = list(dict.fromkeys(s for r in summary["rows"] for s in r.get("perplexity_sets") or {}))
    for col in ("model", "made by", "weights", "ppl", *(f"ppl {s}" for s in sets), "decode tok/s", "out tok/s",
                "p99 TTFT", "p99 TPOT"):
        left = col in ("model", "made by")
        table.add_column(col, justify="left" if left else "right", no_wrap=not left or col == "model")
    notes = set()
    for r in summary["rows"]:
        by_set = r.get("perplexity_sets") or {}
        table.add_row(r["name"], r["made_by"] if r["name"] != "source" else r["ref"], human_bytes(r["size_bytes"]) if r["size_bytes"] else "-",
                      _num(r["perplexity"], ".3f"), *(_num(by_set.get(s), ".3f") for s in sets),
                      _num(r["decode_tok_s"], ".1f"), _num(r["output_tok_s"], ".1f"),
                      _num(r["p99_ttft_ms"], ".0f", " ms"), _num(r["p99_tpot_ms"], ".1f", " ms"))
        for key, label in (("perplexity_note", "ppl"), ("decode_note", "decode tok/s"),
                           ("bench_note", "out tok/s, p99 TTFT / TPOT")):
            if r.get(key):
                notes.add(f"{label}: {r[key]}")
    notes.update(summary["notes"])
    table.caption = "\n".join(sorted(notes)) or None
    table.caption_justify = "left"
    out.print(table)  # in a log, at its natural width (ui.out)


def _num(value, fmt: str, unit: str = "") -> str:
    return "-" if value is None else format(value, fmt) + unit
