"""The router's HTTP app: the OpenAI routes proxied to a replica picked by policy.py, its own /health and
/metrics, and the health checks that eject and re-admit replicas.

- A request that fails before its first byte reaches the client (connection refused or reset, a 5xx from the
  replica, a stream that ends before its first chunk) is retried on another healthy replica, up to `retries`
  times; a connection failure also takes the replica out at once. A stream that fails after its first chunk
  gets an error frame and `data: [DONE]`: the client's connection ends normally.
- With no healthy replica the router answers 503 with Retry-After: the only 5xx it sends.
- Health: every `health_interval_s`, GET /health and /metrics of each replica; `eject_after` failures in a row
  (or one refused connection) take it out, one pass brings it back. /metrics gives its running + waiting
  requests, which least-load and cache-aware's balance read beside the router's own in-flight count.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from .config import RouteConfig
from .policy import Replica, Router

log = logging.getLogger("llmopt.route")
FORWARDED = ("authorization", "content-type", "x-request-id", "accept")
LOAD_METRICS = ("llmopt:num_requests_running", "llmopt:num_requests_waiting")


class RouterMetrics:
    """The router's own series (its /metrics), per replica and per routing decision."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r, label = self.registry, ["replica"]
        self.requests = Counter("llmopt_router:requests", "Requests sent to a replica", label, registry=r)
        self.retries = Counter("llmopt_router:retries", "Requests retried elsewhere after failing on a replica "
                               "before their first byte", label, registry=r)
        self.ejections = Counter("llmopt_router:ejections", "Times a replica was taken out", label, registry=r)
        self.readmissions = Counter("llmopt_router:readmissions", "Times a replica came back", label, registry=r)
        self.stream_errors = Counter("llmopt_router:stream_errors", "Streams cut by a replica after their first "
                                     "byte (the client got an error frame and [DONE])", label, registry=r)
        self.decisions = Counter("llmopt_router:routing_decisions", "Why a replica was picked", ["decision"],
                                 registry=r)
        self.healthy = Gauge("llmopt_router:replica_healthy", "1 while the replica takes requests", label, registry=r)
        self.in_flight = Gauge("llmopt_router:replica_in_flight", "Requests open on the replica", label, registry=r)
        self.unavailable = Counter("llmopt_router:unavailable", "503s for want of a healthy replica", registry=r)


def prompt_text(payload: dict) -> str:
    """The text a request's prefix is matched on: the prompt, or the chat messages in order."""
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "\x00".join(map(str, prompt))
    messages = payload.get("messages")
    if isinstance(messages, list):
        return "".join(f"\x01{m.get('role', '')}\x02{m.get('content', '')}" for m in messages if isinstance(m, dict))
    return ""


