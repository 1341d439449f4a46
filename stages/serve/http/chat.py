"""POST /v1/chat/completions: a conversation through the model's chat template, streamed or not."""
from __future__ import annotations

from fastapi import APIRouter, Request

from .common import ERROR_RESPONSES, check_model, header, json_response, new_id, server_state, usage
from .generation import Generation
from .logprobs import chat_logprobs
from .prompts import chat_prompt
from .protocol import ChatCompletionRequest
from .sse import sse_response

router = APIRouter()


@router.post("/v1/chat/completions", responses=ERROR_RESPONSES)
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    state = server_state(request)
    state.ready_engine()
    body.check_supported()
    check_model(body.model, state)
    prompt = chat_prompt(body.text_messages(), state.tokenizer)
    # No max_tokens: until the model's length, as OpenAI's chat endpoint does.
    params = body.sampling_params(body.max_completion_tokens or body.max_tokens, body.requested_logprobs)
    generation = Generation(state, new_id("chatcmpl"), [prompt], params, "messages").start(request)
    if body.stream:
        head = header(generation.request_id, "chat.completion.chunk", state)
        return sse_response(_events(generation, head, body, state.tokenizer, len(prompt)), generation)
    results = await generation.collect()
    choices = [{"index": i, "message": {"role": "assistant", "content": r.text}, "finish_reason": r.finish_reason,
                "logprobs": chat_logprobs(r.logprobs, state.tokenizer) if body.logprobs else None}
               for i, r in enumerate(results)]
    head = header(generation.request_id, "chat.completion", state)
    return json_response(head | {"choices": choices,
                                 "usage": usage(len(prompt), sum(r.num_output_tokens for r in results))})


async def _events(generation: Generation, head: dict, body: ChatCompletionRequest, tokenizer, num_prompt_tokens: int):
    extra = {"usage": None} if body.include_usage else {}
    for index in range(len(generation)):  # the role first, as OpenAI's stream does
        yield head | {"choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}]} | extra
    completion_tokens = 0
    async for index, out in generation.outputs():
        logprobs = chat_logprobs(out.logprobs, tokenizer) if body.logprobs and out.logprobs else None
        if out.finished:
            completion_tokens += out.num_output_tokens
        elif not out.delta_text and logprobs is None:
            continue
        delta = {"content": out.delta_text} if out.delta_text or not out.finished else {}
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": out.finish_reason if out.finished else None}
        yield head | {"choices": [choice]} | extra
    if body.include_usage:
        yield head | {"choices": [], "usage": usage(num_prompt_tokens, completion_tokens)}
