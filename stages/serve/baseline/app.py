"""The baseline's HTTP API: GET /health, GET /v1/models, POST /v1/completions and
/v1/chat/completions, streaming (one server-sent event per token) or not, usage included;
`max_tokens`, `temperature`, `top_p` and `ignore_eos` are honoured."""
from __future__ import annotations

import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .worker import Baseline


def parse_params(body: dict) -> dict:
    """The sampling fields we honour, checked; a ValueError becomes HTTP 400."""
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", 16))
    temperature = body.get("temperature", 1.0)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError("max_tokens must be a positive integer")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError("temperature must be >= 0")
    return {"max_tokens": max_tokens, "temperature": float(temperature), "top_p": float(body.get("top_p", 1.0)),
            "ignore_eos": bool(body.get("ignore_eos", False)), "stream": bool(body.get("stream", False)),
            "usage": bool((body.get("stream_options") or {}).get("include_usage", False))}


def prompt_ids(tokenizer, body: dict, chat: bool):
    """The request's prompt as a [1, T] tensor of token ids (chat: through the chat template)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("prompt must be a non-empty string")
    return tokenizer(prompt, return_tensors="pt").input_ids


def _choice(delta: str, chat: bool, finish: str | None) -> dict:
    body = {"delta": {"content": delta}} if chat else {"text": delta, "logprobs": None}
    return {"index": 0, **body, "finish_reason": finish}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _usage(ids, count: int) -> dict:
    return {"prompt_tokens": ids.shape[1], "completion_tokens": count, "total_tokens": ids.shape[1] + count}


async def completion(server: Baseline, request: Request, chat: bool):
    try:
        body = await request.json()
        params = parse_params(body)
        ids = prompt_ids(server.tokenizer, body, chat)
    except (ValueError, TypeError, AttributeError, json.JSONDecodeError) as e:
        return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error"}}, status_code=400)
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": server.name, "object": "chat.completion.chunk" if chat else "text_completion"}
    if params["stream"]:
        return StreamingResponse(_stream(server, ids, params, head, chat), media_type="text/event-stream")
    text, count = "", 0
    async for delta, count in server.texts(ids, params):
        text += delta
    finish = "length" if count >= params["max_tokens"] else "stop"
    choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
    return head | {"object": "chat.completion" if chat else "text_completion",
                   "choices": [choice | {"finish_reason": finish}], "usage": _usage(ids, count)}


async def _stream(server: Baseline, ids, params: dict, head: dict, chat: bool):
    count = 0
    try:
        async for delta, count in server.texts(ids, params):
            finish = "length" if count >= params["max_tokens"] else None
            yield _sse(head | {"choices": [_choice(delta, chat, finish)]})
    except Exception as e:
        yield _sse({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}})
        return
    if count < params["max_tokens"]:
        yield _sse(head | {"choices": [_choice("", chat, "stop")]})
    if params["usage"]:
        yield _sse(head | {"choices": [], "usage": _usage(ids, count)})
    yield "data: [DONE]\n\n"


def build_app(server: Baseline) -> FastAPI:
    app = FastAPI(title="transformers baseline")
    app.get("/health")(lambda: {"status": "ok"})
    app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": server.name, "object": "model",
                                                                 "owned_by": "transformers-baseline"}]})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion(server, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await completion(server, request, chat=True)

    return app
