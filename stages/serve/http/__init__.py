"""The OpenAI-compatible HTTP server: `create_app` builds the FastAPI app, `serve` runs it on uvicorn."""
from .app import create_app
from .config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