def error_json(status: int, message: str, kind: str, code: str, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class RouterState:
    """Everything the app's routes share: the replicas, the policy, the HTTP client, the metrics."""

    def __init__(self, config: RouteConfig):
        self.config = config
        self.replicas = [Replica(url.rstrip("/")) for url in config.replicas]
        self.router = Router(self.replicas, config)
        self.metrics = RouterMetrics()
        self.client: httpx.AsyncClient | None = None
        for r in self.replicas:
            self.metrics.healthy.labels(r.url).set(1)

    def eject(self, replica: Replica, why: str) -> None:
        if replica.healthy:
            replica.healthy = False
            self.metrics.ejections.labels(replica.url).inc()
            self.metrics.healthy.labels(replica.url).set(0)
            log.warning("replica %s ejected (%s)", replica.url, why)

    def admit(self, replica: Replica) -> None:
        replica.failed_checks = 0
        if not replica.healthy:
            replica.healthy = True
            self.metrics.readmissions.labels(replica.url).inc()
            self.metrics.healthy.labels(replica.url).set(1)
            log.warning("replica %s is back", replica.url)

    async def check(self, replica: Replica) -> None:
        """One health check (and load reading) of `replica`."""
        timeout = max(0.2, self.config.health_interval_s)
        try:
            response = await self.client.get(replica.url + "/health", timeout=timeout)
        except httpx.ConnectError:
            replica.failed_checks += 1
            self.eject(replica, "connection refused")
            return
        except httpx.HTTPError as e:
            response = None
            why = type(e).__name__
        if response is not None and response.status_code == 200:
            self.admit(replica)
            if not self._load_from_health(replica, response):
                await self._read_load(replica, timeout)
            return
        replica.failed_checks += 1
        if replica.failed_checks >= self.config.eject_after:
            self.eject(replica, f"/health {response.status_code if response is not None else why} "
                                f"{replica.failed_checks} times in a row")

    @staticmethod
    def _load_from_health(replica: Replica, response: httpx.Response) -> bool:
        """llmopt serve's /health carries its running and waiting requests: no /metrics to render and parse."""
        try:
            body = response.json()
            replica.report(int(body["num_requests_running"]) + int(body["num_requests_waiting"]))
            return True
        except (ValueError, KeyError, TypeError):
            return False

    async def _read_load(self, replica: Replica, timeout: float) -> None:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            text = (await self.client.get(replica.url + "/metrics", timeout=timeout)).text
            replica.report(int(sum(s.value for f in text_string_to_metric_families(text)
                                       for s in f.samples if s.name in LOAD_METRICS)))

    async def health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.check(r) for r in self.replicas))
            await asyncio.sleep(self.config.health_interval_s)


