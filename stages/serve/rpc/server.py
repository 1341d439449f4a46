"""The gRPC server on the HTTP server's event loop: `llmopt.v1.Generation`, grpc.health.v1 and reflection.

Health follows the HTTP `/health`: SERVING (for "" and for llmopt.v1.Generation) exactly while `/health`
would answer 200, NOT_SERVING while the model loads, while the server drains and once the engine has died;
Watch streams each change. Health and reflection need no key, as `/health` does not.

Stopping (after the HTTP side has drained): no new calls; calls in flight have until the drain timeout
(the HTTP drain's abort ends them there with finish reason ABORT) plus a few seconds to send their last
messages; then the rest are cancelled, which aborts their sequences.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ...errors import LlmoptError
from ...grpc_api import SERVICE, generate_pb2_grpc
from ..http.server import FLUSH_S
from .service import GenerationService

log = logging.getLogger("llmopt.serve")
HEALTH_POLL_S = 0.1  # how often health is compared with the server's state
SERVICES = (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)


async def start_grpc(state) -> Callable[[], Awaitable[None]]:
    """Serve the gRPC API for `state` (http/state.py's ServerState) on its config's `grpc_port`; returns the
    coroutine function that stops it. LlmoptError when the port cannot be bound."""
    config = state.config
    server = grpc.aio.server(options=[
        ("grpc.so_reuseport", 0),  # a port in use is an error, not a second server sharing it
        ("grpc.max_receive_message_length", config.max_body_bytes),  # the HTTP body limit, same bound
        # 15% less CPU per streamed message than the default ("blend"): 87 against 104 us, 16 streams of 2,000
        # messages on this machine (docs/grpc.md); a serving process is throughput-bound.
        ("grpc.optimization_target", "throughput"),
    ])
    generate_pb2_grpc.add_GenerationServicer_to_server(GenerationService(state), server)
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    reflection.enable_server_reflection(SERVICES, server)
    host = f"[{config.host}]" if ":" in config.host else config.host
    address = f"{host}:{config.grpc_port}"
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise LlmoptError(f"--grpc-port {config.grpc_port}: cannot listen on {address} ({e})") from None
    if not port:
        raise LlmoptError(f"--grpc-port {config.grpc_port}: cannot listen on {address} (is the port in use?)")
    state.grpc_port = port  # the bound one, for --grpc-port 0
    await _set_health(checker, False)
    await server.start()
    watcher = asyncio.create_task(_follow_health(state, checker))
    log.info("gRPC API (llmopt.v1.Generation, health, reflection) on %s:%d", host, port)

    async def stop() -> None:
        watcher.cancel()
        await checker.enter_graceful_shutdown()  # NOT_SERVING from now on, whatever the state says
        await server.stop(config.drain_timeout_s + FLUSH_S)

    return stop


async def _follow_health(state, checker) -> None:
    serving = False
    while True:
        if state.healthy != serving:
            serving = state.healthy
            await _set_health(checker, serving)
        await asyncio.sleep(HEALTH_POLL_S)


async def _set_health(checker, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE):
        await checker.set(name, status)
