"""`llmopt profile` on a pipeline-sharded artifact: each stage's busy, waiting (bubble) and other shares from the
ranks' own clocks over a decode load through the real rank processes."""
import json

import pytest

from llmopt.cli.main import main
from llmopt.stages.errors import ConfigError
from llmopt.stages.profile.config import ProfileConfig
from llmopt.stages.profile.modes import check_sources, tables
from llmopt.stages.profile.pipeline import pipeline_artifact, run_pipeline
from llmopt.stages.shard.config import ShardConfig
from llmopt.stages.shard.run import run_shard
from tests.helpers import write_hf_dir


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp-profile")
    write_hf_dir(root / "base", layers=4, hidden=96, heads=6, kv_heads=2)
    return root, run_shard(str(root / "base"), root / "pp2", ShardConfig(pp=2)).path


def test_every_stage_accounts_for_its_time(pp2):
    _, path = pp2
    report = run_pipeline(str(path), ProfileConfig(batch_sizes=(1, 4), backend="reference"))
    assert report["load"] == {"sequences": 4, "prompt_tokens": 32, "new_tokens": 64, "micro_batches_in_flight": 2}
    assert report["output_tokens"] == 4 * 64 and report["output_tokens_per_s"] > 0
    assert [s["stage"] for s in report["stages"]] == [0, 1]
    assert [s["layers"] for s in report["stages"]] == [[0, 2], [2, 4]]
    for s in report["stages"]:
        assert s["steps"] >= 64  # every decode step of each micro-batch went through every stage
        assert 0 < s["busy_share"] <= 1 and 0 <= s["bubble_share"] <= 1
        assert s["busy_share"] + s["bubble_share"] <= 1.0001
    [table] = tables(json.loads(json.dumps(report)))
    assert table.columns[-2] == "bubble (waiting)" and len(table.rows) == 2


def test_a_pipeline_is_profiled_alone_and_on_the_cli(pp2, tmp_path):
    root, path = pp2
    assert pipeline_artifact(str(path)) is not None and pipeline_artifact(str(root / "base")) is None
    with pytest.raises(ConfigError, match="profiled alone"):
        check_sources([str(path), str(root / "base")], ProfileConfig())
    out = tmp_path / "p.json"
    assert main(["profile", str(path), "--batch-sizes", "1,2", "--backend", "reference", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["tool"] == "llmopt profile (pipeline)"
