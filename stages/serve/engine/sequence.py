"""Sequence: one request's tokens, text and place in the engine (status, KV blocks, progress)."""
from __future__ import annotations

import time
from enum import Enum

from .config import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks; in prefill until every token is computed, then decoding
    FINISHED = "finished"


class Sequence:
    """Prompt and output tokens of one request plus the bookkeeping the scheduler needs.

    `num_computed_tokens` counts tokens whose K/V are in the cache (a prefix-cache hit counts as
    computed). The tokens still to run are `token_ids[num_computed_tokens:]`: the rest of the
    prompt while prefilling, exactly the last sampled token while decoding.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: frozenset[int] = frozenset(), arrival_time: float | None = None, output_text=None):
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.extra_tables: list[list[int]] = []  # the block tables of layer groups 1.. (block_manager.py)
        self.block_hashes: list[int] = []  # hash of each full, computed block, in order (prefix caching)
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at the last admission
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None  # first admission to the running batch (queue time)
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.generator = None  # the request's own torch.Generator when params.seed is set (made by the sampler)
        self.output_text = output_text  # its OutputText (detokenizer + stop strings); None: tokens only
        self.spec = None  # its SpecState once the engine speculates for it (speculative.py)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.time()
        self.token_ids.append(token_id)

    def mark_finished(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.time()
