"""ASGI middleware, outermost first: access log with a request id, API-key check, body-size limit,
body stall timeout; and the app that answers a connection past the server's limit.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would buffer and detach streaming
responses from the client's disconnect.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from typing import Callable

from .common import dumps
from .errors import APIError, error_body

access_log = logging.getLogger("llmopt.access")
_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


async def send_error(send, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> None:
    body = dumps(error_body(status, message, code=code))
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class AccessLog:
    """Gives each request an id (the client's X-Request-Id when it is sane), returns it in the
    response headers, and logs one line per request: as JSON with `log_json`."""

    def __init__(self, app, log_json: bool = False):
        self.app, self.log_json = app, log_json

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = _header(scope, b"x-request-id")
        request_id = given if given and _CLIENT_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        status, start = [500], time.perf_counter()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = list(message.get("headers", [])) + [(b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self._log(scope, request_id, status[0], time.perf_counter() - start)

    def _log(self, scope, request_id: str, status: int, seconds: float) -> None:
        client = scope.get("client") or ("-", 0)
        record = {"ts": round(time.time(), 3), "request_id": request_id, "method": scope.get("method"),
                  "path": scope.get("path"), "status": status, "duration_ms": round(seconds * 1000, 2),
                  "client": f"{client[0]}:{client[1]}"}
        if self.log_json:
            access_log.info(json.dumps(record))
        else:
            access_log.info("%s %s %s %d %.1fms %s", request_id, record["method"], record["path"], status,
                            record["duration_ms"], record["client"])


class ApiKeyAuth:
    """`Authorization: Bearer KEY` on every route but the open ones, KEY one of `keys` (compared in constant
    time, each of them); the key's tenant name goes to the request's scope state as "tenant"."""

    def __init__(self, app, keys: dict[str, str | None], open_paths: frozenset[str]):
        self.app, self.open_paths = app, open_paths
        self.keys = [(key.encode(), tenant) for key, tenant in keys.items()]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        found, tenant = self._tenant(scope)
        if found:
            scope.setdefault("state", {})["tenant"] = tenant
            return await self.app(scope, receive, send)
        await send_error(send, 401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                         "invalid_api_key", {"WWW-Authenticate": "Bearer"})

    def _tenant(self, scope) -> tuple[bool, str | None]:
        return bearer_tenant(_header(scope, b"authorization") or "", self.keys)


def bearer_tenant(authorization: str, keys: list[tuple[bytes, str | None]]) -> tuple[bool, str | None]:
    """Whether `authorization` ("Bearer KEY": an HTTP header's or gRPC metadata's value) holds one of `keys`
    ((key bytes, tenant name) pairs), and that key's tenant. Every key is compared, in constant time."""
    scheme, _, token = authorization.encode("latin-1", "replace").partition(b" ")
    token, found, tenant = token.strip(), False, None
    for key, name in keys:  # no early exit: the time taken does not say which key matched
        if hmac.compare_digest(token, key):
            found, tenant = True, name
    return scheme.lower() == b"bearer" and found, tenant


class BodyLimit:
    """413 for a body over `limit` bytes: from Content-Length at once, or while a chunked body is read."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await send_error(send, 413, self._message(declared), "request_too_large")
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise APIError(413, self._message(f"more than {self.limit}"), code="request_too_large")
            return message

        await self.app(scope, limited_receive, send)

    def _message(self, size: str) -> str:
        return f"the request body ({size} bytes) is over the server's limit of {self.limit} bytes"


class BodyTimeout:
    """408 for a request body that stalls: no new bytes for `timeout_s` while the app waits for more.
    Only the body is timed; what the app receives after it (a disconnect) may take as long as it takes."""

    def __init__(self, app, timeout_s: float):
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        complete = False

        async def timed_receive():
            nonlocal complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except TimeoutError:
                raise APIError(408, f"the request body stalled: no data for {self.timeout_s:g} s (the server's "
                               "--header-timeout)", code="body_timeout", headers={"Connection": "close"}) from None
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, send)


def connection_refusal(retry_after_s: int, refused: Callable[[], None]):
    """The ASGI app that answers every request on a connection past --max-connections: 503 at once."""
    message = "the server has too many open connections; retry later"
    headers = {"Retry-After": str(retry_after_s), "Connection": "close"}

    async def refuse(scope, receive, send):
        if scope["type"] == "http":
            refused()
            await send_error(send, 503, message, "too_many_connections", headers)

    return refuse
