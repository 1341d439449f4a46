"""The router in front of real tiny-model servers and of fake replicas that fail on purpose: it proxies the
OpenAI routes (streams too), keeps a shared prefix on one replica, ejects and re-admits replicas from their
health, retries a request that failed before its first byte, ends a stream cut mid-way with an error frame and
[DONE], and answers 503 + Retry-After only when no replica is healthy."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from llmopt.stages.route.app import create_router_app
from llmopt.stages.route.config import RouteConfig
from tests.stages.serve.http.conftest import CHAT_TEMPLATE, make_engine, running
from tests.helpers import write_chat_model_dir

FAST = dict(health_interval_s=0.1, eject_after=2)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two real servers on the tiny chat model."""
    from llmopt.stages.serve.http import ServerConfig, create_app

    model = write_chat_model_dir(tmp_path_factory.mktemp("tiny"), CHAT_TEMPLATE)
    with running(create_app(ServerConfig(served_model_name="tiny"), engine=make_engine(model))) as a, \
            running(create_app(ServerConfig(served_model_name="tiny"), engine=make_engine(model))) as b:
        yield a, b


class Fake:
    """A replica whose health and answers a test sets: mode ok | error500 | cut (streams one chunk, then dies)."""

    def __init__(self):
        self.healthy, self.mode, self.calls = True, "ok", 0
        self.load_in_health, self.running, self.waiting, self.scrapes = False, 0, 0, 0
        self.app = FastAPI()

        @self.app.get("/health")
        async def health():
            if not self.healthy:
                return JSONResponse({"status": "down"}, status_code=503)
            counts = {"num_requests_running": self.running, "num_requests_waiting": self.waiting}
            return {"status": "ok", **(counts if self.load_in_health else {})}

        @self.app.get("/metrics")
        async def metrics():
            self.scrapes += 1
            return PlainTextResponse(f"llmopt:num_requests_running {self.running}\n"
                                     f"llmopt:num_requests_waiting {self.waiting}\n")

        @self.app.post("/v1/completions")
        async def completions():
            self.calls += 1
            if self.mode == "error500":
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)
            if self.mode == "cut":
                return StreamingResponse(self._cut(), media_type="text/event-stream")
            return {"object": "text_completion", "choices": [{"text": "fake", "index": 0, "finish_reason": "length"}]}

    async def _cut(self):
        yield b'data: {"choices": [{"text": "one"}]}\n\n'
        await asyncio.sleep(0.05)
        raise RuntimeError("the replica died mid-stream")


def wait_for(condition, timeout: float = 3.0) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.02)
    return time.monotonic() - start


def metric(text: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())


