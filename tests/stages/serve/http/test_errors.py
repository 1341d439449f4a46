"""Raw httpx against the real server: every bad input gets its documented status and an OpenAI
error body, never a 500, and the server keeps serving afterwards."""
from __future__ import annotations

import pytest

from .conftest import serve

OK = {"prompt": "the quick brown fox", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


@pytest.fixture(scope="module")
def http(server):
    with server.client() as client:
        yield client
    # the server is still healthy after all of it
    with server.client() as client:
        assert client.post("/v1/completions", json=OK).status_code == 200


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", OK | {"temperature": "hot"}, "temperature"),
    ("/v1/completions", OK | {"temperature": 2.5}, "temperature"),
    ("/v1/completions", OK | {"top_p": 0}, "top_p"),
    ("/v1/completions", OK | {"n": 0}, "n"),
    ("/v1/completions", OK | {"n": "two"}, "n"),
    ("/v1/completions", OK | {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", OK | {"max_tokens": -3}, "max_tokens"),
    ("/v1/completions", OK | {"logprobs": 50}, "logprobs"),
    ("/v1/completions", OK | {"presence_penalty": 5}, "presence_penalty"),
    ("/v1/completions", OK | {"seed": 2**70}, "seed"),
    ("/v1/completions", OK | {"stop": [""]}, "stop"),
    ("/v1/completions", OK | {"stream": {"yes": 1}}, "stream"),
    ("/v1/completions", {"max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, "prompt"),
    ("/v1/completions", {"prompt": [1, -2]}, "prompt"),
    ("/v1/completions", OK | {"echo": True}, "echo"),
    ("/v1/completions", OK | {"logit_bias": {"5": 1.0}}, "logit_bias"),
    ("/v1/completions", OK | {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"max_tokens": 2}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type"),
    ("/v1/chat/completions", CHAT | {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", CHAT | {"tools": [{"type": "function"}]}, "tools"),
])
def test_bad_values_are_400_naming_the_field(http, route, body, param):
    err = error_of(http.post(route, json=body), 400)
    assert err["type"] == "invalid_request_error" and (err["param"] or "").startswith(param)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'{"prompt": "x", "temperature": NaN}',
                                 b'{"prompt": "x", "max_tokens": 1e400}', b"\xff\xfe", b'{"prompt": "\\ud800"}',
                                 b'{"prompt": ["ok", "\\udfff"]}'])
def test_malformed_bodies_are_400(http, raw):
    error_of(http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize("route, raw, param", [
    ("/v1/completions", b'{"prompt": ["ok", "\\udfff"]}', "prompt[1]"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
])
def test_a_lone_surrogate_names_its_json_path(http, route, raw, param):
    err = error_of(http.post(route, content=raw, headers={"content-type": "application/json"}), 400)
    assert err["param"] == param and "Unicode" in err["message"]


def test_prompt_plus_max_tokens_over_the_model_length_names_both_numbers(http):
    err = error_of(http.post("/v1/completions", json={"prompt": [5] * 100, "max_tokens": 40}), 400)
    assert "100" in err["message"] and "40" in err["message"] and "128" in err["message"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    err = error_of(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "dog " * 200}]}),
                   400)
    assert "128" in err["message"] and err["param"] == "messages"


def test_the_context_length_messages_are_word_for_word(http):
    err = error_of(http.post("/v1/completions", json={"prompt": [5] * 100, "max_tokens": 40}), 400)
    assert err["message"] == ("the prompt has 100 tokens and max_tokens asks for 40 more: 140 in all, over this "
                              "model's maximum context length of 128; shorten the prompt or lower max_tokens")
    err = error_of(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "dog " * 200}]}),
                   400)
    assert err["message"].startswith("the prompt has ") and err["message"].endswith(
        " tokens, but this model's maximum context length is 128 (the prompt plus at least one new token); "
        "shorten the prompt") and err["code"] == "context_length_exceeded"


def test_one_bad_prompt_of_several_queues_none_of_them(server, http):
    before = sum(server.state.engine.stats().finished.values())
    body = {"prompt": [[5] * 10, [5] * 10, [5] * 200], "max_tokens": 2, "n": 2}
    err = error_of(http.post("/v1/completions", json=body), 400)
    assert err["code"] == "context_length_exceeded" and "200 tokens" in err["message"]
    assert http.post("/v1/completions", json=OK).status_code == 200
    assert sum(server.state.engine.stats().finished.values()) == before + 1  # only the good request ran
    assert server.state.engine.load() == (0, 0)


def test_prompt_token_ids_outside_the_vocabulary(http):
    err = error_of(http.post("/v1/completions", json={"prompt": [5, 10_000], "max_tokens": 2}), 400)
    assert "300" in err["message"]


def test_unknown_model_route_and_method(http):
    assert error_of(http.post("/v1/completions", json=OK | {"model": "gpt-4"}), 404)["code"] == "model_not_found"
    error_of(http.get("/v1/models/gpt-4"), 404)
    error_of(http.get("/v2/nothing"), 404)
    error_of(http.get("/v1/completions"), 405)


def test_body_over_the_limit_is_413(model_dir):
    with serve(model_dir, max_body_bytes=1000) as small, small.client() as client:
        err = error_of(client.post("/v1/completions", json={"prompt": "x" * 2000}), 413)
        assert "1000" in err["message"]
        chunked = client.post("/v1/completions", content=iter([b'{"prompt": "', b"x" * 2000, b'"}']),
                              headers={"content-type": "application/json"})
        error_of(chunked, 413)
        assert client.post("/v1/completions", json=OK).status_code == 200


def test_chat_without_a_template_is_a_clear_400(tmp_path_factory):
    from tests.helpers import write_hf_dir

    plain = tmp_path_factory.mktemp("no-template")
    write_hf_dir(plain)
    with serve(plain) as no_template, no_template.client() as client:
        err = error_of(client.post("/v1/chat/completions", json=CHAT), 400)
        assert err["code"] == "no_chat_template" and "/v1/completions" in err["message"]
        assert client.post("/v1/completions", json=OK).status_code == 200
