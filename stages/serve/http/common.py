"""Helpers shared by the OpenAI routes: the server state, model-name check, ids, usage."""
from __future__ import annotations

import json
import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from .errors import APIError
from .state import ServerState

_ERROR = {"description": "OpenAI error body", "content": {"application/json": {"schema": {
    "type": "object", "required": ["error"], "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": ["string", "null"]}}}}}}}}
ERROR_RESPONSES = {status: _ERROR for status in (400, 401, 404, 413, 429, 503, 504)}


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def check_model(name: str | None, state: ServerState) -> None:
    served = state.config.served_model_name
    if name is not None and name != served:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {served!r}", "model",
                       "model_not_found")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def header(request_id: str, object_name: str, state: ServerState) -> dict:
    return {"id": request_id, "object": object_name, "created": int(time.time()),
            "model": state.config.served_model_name}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def json_response(content: dict) -> Response:
    """JSON without FastAPI's generic encoder (the bodies are plain dicts of JSON types)."""
    return Response(dumps(content), media_type="application/json")


def dumps(content) -> bytes:
    return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
