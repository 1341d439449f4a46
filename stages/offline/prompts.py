"""The online bench's prompts (stages/bench/dataset.py) as token ids, tokenized the way `llmopt serve`
tokenizes each endpoint's requests."""
from __future__ import annotations

from dataclasses import dataclass

from ..bench.dataset import load_requests
from ..errors import ConfigError
from .config import OfflineConfig


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    output_len: int  # max_tokens; in batch-1 decode, the tokens timed after the prefill's


def offline_prompts(config: OfflineConfig, tokenizer) -> list[Prompt]:
    """One Prompt per request of the dataset: chat prompts through the chat template, completions as text."""
    from ..serve.http.prompts import chat_prompt

    if config.endpoint == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("--endpoint chat: the model's tokenizer has no chat template; use --endpoint completions")
    prompts = []
    for request in load_requests(config.dataset):
        if config.endpoint == "chat":
            ids = chat_prompt([{"role": "user", "content": request.prompt}], tokenizer)
        else:
            ids = tokenizer.encode(request.prompt)
        prompts.append(Prompt(list(ids), request.output_len))
    return prompts
