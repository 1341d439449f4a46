"""The HTTP side's errors as gRPC statuses: the code a gRPC client expects for each, the message as the
details, and what a client needs to act on in trailing metadata (`retry-after`, `llmopt-error-code`,
`llmopt-error-param`)."""
from __future__ import annotations

import grpc

from ...errors import LlmoptError
from ..engine.async_engine import EngineDeadError
from ..http.errors import APIError, bad_request, engine_dead

CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
         403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
         408: grpc.StatusCode.DEADLINE_EXCEEDED, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
         429: grpc.StatusCode.RESOURCE_EXHAUSTED, 499: grpc.StatusCode.CANCELLED,
         503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
# 503s that mean "the queue is full, come back later" rather than "this server cannot serve": gRPC's
# RESOURCE_EXHAUSTED, which clients and meshes back off on instead of failing over.
BACKPRESSURE = {"queue_full", "queue_tokens_full", "too_many_connections"}


def as_api_error(error: BaseException) -> APIError | None:
    """The APIError an HTTP route would answer for `error` (None: not one of ours, a bug)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineDeadError):
        return engine_dead(error)
    if isinstance(error, LlmoptError):
        return bad_request(str(error))
    return None


def status_of(error: APIError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """(code, details, trailing metadata) for `error`."""
    code = CODES.get(error.status_code, grpc.StatusCode.INTERNAL)
    if error.status_code == 503 and error.code in BACKPRESSURE:
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
    details = error.message
    if error.param and not details.startswith(error.param):
        details = f"{error.param}: {details}"
    trailers = []
    retry_after = (error.headers or {}).get("Retry-After")
    if retry_after is not None:
        trailers.append(("retry-after", str(retry_after)))
    if error.code:
        trailers.append(("llmopt-error-code", error.code))
    if error.param:
        trailers.append(("llmopt-error-param", error.param))
    return code, details, tuple(trailers)


async def abort(context: grpc.aio.ServicerContext, error: APIError):
    """End the call with `error`'s status (raises, as context.abort does)."""
    code, details, trailers = status_of(error)
    await context.abort(code, details, trailers)
