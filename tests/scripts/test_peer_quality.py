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
    size = {"nsamples": 128, "seqlen": 2048}
    rows = [{"method": "gptq", "tool": "llmopt", **size, "ppl": 25.1, "kl": 0.0812, "seconds": 1740.4,
             "cpu_seconds": 3300.2, "peak_rss_mib": 2048.2},
            {"method": "gptq", "tool": "llmcompressor", **size, "ppl": 26.0, "kl": 0.0901, "seconds": 2400.0,
             "cpu_seconds": 4700.0, "peak_rss_mib": 3100.0},
            {"method": "awq", "tool": "llmopt", "nsamples": 16, "seqlen": 512, "ppl": 27.0, "kl": 0.1, "seconds": 90.0,
             "cpu_seconds": 170.0, "peak_rss_mib": 1500.0}]
    lines = peer_quality.table(rows, 21.81, 32).splitlines()
    assert "32 WikiText-2 test windows" in lines[0] and "base 21.8100" in lines[0]
    assert lines[4] == "| gptq | 128 x 2048 | llmopt | 25.1000 | +15.1% |  | 0.0812 | 1740 (3300) | 2,048 |"
    assert lines[5] == "| gptq | 128 x 2048 | llmcompressor | 26.0000 | +19.2% |  | 0.0901 | 2400 (4700) | 3,100 |"
    assert lines[6] == "| awq | 16 x 512 | llmopt | 27.0000 | +23.8% |  | 0.1000 | 90 (170) | 1,500 |"
    rtn = {"method": "rtn", "tool": "llmopt", "ppl": 30.94, "kl": 0.35, "seconds": 20.0, "cpu_seconds": 30.0,
           "peak_rss_mib": 900.0}
    lines = peer_quality.table([rtn, *rows], 21.81, 32).splitlines()
    assert lines[4] == "| rtn | none | llmopt | 30.9400 | +41.9% |  | 0.3500 | 20 (30) | 900 |"
    assert lines[5].split(" | ")[5] == "64%" and lines[6].split(" | ")[5] == "54%"  # of RTN's 9.13 increase


def test_timed_reports_the_process_own_peak_memory_and_a_failure_in_one_message(tmp_path):
    cost = peer_quality.timed([sys.executable, "-c", "x = bytearray(64 << 20); print('ok')"], tmp_path / "a.log")
    assert cost["peak_rss_mib"] >= 64 and cost["seconds"] > 0 and cost["cpu_seconds"] > 0
    assert (tmp_path / "a.log").read_text() == "ok\n"
    with pytest.raises(SystemExit, match="exited 3"):
        peer_quality.timed([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], tmp_path / "b.log")


def test_methods_are_checked_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        peer_quality.main(["--methods", "gptq,rtn", "--out", str(tmp_path / "out")])
    assert "--methods" in capsys.readouterr().err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("size", ["32", "32x", "ax512", "32x512x2", "0x512", "16x-1"])
def test_a_malformed_awq_calibration_size_is_refused_before_anything_runs(tmp_path, capsys, size):
    with pytest.raises(SystemExit):
        peer_quality.main(["--awq-calib", size, "--out", str(tmp_path / "out")])
    assert "--awq-calib" in capsys.readouterr().err and not (tmp_path / "out").exists()
