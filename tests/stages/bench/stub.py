"""A stub OpenAI-style server for the bench tests: scripted token timings, failures on request.

Two ways to use it:
- `scripted_transport(clock, scripts)`: an httpx MockTransport whose streams move a fake clock to
  scripted offsets before each event, so every timing the bench measures is known exactly;
- `serve_stub()`: the same behaviour as a real FastAPI app on a loopback port (real sleeps), for
  the command-line tests.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from llmopt.stages.bench.runner import Clock


class FakeClock(Clock):
    def __init__(self, start: float = 1000.0):
        self.t = start

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)  # let tasks created before the sleep read the time first
        self.t += seconds
        await asyncio.sleep(0)


@dataclass(frozen=True)
class Script:
    """Offsets in seconds after the request was sent: one per text event, then the end of the stream."""

    events: tuple[float, ...]
    end: float
    usage_tokens: int | None = None  # completion_tokens to report (None: no usage event)
    prompt_tokens: int | None = None
    status: int = 200
    finish_reason: str | None = None  # sent in a last event without text, when given


def _event(text: str, chat: bool = False, finish_reason: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    if finish_reason is not None:
        choice["finish_reason"] = finish_reason
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


def _usage(script: Script) -> bytes:
    usage = {"prompt_tokens": script.prompt_tokens, "completion_tokens": script.usage_tokens}
    return b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"


def scripted_transport(clock: FakeClock, scripts: dict[str, Script], seen: list | None = None) -> httpx.MockTransport:
    """Requests are matched to scripts by their prompt."""

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "stub-model"}]})
        body = json.loads(request.content)
        if seen is not None:
            seen.append(body)
        prompt = body.get("prompt") or body["messages"][0]["content"]
        script = scripts[prompt]
        if script.status != 200:
            return httpx.Response(script.status, text="scripted failure")
        t0 = clock.t

        async def stream():
            for i, offset in enumerate(script.events):
                clock.t = t0 + offset
                yield _event(f" tok{i}", chat="messages" in body)
            if script.finish_reason is not None:
                yield _event("", chat="messages" in body, finish_reason=script.finish_reason)
            if script.usage_tokens is not None:
                yield _usage(script)
            clock.t = t0 + script.end
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=stream(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def stub_app(ttft_s: float = 0.02, gap_s: float = 0.01):
    """A FastAPI app: every request streams max_tokens events (first after ttft_s, then every gap_s);
    a prompt containing FAIL gets HTTP 500, one containing SLOW waits 0.5 s more before its first token."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if "FAIL" in body["prompt"]:
            return JSONResponse({"error": {"message": "scripted failure"}}, status_code=500)
        n = int(body.get("max_tokens", 16))

        async def stream():
            await asyncio.sleep(ttft_s + (0.5 if "SLOW" in body["prompt"] else 0.0))
            for i in range(n):
                if i:
                    await asyncio.sleep(gap_s)
                yield _event(f" t{i}")
            prompt_tokens = len(body["prompt"].split())
            yield _usage(Script((), 0.0, usage_tokens=n, prompt_tokens=prompt_tokens))
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_stub(**kwargs):
    """Run stub_app on a loopback port in a thread; yields its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(stub_app(**kwargs), host="127.0.0.1", port=port, log_level="error",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
