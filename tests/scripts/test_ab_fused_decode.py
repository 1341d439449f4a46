"""scripts/ab_fused_decode.py on a tiny two-group Gemma 3: both arms run, the fused one really fused."""
import subprocess
import sys
from pathlib import Path

import pytest

from llmopt.kernels import cpu_native
from tests.stages.serve.runner_steps import save_hf
from tests.stages.serve.test_model import build_hf

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ab_fused_decode.py"


@pytest.mark.skipif(not cpu_native.gemv_available(), reason="the fused step needs the native GEMVs")
def test_both_arms_are_timed(tmp_path):
    path = save_hf(build_hf("gemma3-window"), tmp_path / "gemma")
    done = subprocess.run([sys.executable, str(SCRIPT), str(path), "--rounds", "1", "--threads", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("per-layer: ") and lines[1].startswith("fused: ") and "x faster" in lines[2]
