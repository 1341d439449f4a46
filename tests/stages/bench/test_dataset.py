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


def test_shared_prefix_groups_share_their_prefix_and_nothing_else(tiny_hf):
    config = DatasetConfig("shared-prefix:3,20", num_prompts=12, input_len=6, output_len=4, seed=5)
    requests = load_requests(config)
    prefixes = [r.prompt.split("\n\n")[0] for r in requests]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 4 for p in set(prefixes))
    assert all(len(p.split()) == 20 for p in prefixes)
    questions = [r.prompt.split("\n\n")[1] for r in requests]
    assert len(set(questions)) == 12 and all(len(q.split()) == 6 for q in questions)
    assert all(r.prompt_len == 26 and r.output_len == 4 for r in requests)
    assert [r.prompt for r in load_requests(config)] == [r.prompt for r in requests]  # seeded
    in_order = load_requests(DatasetConfig("shared-prefix:3,20", num_prompts=12, input_len=6, shuffle=False))
    firsts = [r.prompt.split("\n\n")[0] for r in in_order]
    assert firsts[:4] == [firsts[0]] * 4 and firsts[4] != firsts[0]  # group by group without shuffling
    assert {len(load_requests(DatasetConfig("shared-prefix", num_prompts=2))[0].prompt.split())} == {512 + 128}
    tok = tiny_hf[2]
    counted = load_requests(DatasetConfig("shared-prefix:2,16", num_prompts=4, input_len=8), tokenizer=tok)
    assert all(r.prompt_len == len(tok.encode(r.prompt, add_special_tokens=False)) for r in counted)


@pytest.mark.parametrize("spec", ["shared-prefix:8", "shared-prefix:0,512", "shared-prefix:a,b"])
def test_shared_prefix_shape_errors(spec):
    with pytest.raises(ConfigError, match="GROUPS,PREFIX_LEN"):
        DatasetConfig(spec).validate()
