"""StepInputs as the engine builds them, for synthetic prefill and decode steps.

Sequence b owns the contiguous blocks [b * blocks_per_seq, (b + 1) * blocks_per_seq) of the
runner's cache, and in KV layer group g (a model with several: Gemma 3) the same run shifted by g times the
step's blocks. A decode step at context c attends over c cached tokens per sequence that were
never prefilled: the cache holds zeros there, which costs exactly what real keys and values cost
(same shapes, same reads), so a batch of 64 at context 2048 needs no 131k-token prefill first.
"""
from __future__ import annotations

import torch

from ..serve.batch import StepInput
from ..serve.runner import ModelRunner
from .machine import timed


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def step_input(cached: list[int], new: list[int], block_size: int, blocks_per_seq: int, vocab: int,
               seed: int = 0, groups: int = 1) -> StepInput:
    """Sequence b has `cached[b]` tokens in the cache and brings `new[b]` random tokens this step; `groups`: the
    model's KV layer groups, each with its own blocks."""
    g = torch.Generator().manual_seed(seed)
    total = sum(new)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, new)])  # [T]
    seq = torch.cat([torch.full((n,), b) for b, n in enumerate(new)])  # [T] owning sequence
    cu = torch.tensor([0] + new).cumsum(0).to(torch.int32)  # [B+1]
    tables = torch.arange(len(new) * blocks_per_seq, dtype=torch.int32).view(len(new), blocks_per_seq)
    slots = tables[seq, positions // block_size].long() * block_size + positions % block_size  # [T]
    context = torch.tensor(cached, dtype=torch.int32) + torch.tensor(new, dtype=torch.int32)  # [B]
    shift = tables.numel()  # group g's blocks follow group g - 1's
    return StepInput(token_ids=torch.randint(0, vocab, (total,), generator=g), positions=positions,
                     cu_seqlens_q=cu, context_lens=context, block_tables=tables, slot_mapping=slots,
                     max_query_len=max(new), logits_indices=cu[1:].long() - 1,
                     extra_block_tables=tuple(tables + k * shift for k in range(1, groups)),
                     extra_slot_mappings=tuple(slots + k * shift * block_size for k in range(1, groups)))


def prefill_step(runner: ModelRunner, prompt_len: int) -> StepInput:
    """One sequence's whole prompt in one step (no chunking)."""
    bs = runner.block_size
    return step_input([0], [prompt_len], bs, blocks_for(prompt_len, bs), runner.vocab_size,
                      groups=runner.kv_groups.count)


def decode_step(runner: ModelRunner, batch: int, context: int) -> StepInput:
    """`batch` sequences each bring one token after `context - 1` cached ones."""
    bs = runner.block_size
    return step_input([context - 1] * batch, [1] * batch, bs, blocks_for(context, bs), runner.vocab_size,
                      groups=runner.kv_groups.count)


def blocks_needed(batch: int, context: int, block_size: int, groups: int = 1) -> int:
    return groups * batch * blocks_for(context, block_size)


def time_step(runner: ModelRunner, step: StepInput, repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of `runner.execute(step)` per repeat, after `warmup` untimed calls.

    Repeating a decode step rewrites the same cache slot: the cost of a real step, none of its growth.
    """
    device = runner.kv_cache.device
    for _ in range(warmup):
        runner.execute(step)
    return [timed(lambda: runner.execute(step), device) for _ in range(repeats)]
