"""Run the app on uvicorn until SIGTERM/SIGINT, then drain, in the order a Kubernetes readiness probe
expects, and return normally (exit code 0):

1. Grace: `/health` answers 503 `draining` and new requests 503 + Retry-After, while the port stays
   open for `drain_grace_s`, so a load balancer sees the 503 and stops sending, instead of meeting a
   refused connection. Requests in flight run on. (SIGTERM only: Ctrl-C has no load balancer to tell.)
2. The port closes; requests in flight may finish for up to `drain_timeout_s`.
3. What still runs is aborted: a stream gets a last chunk whose finish_reason is "abort", then
   [DONE]; a whole response gets 503; one log line each, no traceback. Then the engine stops.

A second signal ends the grace at once; a second Ctrl-C after that quits without waiting (uvicorn's
force exit). Connections are guarded throughout (http/connections.py, middleware.BodyTimeout).
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import socket
import sys
import time
from contextlib import contextmanager
from typing import Callable

import uvicorn

from ...errors import LlmoptError
from .app import create_app
from .config import ServerConfig
from .connections import guarded_protocol
from .middleware import connection_refusal

log = logging.getLogger("llmopt.serve")
FLUSH_S = 5.0  # after the abort, for the last frames to go out before uvicorn cancels what is left


def setup_logging(log_json: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s" if log_json else "%(asctime)s %(name)s %(message)s"))
    for name in ("llmopt.access", "llmopt.serve"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False


def make_server(config: ServerConfig, loader: Callable[[], object], on_load_error=None, startup=None, services=()):
    """A uvicorn Server for the app (not started); `run()` serves until a signal, then drains. services:
    other APIs on the same event loop and engine (app.Service: the gRPC server)."""
    def failed(error: BaseException) -> None:
        server.load_error = error
        server.should_exit = True
        if on_load_error is not None:
            on_load_error(error)

    app = create_app(config, loader=loader, on_load_error=failed, startup=startup, services=services)
    state = app.state.server
    refuse = connection_refusal(config.retry_after_s, lambda: state.refused.update(["too_many_connections"]))
    # uvicorn's own lines stay quiet below warnings: what a user needs (serving, draining) is ours, and a
    # model that fails to load is one line from the command.
    server = DrainingServer(config, state, uvicorn.Config(
        app, host=config.host, port=config.port, access_log=False, lifespan="on", log_level="warning",
        loop="asyncio",  # what the drain and the guarded protocol were built and tested on (uvloop: the router's)
        http=guarded_protocol(config.header_timeout_s, config.max_connections, refuse),
        timeout_keep_alive=config.keep_alive_timeout_s,  # typed int, used as call_later(seconds)
        timeout_graceful_shutdown=config.drain_timeout_s + FLUSH_S))
    return server


def serve(config: ServerConfig, loader: Callable[[], object], startup=None, services=()) -> None:
    """Serve until SIGINT/SIGTERM. Raises the loader's error if the model fails to load. startup: the
    process's StartupReport, logged when serving starts; services: as make_server's."""
    setup_logging(config.log_json)
    if config.api_key is None and not is_loopback(config.host):
        log.warning("warning: serving on %s, which is not a loopback address, without an API key: anyone who can "
                    "reach port %d can use the model (give --api-key-file or $LLMOPT_API_KEY)", config.host, config.port)
    server = make_server(config, loader, startup=startup, services=services)
    with _signals_stop(server):
        try:
            server.run()
        finally:
            server.config.app.state.server.finish()
    error = server.load_error
    if isinstance(error, LlmoptError):
        raise error
    if error is not None:
        raise LlmoptError(f"the model failed to load: {error.__class__.__name__}: {error}") from error
    if server.signalled:
        log.info("stopped")


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) reaches this machine only; a name that does not resolve is not."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


class DrainingServer(uvicorn.Server):
    """uvicorn's Server with the drain above: the grace before its own shutdown, and the abort at the
    end of `drain_timeout_s` inside it."""

    def __init__(self, config: ServerConfig, state, uvicorn_config: uvicorn.Config):
        super().__init__(uvicorn_config)
        self.settings, self.state = config, state
        self.load_error: BaseException | None = None
        self.signalled = False
        self.grace_ends: float | None = None

    def handle_exit(self, sig, frame) -> None:
        if not self.signalled:
            self.signalled = True
            self.state.draining = True  # /health and new requests say 503 from the first signal on
            grace = self.settings.drain_grace_s if sig == signal.SIGTERM else 0.0
            if grace > 0 and self.started and not self.should_exit:
                self.grace_ends = time.monotonic() + grace
                log.info("SIGTERM: draining; /health and new requests get 503, the port stays open for %g s", grace)
                return
        elif self.grace_ends is not None and not self.should_exit:
            self.grace_ends = time.monotonic()  # a second signal: no more grace
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.grace_ends is not None and time.monotonic() >= self.grace_ends:
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        self.state.draining = True
        if self.signalled:
            log.info("port closed; waiting up to %g s for %d request(s) in flight", self.settings.drain_timeout_s,
                     len(self.state.in_flight))
        abort = asyncio.get_running_loop().call_later(self.settings.drain_timeout_s, self.state.abort_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            abort.cancel()


@contextmanager
def _signals_stop(server):
    """SIGINT/SIGTERM start the server's graceful shutdown from now on, even before uvicorn has
    installed its own handlers. uvicorn re-raises the signal once it has drained; here that lands
    on the same handler again, so a drained server returns normally instead of 'interrupted'."""
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, server.handle_exit) for sig in handled}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
