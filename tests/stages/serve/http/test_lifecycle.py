"""Cancellation, backpressure, timeouts, health and auth on the real server."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest

from .conftest import make_engine, running, serve
from .prom_text import value

LONG = {"prompt": "the quick brown fox", "max_tokens": 100, "ignore_eos": True, "temperature": 0}


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        if time.time() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


@pytest.fixture(scope="module")
def slow(model_dir):
    with serve(model_dir, step_delay=0.01, request_timeout_s=None) as running_server:
        yield running_server


def engine_is_idle(server, free_blocks: int) -> bool:
    stats = server.state.engine.stats()
    return stats.num_free_blocks == free_blocks and stats.num_running == stats.num_waiting == 0


def test_disconnect_mid_stream_aborts_and_frees_every_block(slow):
    engine = slow.state.engine
    initial, aborted = engine.stats().num_free_blocks, engine.stats().finished.get("abort", 0)
    with slow.client() as client, client.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert engine.stats().num_free_blocks < initial  # the request holds blocks now
    wait_until(lambda: engine_is_idle(slow, initial), timeout=5)
    assert engine.stats().finished["abort"] == aborted + 1


def test_disconnect_while_waiting_for_a_whole_response_aborts_too(slow):
    engine = slow.state.engine
    initial, aborted = engine.stats().num_free_blocks, engine.stats().finished.get("abort", 0)
    with httpx.Client(base_url=slow.base_url, timeout=httpx.Timeout(5, read=0.3)) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/completions", json=LONG)
    wait_until(lambda: engine_is_idle(slow, initial), timeout=5)
    assert engine.stats().finished["abort"] == aborted + 1


@contextmanager
def engine_paused(server):
    """Hold the engine inside its next step until the block ends: nothing finishes meanwhile."""
    runner, gate = server.state.engine.engine.runner, threading.Event()
    execute = runner.execute

    def held(step):
        gate.wait(30)
        return execute(step)

    runner.execute = held
    try:
        yield
    finally:
        gate.set()


def test_a_flood_past_the_queue_bound_gets_503_while_admitted_requests_complete(model_dir):
    body = {"prompt": "pack the weights", "max_tokens": 20, "ignore_eos": True}
    with serve(model_dir, engine_overrides={"max_num_seqs": 2}, max_queued_requests=2) as small:
        def post(_):
            with small.client() as client:
                return client.post("/v1/completions", json=body)

        with ThreadPoolExecutor(12) as pool:
            with engine_paused(small):  # 2 running + 2 queued are admitted; the other 8 must not wait
                futures = [pool.submit(post, i) for i in range(12)]
                wait_until(lambda: sum(f.done() for f in futures) == 8)
            responses = [f.result() for f in futures]
        busy = [r for r in responses if r.status_code == 503]
        done = [r for r in responses if r.status_code == 200]
        assert len(busy) == 8 and len(done) == 4
        assert all(r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full" for r in busy)
        assert all(r.json()["usage"]["completion_tokens"] == 20 for r in done)
        assert small.state.admission.in_flight == 0 and small.state.admission.queued_tokens == 0
        with small.client() as client:
            assert client.post("/v1/completions", json=body).status_code == 200
            metrics = client.get("/metrics").text
        assert value(metrics, "llmopt:requests_rejected_total", reason="queue_full") == 8


def test_a_token_bound_refuses_a_second_long_prompt(model_dir):
    body = {"prompt": [7] * 60, "max_tokens": 3, "ignore_eos": True}
    with serve(model_dir, max_queued_tokens=100) as s, s.client() as client, ThreadPoolExecutor(1) as pool:
        with engine_paused(s):
            first = pool.submit(client.post, "/v1/completions", json=body)
            wait_until(lambda: s.state.admission.queued_tokens == 60)
            err = client.post("/v1/completions", json=body)
        assert err.status_code == 503 and err.json()["error"]["code"] == "queue_tokens_full"
        assert "60" in err.json()["error"]["message"] and "100" in err.json()["error"]["message"]
        assert first.result().status_code == 200
        assert client.post("/v1/completions", json=body).status_code == 200  # the queue is empty again


def test_request_timeout_aborts_with_504_or_an_error_frame(model_dir):
    with serve(model_dir, step_delay=0.01, request_timeout_s=0.3) as timed, timed.client() as client:
        initial = timed.state.engine.stats().num_free_blocks
        response = client.post("/v1/completions", json=LONG)
        assert response.status_code == 504 and response.json()["error"]["code"] == "request_timeout"
        with client.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as stream:
            frames = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        assert frames[-1] == "[DONE]" and json.loads(frames[-2])["error"]["code"] == "request_timeout"
        wait_until(lambda: engine_is_idle(timed, initial), timeout=5)


def test_api_key(model_dir):
    with serve(model_dir, api_key="sekrit") as locked, locked.client() as client:
        assert client.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/metrics").status_code == 401 and client.get("/openapi.json").status_code == 401
        good = openai.OpenAI(base_url=locked.base_url + "/v1", api_key="sekrit", max_retries=0)
        assert good.completions.create(model="tiny", prompt="x", max_tokens=1).usage.completion_tokens == 1
        bad = openai.OpenAI(base_url=locked.base_url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    with serve(model_dir, api_key="sekrit", metrics_public=True) as public, public.client() as client:
        assert client.get("/metrics").status_code == 200 and client.get("/v1/models").status_code == 401


def test_health_is_503_while_loading_and_after_a_failed_load(model_dir):
    from llmopt.stages.errors import SourceError
    from llmopt.stages.serve.http import ServerConfig, create_app

    release, failures = threading.Event(), []

    def loader():
        release.wait(10)
        return make_engine(model_dir)

    with running(create_app(ServerConfig(), loader=loader)) as loading, loading.client() as client:
        assert client.get("/health").json() == {"status": "loading"} and client.get("/health").status_code == 503
        busy = client.post("/v1/completions", json={"prompt": "x"})
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "loading" and "retry-after" in busy.headers
        assert value(client.get("/metrics").text, "llmopt:server_ready") == 0
        release.set()
        wait_until(lambda: client.get("/health").status_code == 200)

    def broken():
        raise SourceError("no such model")

    with running(create_app(ServerConfig(), loader=broken, on_load_error=failures.append)) as failed:
        with failed.client() as client:
            wait_until(lambda: failures)
            assert client.get("/health").json() == {"status": "load_failed"}
            assert "no such model" in client.post("/v1/completions", json={"prompt": "x"}).json()["error"]["message"]


def test_a_dead_engine_turns_health_and_requests_to_503(model_dir):
    with serve(model_dir) as doomed, doomed.client() as client:
        def explode(step):
            raise RuntimeError("device lost")

        doomed.state.engine.engine.runner.execute = explode
        response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
        assert client.get("/health").status_code == 503 and client.get("/health").json()["status"] == "engine_dead"
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 503


def test_access_log_has_a_request_id(server, caplog):
    with caplog.at_level("INFO", logger="llmopt.access"), server.client() as client:
        response = client.get("/health", headers={"X-Request-Id": "abc-123"})
        other = client.get("/health")
    assert response.headers["x-request-id"] == "abc-123" and len(other.headers["x-request-id"]) == 32
    assert any("abc-123" in r.getMessage() and "/health" in r.getMessage() for r in caplog.records)
