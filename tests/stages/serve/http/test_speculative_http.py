"""A server with n-gram speculation: streamed and whole answers equal a plain server's, and /metrics counts drafts."""
import json

from llmopt.stages.serve.engine.config import SpeculativeConfig

from .conftest import serve
from .prom_text import value

BODY = {"model": "tiny", "prompt": "twelve twelve twelve twelve", "max_tokens": 30, "temperature": 0,
        "ignore_eos": True}


def _streamed_text(client) -> str:
    with client.stream("POST", "/v1/completions", json=BODY | {"stream": True}) as response:
        chunks = [line[6:] for line in response.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    return "".join(json.loads(c)["choices"][0]["text"] for c in chunks)


def test_speculative_server_answers_as_a_plain_one_and_counts_drafts(model_dir):
    with serve(model_dir) as plain, plain.client() as client:
        expected = client.post("/v1/completions", json=BODY).json()["choices"][0]["text"]
    with serve(model_dir, {"speculative": SpeculativeConfig("ngram", 3)}) as spec, spec.client() as client:
        assert client.post("/v1/completions", json=BODY).json()["choices"][0]["text"] == expected
        assert _streamed_text(client) == expected
        metrics = client.get("/metrics").text
    assert value(metrics, "llmopt:spec_decode_num_accepted_tokens_total", model_name="tiny") > 0
