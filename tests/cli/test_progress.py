"""Layer progress that tells the truth: an ETA from the layers done, plain lines in a log, no idle bar."""
import io

import pytest
from rich.console import Console
from rich.table import Table

from llmopt.cli import ui
from llmopt.stages.layerwise import LayerReport


def _console(terminal: bool) -> Console:
    return Console(file=io.StringIO(), force_terminal=terminal, width=200)


def test_eta_comes_from_the_layers_done_even_when_each_takes_minutes():
    timer = ui.LayerClock()
    assert timer.eta(30) is None
    for seconds in (40.0, 50.0):  # far past rich's ~30 s speed window
        timer.add(seconds)
    assert timer.eta(30) == pytest.approx(45.0 * 28)
    assert ui.clock(timer.eta(30)) == "0:21:00"
    assert ui.clock(None) == "-:--:--"


def test_the_live_bar_shows_an_eta_after_a_slow_layer(monkeypatch):
    monkeypatch.setattr(ui, "err", _console(terminal=True))
    with ui.layer_progress("quantize") as (_, on_layer, _):
        on_layer(LayerReport(0, 40.0, {}), 30)
    shown = ui.err.file.getvalue()
    assert "eta 0:19:20" in shown and "-:--:--" not in shown


def test_not_a_terminal_one_plain_line_per_layer(monkeypatch):
    monkeypatch.setattr(ui, "err", _console(terminal=False))
    with ui.layer_progress("quantize") as (status, on_layer, _):
        status("calibration: 4 x 32 tokens")
        for i in range(3):
            on_layer(LayerReport(i, 2.0, {"gptq_loss": {"q_proj": 0.5, "k_proj": 1.5}}), 3)
    lines = ui.err.file.getvalue().splitlines()
    assert lines == ["calibration: 4 x 32 tokens",
                     "quantize: layer 1/3  2.0 s  eta 0:00:04  gptq_loss mean 1",
                     "quantize: layer 2/3  2.0 s  eta 0:00:02  gptq_loss mean 1",
                     "quantize: layer 3/3  2.0 s  eta 0:00:00  gptq_loss mean 1"]


def test_a_stage_without_layers_shows_no_layer_bar(monkeypatch):
    """shard reports no layers: no `layers 0/? ... eta` bar that never moves."""
    monkeypatch.setattr(ui, "err", _console(terminal=True))
    with ui.layer_progress("shard") as (status, _, _):
        status("reading out/model")
    shown = ui.err.file.getvalue()
    assert "reading out/model" in shown and "layers" not in shown and "eta" not in shown


def test_tables_in_a_log_keep_numbers_and_paths_whole(monkeypatch, capsys):
    monkeypatch.delenv("COLUMNS", raising=False)
    path = "out/" + "demo-" * 30 + "quantize"
    table = Table(title=f"quantized -> {path}")
    for col in ("perplexity before", "perplexity after", "decode tokens per second", "output path"):
        table.add_column(col)
    table.add_row("12.345678", "13.456789", "1234.5", path)
    ui._console().print(table)
    shown = capsys.readouterr().out
    for text in ("perplexity before", "decode tokens per second", "12.345678", "1234.5", path):
        assert text in shown
    assert "…" not in shown


def test_a_narrow_terminal_folds_cells_instead_of_cutting_them():
    console = ui._Results(file=io.StringIO(), force_terminal=True, width=40)
    table = Table("metric", "value")
    table.add_row("perplexity_before_after", "out/demo-quantize-w4a16-g128")
    console.print(table)
    shown = console.file.getvalue()
    assert "…" not in shown and "perplexity" in shown and "out/demo" in shown
