"""Pack a ScheduledBatch into the runner's StepInput (the contract in `stages/serve/batch.py`)."""
from __future__ import annotations

import torch

from ..batch import StepInput
from .scheduler import ScheduledBatch


def build_step_input(batch: ScheduledBatch, block_size: int) -> StepInput:
    """CPU tensors for one step: each sequence's next `n` uncomputed tokens, their positions and
    cache slots, and the rows whose logits are sampled (the last token of a sequence that
    reaches its end; a prefill chunk that stops short of it needs none)."""
    token_ids, positions, slots, logits_indices = [], [], [], []
    cu_seqlens, context_lens = [0], []
    for seq, n, samples in zip(batch.seqs, batch.num_new_tokens, batch.samples):
        start, table = seq.num_computed_tokens, seq.block_table
        token_ids += seq.token_ids[start:start + n]
        positions += range(start, start + n)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
        cu_seqlens.append(cu_seqlens[-1] + n)
        context_lens.append(start + n)
        if samples:
            logits_indices.append(cu_seqlens[-1] - 1)
    width = max(len(s.block_table) for s in batch.seqs)
    tables = [s.block_table + [0] * (width - len(s.block_table)) for s in batch.seqs]
    return StepInput(
        token_ids=torch.tensor(token_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(batch.num_new_tokens),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
    )
