"""Tenants (--api-keys-file): each key's own limits answer 429 + Retry-After before the engine's queue,
other tenants go on as before, and /metrics counts requests by tenant and outcome."""
from __future__ import annotations

import time

import pytest

from llmopt.stages.serve.http.quota import Quotas
from llmopt.stages.serve.http.tenants import Tenant

from .conftest import serve
from .prom_text import value

TENANTS = (Tenant("a", "key-a", max_concurrency=1), Tenant("b", "key-b"), Tenant("c", "key-c", tokens_per_minute=100))
PROMPT = [1, 2, 3, 4, 5]  # token ids: 5 prompt tokens, whatever the tokenizer


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def complete(client, key: str, max_tokens: int = 4):
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    return client.post("/v1/completions", json=body, headers=auth(key))


@pytest.fixture(scope="module")
def tenant_server(model_dir):
    # Each step sleeps a little so that a stream of 100 tokens is still running while the test asks again.
    with serve(model_dir, step_delay=0.05, tenants=TENANTS) as running:
        state = running.state
        state.quotas = Quotas(TENANTS, state.config.retry_after_s, clock=lambda: 0.0)  # no refill: deterministic
        yield running


def wait_until(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.01)


def test_a_tenant_over_max_concurrency_gets_429_while_another_is_served(tenant_server):
    usage = tenant_server.state.quotas.usage
    body = {"prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "stream": True}
    with tenant_server.client() as client:
        with client.stream("POST", "/v1/completions", json=body, headers=auth("key-a")) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()  # held: a dropped iterator closes the connection
            assert next(line for line in lines if line.startswith("data:"))
            refused = complete(client, "key-a")
            assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
            error = refused.json()["error"]
            assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
            assert "max_concurrency of 1" in error["message"]
            assert complete(client, "key-b").status_code == 200  # another tenant: admitted as before
            assert usage["a"].in_flight == 1
        wait_until(lambda: usage["a"].in_flight == 0)  # the client left mid-stream: the slot is free again
        assert complete(client, "key-a").status_code == 200
        metrics = client.get("/metrics", headers=auth("key-b")).text
    name = "llmopt:tenant_requests_total"
    assert value(metrics, name, tenant="a", outcome="concurrency_limited") == 1
    assert value(metrics, name, tenant="a", outcome="admitted") == 2
    assert value(metrics, name, tenant="b", outcome="admitted") == 1
    assert value(metrics, "llmopt:tenant_requests_in_flight", tenant="a") == 0
    assert value(metrics, "llmopt:num_requests_running", model_name="tiny") >= 0  # old series: labels unchanged


def test_tokens_per_minute_exhausted_gives_429_with_retry_after(tenant_server):
    with tenant_server.client() as client:
        for _ in range(2):  # 5 prompt + 40 generated each: 90 of the 100
            assert complete(client, "key-c", max_tokens=40).status_code == 200
        refused = complete(client, "key-c", max_tokens=40)  # may use 45; 10 are left
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "21"  # 35 tokens at 100 a minute
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "tokens"
        assert "tokens_per_minute of 100" in error["message"]
        assert complete(client, "key-c", max_tokens=5).status_code == 200  # 10 tokens still fit
        never = complete(client, "key-c", max_tokens=120)  # 125 could never fit a bucket of 100
        assert never.status_code == 400 and never.json()["error"]["code"] == "tokens_over_tenant_limit"
        assert complete(client, "key-b").status_code == 200  # no token limit of its own
        metrics = client.get("/metrics", headers=auth("key-c")).text
    assert value(metrics, "llmopt:tenant_requests_total", tenant="c", outcome="rate_limited") == 1
    assert value(metrics, "llmopt:tenant_requests_total", tenant="c", outcome="admitted") == 3
    assert value(metrics, "llmopt:tenant_tokens_total", tenant="c") == 100


@pytest.mark.parametrize("headers", [{}, auth("nope"), {"Authorization": "Basic key-a"}, {"Authorization": "Bearer"}])
def test_a_missing_or_wrong_key_is_401(tenant_server, headers):
    with tenant_server.client() as client:
        response = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["WWW-Authenticate"] == "Bearer"
        assert client.get("/health").status_code == 200


def test_the_unused_part_of_a_reservation_is_given_back():
    quotas = Quotas((Tenant("t", "k", max_concurrency=2, tokens_per_minute=60),), 1, clock=lambda: 0.0)
    lease = quotas.acquire("t", 50)
    lease.release(20)
    lease.release(20)  # a second release (stream end after disconnect) changes nothing
    assert quotas.usage["t"].bucket.level == 40 and quotas.usage["t"].in_flight == 0
    assert quotas.acquire(None, 10) is None and quotas.acquire("unknown", 10) is None
