"""scripts/bench_llamacpp.py: the side-by-side table (medians over rounds, ratios to llama-server, the fall beside
a busy core) from bench reports, and its command line's errors. The runs themselves are `llmopt bench --server`
(tested in tests/stages/bench/test_server.py); `make bench-llamacpp` runs the whole comparison."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_llamacpp.py"
spec = importlib.util.spec_from_file_location("bench_llamacpp", SCRIPT)
bench_llamacpp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_llamacpp)


def _report(tok_s, tpot=10.0, ttft=100.0, ready=None, rss=None):
    return {"output_throughput": tok_s, "median_tpot_ms": tpot, "median_ttft_ms": ttft,
            "server": {"ready_s": ready, "peak_rss_bytes": rss}}


def test_table_gives_medians_over_rounds_and_ratios_to_llama_server():
    reports = {
        "llama-server": {"c1": [_report(60), _report(70), _report(64)], "c16": [_report(100, ready=1.0, rss=1.0e9)] * 3,
                         "p512": [_report(0, ttft=1500.0)] * 3, "c1-busy": [_report(48)] * 3},
        "llmopt": {"c1": [_report(120), _report(140), _report(128)],
                   "c16": [_report(300, ready=2.0, rss=1.5e9), _report(330, ready=1.0, rss=1.4e9),
                           _report(320, ready=3.0, rss=1.6e9)],
                   "p512": [_report(0, ttft=300.0)] * 3, "c1-busy": [_report(64)] * 3},
    }
    text, data = bench_llamacpp.table(reports)
    lines = text.splitlines()
    assert lines[0] == "| | llama-server | llmopt |"
    assert "| concurrency 1, output tok/s | 64.0 | 128.0 (2.00x) |" in lines
    assert "| concurrency 16, output tok/s | 100.0 | 320.0 (3.20x) |" in lines
    assert "| 512-token prompt, median TTFT ms | 1,500.0 | 300.0 (0.20x) |" in lines
    assert "| ready after start, s | 1.00 | 2.00 (2.00x) |" in lines
    assert "| peak RSS (VmHWM), MB | 1,000.0 | 1,500.0 (1.50x) |" in lines
    assert lines[-1] == "| fall beside a busy core | 25% | 50% |"
    assert data["llmopt"]["fall beside a busy core"] == pytest.approx(0.5)


def test_a_run_without_a_figure_shows_a_dash():
    reports = {"llmopt": {row: [{"server": None}] for row in bench_llamacpp.ROWS}}
    text, data = bench_llamacpp.table(reports)
    assert "| concurrency 1, output tok/s | - |" in text and data["llmopt"]["fall beside a busy core"] is None


def test_command_line_errors(capsys, monkeypatch):
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    with pytest.raises(SystemExit) as exit_:
        bench_llamacpp.main([])
    assert exit_.value.code == 2 and "nothing to run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_llamacpp.main(["--run", "=out/x"])
    assert "write NAME=SOURCE" in capsys.readouterr().err
