"""scripts/bench_pipeline.py: its command line, the rotation of the setups, the bench command it runs, and the
table from a run's numbers. The run itself serves three setups for minutes: `make bench-pp`."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_pipeline.py"
spec = importlib.util.spec_from_file_location("bench_pipeline", SCRIPT)
bench_pipeline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_pipeline)


def test_rounds_rotate_so_no_setup_always_runs_first():
    assert bench_pipeline.rotation(["pp1", "pp2", "tp2"], 3) == [["pp1", "pp2", "tp2"], ["pp2", "tp2", "pp1"],
                                                                ["tp2", "pp1", "pp2"]]
    assert bench_pipeline.shard_args("0-16,17-29")["pp2-layers"] == ["--pp", "2", "--pp-layers", "0-16,17-29"]
    assert "pp2-layers" not in bench_pipeline.shard_args(None)


def test_bench_command_serves_the_concurrency_it_loads(tmp_path):
    cmd = bench_pipeline.bench_command(tmp_path / "a", 16, 64, tmp_path / "r.json")
    assert cmd[cmd.index("--max-concurrency") + 1] == "16" and cmd[cmd.index("--num-prompts") + 1] == "32"
    assert "--max-num-seqs 16" in cmd[cmd.index("--serve-args") + 1]
    args = bench_pipeline.parse_args([str(tmp_path), "--rounds", "5"])
    assert args.rounds == 5 and args.concurrency == 16
    with pytest.raises(SystemExit):
        bench_pipeline.parse_args([str(tmp_path), "--rounds", "0"])


def test_table_gives_medians_ratios_to_pp1_and_the_bubbles():
    profile = {"stages": [{"stage": 0, "layers": [0, 15], "busy_share": 0.84, "bubble_share": 0.14,
                           "busy_ms_per_step": 52.8},
                          {"stage": 1, "layers": [15, 30], "busy_share": 0.91, "bubble_share": 0.09,
                           "busy_ms_per_step": 59.3}]}
    summary = bench_pipeline.summarize({"pp1": [50.0, 48.0, 49.0], "pp2": [47.0, 49.0, 48.0],
                                        "tp2": [20.0, 19.0, 21.0]}, {"pp2": profile})
    text = bench_pipeline.table(summary, 16)
    assert "| PP1 | 49.0 | 50.0, 48.0, 49.0 | 1.00x |" in text
    assert "| PP2 | 48.0 |" in text and "0.98x" in text and "| TP2 | 20.0 |" in text and "0.41x" in text
    assert "| PP2 | 1 | 15-29 | 59.3 | 91% | 9% |" in text


def test_an_artifact_is_resharded_when_its_config_is_not_todays():
    assert bench_pipeline.shard_config(["--pp", "2"]) == {"tp": 1, "pp": 2, "pp_layers": None, "pp_balance": "decode"}
    assert bench_pipeline.shard_config(["--pp", "2", "--pp-layers", "0-18,19-29"]) == {
        "tp": 1, "pp": 2, "pp_layers": "0-18,19-29"}
    assert bench_pipeline.shard_config(["--tp", "2"]) == {"tp": 2}
