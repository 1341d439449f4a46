"""OpenAI request bodies as pydantic models, and their translation into engine SamplingParams.

Field bounds live here so FastAPI's validation (and the OpenAPI schema) reject out-of-range values
with a 400 before anything reaches the engine. Unknown fields are ignored, as OpenAI clients send
options this server does not know; fields it knows but cannot honour are refused by name.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from ...errors import ConfigError
from ..engine.config import SamplingParams
from .errors import bad_request

U64 = 2**64
StopText = Annotated[str, Field(min_length=1, max_length=512)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Options shared by /v1/completions and /v1/chat/completions (plus vLLM-style extensions)."""
    model: str | None = Field(None, description="Must be the served model's name (GET /v1/models); may be left out.")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=16)] | None = None
    seed: int | None = Field(None, ge=-2**63, le=U64 - 1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (vLLM spells them the same way)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1, description="-1 or 0: off")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    skip_special_tokens: bool = True

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


class CompletionRequest(_Sampling):
    prompt: Union[str, Annotated[list[TokenId], Field(min_length=1)],
                  Annotated[list[str], Field(min_length=1, max_length=256)],
                  Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=256)]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
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


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Field(max_length=256)] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
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

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def text_messages(self) -> list[dict[str, str]]:
        """The conversation as {"role", "content"} dicts with text content, for a chat template."""
        out = []
        for i, message in enumerate(self.messages):
            content = message.content
            if isinstance(content, list):
                if any(part.type != "text" or part.text is None for part in content):
                    raise bad_request("only text content parts are supported", f"messages.{i}.content",
                                      "unsupported_content")
                content = "".join(part.text for part in content)
            out.append({"role": message.role, "content": content or ""})
        return out


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)