def create_router_app(config: RouteConfig, replica_metrics: bool = False) -> FastAPI:
    """The router's app for `config` (validated); its health loop runs while the app is served. replica_metrics:
    /metrics also carries every replica's own series, labelled `replica` by its index (serve --data-parallel)."""
    config.validate()
    state = RouterState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        state.client = httpx.AsyncClient(timeout=httpx.Timeout(config.timeout_s, connect=5.0), limits=limits)
        task = asyncio.create_task(state.health_loop())
        try:
            yield
        finally:
            task.cancel()
            await state.client.aclose()

    app = FastAPI(title="llmopt route", lifespan=lifespan)
    app.state.router = state

    @app.get("/health")
    async def health():
        replicas = [{"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight, "load": r.load}
                    for r in state.replicas]
        if any(r.healthy for r in state.replicas):
            return {"status": "ok", "replicas": replicas}
        return JSONResponse({"status": "no_healthy_replica", "replicas": replicas}, status_code=503,
                            headers={"Retry-After": str(config.retry_after_s)})

    @app.get("/metrics")
    async def metrics():
        for r in state.replicas:
            state.metrics.in_flight.labels(r.url).set(r.in_flight)
        text = generate_latest(state.metrics.registry).decode()
        if replica_metrics:
            text += await _replicas_metrics(state)
        return Response(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        return await forward_get(state, request, "/v1/models")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await proxy(state, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await proxy(state, request, "/v1/chat/completions")

    return app


async def _replicas_metrics(state: RouterState) -> str:
    """Every healthy replica's /metrics, each sample labelled replica="i", family by family (the text format wants
    a family's lines together: its HELP and TYPE once, then every replica's samples)."""
    families: dict[str, tuple[list[str], list[str]]] = {}  # family -> (comment lines, samples), in first order
    for i, replica in enumerate(state.replicas):
        if not replica.healthy:
            continue
        with contextlib.suppress(httpx.HTTPError):
            text = (await state.client.get(replica.url + "/metrics", timeout=5)).text
            family = ""
            for line in text.splitlines():
                if line.startswith("# HELP ") or line.startswith("# TYPE "):
                    family = line.split()[2]
                    comments = families.setdefault(family, ([], []))[0]
                    if line not in comments:
                        comments.append(line)
                elif line.strip() and not line.startswith("#"):
                    families.setdefault(family, ([], []))[1].append(with_label(line, "replica", str(i)))
    lines = [line for comments, samples in families.values() for line in (*comments, *samples)]
    return "\n".join(lines) + "\n" if lines else ""


def with_label(sample: str, name: str, value: str) -> str:
    """A Prometheus text sample line with one more label: 'x{a="1"} 2' -> 'x{a="1",replica="0"} 2'."""
    metric, _, rest = sample.partition(" ")
    if metric.endswith("}"):
        return f'{metric[:-1]},{name}="{value}"}} {rest}'
    return f'{metric}{{{name}="{value}"}} {rest}'


def _headers(request: Request) -> dict:
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}


def no_replica(state: RouterState) -> JSONResponse:
    state.metrics.unavailable.inc()
    return error_json(503, "no healthy replica can take the request now; retry later", "service_unavailable",
                      "no_healthy_replica", {"Retry-After": str(state.config.retry_after_s)})


async def forward_get(state: RouterState, request: Request, path: str) -> Response:
    for replica in state.router.healthy():
        try:
            response = await state.client.get(replica.url + path, headers=_headers(request))
        except httpx.TransportError:
            state.eject(replica, "connection failed")
            continue
        return Response(response.content, response.status_code, media_type=response.headers.get("content-type"))
    return no_replica(state)


async def proxy(state: RouterState, request: Request, path: str) -> Response:
    """Send the request to the policy's replica; retry elsewhere while nothing has reached the client."""
    body = await request.body()
    try:
        payload = json.loads(body or b"{}")
    except json.JSONDecodeError as e:
        return error_json(400, f"the body is not JSON ({e.msg})", "invalid_request_error", "invalid_json")
    if not isinstance(payload, dict):
        return error_json(400, "the body must be a JSON object", "invalid_request_error", "invalid_json")
    text, tried = prompt_text(payload), set()
    for _ in range(state.config.retries + 1):
        replica = state.router.pick(text, tried)
        if replica is None:
            break
        tried.add(replica.url)
        state.metrics.decisions.labels(state.router.last_decision).inc()
        response = await _attempt(state, replica, request, path, body)
        if response is not None:
            return response
        state.metrics.retries.labels(replica.url).inc()
    return no_replica(state)


async def _attempt(state: RouterState, replica: Replica, request: Request, path: str, body: bytes):
    """The client's response from `replica`, or None when it failed before anything could be sent on."""
    state.metrics.requests.labels(replica.url).inc()
    replica.in_flight += 1
    upstream = None
    try:
        upstream = await state.client.send(
            state.client.build_request("POST", replica.url + path, content=body, headers=_headers(request)),
            stream=True)
        if upstream.status_code >= 500:  # draining, dead engine, overloaded: someone else may take it
            await upstream.aclose()
            replica.in_flight -= 1
            return None
        chunks = upstream.aiter_raw()
        first = await anext(chunks, b"")
    except httpx.TransportError as e:
        if upstream is not None:
            await upstream.aclose()
        if isinstance(e, httpx.ConnectError):
            state.eject(replica, "connection refused")
        replica.in_flight -= 1
        return None
    except BaseException:
        replica.in_flight -= 1
        raise
    headers = {k: v for k, v in upstream.headers.items() if k.lower() in ("content-type", "retry-after", "x-request-id")}
    return StreamingResponse(_relay(state, replica, upstream, first, chunks), status_code=upstream.status_code,
                             headers=headers)


async def _relay(state: RouterState, replica: Replica, upstream: httpx.Response, first: bytes, chunks):
    """The replica's bytes as they come; a replica lost mid-stream ends the client's stream with an error frame
    and [DONE] (an SSE stream) instead of a cut connection."""
    try:
        yield first
        async for chunk in chunks:
            yield chunk
    except httpx.HTTPError as e:
        state.metrics.stream_errors.labels(replica.url).inc()
        log.warning("replica %s failed mid-stream (%s)", replica.url, type(e).__name__)
        if "text/event-stream" in upstream.headers.get("content-type", ""):
            frame = {"error": {"message": f"the replica serving this stream failed ({type(e).__name__}); the output "
                                          "is incomplete", "type": "server_error", "param": None,
                               "code": "replica_failed"}}
            yield f"\n\ndata: {json.dumps(frame)}\n\ndata: [DONE]\n\n".encode()
    finally:
        replica.in_flight -= 1
        await upstream.aclose()
