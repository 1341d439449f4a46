import json

import pytest

from llmopt.stages.bench.dataset import DEFAULT_OUTPUT_LEN, DatasetConfig, load_requests
from llmopt.stages.errors import ConfigError, DataError


def _sharegpt(path, records):
    path.write_text(json.dumps(records))
    return f"sharegpt:{path}"


def test_sharegpt_without_replies_takes_output_len(tmp_path):
    spec = _sharegpt(tmp_path / "s.json", [{"id": i, "conversations": [{"from": "human", "value": f"q{i}"}]}
                                           for i in range(5)])
    requests = load_requests(DatasetConfig(spec, num_prompts=5, output_len=7, seed=1))
    assert sorted(r.prompt for r in requests) == [f"q{i}" for i in range(5)]  # each once, shuffled
    assert {r.output_len for r in requests} == {7} and {r.prompt_len for r in requests} == {None}
    assert [r.prompt for r in requests] == [r.prompt for r in load_requests(DatasetConfig(spec, 5, output_len=7, seed=1))]
    assert load_requests(DatasetConfig(spec, num_prompts=2))[0].output_len == DEFAULT_OUTPUT_LEN
    assert len(load_requests(DatasetConfig(spec, num_prompts=12))) == 12  # records repeat past the end


def test_disable_shuffle_keeps_file_order(tmp_path):
    spec = _sharegpt(tmp_path / "s.json", [{"conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(3)])
    requests = load_requests(DatasetConfig(spec, num_prompts=5, seed=1, shuffle=False))
    assert [r.prompt for r in requests] == ["q0", "q1", "q2", "q0", "q1"]
    assert DatasetConfig(spec, shuffle=False).describe()["shuffle"] is False


def test_sharegpt_replies_set_output_len(tmp_path, tiny_hf):
    spec = _sharegpt(tmp_path / "s.json", [{"conversations": [{"from": "human", "value": "the quick brown fox"},
                                                              {"from": "gpt", "value": "x" * 40}]},
                                           {"conversations": [{"from": "gpt", "value": "no human turn"}]}])
    (request,) = load_requests(DatasetConfig(spec, num_prompts=1))
    assert request.output_len == 10  # ~4 characters per token without a tokenizer
    tok = tiny_hf[2]
    (counted,) = load_requests(DatasetConfig(spec, num_prompts=1), tokenizer=tok)
    assert counted.prompt_len == len(tok.encode("the quick brown fox", add_special_tokens=False))
    assert counted.output_len == len(tok.encode("x" * 40, add_special_tokens=False))


def test_shared_sharegpt_file_loads():
    try:
        requests = load_requests(DatasetConfig("sharegpt", num_prompts=3, output_len=16))
    except DataError:
        pytest.skip("shared data not present")
    assert len(requests) == 3 and all(r.prompt for r in requests)


def test_random_prompts_have_the_asked_lengths(tiny_hf):
    requests = load_requests(DatasetConfig("random", num_prompts=4, input_len=12, output_len=5, seed=3))
    assert all(len(r.prompt.split()) == 12 and r.prompt_len == 12 and r.output_len == 5 for r in requests)
    assert len({r.prompt for r in requests}) == 4
    tok = tiny_hf[2]
    with_tok = load_requests(DatasetConfig("random", num_prompts=2, input_len=12, seed=3), tokenizer=tok)
    assert all(r.prompt_len == len(tok.encode(r.prompt, add_special_tokens=False)) for r in with_tok)


def test_jsonl_records_and_errors(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "a", "output_len": 3}\n\n{"prompt": "b"}\n')
    requests = load_requests(DatasetConfig(f"jsonl:{good}", num_prompts=2, seed=0))
    assert sorted((r.prompt, r.output_len) for r in requests) == [("a", 3), ("b", DEFAULT_OUTPUT_LEN)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: needs a \"prompt\" string"):
        load_requests(DatasetConfig(f"jsonl:{bad}"))
    with pytest.raises(ConfigError, match="--dataset"):
        load_requests(DatasetConfig("jsonl"))
