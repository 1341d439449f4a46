"""The official `openai` client against the real server: completions, chat, streaming, usage."""
from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_models_lists_the_served_name(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].owned_by == "llmopt"
    assert client.models.retrieve("tiny").id == "tiny"


def test_completion_text_and_usage(client):
    out = client.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert out.object == "text_completion" and out.model == "tiny" and out.id.startswith("cmpl-")
    assert choice.finish_reason == "length" and choice.text
    assert out.usage.completion_tokens == 6 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 6


def test_greedy_is_deterministic_and_seeded_sampling_reproduces(client):
    def text(**kw):
        return client.completions.create(model="tiny", prompt="a language model", max_tokens=8,
                                         extra_body={"ignore_eos": True}, **kw).choices[0].text

    assert text(temperature=0) == text(temperature=0)
    assert text(temperature=1.0, top_p=0.9, seed=11) == text(temperature=1.0, top_p=0.9, seed=11)


def test_n_choices_and_a_batch_of_prompts(client):
    out = client.completions.create(model="tiny", prompt=["the lazy dog", "pack the weights"], n=2, max_tokens=4,
                                    temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 16
    assert out.choices[0].text != out.choices[1].text or out.choices[0].text == ""  # seeds 3 and 4


def test_token_id_prompt_and_penalties(client):
    out = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=5, temperature=0.7,
                                    presence_penalty=0.5, frequency_penalty=0.5,
                                    extra_body={"ignore_eos": True, "repetition_penalty": 1.2})
    assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 5


def test_stop_string_cuts_the_text(client):
    full = client.completions.create(model="tiny", prompt="the quick brown", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[4:6]
    cut = client.completions.create(model="tiny", prompt="the quick brown", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]


def test_completion_logprobs(client):
    out = client.completions.create(model="tiny", prompt="the quick", max_tokens=3, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(max(top.values()) == pytest.approx(chosen) for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == sorted(lp.text_offset)


def test_streamed_completion_equals_the_whole_one(client):
    kw = dict(model="tiny", prompt="twelve small layers", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_completion_with_the_template(client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "be brief"},
                                                                 {"role": "user", "content": "the quick brown fox"}],
                                         max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 5
    assert len(choice.logprobs.content) == 5 and all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)


def test_streamed_chat_with_usage(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": [{"type": "text", "text": "pack the weights"}]}],
              max_completion_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 7 and chunks[-1].usage.prompt_tokens > 0


def test_streamed_n_choices_arrive_under_their_index(client):
    stream = client.completions.create(model="tiny", prompt="the lazy dog", n=3, max_tokens=4, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    texts = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert sorted(texts) == [0, 1, 2] and len(set(texts.values())) == 1  # greedy: three equal choices


def test_the_client_sees_openai_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=100_000)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
