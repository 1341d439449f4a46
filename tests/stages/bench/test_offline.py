"""`llmopt bench --offline`: the engine in-process against transformers on a tiny random model; the
report's counts, ratios and agreement; and the options that belong to the other kind of run."""
import json

import pytest

from llmopt.cli.main import main
from llmopt.stages.offline.config import OfflineConfig
from llmopt.stages.offline.engine import EngineRun
from llmopt.stages.offline.report import Measured, build_report

LOAD = ["--dataset", "random", "--input-len", "6", "--dtype", "fp32", "--threads", "1", "--quiet"]


def _offline(tmp_path, sources, *extra) -> dict:
    path = tmp_path / "offline.json"
    argv = ["bench", *(a for s in sources for a in ("--offline", str(s))), *LOAD, *extra, "--json", str(path)]
    assert main(argv) == 0
    return json.loads(path.read_text())


def test_throughput_rows_add_up_and_agree_with_transformers(tiny_hf, tmp_path):
    src = tiny_hf[0]
    report = _offline(tmp_path, [src, src], "--num-prompts", "5", "--output-len", "6", "--ignore-eos",
                      "--hf-batch-size", "2")
    assert report["format"] == "llmopt-bench-offline" and report["mode"] == "throughput"
    base, first, second = report["rows"]
    assert base["baseline"] and base["engine"] == "transformers generate, static batches of 2"
    assert [r["output_tokens"] for r in report["rows"]] == [30, 30, 30]  # 5 prompts x 6 tokens, EOS ignored
    for row in report["rows"]:
        assert row["output_tok_s"] == pytest.approx(row["output_tokens"] / row["seconds"])
        assert row["x_transformers"] == pytest.approx(row["output_tok_s"] / base["output_tok_s"])
    # fp32 greedy: the engine's tokens are transformers', and a source run twice agrees with itself
    assert first["identical_to_transformers"] == second["identical_to_transformers"] == 5
    assert first["identical_to_first"] is None and second["identical_to_first"] == 5
    assert first["median_ttft_ms"] > 0 and first["p99_tpot_ms"] >= first["median_tpot_ms"] > 0
    assert "median_ttft_ms" not in base  # static batches have no per-request first token


def test_batch1_decode_reports_per_token_medians(tiny_hf, tmp_path):
    report = _offline(tmp_path, [tiny_hf[0]], "--num-prompts", "3", "--output-len", "4", "--max-concurrency", "1")
    assert report["mode"] == "batch-1 decode" and report["ignore_eos"] is True
    base, engine = report["rows"]
    assert base["engine"] == "transformers generate" and engine["engine"] == "llmopt LLMEngine"
    for row in (base, engine):
        assert len(row["ms_per_token_per_prompt"]) == 3
        assert row["ms_per_token"] == pytest.approx(sorted(row["ms_per_token_per_prompt"])[1])  # one run: the median
        assert row["tok_s"] == pytest.approx(1e3 / row["ms_per_token"])
    assert engine["x_transformers"] == pytest.approx(base["ms_per_token"] / engine["ms_per_token"])


def test_engine_hf_runs_transformers_on_every_source_against_the_first(tiny_hf, tmp_path):
    src = tiny_hf[0]
    report = _offline(tmp_path, [src, src], "--engine", "hf", "--num-prompts", "3", "--output-len", "4")
    first, second = report["rows"]
    assert first["baseline"] and not second["baseline"] and first["x_transformers"] == 1.0
    assert {r["engine"] for r in report["rows"]} == {"transformers generate, static batches of 8"}
    assert second["identical_to_transformers"] == 3 and second["identical_to_first"] is None  # the first is the baseline


def test_baseline_none_has_no_ratios(tiny_hf, tmp_path):
    report = _offline(tmp_path, [tiny_hf[0]], "--num-prompts", "2", "--output-len", "3", "--baseline", "none",
                      "--repeats", "2")
    (row,) = report["rows"]
    assert row["x_transformers"] is None and row["identical_to_transformers"] is None
    assert len(row["seconds_all"]) == 2 and report["repeats"] == 2


def _run(outputs, seconds):
    return EngineRun(outputs, seconds, [0.01] * len(outputs), [0.002] * len(outputs))


