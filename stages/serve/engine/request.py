"""Request: what a caller hands the engine, checked once by RequestChecker.

The check reads only facts fixed when the engine is built (the resolved EngineConfig and the
vocabulary size), so it runs in the caller's thread: an asyncio server rejects a request at once,
and the engine thread never checks it again.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from .block_manager import pages_needed
from .config import ContextLengthExceeded, EngineConfig, RequestRejected, SamplingParams


@dataclass(frozen=True)
class Request:
    """A checked request: made by `RequestChecker.request`, queued by the engine as it is."""
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_time: float


@dataclass(frozen=True)
class RequestChecker:
    """The one check every request passes before it is queued."""
    config: EngineConfig  # resolved: num_blocks and max_model_len are set
    vocab_size: int | None  # None: token ids are not range-checked
    kv_windows: tuple = (None,)  # the window of each KV layer group (block_manager.py)

    def check(self, prompt_token_ids: list[int] | tuple[int, ...], params: SamplingParams) -> None:
        """Raise RequestRejected (ContextLengthExceeded for a too-long one) for a request that
        could never run to its end; the order of the checks decides which reason a caller sees."""
        n, max_tokens, max_len = len(prompt_token_ids), params.max_tokens, self.config.max_model_len
        if max_tokens is None and n >= max_len:
            raise ContextLengthExceeded(f"the prompt has {n} tokens but max_model_len is {max_len} (prompt plus at "
                                        "least one new token); shorten the prompt")
        if max_tokens is not None and n + max_tokens > max_len:
            raise ContextLengthExceeded(f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                                        f"{max_len}; shorten the prompt or lower max_tokens")
        if self.vocab_size and any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise RequestRejected(f"prompt token ids must be in [0, {self.vocab_size})")
        if n == 0:
            raise RequestRejected("the prompt is empty; give at least one token")
        self._check_cache(n, max_len if max_tokens is None else n + max_tokens)

    def _check_cache(self, prompt: int, longest: int) -> None:
        cfg = self.config
        needed = pages_needed(self.kv_windows, cfg.block_size, prompt, longest)
        if needed > cfg.num_blocks:
            raise RequestRejected(f"the request may grow to {longest} tokens ({needed} KV blocks) but the cache has "
                                  f"{cfg.num_blocks} blocks; lower max_tokens or give the cache more memory")

    def request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                arrival_time: float | None = None) -> Request:
        """A checked Request (RequestRejected says why it can never run)."""
        params = params or SamplingParams()
        ids = tuple(int(t) for t in prompt_token_ids)
        self.check(ids, params)
        return Request(str(request_id), ids, params, time.time() if arrival_time is None else arrival_time)


def prompt_ids(tokenizer, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
    """The token ids of a request given as text (encoded with `tokenizer`) or as ids."""
    if (prompt is None) == (prompt_token_ids is None):
        raise RequestRejected("give either a prompt or prompt_token_ids")
    return tokenizer.encode(prompt) if prompt is not None else list(prompt_token_ids)
