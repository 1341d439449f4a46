"""POST /v1/completions: text (or token ids) in, n completions per prompt out, streamed or not."""
from __future__ import annotations

from fastapi import APIRouter, Request

from .common import ERROR_RESPONSES, check_model, header, json_response, new_id, server_state, usage
from .generation import Generation
from .logprobs import completion_logprobs
from .prompts import completion_prompts
from .protocol import CompletionRequest
from .sse import sse_response

router = APIRouter()
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


@router.post("/v1/completions", responses=ERROR_RESPONSES)
async def create_completion(body: CompletionRequest, request: Request):
    state = server_state(request)
    state.ready_engine()
    body.check_supported()
    check_model(body.model, state)
    prompts = completion_prompts(body.prompt, state.tokenizer)
    params = body.sampling_params(body.max_tokens or DEFAULT_MAX_TOKENS, body.logprobs)
    generation = Generation(state, new_id("cmpl"), prompts, params).start(request)
    head = header(generation.request_id, "text_completion", state)
    num_prompt_tokens = sum(len(p) for p in prompts)
    if body.stream:
        return sse_response(_events(generation, head, body, state.tokenizer, num_prompt_tokens), generation)
    results = await generation.collect()
    choices = [{"index": i, "text": r.text, "finish_reason": r.finish_reason,
                "logprobs": completion_logprobs(r.logprobs, state.tokenizer) if body.logprobs is not None else None}
               for i, r in enumerate(results)]
    return json_response(head | {"choices": choices,
                                 "usage": usage(num_prompt_tokens, sum(r.num_output_tokens for r in results))})


async def _events(generation: Generation, head: dict, body: CompletionRequest, tokenizer, num_prompt_tokens: int):
    offsets, completion_tokens = [0] * len(generation), 0
    extra = {"usage": None} if body.include_usage else {}
    async for index, out in generation.outputs():
        logprobs = None
        if body.logprobs is not None and out.logprobs:
            logprobs = completion_logprobs(out.logprobs, tokenizer, offsets[index])
        offsets[index] += len(out.delta_text)
        if out.finished:
            completion_tokens += out.num_output_tokens
        elif not out.delta_text and logprobs is None:
            continue  # a token that ends mid-character: its text comes with the next one
        choice = {"index": index, "text": out.delta_text, "logprobs": logprobs,
                  "finish_reason": out.finish_reason if out.finished else None}
        yield head | {"choices": [choice]} | extra
    if body.include_usage:
        yield head | {"choices": [], "usage": usage(num_prompt_tokens, completion_tokens)}
