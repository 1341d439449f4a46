"""POST /tokenize and /detokenize, in vLLM's shapes: a prompt (or chat messages, through the chat template)
to {count, max_model_len, tokens, token_strs}; token ids back to {prompt}."""
from __future__ import annotations

from typing import Union

from fastapi import APIRouter, Request

from .common import ERROR_RESPONSES, check_model, json_response, server_state
from .errors import bad_request
from .prompts import chat_prompt, encode
from .protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

router = APIRouter()


@router.post("/tokenize", responses=ERROR_RESPONSES)
async def tokenize(body: Union[TokenizeCompletionRequest, TokenizeChatRequest], request: Request):
    state = server_state(request)
    state.ready_engine()
    check_model(body.model, state)
    tokenizer = state.tokenizer
    if isinstance(body, TokenizeChatRequest):
        tokens = chat_prompt(body.text_messages(), tokenizer, body.add_generation_prompt, body.add_special_tokens)
    else:
        tokens = encode(tokenizer, body.prompt, "prompt", body.add_special_tokens)
    strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return json_response({"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens,
                          "token_strs": strs})


@router.post("/detokenize", responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, request: Request):
    state = server_state(request)
    state.ready_engine()
    check_model(body.model, state)
    vocab = len(state.tokenizer)
    for i, token in enumerate(body.tokens):
        if token >= vocab:
            raise bad_request(f"token {token} is not in the vocabulary (ids 0..{vocab - 1})", f"tokens[{i}]")
    return json_response({"prompt": state.tokenizer.decode(body.tokens)})
