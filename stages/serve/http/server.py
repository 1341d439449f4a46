"""Run the app on uvicorn until SIGINT/SIGTERM, then drain: stop accepting, let in-flight requests
finish for up to `drain_timeout_s`, stop the engine, and return normally (exit code 0)."""
from __future__ import annotations

import logging
import signal
import sys
from contextlib import contextmanager
from typing import Callable

from ...errors import LlmoptError
from .app import create_app
from .config import ServerConfig

log = logging.getLogger("llmopt.serve")


def setup_logging(log_json: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s" if log_json else "%(asctime)s %(name)s %(message)s"))
    for name in ("llmopt.access", "llmopt.serve"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False


def make_server(config: ServerConfig, loader: Callable[[], object], on_load_error=None):
    """A uvicorn Server for the app (not started); `run()` serves until a signal."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            app.state.server.draining = True  # /health says 503 from the first signal on
            super().handle_exit(sig, frame)

    def failed(error: BaseException) -> None:
        server.load_error = error
        server.should_exit = True
        if on_load_error is not None:
            on_load_error(error)

    app = create_app(config, loader=loader, on_load_error=failed)
    server = Server(uvicorn.Config(app, host=config.host, port=config.port, access_log=False, lifespan="on",
                                   timeout_graceful_shutdown=config.drain_timeout_s, log_level="info"))
    server.load_error = None
    return server


def serve(config: ServerConfig, loader: Callable[[], object]) -> None:
    """Serve until SIGINT/SIGTERM. Raises the loader's error if the model fails to load."""
    setup_logging(config.log_json)
    server = make_server(config, loader)
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