BODY = {"model": "tiny", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def test_proxies_completions_chat_and_streams_as_the_replica_answers(replicas):
    a, _ = replicas
    config = RouteConfig((a.base_url, replicas[1].base_url), "round-robin", **FAST)
    with running(create_router_app(config)) as router, httpx.Client(timeout=30) as client:
        direct = client.post(a.base_url + "/v1/completions", json={**BODY, "prompt": "the quick"}).json()
        routed = [client.post(router.base_url + "/v1/completions", json={**BODY, "prompt": "the quick"}).json()
                  for _ in range(2)]
        assert [r["choices"][0]["text"] for r in routed] == [direct["choices"][0]["text"]] * 2  # greedy, both
        chat = client.post(router.base_url + "/v1/chat/completions",
                           json={**BODY, "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
        with client.stream("POST", router.base_url + "/v1/completions",
                           json={**BODY, "prompt": "the quick", "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert "".join(json.loads(x[6:])["choices"][0]["text"] for x in lines[:-1]) == direct["choices"][0]["text"]
        assert client.get(router.base_url + "/v1/models").json()["data"][0]["id"] == "tiny"
        text = client.get(router.base_url + "/metrics").text
        assert metric(text, "llmopt_router:requests_total") == 4
        assert metric(text, "llmopt_router:requests_total", replica=a.base_url) == 2  # round-robin


def test_cache_aware_sends_each_prefix_to_one_replica_whose_cache_then_hits(replicas):
    a, b = replicas
    config = RouteConfig((a.base_url, b.base_url), "cache-aware", **FAST)
    before = {r.base_url: httpx.get(r.base_url + "/metrics").text for r in replicas}
    prefixes = {g: f"group {g}: " + " ".join(["the quick brown fox jumps"] * 4) for g in "xy"}
    with running(create_router_app(config)) as router, httpx.Client(timeout=30) as client:
        for i in range(4):
            for g in "xy":
                body = {**BODY, "prompt": f"{prefixes[g]} question {i}", "max_tokens": 1}
                assert client.post(router.base_url + "/v1/completions", json=body).status_code == 200
        state = router.app.state.router
        sizes = sorted(len(r.tree.texts) for r in state.replicas)
        text = client.get(router.base_url + "/metrics").text
    assert sizes == [4, 4]  # each group's four prompts on one replica
    assert metric(text, "llmopt_router:routing_decisions_total", decision="cache_hit") == 6
    hits = {r.base_url: metric(httpx.get(r.base_url + "/metrics").text, "llmopt:prefix_cache_hits_total")
            - metric(before[r.base_url], "llmopt:prefix_cache_hits_total") for r in replicas}
    assert all(h > 0 for h in hits.values())  # both replicas reuse their group's prefix


def test_a_replica_is_ejected_and_readmitted_from_its_health(replicas):
    fake = Fake()
    with running(fake.app) as f:
        config = RouteConfig((f.base_url, replicas[0].base_url), "round-robin", **FAST)
        with running(create_router_app(config)) as router:
            state = router.app.state.router
            fake.healthy = False
            assert wait_for(lambda: not state.replicas[0].healthy) < 3.0
            calls = fake.calls
            with httpx.Client(timeout=30) as client:
                for _ in range(3):  # all to the healthy one
                    assert client.post(router.base_url + "/v1/completions",
                                       json={**BODY, "prompt": "a"}).status_code == 200
                assert fake.calls == calls
                fake.healthy = True
                assert wait_for(lambda: state.replicas[0].healthy) < 3.0
                text = client.get(router.base_url + "/metrics").text
    assert metric(text, "llmopt_router:ejections_total", replica=f.base_url) == 1
    assert metric(text, "llmopt_router:readmissions_total", replica=f.base_url) == 1


def test_a_failure_before_the_first_byte_is_retried_elsewhere():
    bad, good = Fake(), Fake()
    bad.mode = "error500"
    with running(bad.app) as b, running(good.app) as g:
        config = RouteConfig((b.base_url, g.base_url), "round-robin", **FAST)
        with running(create_router_app(config)) as router, httpx.Client(timeout=30) as client:
            for _ in range(4):
                response = client.post(router.base_url + "/v1/completions", json={**BODY, "prompt": "a"})
                assert response.status_code == 200 and response.json()["choices"][0]["text"] == "fake"
            text = client.get(router.base_url + "/metrics").text
    assert bad.calls >= 2 and metric(text, "llmopt_router:retries_total", replica=b.base_url) == bad.calls


def test_a_stream_cut_mid_way_ends_with_an_error_frame_and_done():
    fake = Fake()
    fake.mode = "cut"
    with running(fake.app) as f:
        with running(create_router_app(RouteConfig((f.base_url,), **FAST))) as router, httpx.Client(timeout=30) as c:
            with c.stream("POST", router.base_url + "/v1/completions", json={**BODY, "prompt": "a", "stream": True}) as s:
                assert s.status_code == 200
                frames = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert json.loads(frames[0])["choices"][0]["text"] == "one"
    assert json.loads(frames[-2])["error"]["code"] == "replica_failed" and frames[-1] == "[DONE]"


def test_no_healthy_replica_is_503_with_retry_after():
    fake = Fake()
    fake.healthy = False
    with running(fake.app) as f:
        with running(create_router_app(RouteConfig((f.base_url,), **FAST))) as router, httpx.Client(timeout=30) as c:
            wait_for(lambda: not router.app.state.router.replicas[0].healthy)
            response = c.post(router.base_url + "/v1/completions", json={**BODY, "prompt": "a"})
            assert response.status_code == 503 and response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] == "no_healthy_replica"
            assert c.get(router.base_url + "/health").status_code == 503
            assert c.post(router.base_url + "/v1/completions", content=b"{not json").status_code == 400


def test_a_stopped_replica_refuses_connections_and_is_ejected_at_once():
    import contextlib

    gone, stays = Fake(), Fake()
    with running(stays.app) as s, contextlib.ExitStack() as stack:
        g = stack.enter_context(running(gone.app))
        config = RouteConfig((g.base_url, s.base_url), "round-robin", health_interval_s=0.1, eject_after=100)
        with running(create_router_app(config)) as router, httpx.Client(timeout=30) as client:
            stack.close()  # the replica's port closes: connections are refused
            state = router.app.state.router
            assert wait_for(lambda: not state.replicas[0].healthy) < 3.0  # long before 100 failed checks
            for _ in range(3):
                assert client.post(router.base_url + "/v1/completions", json={**BODY, "prompt": "a"}).status_code == 200


@pytest.mark.parametrize("load_in_health", [True, False])
def test_least_load_reads_each_replica_from_health_or_else_metrics(load_in_health):
    """llmopt serve's /health carries the counts (no /metrics scrape); another server's load comes from /metrics."""
    fakes = [Fake(), Fake()]
    for f in fakes:
        f.load_in_health = load_in_health
    fakes[0].running, fakes[0].waiting = 3, 2  # another router's requests keep replica 0 busy
    with running(fakes[0].app) as r0, running(fakes[1].app) as r1:
        config = RouteConfig((r0.base_url, r1.base_url), "least-load", **FAST)
        app = create_router_app(config)
        with running(app) as router, httpx.Client(timeout=10) as client:
            state = app.state.router
            wait_for(lambda: state.router.replicas[0].load == 5)
            for _ in range(3):
                assert client.post(router.base_url + "/v1/completions", json={**BODY, "prompt": "x"}).status_code == 200
            assert (fakes[0].calls, fakes[1].calls) == (0, 3)
            assert (fakes[0].scrapes == 0) is load_in_health
