"""create_app: the FastAPI application around an engine (given, or loaded in the background)."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from contextlib import asynccontextmanager
from typing import Awaitable, Callable, Sequence

from fastapi import FastAPI

from ...errors import LlmoptError

from . import chat, completions, routes, tokenize
from .config import ServerConfig
from .errors import install_handlers
from .middleware import AccessLog, ApiKeyAuth, BodyLimit, BodyTimeout
from .state import ServerState

log = logging.getLogger("llmopt.serve")
# Another API over the same state, run on the server's event loop (the gRPC server, stages/serve/rpc):
# started when the app starts, it returns the coroutine function that stops it.
Service = Callable[[ServerState], Awaitable[Callable[[], Awaitable[None]]]]


def create_app(config: ServerConfig, engine=None, loader: Callable[[], object] | None = None,
               on_load_error: Callable[[BaseException], None] | None = None, startup=None,
               services: Sequence[Service] = ()) -> FastAPI:
    """The app serving `engine` (an LLMEngine), or the one `loader()` returns: it runs in a thread
    of its own once the server is up, and /health answers 503 until it is done. startup: the process's
    `StartupReport` (stages/serve/startup.py), completed and logged in the "serving on" line. services:
    other APIs over the same engine, started before the model loads and stopped before the engine is (a
    service that cannot start is a failed load: `on_load_error`, else raised)."""
    if (engine is None) == (loader is None):
        raise ValueError("give either an engine or a loader")
    state = ServerState(config)
    state.startup = startup

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        stops = []
        try:
            for start in services:
                stops.append(await start(state))
        except LlmoptError as e:
            if on_load_error is None:
                raise
            state.load_error = e
            on_load_error(e)
        if state.load_error is None:
            if engine is not None:
                state.attach(engine)
            else:
                if startup is not None:
                    startup.mark("http")
                _load_in_background(state, loader, on_load_error)
        try:
            yield
        finally:
            state.draining = True
            for stop in reversed(stops):
                await stop()
            state.shutdown()

    app = FastAPI(title="llmopt", summary="OpenAI-compatible server for llmopt models", version="1",
                  lifespan=lifespan)
    app.state.server = state
    for module in (completions, chat, tokenize, routes):
        app.include_router(module.router)
    install_handlers(app)
    app.openapi = lambda: _openapi(app)
    _add_middleware(app, config)
    return app


def _add_middleware(app: FastAPI, config: ServerConfig) -> None:
    # Each one added wraps the ones before: the access log sees every answer, 401, 408 and 413 included.
    app.add_middleware(BodyTimeout, timeout_s=config.header_timeout_s)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    keys = config.bearer_keys()
    if keys:
        open_paths = {"/health", "/ping"} | ({"/metrics"} if config.metrics_public else set())
        app.add_middleware(ApiKeyAuth, keys=keys, open_paths=frozenset(open_paths))
    app.add_middleware(AccessLog, log_json=config.log_json)


def _load_in_background(state: ServerState, loader, on_load_error) -> None:
    # A daemon thread rather than the default executor: Ctrl-C during a long load must not wait for it.
    loop = asyncio.get_running_loop()

    def done(engine, error) -> None:
        if error is None:
            if state.draining:
                return
            state.attach(engine)
            _watch_ranks(engine, state, loop, on_load_error)
            _log_ready(state)
            return
        state.load_error = error
        # Whoever passed on_load_error reports a known error (`llmopt serve`: one line, exit 2); a bug is
        # logged here with its traceback either way.
        if on_load_error is None or not isinstance(error, LlmoptError):
            log.error("the model failed to load: %s", error, exc_info=None if isinstance(error, LlmoptError) else error)
        if on_load_error is not None:
            on_load_error(error)

    def work() -> None:
        try:
            engine, error = loader(), None
        except BaseException as e:  # reported through /health and on_load_error, never lost
            engine, error = None, e
        try:
            loop.call_soon_threadsafe(done, engine, error)
        except RuntimeError:  # the server has already stopped
            pass

    state.loader = threading.Thread(target=work, name="llmopt-load", daemon=True)
    state.loader.start()


def _log_ready(state: ServerState) -> None:
    """The "serving on" line, with the start-up report (a JSON object under --log-json)."""
    host = f"[{state.config.host}]" if ":" in state.config.host else state.config.host
    url = f"http://{host}:{state.config.port}"
    report = state.startup
    if report is not None:
        report.ready()
    if state.config.log_json:
        log.info(json.dumps({"event": "ready", "url": url, "startup": report.as_dict() if report else None}))
    elif report is not None:
        log.info("model loaded; serving on %s; %s", url, report.summary())
    else:
        log.info("model loaded; serving on %s", url)


def _watch_ranks(engine, state: ServerState, loop, on_fatal) -> None:
    """A tensor-parallel engine whose rank dies: /health turns 503 at once and the server stops
    (through the same path as a failed load, so it exits non-zero with the rank's message)."""
    watch = getattr(engine.runner, "watch", None)
    if watch is None:
        return

    def fatal(error: BaseException) -> None:
        state.fatal = error
        if on_fatal is not None:
            on_fatal(error)

    def from_monitor(error: BaseException) -> None:
        try:
            loop.call_soon_threadsafe(fatal, error)
        except RuntimeError:  # the server has already stopped
            pass

    watch(from_monitor)


def _openapi(app: FastAPI) -> dict:
    """FastAPI's spec without its 422 responses: validation errors here are OpenAI-style 400s."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        spec = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for path in spec.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            spec.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = spec
    return app.openapi_schema
