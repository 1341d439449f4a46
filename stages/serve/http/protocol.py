"""OpenAI request bodies as pydantic models, and their translation into engine SamplingParams.

Field bounds live here so FastAPI's validation (and the OpenAPI schema) reject out-of-range values
with a 400 before anything reaches the engine. JSON types must match, as in OpenAI's API (strict
mode: "2" is not an integer, "yes" not a boolean, 2.0 not a token id; an integer is a number).
Every optional field takes null as its default, as OpenAI's do; a required one (prompt, messages,
a message's role and content, a tool message's tool_call_id) must be there and not null. Unknown
fields are ignored, as OpenAI clients send options this server does not know; fields it knows but
cannot honour are refused by name. errors.py names a refused field by the client's JSON path.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from ...errors import ConfigError
from ..engine.config import SamplingParams
from .errors import bad_request, field_path

U64 = 2**64
MAX_STOP = 16  # stop sequences per request
StopText = Annotated[str, Field(min_length=1, max_length=512)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    @model_validator(mode="after")
    def _null_is_the_default(self):
        for name, field in type(self).model_fields.items():
            if getattr(self, name) is None and not field.is_required() and field.default is not None:
                setattr(self, name, field.default)
        return self


class StreamOptions(_Body):
    include_usage: bool | None = False


class _Sampling(_Body):
    """Options shared by /v1/completions and /v1/chat/completions (plus vLLM-style extensions)."""
    model: str | None = Field(None, description="Must be the served model's name (GET /v1/models); may be left out.")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(1, ge=1, le=128)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=-2**63, le=U64 - 1)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (vLLM spells them the same way)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1, description="-1 or 0: off")
    min_p: float | None = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(1.0, gt=0.0, le=10.0)
    ignore_eos: bool | None = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    skip_special_tokens: bool | None = True

    def check_supported(self) -> None:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by this server", "logit_bias", "unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> list[SamplingParams]:
        """One SamplingParams per choice (n of them): with a seed, choice i samples with seed + i."""
        kwargs = dict(max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                      top_p=1.0 if self.top_p is None else self.top_p, top_k=max(self.top_k or 0, 0),
                      min_p=self.min_p, presence_penalty=self.presence_penalty,
                      frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                      stop=_stops(self.stop), stop_token_ids=tuple(self.stop_token_ids or ()),
                      ignore_eos=self.ignore_eos, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens)
        try:
            return [SamplingParams(**kwargs, seed=None if self.seed is None else (self.seed + i) % U64)
                    for i in range(self.n)]
        except ConfigError as e:
            raise bad_request(str(e)) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _prompt_kind(prompt: Any) -> str | None:
    """Which of the four prompt shapes `prompt` has, from its first item, so that a bad prompt is
    told what that shape wanted (["a", 5]: item 1 is not a string) rather than all four's errors."""
    if isinstance(prompt, str):
        return "text"
    if not isinstance(prompt, list):
        return None
    first = prompt[0] if prompt else 0
    return "texts" if isinstance(first, str) else "batches" if isinstance(first, list) else "tokens"


Prompt = Annotated[Union[
    Annotated[str, Tag("text")],
    Annotated[list[TokenId], Field(min_length=1), Tag("tokens")],
    Annotated[list[str], Field(min_length=1, max_length=256), Tag("texts")],
    Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=256), Tag("batches")],
], Discriminator(_prompt_kind, custom_error_type="invalid_type",
                 custom_error_message="a string, an array of strings, an array of token ids or an array of arrays "
                                      "of token ids")]


class CompletionRequest(_Sampling):
    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_request("echo is not supported by this server", "echo", "unsupported_parameter")
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix", "unsupported_parameter")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported by this server", "best_of",
                              "unsupported_parameter")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class OtherPart(_Body):
    type: str = Field(json_schema_extra={"not": {"const": "text"}})  # image_url, input_audio, ...: refused by name


def _part_kind(part: Any) -> str:
    return "text" if isinstance(part, dict) and part.get("type") == "text" else "other"


ContentPart = Annotated[Union[Annotated[TextPart, Tag("text")], Annotated[OtherPart, Tag("other")]],
                        Discriminator(_part_kind)]
Content = Union[str, Annotated[list[ContentPart], Field(max_length=256)]]


class _Message(_Body):
    name: str | None = None


class TextMessage(_Message):
    role: Literal["system", "developer", "user"]
    content: Content


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Content | None = None  # OpenAI allows none beside tool_calls; here it is an empty turn


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


ChatMessage = Annotated[Union[TextMessage, AssistantMessage, ToolMessage], Field(discriminator="role")]


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools or self.tool_choice not in (None, "none"):
            raise bad_request("tools are not supported by this server", "tools", "unsupported_parameter")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request("only response_format {\"type\": \"text\"} is supported", "response_format",
                              "unsupported_parameter")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        for i, message in enumerate(self.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
                if isinstance(part, OtherPart):
                    raise bad_request(f"only text content parts are supported, not {part.type!r}",
                                      field_path(("messages", i, "content", j, "type")), "unsupported_content")

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def text_messages(self) -> list[dict[str, str]]:
        """The conversation as {"role", "content"} dicts with text content (and a tool message's
        tool_call_id), for a chat template. Call check_supported first: it refuses non-text parts."""
        out = []
        for message in self.messages:
            content = message.content
            if isinstance(content, list):
                content = "".join(part.text for part in content if isinstance(part, TextPart))
            entry = {"role": message.role, "content": content or ""}
            if isinstance(message, ToolMessage):
                entry["tool_call_id"] = message.tool_call_id
            out.append(entry)
        return out


# POST /tokenize and /detokenize (vLLM's bodies)

class TokenizeCompletionRequest(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Body):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]
    add_generation_prompt: bool | None = True
    add_special_tokens: bool | None = False  # the template writes them
    return_token_strs: bool | None = False

    def text_messages(self) -> list[dict[str, str]]:
        return ChatCompletionRequest.text_messages(self)  # same messages, same rendering


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1 << 20)]


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)