def test_report_counts_identical_sequences_and_takes_medians():
    config = OfflineConfig(max_concurrency=None)
    base = Measured("base", "hf", baseline=True, runs=[_run([[1, 2], [3], [4, 5, 6]], 2.0)])
    same = Measured("base", "llmopt", runs=[_run([[1, 2], [3], [4, 5, 6]], s) for s in (0.4, 0.5, 0.9)])
    other = Measured("w4", "llmopt", runs=[_run([[1, 2], [7], [4, 5, 6, 8]], 0.25)])
    report = build_report(config, [base, same, other], prompt_tokens=12, threads=1)
    rows = report["rows"]
    assert [r["output_tokens"] for r in rows] == [6, 6, 7] and report["total_input_tokens"] == 12
    assert rows[1]["seconds"] == 0.5 and rows[1]["x_transformers"] == pytest.approx((6 / 0.5) / (6 / 2.0))
    assert [r["identical_to_transformers"] for r in rows] == [None, 3, 1]
    assert [r["identical_to_first"] for r in rows] == [None, None, 1]
    assert rows[2]["median_ttft_ms"] == pytest.approx(10.0) and rows[2]["median_tpot_ms"] == pytest.approx(2.0)


@pytest.mark.parametrize("argv, expect", [
    (["--offline", "SRC", "--url", "http://127.0.0.1:9"], "give --offline SOURCE (the engine in this process) or"),
    (["--offline", "SRC", "--request-rate", "4"], "--request-rate is for runs against a server"),
    (["--offline", "SRC", "--serve-args", "--max-num-seqs 4"], "--serve-args is for runs against a server"),
    (["--url", "http://127.0.0.1:9", "--hf-batch-size", "4"], "--hf-batch-size is for --offline runs only"),
    (["--offline", "SRC", "--endpoint", "chat"], "--endpoint chat: the model's tokenizer has no chat template"),
    (["--offline", "SRC", "--baseline", "vllm"], "--baseline: expected one of hf, none"),
    (["--offline", "SRC", "--hf-batch-size", "0"], "--hf-batch-size must be at least 1"),
    (["--offline", "SRC", "--device", "tpu"], "--device must be cpu or cuda"),
    (["--offline", "SRC", "--num-prompts", "2", "--input-len", "300"], "passes the model's 256 positions"),
])
def test_bad_offline_options_give_one_line_and_exit_2(argv, expect, tiny_hf, capsys):
    assert main(["bench", *(str(tiny_hf[0]) if a == "SRC" else a for a in argv)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expect in err, err


def test_a_sharded_artifact_agrees_with_its_source_token_for_token(tiny_hf, tmp_path):
    from llmopt.stages.shard.config import ShardConfig
    from llmopt.stages.shard.run import run_shard

    sharded = run_shard(str(tiny_hf[0]), tmp_path / "tp2", ShardConfig(2))
    report = _offline(tmp_path, [tiny_hf[0], sharded.path], "--num-prompts", "3", "--output-len", "5", "--ignore-eos",
                      "--baseline", "none")
    source, tp2 = report["rows"]
    assert source["identical_to_first"] is None and tp2["identical_to_first"] == 3
    assert tp2["output_tokens"] == source["output_tokens"] == 15


def test_batch1_with_ngram_speculation_reports_acceptance(tiny_hf, tmp_path):
    prompts = tmp_path / "loops.jsonl"  # a tiny random model loops on these, which n-gram lookup guesses
    prompts.write_text('{"prompt": "a b c d a b c d a b c d a b"}\n{"prompt": "twelve twelve twelve twelve"}\n')
    report = _offline(tmp_path, [tiny_hf[0]], "--num-prompts", "2", "--output-len", "24", "--max-concurrency", "1",
                      "--baseline", "none", "--speculative", "ngram", "--num-speculative-tokens", "3",
                      "--dataset", f"jsonl:{prompts}")
    assert report["speculative"] == "ngram" and report["num_speculative_tokens"] == 3
    (engine,) = report["rows"]
    assert 0 < engine["spec_acceptance_rate"] <= 1 and engine["spec_mean_accepted_length"] > 1
    assert engine["tok_s"] == pytest.approx(1e3 / engine["ms_per_token"])
