"""Console helpers: one stderr console for progress and errors, stdout for results."""
from __future__ import annotations

import json
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

out = Console()
err = Console(stderr=True)


def print_json(data) -> None:
    print(json.dumps(data, indent=2, default=str))


def note(message: str) -> None:
    err.print(f"[dim]{message}[/dim]")


@contextmanager
def progress_bar(description: str):
    """Yields a callback(done, total) that drives a bar with ETA on stderr."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=False) as progress:
        task = progress.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield update


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


@contextmanager
def layer_progress(stage: str):
    """Yields (status, on_layer, on_window) callbacks driving one live display on stderr."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
    with Progress(*columns, console=err) as progress:
        layers = progress.add_task(f"{stage}: layers", total=None, info="")
        windows = progress.add_task("eval windows", total=None, info="", visible=False)

        def status(message: str) -> None:
            progress.console.print(f"[dim]{message}[/dim]")
            progress.update(windows, visible=False, completed=0)

        def on_layer(report, total: int) -> None:
            progress.update(layers, completed=report.index + 1, total=total, info=_layer_info(report.stats))

        def on_window(done: int, total: int) -> None:
            progress.update(windows, completed=done, total=total, visible=True)

        yield status, on_layer, on_window


def _layer_info(stats: dict) -> str:
    for key in ("rel_weight_error", "gptq_loss"):
        if stats.get(key):
            values = list(stats[key].values())
            return f"{key} mean {sum(values) / len(values):.4g}"
    return ""


def run_stage(stage: str, run, as_json: bool, render) -> None:
    """Run a model-rewriting stage (`run(hooks) -> Artifact`) under one live display, then print
    its result as JSON or through `render(artifact, metrics)`."""
    from llmopt.stages.progress import StageHooks

    with layer_progress(stage) as (status, on_layer, on_window):
        art = run(StageHooks(status=status, layer=on_layer, window=on_window))
    metrics = art.manifest["metrics"]
    if as_json:
        print_json({"path": str(art.path), "content_hash": art.content_hash, "metrics": metrics})
        return
    render(art, metrics)
