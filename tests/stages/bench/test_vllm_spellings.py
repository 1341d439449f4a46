"""`llmopt bench` takes vLLM's spellings: --dataset-name, --dataset-path, --random-input-len,
--random-output-len, --goodput, --save-result, --result-dir (vllm bench serve's command lines, unchanged)."""
import json

import pytest

from llmopt.cli.main import main
from llmopt.stages.bench.config import goodput_as_slo, parse_slo
from llmopt.stages.bench.dataset import dataset_spec
from llmopt.stages.errors import ConfigError
from tests.stages.bench.stub import serve_stub


@pytest.fixture(scope="module")
def stub_url():
    with serve_stub(ttft_s=0.01, gap_s=0.002) as url:
        yield url


VLLM_INVOCATIONS = [  # (argv after `bench --url URL`, checks on the report)
    (["--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "3", "--num-prompts", "4"],
     {"dataset": "random", "input_len": 32, "output_len": 3, "total_output_tokens": 12, "completed": 4}),
    (["--dataset-name", "random", "--random-input-len", "8", "--num-prompts", "3", "--goodput", "ttft:60000",
      "--goodput", "e2el:60000"], {"input_len": 8, "goodput_completed": 3, "slo": {"ttft_ms": 60000.0,
                                                                                  "e2el_ms": 60000.0}}),
]


@pytest.mark.parametrize("argv, expected", VLLM_INVOCATIONS)
def test_vllm_style_bench_invocations_work_unchanged(stub_url, tmp_path, argv, expected):
    argv = ["bench", "--url", stub_url, *argv, "--max-concurrency", "2", "--quiet", "--save-result", "--result-dir",
            str(tmp_path / "results")]
    assert main(argv) == 0
    [path] = (tmp_path / "results").iterdir()  # vLLM's --save-result: a named file in --result-dir
    assert path.name.startswith("llmopt-infqps-concurrency2-stub-") and path.suffix == ".json"
    report = json.loads(path.read_text())
    assert {key: report[key] for key in expected} == expected


def test_result_filename_and_dataset_path(stub_url, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p {i}", "output_len": 2}) + "\n" for i in range(3)))
    argv = ["bench", "--url", stub_url, "--dataset-name", "custom", "--dataset-path", str(data), "--num-prompts", "3",
            "--quiet", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "run.json"]
    assert main(argv) == 0
    report = json.loads((tmp_path / "run.json").read_text())
    assert report["dataset"] == f"jsonl:{data}" and report["completed"] == 3 and report["total_output_tokens"] == 6


def test_dataset_spec_joins_vllm_name_and_path():
    assert dataset_spec("random") == "random" and dataset_spec("sharegpt", "a.json") == "sharegpt:a.json"
    assert dataset_spec("custom", "a.jsonl") == "jsonl:a.jsonl"
    with pytest.raises(ConfigError, match="--dataset-path a.json: --dataset random reads no file"):
        dataset_spec("random", "a.json")


def test_goodput_is_slo_in_vllm_words():
    assert parse_slo(goodput_as_slo(["ttft:500", "tpot:50 e2el:3000"])) == {"ttft_ms": 500.0, "tpot_ms": 50.0,
                                                                          "e2el_ms": 3000.0}
    assert goodput_as_slo(["tpot:50"], "ttft_ms=100") == "ttft_ms=100,tpot_ms=50"
    assert goodput_as_slo(None, None) is None
    for bad in ("ttft=500", "itl:5"):
        with pytest.raises(ConfigError, match="--goodput"):
            goodput_as_slo([bad])
