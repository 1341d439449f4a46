"""The transformers baseline (`--engine hf`): its HTTP API in-process, and its generate code, which the
offline bench shares, on a tiny random model."""
import json

import pytest
from fastapi.testclient import TestClient

from llmopt.stages.serve.baseline.app import build_app
from llmopt.stages.serve.baseline.hf import generate_batches, generated, load_model, ms_per_token, sampling_kwargs
from llmopt.stages.serve.baseline.worker import Baseline
from tests.stages.serve.http.conftest import model_dir  # noqa: F401  (the tiny model with a chat template)


@pytest.fixture(scope="module")
def chat_model(model_dir):
    from transformers import AutoTokenizer

    return model_dir, load_model(model_dir, "fp32"), AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def client(chat_model):
    _, model, tok = chat_model
    with TestClient(build_app(Baseline(model, tok, "tiny"))) as c:
        yield c


def _events(response) -> list:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_health_and_models(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"


def test_completions_match_generate_and_report_usage(client, chat_model):
    _, model, tok = chat_model
    body = {"prompt": "the quick brown fox", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    reply = client.post("/v1/completions", json=body).json()
    ids = tok("the quick brown fox").input_ids
    (expected,), _ = generate_batches(model, [ids], [6], 8, {tok.eos_token_id}, 0, ignore_eos=True)
    assert reply["choices"][0]["text"] == tok.decode(expected, skip_special_tokens=True)
    assert reply["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 6, "total_tokens": len(ids) + 6}
    assert reply["choices"][0]["finish_reason"] == "length"


def test_chat_streams_one_event_per_token_then_usage(client):
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events = _events(client.post("/v1/chat/completions", json=body))
    tokens, usage = events[:-1], events[-1]
    assert len(tokens) == 5 and all("content" in e["choices"][0]["delta"] for e in tokens)
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("body", [{"prompt": "x", "max_tokens": 0}, {"prompt": ""}, {"messages": "hi"}])
def test_bad_requests_are_400(client, body):
    endpoint = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = client.post(endpoint, json=body)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_batches_count_tokens_up_to_eos_only(chat_model):
    _, model, tok = chat_model
    assert generated([5, 7, 0, 9], {0}, 10) == [5, 7, 0] and generated([5, 7, 0, 9], {0}, 10, True) == [5, 7, 0, 9]
    assert generated([5, 7, 8], {0}, 2) == [5, 7]
    prompts = [tok("the lazy dog").input_ids, tok("a model").input_ids, tok("pack the weights").input_ids]
    batched, _ = generate_batches(model, prompts, [4, 6, 3], 2, {tok.eos_token_id}, 0, ignore_eos=True)
    alone = [generate_batches(model, [p], [n], 1, {tok.eos_token_id}, 0, ignore_eos=True)[0][0]
             for p, n in zip(prompts, [4, 6, 3])]
    assert [len(o) for o in batched] == [4, 6, 3]
    assert batched == alone  # left padding changes nothing for fp32 greedy decoding


def test_batch1_ms_per_token_is_one_figure_per_prompt(chat_model):
    _, model, tok = chat_model
    per_prompt = ms_per_token(model, [tok("the lazy dog").input_ids, tok("a model").input_ids], [3, 3])
    assert len(per_prompt) == 2 and all(isinstance(ms, float) for ms in per_prompt)


def test_sampling_arguments():
    assert sampling_kwargs(8, True)["min_new_tokens"] == 8 and not sampling_kwargs(8, False)["do_sample"]
    sample = sampling_kwargs(8, False, temperature=0.7, top_p=0.9)
    assert sample["do_sample"] and sample["temperature"] == 0.7 and sample["top_p"] == 0.9
