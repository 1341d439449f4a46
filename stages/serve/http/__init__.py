"""The OpenAI-compatible HTTP server: `create_app` builds the FastAPI app, `serve` runs it on uvicorn.

`create_app` is imported on first use, so that reading ServerConfig (the CLI's defaults) does not
import FastAPI."""
from .config import ServerConfig

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
