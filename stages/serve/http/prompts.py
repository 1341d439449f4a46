"""Request prompts to token ids: completion prompts (text, token ids, or batches of either) and
chat conversations through the tokenizer's chat template. Bad text is a 400, never a 500."""
from __future__ import annotations

from .errors import APIError, bad_request


def completion_prompts(prompt, tokenizer) -> list[list[int]]:
    """One token-id list per prompt of a /v1/completions body."""
    if isinstance(prompt, str):
        return [encode(tokenizer, prompt, "prompt")]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [encode(tokenizer, p, f"prompt[{i}]") if isinstance(p, str) else list(p) for i, p in enumerate(prompt)]


def chat_prompt(messages: list[dict[str, str]], tokenizer, add_generation_prompt: bool = True,
                add_special_tokens: bool = False) -> list[int]:
    """The conversation rendered with the model's chat template, ending with the assistant's turn (unless
    not `add_generation_prompt`: POST /tokenize may ask so)."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model's tokenizer has no chat template, so /v1/chat/completions cannot format the "
                          "messages; use /v1/completions with a prompt instead", "messages", "no_chat_template")
    for i, message in enumerate(messages):
        _check_text(message["content"], f"messages[{i}].content")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja raises for conversations a template refuses (roles out of order, ...)
        raise bad_request(f"the chat template rejected the messages: {e}", "messages", "invalid_messages") from None
    return encode(tokenizer, text, "messages", add_special_tokens=add_special_tokens)


def encode(tokenizer, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    _check_text(text, param)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _check_text(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{param} is not valid Unicode (it holds an unpaired surrogate)", param) from None


def context_length_error(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                         param: str) -> APIError:
    """The 400 for a request the engine refused as too long (ContextLengthExceeded), naming the numbers."""
    if max_tokens is None:
        return bad_request(f"the prompt has {num_prompt_tokens} tokens, but this model's maximum context length is "
                           f"{max_model_len} (the prompt plus at least one new token); shorten the prompt",
                           param, "context_length_exceeded")
    return bad_request(f"the prompt has {num_prompt_tokens} tokens and max_tokens asks for {max_tokens} more: "
                       f"{num_prompt_tokens + max_tokens} in all, over this model's maximum context length of "
                       f"{max_model_len}; shorten the prompt or lower max_tokens", "max_tokens",
                       "context_length_exceeded")
