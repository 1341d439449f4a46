"""One streaming request to an OpenAI-style server, timed token by token.

Every server-sent event is stamped on arrival; an event carrying text is a token arrival. TTFT is
the first arrival minus the send time, ITL each gap between arrivals, e2e the time the stream ends.
Output tokens come from the server's `usage` when it reports it (we ask with
`stream_options.include_usage`), else from the number of text events. A stream that ends with a
finish reason but no text (the model stopped at once) is a completed request of 0 output tokens,
with no TTFT; one with neither failed.

`http_session` is the HTTP side of a run (grpc_client.py has the gRPC side): one client for every request,
and the model to send.
"""
from __future__ import annotations

import json
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

import httpx

from .config import BenchConfig
from .dataset import BenchRequest


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int | None = None
    output_tokens: int = 0
    ttft: float | None = None  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between token arrivals
    e2e: float | None = None  # seconds from send to the end of the stream
    start: float = 0.0  # send time, seconds after the bench started
    error: str | None = None  # the failure's kind: "HTTP 503", "connect error", "timeout", "gRPC UNAVAILABLE", ...
    detail: str = ""

    @property
    def tpot(self) -> float | None:
        """(e2e - ttft) / (output_tokens - 1): mean time per output token after the first."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class Stream:
    """What one response stream has delivered so far (an HTTP event stream or a gRPC one)."""

    arrivals: list[float] = field(default_factory=list)
    usage: dict = field(default_factory=dict)  # prompt_tokens and completion_tokens, when the server says
    error: str | None = None
    finished: bool = False  # a message carried a finish reason

    def result(self, result: RequestResult, start: float, end: float) -> RequestResult:
        """`result` completed from what arrived: the timings, the token counts, or why it failed."""
        if self.error:
            return failed(result, "bad response", self.error)
        if not self.arrivals and not self.finished:
            return failed(result, "no tokens", "the stream ended without any text or finish reason")
        times = self.arrivals
        result.ok = True
        result.ttft = times[0] - start if times else None  # no token: no time to one
        result.itl = [b - a for a, b in zip(times, times[1:])]
        result.e2e = end - start
        result.output_tokens = int(self.usage.get("completion_tokens") or len(times))
        if self.usage.get("prompt_tokens"):
            result.prompt_len = int(self.usage["prompt_tokens"])
        return result


@dataclass(frozen=True)
class Session:
    """One run's connection to the server, either protocol: the model it sends and how to send a request."""

    model: str | None
    send: Callable[[BenchRequest, float], Awaitable[RequestResult]]  # (request, t0) -> its timed result


class Api:
    """Request bodies and response parsing for /v1/completions and /v1/chat/completions."""

    def __init__(self, config: BenchConfig, model: str | None):
        self.config, self.model, self.url = config, model, config.api_url
        self.headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}

    def body(self, request: BenchRequest) -> dict:
        body = {"max_tokens": request.output_len, "temperature": self.config.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.config.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        if self.model:
            body["model"] = self.model
        if self.config.ignore_eos:
            body["ignore_eos"] = True
        return body

    def text(self, event: dict) -> str:
        choices = event.get("choices") or []
        if not choices or not isinstance(choices[0], dict):
            return ""
        if self.config.endpoint == "chat":
            return (choices[0].get("delta") or {}).get("content") or ""
        return choices[0].get("text") or ""

    def finish_reason(self, event: dict) -> str | None:
        choices = event.get("choices") or []
        return choices[0].get("finish_reason") if choices and isinstance(choices[0], dict) else None


async def send(client: httpx.AsyncClient, api: Api, request: BenchRequest, clock: Callable[[], float],
               t0: float = 0.0) -> RequestResult:
    """Send one request and time it; failures are returned (with their kind), never raised."""
    start = clock()
    result = RequestResult(ok=False, prompt_len=request.prompt_len, start=start - t0)
    stream = Stream()
    try:
        async with client.stream("POST", api.url, json=api.body(request), headers=api.headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                return failed(result, f"HTTP {response.status_code}", body)
            await _read_events(response, api, clock, stream)
    except httpx.ConnectError as e:
        return failed(result, "connect error", str(e))
    except httpx.TimeoutException as e:
        return failed(result, "timeout", str(e) or type(e).__name__)
    except httpx.HTTPError as e:
        return failed(result, "stream error", f"{type(e).__name__}: {e}")
    return stream.result(result, start, clock())


async def _read_events(response: httpx.Response, api: Api, clock: Callable[[], float], stream: Stream) -> None:
    async for line in response.aiter_lines():
        now = clock()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            stream.error = f"bad event: {data[:80]}"
            return
        if not isinstance(event, dict) or event.get("error"):
            stream.error = f"server error: {str(event.get('error') if isinstance(event, dict) else event)[:200]}"
            return
        if api.text(event):
            stream.arrivals.append(now)
        if api.finish_reason(event):
            stream.finished = True
        if isinstance(event.get("usage"), dict):
            stream.usage = event["usage"]


def failed(result: RequestResult, kind: str, detail: str) -> RequestResult:
    """`result` marked failed, of `kind` ("HTTP 503", "gRPC UNAVAILABLE", ...), with the detail on one line."""
    result.ok, result.error, result.detail = False, kind, " ".join(detail.split())[:300]
    return result


@asynccontextmanager
async def http_session(config: BenchConfig, clock: Callable[[], float],
                       transport: httpx.AsyncBaseTransport | None = None) -> AsyncIterator[Session]:
    """One HTTP client for the run (a connection per concurrent request), with the model to send."""
    timeout = httpx.Timeout(config.timeout_s, connect=10.0, pool=None)
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=config.max_concurrency)
    async with httpx.AsyncClient(transport=transport, timeout=timeout, limits=limits) as client:
        api = Api(config, config.model or await discover_model(client, config.url))
        yield Session(api.model, lambda request, t0: send(client, api, request, clock, t0))


async def discover_model(client: httpx.AsyncClient, base_url: str) -> str | None:
    """The first model GET /v1/models lists; None when the server has no such route or is down."""
    try:
        response = await client.get(base_url + "/v1/models", timeout=10.0)
        return str(response.json()["data"][0]["id"]) if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None
