"""`llmopt.v1.Generation` over the server's state: each call is turned into the HTTP API's own request
model (so the same names, bounds and defaults are checked, and a bad field is named), then runs as an HTTP
request does: the key's tenant and its quota, admission, a `Generation` over the engine, metrics.

A call that ends early (the client cancels, its deadline passes, the server stops) aborts its sequences, so
the engine frees their KV blocks at its next step, as an HTTP disconnect does.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from pydantic import ValidationError

from ...grpc_api import generate_pb2 as pb
from ...grpc_api import generate_pb2_grpc
from ..http.common import check_model, new_id
from ..http.completions import DEFAULT_MAX_TOKENS
from ..http.errors import APIError, bad_request, validation_error
from ..http.generation import Generation
from ..http.middleware import bearer_tenant
from ..http.prompts import chat_prompt, completion_prompts, encode
from ..http.protocol import ChatCompletionRequest, CompletionRequest
from ..http.routes import STARTED
from .status import abort, as_api_error

log = logging.getLogger("llmopt.serve")
FINISH = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
          "abort": pb.FINISH_REASON_ABORT}
# The sampling fields proto3 tracks presence of: set, they go to the HTTP model; unset, its default applies.
OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "seed", "skip_special_tokens", "n")
UNAUTHENTICATED = "missing or wrong API key: send the metadata 'authorization: Bearer <key>'"


class GenerationService(generate_pb2_grpc.GenerationServicer):
    def __init__(self, state):
        self.state = state  # http/state.py's ServerState, shared with the HTTP routes
        self.keys = [(key.encode(), tenant) for key, tenant in state.config.bearer_keys().items()]

    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        try:
            generation, want_logprobs, num_prompt_tokens = self._start(request, context)
            results = await generation.collect()
        except Exception as e:
            await self._fail(context, e)
        tokenizer = self.state.tokenizer
        choices = [pb.Choice(index=i, text=r.text, token_ids=r.token_ids, finish_reason=FINISH[r.finish_reason],
                             logprobs=_logprobs(r.logprobs, tokenizer) if want_logprobs else ())
                   for i, r in enumerate(results)]
        completion_tokens = sum(r.num_output_tokens for r in results)
        return pb.GenerateResponse(id=generation.request_id, model=self.state.config.served_model_name,
                                   choices=choices, usage=_usage(num_prompt_tokens, completion_tokens))

    async def GenerateStream(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateStreamResponse]:
        try:
            generation, want_logprobs, _ = self._start(request, context)
        except Exception as e:
            await self._fail(context, e)
        tokenizer = self.state.tokenizer
        try:
            async for index, out in generation.outputs():
                message = pb.GenerateStreamResponse(id=generation.request_id, index=index, token_ids=out.token_ids,
                                                    text=out.delta_text)
                if want_logprobs and out.logprobs:
                    message.logprobs.extend(_logprobs(out.logprobs, tokenizer))
                if out.finished:
                    message.finish_reason = FINISH[out.finish_reason]
                    message.usage.CopyFrom(_usage(out.num_prompt_tokens, out.num_output_tokens))
                yield message
        except Exception as e:
            await self._fail(context, e)
        finally:
            generation.close()  # a cancelled or expired call lands here too: its sequences are aborted

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        try:
            self._authorize(context)
            self.state.ready_engine()
            check_model(request.model or None, self.state)
            tokenizer, kind = self.state.tokenizer, request.WhichOneof("input")
            if kind == "messages":
                messages = _chat(request.messages, "messages").text_messages()
                special = request.add_special_tokens if request.HasField("add_special_tokens") else False
                generation_prompt = request.add_generation_prompt if request.HasField("add_generation_prompt") \
                    else True
                tokens = chat_prompt(messages, tokenizer, generation_prompt, special)
            elif kind == "text":
                special = request.add_special_tokens if request.HasField("add_special_tokens") else True
                tokens = encode(tokenizer, request.text, "text", special)
            else:
                raise bad_request("input is required: give text or messages", "input", "missing_required_parameter")
        except Exception as e:
            await self._fail(context, e)
        strs = tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else ()
        return pb.TokenizeResponse(token_ids=tokens, count=len(tokens), max_model_len=self.state.max_model_len,
                                   token_strs=strs)

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        try:
            self._authorize(context)
            self.state.ready_engine()
            check_model(request.model or None, self.state)
            vocab = len(self.state.tokenizer)
            for i, token in enumerate(request.token_ids):
                if token >= vocab:
                    raise bad_request(f"token {token} is not in the vocabulary (ids 0..{vocab - 1})",
                                      f"token_ids[{i}]")
        except Exception as e:
            await self._fail(context, e)
        return pb.DetokenizeResponse(text=self.state.tokenizer.decode(list(request.token_ids)))

    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        try:
            self._authorize(context)
            self.state.ready_engine()
        except Exception as e:
            await self._fail(context, e)
        return pb.ListModelsResponse(models=[pb.Model(id=self.state.config.served_model_name, owned_by="llmopt",
                                                      max_model_len=self.state.max_model_len, created=STARTED)])

    def _authorize(self, context) -> str | None:
        """The key's tenant; APIError 401 without a right key (when the server has keys)."""
        if not self.keys:
            return None
        value = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), "")
        found, tenant = bearer_tenant(value if isinstance(value, str) else "", self.keys)
        if not found:
            raise APIError(401, UNAUTHENTICATED, code="invalid_api_key")
        return tenant

    def _start(self, request: pb.GenerateRequest, context):
        """The call's Generation, started (checked, admitted, submitted); whether it asked for logprobs; the
        number of prompt tokens."""
        tenant = self._authorize(context)
        state = self.state
        state.ready_engine()
        body = http_body(request)
        body.check_supported()
        check_model(body.model, state)
        if isinstance(body, ChatCompletionRequest):
            prompts = [chat_prompt(body.text_messages(), state.tokenizer)]
            params = body.sampling_params(body.max_tokens, body.requested_logprobs)
            logprobs, prefix, param = body.requested_logprobs, "chatcmpl", "messages"
        else:
            prompts = completion_prompts(body.prompt, state.tokenizer)
            params = body.sampling_params(body.max_tokens or DEFAULT_MAX_TOKENS, body.logprobs)
            logprobs, prefix, param = body.logprobs, "cmpl", request.WhichOneof("prompt")
        remaining = context.time_remaining()
        generation = Generation(state, new_id(prefix), prompts, params, param, protocol="grpc")
        generation.start(tenant=tenant, timeout_s=remaining)
        return generation, logprobs is not None, sum(len(p) for p in prompts)

    async def _fail(self, context, error: BaseException):
        """End the call with the status an HTTP route would have answered `error` with (raises)."""
        api_error = as_api_error(error)
        if api_error is None:
            log.exception("unexpected error in a gRPC call", exc_info=error)
            api_error = APIError(500, f"internal server error ({error.__class__.__name__}); see the server log",
                                 code="internal_error")
        await abort(context, api_error)


