"""Console helpers: one stderr console for progress and errors, stdout for results.

Where a stream is not a terminal (CI, nohup, a log file) nothing is drawn live: rich would hold a live
display back until it ends, and cut tables at 80 columns. Progress becomes one plain line per layer,
and results print at their natural width."""
from __future__ import annotations

import json
import os
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

LOG_WIDTH = 10_000  # "no width" for a log: a table is as wide as its cells, never cut


class _Results(Console):
    """stdout's console. A table is never narrower than its title: titles carry paths (`quantized -> out/...`)
    that rich would otherwise fold at the table's width. On a terminal too narrow for a table, its cells
    fold onto more lines instead of ending in "…" (numbers and paths are never cut)."""

    def print(self, *objects, **kwargs) -> None:
        for o in objects:
            if isinstance(o, Table):
                _keep_whole(o)
        super().print(*objects, **kwargs)


def _keep_whole(table: Table) -> None:
    if isinstance(table.title, str):
        table.min_width = max(table.min_width or 0, Text.from_markup(table.title).cell_len)
    for column in table.columns:
        if column.overflow == "ellipsis":
            column.overflow = "fold"


def _console() -> Console:
    """A terminal's width on a terminal (or $COLUMNS); in a log, no width: nothing is cut."""
    probe = Console()
    if probe.is_terminal or "COLUMNS" in os.environ:
        return _Results()
    return _Results(width=LOG_WIDTH)


out = _console()
err = Console(stderr=True)  # progress and notes; plain lines in a log are printed with soft_wrap (never cut)


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


def before_after_rows(ba: dict | None) -> list[tuple[str, str]]:
    """A stage's `perplexity_before_after` as table rows: one per evaluation set, then their protocol (a manifest
    written before the stages measured several sets: WikiText-2's one row)."""
    if not ba:
        return []
    if "sets" not in ba:
        return [("perplexity", f"{_change(ba)}, {ba['protocol']}")]
    skipped = "".join(f"; {name} skipped: {why}" for name, why in ba["skipped"].items())
    return [(f"perplexity {name}", _change(v)) for name, v in ba["sets"].items()] + [
        ("perplexity protocol", ba["sets_protocol"] + skipped)]


def _change(v: dict) -> str:
    return f"{v['before']:.4f} -> {v['after']:.4f} ({v['increase_pct']:+.2f}%)"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def clock(seconds: float | None) -> str:
    """H:MM:SS, or -:--:-- when unknown."""
    if seconds is None:
        return "-:--:--"
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class LayerClock:
    """The ETA of a layer-by-layer run from the layers already done (their mean time times the layers
    left). rich's own ETA comes from a speed window of ~30 s and goes blank once a layer takes longer."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def add(self, seconds: float) -> None:
        self.seconds.append(seconds)

    def eta(self, total: int) -> float | None:
        if not self.seconds:
            return None
        return sum(self.seconds) / len(self.seconds) * max(total - len(self.seconds), 0)


def layer_line(stage: str, report, total: int, eta: float | None) -> str:
    """The plain line written per layer where stderr is not a terminal."""
    info = _layer_info(report.stats)
    return (f"{stage}: layer {report.index + 1}/{total}  {report.seconds:.1f} s  eta {clock(eta)}"
            + (f"  {info}" if info else ""))


@contextmanager
def layer_progress(stage: str):
    """Yields (status, on_layer, on_window) callbacks: a live display on a terminal's stderr, else plain lines.
    The layers bar appears with the first layer (a stage without layers, like shard, shows none)."""
    if not err.is_terminal:
        yield _plain_callbacks(stage)
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("eta {task.fields[eta]}"), TextColumn("{task.fields[info]}"))
    with Progress(*columns, console=err) as progress:
        windows = progress.add_task("eval windows", total=None, info="", eta="", visible=False)
        layers, timer = [], LayerClock()

        def status(message: str) -> None:
            progress.console.print(f"[dim]{message}[/dim]")
            progress.update(windows, visible=False, completed=0)

        def on_layer(report, total: int) -> None:
            timer.add(report.seconds)
            if not layers:
                layers.append(progress.add_task(f"{stage}: layers", total=total, info="", eta=""))
            progress.update(layers[0], completed=report.index + 1, total=total, info=_layer_info(report.stats),
                            eta=clock(timer.eta(total)))

        def on_window(done: int, total: int) -> None:
            progress.update(windows, completed=done, total=total, visible=True)

        yield status, on_layer, on_window


def _plain_callbacks(stage: str):
    timer = LayerClock()

    def status(message: str) -> None:
        err.print(message, markup=False, highlight=False, soft_wrap=True)

    def on_layer(report, total: int) -> None:
        timer.add(report.seconds)
        err.print(layer_line(stage, report, total, timer.eta(total)), markup=False, highlight=False, soft_wrap=True)
        err.file.flush()

    def on_window(done: int, total: int) -> None:
        if total > 0 and (done == total or done * 10 // total != (done - 1) * 10 // total):  # each tenth
            err.print(f"eval windows {done}/{total}", markup=False, highlight=False, soft_wrap=True)

    return status, on_layer, on_window


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
