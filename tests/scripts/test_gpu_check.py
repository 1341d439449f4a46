"""scripts/gpu_check.sh in its smoke mode (GPU_CHECK_DEVICE=cpu): every part runs on CPU with tiny shapes
and leaves its report, and the verdict is the PASS/FAIL table over them. The functional rows pass; the
speed bars are a GPU's, so some fail here and the script's exit status says so. 2-3 minutes on 2 shared
cores (a process per part), hence integration."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmopt.stages.profile.acceptance import FAIL, PASS, REPORTS

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_the_smoke_mode_runs_every_part_and_ends_with_the_verdict(tmp_path):
    # Budgets at 5x the H200's (the smoke mode's own default is 3x): make test runs a second pytest worker beside
    # this one, and the parts that start a pytest or a server wait on that worker's compute.
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_DEVICE": "cpu", "PYTHON": sys.executable, "COLUMNS": "200",
           "GPU_CHECK_BUDGET_SCALE": "5"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, env=env,
                          timeout=1900, cwd=tmp_path)
    log = (tmp_path / "gpu_check.log").read_text()
    assert done.stdout == log and "!!" not in log, log[-3000:]  # no part failed to run or ran out of time
    for name in set(REPORTS.values()) - {"graphs.xml"}:
        assert (tmp_path / name).is_file(), name
    verdict = json.loads((tmp_path / "acceptance.json").read_text())
    rows = {r["check"]: r["status"] for r in verdict["rows"]}
    functional = [c for c in rows if c.startswith(("kernel tests", "end to end", "greedy"))]
    assert len(functional) == 4 and all(rows[c] == PASS for c in functional), rows
    assert done.returncode == (1 if FAIL in rows.values() else 0) == 1  # a CPU misses the GEMV bars
    assert "== part times: setup:" in log and "exit status 1" in log
