"""One GenerateStream call to llmopt's gRPC API (proto/llmopt/v1/generate.proto), timed as client.py times an
HTTP stream, so the two protocols give the same RequestResult and the same report.

Every stream message is stamped on arrival; one carrying text is a token arrival. TTFT is the first arrival
minus the send time, ITL each gap between arrivals, e2e the time the stream ends. Output tokens come from
the usage on the choice's last message, else from the number of text messages. A call that ends in a gRPC
status other than OK is a failed result of kind "gRPC CODE" (e.g. "gRPC RESOURCE_EXHAUSTED") with the
status details. The config's --timeout is each call's deadline.
"""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

import grpc

from ..grpc_api import generate_pb2, generate_pb2_grpc
from .client import RequestResult, Session, Stream, failed
from .config import BenchConfig
from .dataset import BenchRequest

LIST_MODELS_TIMEOUT_S = 10.0


class GrpcApi:
    """GenerateStream requests as the bench's config asks for them, and the call's metadata."""

    def __init__(self, stub: generate_pb2_grpc.GenerationStub, config: BenchConfig, model: str | None):
        self.stub, self.config, self.model = stub, config, model
        self.metadata = auth_metadata(config.api_key)

    def request(self, request: BenchRequest) -> generate_pb2.GenerateRequest:
        message = generate_pb2.GenerateRequest(model=self.model or "", max_tokens=request.output_len,
                                               temperature=self.config.temperature,
                                               ignore_eos=self.config.ignore_eos)
        if self.config.endpoint == "chat":
            message.messages.messages.add(role="user", content=request.prompt)
        else:
            message.text = request.prompt
        return message


async def send_grpc(api: GrpcApi, request: BenchRequest, clock: Callable[[], float],
                    t0: float = 0.0) -> RequestResult:
    """Send one request and time it; failures are returned (with their kind), never raised."""
    start = clock()
    result = RequestResult(ok=False, prompt_len=request.prompt_len, start=start - t0)
    stream = Stream()
    call = api.stub.GenerateStream(api.request(request), timeout=api.config.timeout_s, metadata=api.metadata)
    try:
        async for message in call:
            _record(message, clock(), stream)
    except grpc.aio.AioRpcError as e:
        return failed(result, f"gRPC {e.code().name}", e.details() or "")
    return stream.result(result, start, clock())


def _record(message: generate_pb2.GenerateStreamResponse, now: float, stream: Stream) -> None:
    if message.text:
        stream.arrivals.append(now)
    if message.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
        stream.finished = True
    if message.HasField("usage"):
        stream.usage = {"prompt_tokens": message.usage.prompt_tokens,
                        "completion_tokens": message.usage.completion_tokens}


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries the API key, as `llmopt serve --api-key` checks it."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


async def discover_model(stub: generate_pb2_grpc.GenerationStub, metadata: tuple) -> str | None:
    """The first model ListModels names; None when the call fails or names none."""
    try:
        reply = await stub.ListModels(generate_pb2.ListModelsRequest(), timeout=LIST_MODELS_TIMEOUT_S,
                                      metadata=metadata)
    except grpc.aio.AioRpcError:
        return None
    return reply.models[0].id if reply.models else None


@asynccontextmanager
async def grpc_session(config: BenchConfig, clock: Callable[[], float]) -> AsyncIterator[Session]:
    """One channel to config.grpc for the whole run (every call a stream on it), with the model to send."""
    async with grpc.aio.insecure_channel(config.grpc) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        api = GrpcApi(stub, config, config.model or await discover_model(stub, auth_metadata(config.api_key)))
        yield Session(api.model, lambda request, t0: send_grpc(api, request, clock, t0))
