"""Strict request validation: a JSON value of the wrong type, or null where a value is required, is
a 400 whose `param` is the client's JSON path (messages[1].tool_call_id), never pydantic's internal
location (prompt.str, stop.constrained-str); null in an optional field is its default; OpenAI's
good variants (an integer temperature, content as text parts) still answer 200."""
from __future__ import annotations

import re

import pytest

from llmopt.stages.serve.http.errors import field_path, user_path
from llmopt.stages.serve.http.protocol import MAX_STOP, ChatCompletionRequest, CompletionRequest

OK = {"prompt": "the quick brown fox", "max_tokens": 2}
USER = {"role": "user", "content": "hi"}
CHAT = {"messages": [USER], "max_tokens": 2}
CMPL, CHATS = "/v1/completions", "/v1/chat/completions"
TYPE, MISSING, VALUE = "invalid_type", "missing_required_parameter", "invalid_value"
JSON_PATH = re.compile(r"^[a-z_]+(\[\d+\]|\.[a-z_0-9]+)*$")


def chat(*messages, **fields) -> dict:
    return {"messages": list(messages), "max_tokens": 2} | fields


BAD = [
    # the cases issue 25 found answering 200
    (CMPL, OK | {"stream": "yes"}, "stream", TYPE),
    (CMPL, OK | {"n": "2"}, "n", TYPE),
    (CMPL, OK | {"max_tokens": True}, "max_tokens", TYPE),
    (CHATS, chat({"role": "user", "content": None}), "messages[0].content", TYPE),
    (CHATS, chat({"role": "user"}), "messages[0].content", MISSING),
    (CHATS, chat(USER, {"role": "tool", "content": "sunny"}), "messages[1].tool_call_id", MISSING),
    (CMPL, OK | {"stop": ["x"] * (MAX_STOP + 1)}, "stop", VALUE),
    # the same class of bug in the other fields: strings, booleans and decimals are not integers...
    (CMPL, OK | {"n": 2.0}, "n", TYPE),
    (CMPL, OK | {"n": True}, "n", TYPE),
    (CMPL, OK | {"max_tokens": "5"}, "max_tokens", TYPE),
    (CMPL, OK | {"max_tokens": 2.5}, "max_tokens", TYPE),
    (CMPL, OK | {"seed": "7"}, "seed", TYPE),
    (CMPL, OK | {"logprobs": True}, "logprobs", TYPE),
    (CMPL, OK | {"best_of": "1"}, "best_of", TYPE),
    (CMPL, OK | {"top_k": 1.5}, "top_k", TYPE),
    (CMPL, OK | {"stop_token_ids": ["2"]}, "stop_token_ids[0]", TYPE),
    (CHATS, CHAT | {"max_completion_tokens": "5"}, "max_completion_tokens", TYPE),
    (CHATS, CHAT | {"logprobs": True, "top_logprobs": True}, "top_logprobs", TYPE),
    # ...strings and booleans are not numbers...
    (CMPL, OK | {"temperature": "1"}, "temperature", TYPE),
    (CMPL, OK | {"temperature": True}, "temperature", TYPE),
    (CMPL, OK | {"top_p": "0.5"}, "top_p", TYPE),
    (CMPL, OK | {"presence_penalty": "0"}, "presence_penalty", TYPE),
    (CMPL, OK | {"logit_bias": {"5": "1"}}, "logit_bias.5", TYPE),
    # ...strings and numbers are not booleans, numbers are not strings
    (CMPL, OK | {"stream": 1}, "stream", TYPE),
    (CMPL, OK | {"echo": "no"}, "echo", TYPE),
    (CMPL, OK | {"ignore_eos": "true"}, "ignore_eos", TYPE),
    (CMPL, OK | {"skip_special_tokens": 0}, "skip_special_tokens", TYPE),
    (CMPL, OK | {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", TYPE),
    (CHATS, CHAT | {"logprobs": 1}, "logprobs", TYPE),
    (CHATS, CHAT | {"stream": "yes"}, "stream", TYPE),
    (CMPL, OK | {"user": 5}, "user", TYPE),
    (CMPL, OK | {"model": 5}, "model", TYPE),
    # unions: the member the value's shape picks names the item (never prompt.str, stop.constrained-str)
    (CMPL, OK | {"stop": 5}, "stop", TYPE),
    (CMPL, OK | {"stop": [""]}, "stop[0]", VALUE),
    (CMPL, OK | {"stop": ["a", 5]}, "stop[1]", TYPE),
    (CMPL, {"prompt": None}, "prompt", TYPE),
    (CMPL, {"prompt": {"str": "x"}}, "prompt", TYPE),
    (CMPL, {"prompt": [1, True]}, "prompt[1]", TYPE),
    (CMPL, {"prompt": [1.0]}, "prompt[0]", TYPE),
    (CMPL, {"prompt": ["a", 5]}, "prompt[1]", TYPE),
    (CMPL, {"prompt": [[1], ["a"]]}, "prompt[1][0]", TYPE),
    # messages: a value required by the role, of the type OpenAI's API has
    (CHATS, chat({"role": "system", "content": None}, USER), "messages[0].content", TYPE),
    (CHATS, chat(USER, {"role": "tool", "content": "sunny", "tool_call_id": 5}), "messages[1].tool_call_id", TYPE),
    (CHATS, chat(USER, {"role": "tool", "tool_call_id": "call_1"}), "messages[1].content", MISSING),
    (CHATS, chat({"content": "hi"}), "messages[0].role", MISSING),
    (CHATS, chat({"role": None, "content": "hi"}), "messages[0].role", VALUE),
    (CHATS, chat({"role": "user", "user": "hi"}), "messages[0].content", MISSING),
    (CHATS, chat({"role": "user", "content": 5}), "messages[0].content", TYPE),
    (CHATS, chat({"role": "user", "content": ["hi"]}), "messages[0].content[0]", TYPE),
    (CHATS, chat({"role": "user", "content": [{"type": "text"}]}), "messages[0].content[0].text", MISSING),
    (CHATS, chat({"role": "user", "content": [{"type": "text", "text": None}]}), "messages[0].content[0].text", TYPE),
    (CHATS, chat({"role": "user", "content": [{"text": "hi"}]}), "messages[0].content[0].type", MISSING),
    (CHATS, chat({"role": "user", "content": "hi", "name": 5}), "messages[0].name", TYPE),
    (CHATS, chat(5), "messages[0]", TYPE),
]


def error_of(response) -> dict:
    assert response.status_code == 400, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]


@pytest.fixture(scope="module")
def http(server):
    with server.client() as client:
        yield client


@pytest.mark.parametrize("route, body, param, code", BAD, ids=[f"{i}-{case[2]}" for i, case in enumerate(BAD)])
def test_wrong_types_and_missing_values_are_400_naming_the_json_path(http, route, body, param, code):
    err = error_of(http.post(route, json=body))
    assert (err["param"], err["code"]) == (param, code), err["message"]
    assert JSON_PATH.match(err["param"]) and err["message"].startswith(param)


def test_the_messages_say_what_was_wanted_and_the_limit(http):
    assert error_of(http.post(CMPL, json=OK | {"n": "2"}))["message"] == "n: expected an integer, got a string"
    assert error_of(http.post(CMPL, json=OK | {"max_tokens": 2.5}))["message"] == \
        "max_tokens: expected an integer, got a decimal number"
    err = error_of(http.post(CHATS, json=chat({"role": "user", "content": None})))
    assert err["message"] == "messages[0].content: expected a string or an array, got null"
    err = error_of(http.post(CMPL, json=OK | {"stop": ["x"] * 17}))
    assert err["message"] == f"stop: at most {MAX_STOP} items are allowed, got 17"
    assert error_of(http.post(CHATS, json=chat(USER, {"role": "tool", "content": "x"})))["message"] == \
        "messages[1].tool_call_id is required"


@pytest.mark.parametrize("route, body, choices", [
    (CMPL, OK | {"n": 1}, 1),
    (CMPL, OK | {"n": 2}, 2),
    (CMPL, OK | {"temperature": 1, "top_p": 1, "presence_penalty": 0, "min_p": 0, "repetition_penalty": 1}, 1),
    (CMPL, OK | {"n": None, "stream": None, "temperature": None, "stop": None, "seed": None, "echo": None,
                 "presence_penalty": None, "frequency_penalty": None, "logprobs": None, "ignore_eos": None}, 1),
    (CMPL, OK | {"stop": ["x"] * MAX_STOP, "stop_token_ids": [0], "seed": 0, "echo": False, "stream": False}, 1),
    (CMPL, {"prompt": [[5, 6], [7]], "max_tokens": 2}, 2),
    (CHATS, chat({"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "!"}]}), 1),
    (CHATS, chat({"role": "system", "content": "be brief"}, USER, {"role": "assistant", "content": None},
                 {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}, USER), 1),
    (CHATS, CHAT | {"logprobs": None, "n": None, "stream_options": None, "max_completion_tokens": 2,
                    "temperature": 0}, 1),
])
def test_good_variants_still_answer_200(http, route, body, choices):
    response = http.post(route, json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == choices


def test_a_stream_true_stays_a_stream(http):
    response = http.post(CMPL, json=OK | {"stream": True, "stream_options": {"include_usage": None}})
    assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")


def test_text_parts_read_as_the_same_text(http):
    greedy = {"max_tokens": 4, "temperature": 0}
    parts = [{"type": "text", "text": "the quick "}, {"type": "text", "text": "brown fox"}]
    as_parts = http.post(CHATS, json=chat({"role": "user", "content": parts}, **greedy)).json()
    as_text = http.post(CHATS, json=chat({"role": "user", "content": "the quick brown fox"}, **greedy)).json()
    assert as_parts["usage"] == as_text["usage"]
    assert as_parts["choices"][0]["message"] == as_text["choices"][0]["message"]


@pytest.mark.parametrize("model, loc, path", [
    (CompletionRequest, ("body", "prompt", "list[constrained-int]", 1), ("prompt", 1)),
    (CompletionRequest, ("body", "prompt", "tokens", 1), ("prompt", 1)),
    (CompletionRequest, ("body", "stop", "constrained-str"), ("stop",)),
    (CompletionRequest, ("body", "stop", "list[constrained-str]", 3), ("stop", 3)),
    (CompletionRequest, ("body", "stream_options", "include_usage"), ("stream_options", "include_usage")),
    (ChatCompletionRequest, ("body", "messages", 2, "tool", "content", "str"), ("messages", 2, "content")),
    (ChatCompletionRequest, ("body", "messages", 0, "user", "content", "list[...]", 1, "text", "text"),
     ("messages", 0, "content", 1, "text")),
    (None, ("body", "messages", 0, "content"), ("messages", 0, "content")),
])
def test_pydantic_locations_map_to_json_paths(model, loc, path):
    assert user_path(loc, model) == path


def test_json_paths_are_written_as_openai_writes_them():
    assert field_path(("messages", 0, "content", 1, "text")) == "messages[0].content[1].text"
    assert field_path(("prompt", 2, 0)) == "prompt[2][0]"
    assert field_path(()) == ""
