"""`llmopt profile --synthetic` (the engine step of scripts/gpu_check.sh) runs end to end on CPU with a
tiny shape, in a process of its own as the GPU check runs it, so the check does not rot between the
rare sessions that have a GPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_engine_check_reports_each_batch(tmp_path):
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, "-m", "llmopt.cli.main", "profile", "--synthetic", "tiny", "--device", "cpu",
                           "--layers", "2", "--dtype", "fp32", "--batch-sizes", "1,3", "--decode-context", "20",
                           "--decode-steps", "6", "--json", str(out)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["rows"]] == [1, 3]
    for row in report["rows"]:
        assert row["steps"] >= 3 and row["tokens_per_s"] > 0 and 0 < row["share"]
        assert row["bytes_per_step"] > 2 * 2 * 256 * 512 * 4  # at least two layers' MLP weights in fp32
    assert "│ 3 " in done.stdout
