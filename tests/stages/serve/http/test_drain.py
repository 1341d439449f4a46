"""The drain of a real `llmopt serve` process on SIGTERM: a grace in which the port stays open and
says 503, then a bounded wait, then every unfinished request is ended cleanly, and exit 0."""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx

from .prom_text import value
from .serve_process import serve_process

GRACE_S, TIMEOUT_S = 2.0, 1.0  # a 2 s grace: the test gets its refused request in on a loaded machine


class Stream(threading.Thread):
    """One streaming completion read to its end in a thread: its data frames and when [DONE] came."""

    def __init__(self, base_url: str, max_tokens: int):
        super().__init__(daemon=True)
        self.base_url, self.max_tokens = base_url, max_tokens
        self.frames: list[str] = []
        self.started, self.done_at = threading.Event(), None

    def run(self) -> None:
        body = {"prompt": "the quick brown fox", "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.Client(base_url=self.base_url, timeout=30) as client:
            with client.stream("POST", "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.frames.append(line[6:])
                        self.started.set()
        self.done_at = time.monotonic()

    def finish_reason(self) -> str:
        return [json.loads(f) for f in self.frames[:-1] if json.loads(f)["choices"]][-1]["choices"][0]["finish_reason"]

    def completion_tokens(self) -> int:
        return json.loads(self.frames[-2])["usage"]["completion_tokens"]


def running_sequences(server) -> int:
    with server.client() as client:
        text = client.get("/metrics").text
    return int(value(text, "llmopt:num_requests_running"))


def fresh_get(server, path: str) -> httpx.Response:
    """On a new connection each time: what a load balancer's probe does."""
    with server.client() as client:
        return client.get(path)


def test_sigterm_drains_in_order_and_ends_every_request_cleanly(model_dir, tmp_path):
    with serve_process(model_dir, "--drain-grace", str(GRACE_S), "--drain-timeout", str(TIMEOUT_S), "--log-json",
                       step_delay=0.05, tmp_path=tmp_path) as server:
        long, short = Stream(server.base_url, 100), Stream(server.base_url, 24)  # ~5 s and ~1.2 s of steps
        whole: list[httpx.Response] = []
        worker = threading.Thread(target=lambda: whole.append(httpx.post(
            server.base_url + "/v1/completions", json={"prompt": "pack", "max_tokens": 100, "ignore_eos": True},
            timeout=30)), daemon=True)
        for thread in (long, short, worker):
            thread.start()
        deadline = time.monotonic() + 20
        while running_sequences(server) < 3:
            assert time.monotonic() < deadline, "the three requests never ran together"
            time.sleep(0.02)

        sent = server.terminate()
        # The grace: new connections are still accepted; /health and new requests get 503 on them.
        while (health := fresh_get(server, "/health")).status_code == 200:
            time.sleep(0.01)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        with server.client() as client:
            refused = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert refused.headers["retry-after"] == "1"
        # Then the port closes, while the long requests still run.
        while True:
            try:
                fresh_get(server, "/health")
            except httpx.ConnectError:
                closed_after = time.monotonic() - sent
                break
            time.sleep(0.02)
        assert closed_after >= GRACE_S and long.done_at is None

        for thread in (long, short, worker):
            thread.join(30)
        code = server.proc.wait(30)
        exited_after = time.monotonic() - sent

    # The short stream finished within the timeout: untouched.
    assert short.frames[-1] == "[DONE]" and short.finish_reason() == "length" and short.completion_tokens() == 24
    # The long stream ran past it: a last chunk that says "abort", then [DONE] -- no cut connection.
    assert long.frames[-1] == "[DONE]" and long.finish_reason() == "abort" and long.completion_tokens() < 100
    assert long.done_at - sent >= GRACE_S + TIMEOUT_S
    # A whole response cannot say so in a chunk: 503.
    assert whole[0].status_code == 503 and whole[0].json()["error"]["code"] == "shutting_down"
    assert code == 0
    stderr = server.stderr
    assert "Traceback" not in stderr and "CancelledError" not in stderr
    assert len([line for line in stderr.splitlines() if "aborted cmpl-" in line]) == 2  # one line each
    print(f"port closed {closed_after:.2f} s after SIGTERM, long stream ended {long.done_at - sent:.2f} s after, "
          f"exit {exited_after:.2f} s after")



def draining_server(grace_s: float):
    """A DrainingServer that has started (nothing bound): what its signal handler decides."""
    import uvicorn

    from llmopt.stages.serve.http import ServerConfig
    from llmopt.stages.serve.http.server import DrainingServer
    from llmopt.stages.serve.http.state import ServerState

    config = ServerConfig(drain_grace_s=grace_s)
    server = DrainingServer(config, ServerState(config), uvicorn.Config(lambda scope, receive, send: None))
    server.started = True
    return server


def test_sigterm_starts_the_grace_and_a_second_signal_ends_it():
    server = draining_server(30)
    server.handle_exit(signal.SIGTERM, None)
    assert server.state.draining and not server.should_exit and server.grace_ends > time.monotonic() + 20
    server.handle_exit(signal.SIGTERM, None)
    assert server.grace_ends <= time.monotonic() and not server.should_exit
    assert asyncio.run(server.on_tick(1)) and server.should_exit  # uvicorn's next tick (every 0.1 s) ends it


def test_ctrl_c_skips_the_grace():
    """SIGINT is a person at a terminal, not an orchestrator: no load balancer to wait for."""
    server = draining_server(30)
    server.handle_exit(signal.SIGINT, None)
    assert server.state.draining and server.should_exit and server.grace_ends is None
