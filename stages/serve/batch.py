"""StepInput: the one contract between the scheduler side (engine/) and the model runner.

The engine packs every scheduled sequence's new tokens (prefill chunks and single decode tokens)
into one flat batch; the runner writes their K/V into the paged cache at `slot_mapping`, attends
over each sequence's blocks and returns logits only at `logits_indices`.

A speculative verify step (engine/speculative.py) brings one sequence's last token and its drafts as
single-token rows that share its block table, row i's context ending at its own token. So the runner
must write every row's K/V into the cache before any row attends (every backend does).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepInput:
    token_ids: torch.Tensor  # [T] int64: new tokens of every scheduled sequence, concatenated in batch order
    positions: torch.Tensor  # [T] int64: absolute position of each new token in its sequence
    cu_seqlens_q: torch.Tensor  # [B+1] int32: sequence b's new tokens are token_ids[cu[b]:cu[b+1]]
    context_lens: torch.Tensor  # [B] int32: tokens in the cache for each sequence once this step is written
    block_tables: torch.Tensor  # [B, max_blocks] int32: physical block ids, padded with 0
    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset for each new token
    max_query_len: int  # longest run of new tokens of one sequence (1 for a pure decode step)
    logits_indices: torch.Tensor  # [R] int64: indices into T whose logits the engine needs (R <= B)
    # Layer groups 1.. of a model with several (engine/block_manager.py): their block tables [B, max_blocks]
    # and cache slots [T], as block_tables and slot_mapping are group 0's. Empty for one group.
    extra_block_tables: tuple = ()
    extra_slot_mappings: tuple = ()

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        """Every sequence brings exactly one new token (the fast decode path applies)."""
        return self.max_query_len == 1
