"""scripts/peer_quality.py: its table, its per-process time and peak memory, and its command line. The comparison
itself quantizes twice per method and takes hours at 128 x 2048: `make peer-quality`."""
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "peer_quality.py"
spec = importlib.util.spec_from_file_location("peer_quality", SCRIPT)
peer_quality = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peer_quality)


def test_table_gives_each_tool_and_method_against_the_base():
    rows = [{"method": "gptq", "tool": "llmopt", "ppl": 25.1, "kl": 0.0812, "seconds": 1740.4, "peak_rss_mib": 2048.2},
            {"method": "gptq", "tool": "llmcompressor", "ppl": 26.0, "kl": 0.0901, "seconds": 2400.0,
             "peak_rss_mib": 3100.0}]
    lines = peer_quality.table(rows, 21.81, 32, 128, 2048).splitlines()
    assert "calibration 128 x 2048" in lines[0] and "base 21.8100" in lines[0]
    assert lines[4] == "| gptq | llmopt | 25.1000 | +15.1% | 0.0812 | 1740 | 2,048 |"
    assert lines[5] == "| gptq | llmcompressor | 26.0000 | +19.2% | 0.0901 | 2400 | 3,100 |"


def test_timed_reports_the_process_own_peak_memory_and_a_failure_in_one_message(tmp_path):
    cost = peer_quality.timed([sys.executable, "-c", "x = bytearray(64 << 20); print('ok')"], tmp_path / "a.log")
    assert cost["peak_rss_mib"] >= 64 and cost["seconds"] > 0 and (tmp_path / "a.log").read_text() == "ok\n"
    with pytest.raises(SystemExit, match="exited 3"):
        peer_quality.timed([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], tmp_path / "b.log")


def test_methods_are_checked_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        peer_quality.main(["--methods", "gptq,rtn", "--out", str(tmp_path / "out")])
    assert "--methods" in capsys.readouterr().err and not (tmp_path / "out").exists()
