"""--dataset grounded: prompts that ask to repeat or edit a ShareGPT passage, deterministic from the seed."""
import json

import pytest

from llmopt.stages.bench.dataset import GROUNDED_TASKS, DatasetConfig, load_requests
from llmopt.stages.errors import DataError


def _file(path, texts):
    path.write_text(json.dumps([{"id": i, "conversations": [{"from": "human", "value": t}]}
                                for i, t in enumerate(texts)]))
    return f"grounded:{path}"


def test_grounded_prompts_quote_a_passage_and_ask_for_about_its_length(tmp_path):
    passages = [f"passage {i}: " + "word " * (60 + 10 * i) for i in range(6)]
    spec = _file(tmp_path / "s.json", passages + ["too short"])
    requests = load_requests(DatasetConfig(spec, 10, seed=3))
    for r in requests:
        passage = next(p for p in passages if p.strip() in r.prompt)
        assert r.prompt in [t.format(passage=passage.strip()) for t in GROUNDED_TASKS]
        assert r.output_len == round(len(passage.strip()) / 4)  # no tokenizer: ~4 characters a token
    assert load_requests(DatasetConfig(spec, 10, seed=3)) == requests
    assert load_requests(DatasetConfig(spec, 10, seed=4)) != requests


def test_grounded_needs_passages_of_a_usable_length(tmp_path):
    with pytest.raises(DataError, match="characters"):
        load_requests(DatasetConfig(_file(tmp_path / "s.json", ["short"]), 2))