def http_body(request: pb.GenerateRequest) -> CompletionRequest | ChatCompletionRequest:
    """The HTTP API's request model for a GenerateRequest: `messages` is a chat completion, text or token ids
    a completion. A refused field is an APIError 400 naming the gRPC field."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise bad_request("prompt is required: give text, token_ids or messages", "prompt",
                          "missing_required_parameter")
    fields: dict = {name: getattr(request, name) for name in OPTIONAL if request.HasField(name)}
    if request.model:
        fields["model"] = request.model
    if request.stop:
        fields["stop"] = list(request.stop)
    if request.stop_token_ids:
        fields["stop_token_ids"] = list(request.stop_token_ids)
    fields["ignore_eos"] = request.ignore_eos
    if kind == "messages":
        return _chat(request.messages, "messages", fields, request)
    fields["prompt"] = request.text if kind == "text" else list(request.token_ids.ids)
    if request.HasField("logprobs"):
        fields["logprobs"] = request.logprobs
    return _validated(CompletionRequest, fields, {"prompt": "text" if kind == "text" else "token_ids.ids"})


def _chat(conversation: pb.Conversation, name: str, fields: dict | None = None,
          request: pb.GenerateRequest | None = None) -> ChatCompletionRequest:
    fields = dict(fields or {})
    fields["messages"] = [{"role": m.role, "content": m.content} for m in conversation.messages]
    if request is not None and request.HasField("logprobs"):
        fields["logprobs"], fields["top_logprobs"] = True, request.logprobs
    return _validated(ChatCompletionRequest, fields, {"messages": f"{name}.messages"})


def _validated(model, fields: dict, renamed: dict[str, str]):
    """`model` validated from `fields`; its 400 names the field as the proto spells it."""
    try:
        return model.model_validate(fields)
    except ValidationError as e:
        error = validation_error(e.errors(), model)
    head = (error.param or "").split("[")[0].split(".")[0]
    if head in renamed:
        new = renamed[head] + error.param[len(head):]
        error.message = error.message.replace(error.param, new, 1)
        error.param = new
    raise error


def _logprobs(entries, tokenizer) -> list[pb.TokenLogprob]:
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    return [pb.TokenLogprob(token_id=e.token_id, token=text(e.token_id), logprob=e.logprob,
                            top_logprobs=[pb.TopLogprob(token_id=t, token=text(t), logprob=lp) for t, lp in e.top])
            for e in entries]


def _usage(prompt_tokens: int, completion_tokens: int) -> pb.Usage:
    return pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                    total_tokens=prompt_tokens + completion_tokens)
