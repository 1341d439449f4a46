"""llmopt run RECIPE: a whole pipeline from one YAML file, cached and resumable, then one comparison table."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .run_view import ConsoleView, render_plan, render_summary
from .ui import err, note, print_json


def run(recipe: Annotated[str, typer.Argument(help="Recipe file, or a built-in recipe name (smollm2-w4a16-gptq).")],
        workdir: Annotated[Optional[Path], typer.Option("--output", "-o", help="Work directory (default: the "
                                                        "recipe's workdir:, else out/<recipe name>).")] = None,
        start: Annotated[Optional[str], typer.Option("--from", help="Rerun this stage and every stage after it.")] = None,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate and show what would run or be skipped.")] = False,
        json: Annotated[bool, typer.Option("--json", help="Print the final comparison as JSON on stdout.")] = False) -> None:
    from llmopt.recipes.runner import RecipeRunner, StageFailed
    from llmopt.recipes.spec import default_workdir, load_recipe

    spec = load_recipe(recipe)
    workdir_from = "-o" if workdir else "the recipe's workdir:" if spec.workdir else "the default, out/<recipe name>"
    workdir = workdir or default_workdir(spec)
    runner = RecipeRunner(spec, workdir, ConsoleView(show_results=not json))
    if dry_run:
        render_plan(runner, runner.plan(start), workdir_from)
        return
    note(f"recipe {spec.name} ({spec.path}) -> {workdir}")
    try:
        outcomes = runner.run(start)
    except StageFailed as e:  # e.g. a bench --fail-on bound: a result, not bad input
        err.print(f"[bold red]failed:[/bold red] {e}", highlight=False)
        raise typer.Exit(1) from None
    summary = runner.summary()
    ran = sum(o.action == "ran" for o in outcomes)
    _write_summary(workdir, summary)
    if json:
        print_json(summary)
        return
    render_summary(summary)
    note(f"{ran} stage(s) ran, {len(outcomes) - ran} skipped as up to date; summary in {workdir / 'summary.json'}")


def _write_summary(workdir: Path, summary: dict) -> None:
    import json as jsonlib

    from llmopt.recipes.runner import SUMMARY

    tmp = workdir / f".{SUMMARY}.tmp"
    tmp.write_text(jsonlib.dumps(summary, indent=2))
    tmp.replace(workdir / SUMMARY)
