"""The plain-transformers baseline of `make bench`: a minimal OpenAI-style server, one request at a time.

Each request runs `model.generate` (greedy unless temperature > 0) with a streamer that hands every
new token to the HTTP response as one server-sent event: what serving looks like without an engine
(no batching, no paged KV cache). Requests queue FIFO behind a single worker thread. It serves
GET /health, GET /v1/models, POST /v1/completions and POST /v1/chat/completions (streaming or not,
usage included); `max_tokens`, `temperature`, `top_p` and `ignore_eos` are honoured.

    python scripts/baseline_server.py out/bench/base --port 8001      # or: llmopt bench --server SRC --engine hf

The source is a Hugging Face directory or llmopt artifact (or an alias / GGUF, which llmopt's source
resolution turns into its cached import artifact); generation itself is plain transformers only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
import uvicorn  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

DTYPES = {"auto": "auto", "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class QueueStreamer(BaseStreamer):
    """Hands each generated token id to the event loop; the first put() is the prompt and is skipped."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop, self.queue, self.prompt_seen = loop, queue, False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, token)

    def end(self, error: Exception | None = None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, error)


class Cancelled(StoppingCriteria):
    """Stops a generation whose client went away."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)


class Baseline:
    def __init__(self, model, tokenizer, name: str):
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.worker = ThreadPoolExecutor(max_workers=1)  # one request at a time, in arrival order

    def _generate(self, ids, params: dict, streamer: QueueStreamer, cancel: threading.Event) -> None:
        if cancel.is_set():
            return streamer.end()
        n = params["max_tokens"]
        sample = params["temperature"] > 0
        try:
            with torch.inference_mode():
                self.model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                    min_new_tokens=n if params["ignore_eos"] else None, do_sample=sample,
                    temperature=params["temperature"] if sample else None, top_p=params["top_p"] if sample else None,
                    top_k=None, streamer=streamer, stopping_criteria=StoppingCriteriaList([Cancelled(cancel)]),
                    pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id)
        except Exception as e:  # reported to the client as an error event, the server keeps serving
            return streamer.end(e)
        streamer.end()

    async def tokens(self, ids, params: dict):
        """Yields generated token ids as they are made."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        loop.run_in_executor(self.worker, self._generate, ids, params, QueueStreamer(loop, queue), cancel)
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            cancel.set()  # the client left (or we are done): free the worker at its next step

    async def texts(self, ids, params: dict):
        """Yields (text delta, tokens so far) per token; a partial UTF-8 character waits for the next."""
        generated, sent = [], ""
        async for token in self.tokens(ids, params):
            generated.append(token)
            text = self.tokenizer.decode(generated, skip_special_tokens=True)
            delta = "" if text.endswith("\ufffd") else text[len(sent):]
            sent += delta
            yield delta, len(generated)


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


async def completion(server: Baseline, request: Request, chat: bool):
    try:
        body = await request.json()
        params = parse_params(body)
        ids = prompt_ids(server.tokenizer, body, chat)
    except (ValueError, TypeError, json.JSONDecodeError) as e:
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


def _usage(ids, count: int) -> dict:
    return {"prompt_tokens": ids.shape[1], "completion_tokens": count, "total_tokens": ids.shape[1] + count}


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


def model_dir(source: str) -> Path:
    """A directory transformers can load: the source itself, or (alias, GGUF) its cached llmopt import."""
    path = Path(source).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    from llmopt.stages.source import as_artifact, resolve

    return as_artifact(resolve(source)).path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="HF directory, llmopt artifact, alias or .gguf")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--engine", choices=["hf"], default="hf", help="accepted for symmetry with llmopt bench")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    directory = model_dir(args.source)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPES[args.dtype]).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    server = Baseline(model, tokenizer, args.served_model_name or Path(args.source).name)
    uvicorn.run(build_app(server), host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=2)


if __name__ == "__main__":
    main()
