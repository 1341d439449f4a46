"""Pack a ScheduledBatch into the runner's StepInput (the contract in `stages/serve/batch.py`)."""
from __future__ import annotations

import torch

from ..batch import StepInput
from .scheduler import ScheduledBatch


class StepBuilder:
    """The lists of one StepInput, filled sequence by sequence (`add`), then made tensors (`build`)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.token_ids, self.positions, self.slots, self.logits_indices = [], [], [], []
        self.cu_seqlens, self.context_lens, self.tables = [0], [], []
        self.extra: list[tuple[list, list]] = []  # layer groups 1..: (slots, tables), as the group 0's above

    def add(self, tokens: list[int], start: int, table: list[int], sampled_rows: int, as_rows: bool = False,
            extra_tables: list[list[int]] = ()) -> None:
        """`tokens` at positions start.. of a sequence with blocks `table`; its last `sampled_rows` tokens
        give logits. as_rows: each token as a sequence of its own, sharing the table, whose context ends at
        that token (a verify step: a decode step for the runner, which its fused path takes; every backend
        writes a step's K/V before it attends, so each row sees the rows before it).
        extra_tables: the sequence's block tables of layer groups 1.. (block_manager.py)."""
        bs, n = self.block_size, len(tokens)
        if not self.extra:
            self.extra = [([], []) for _ in extra_tables]
        self.token_ids += tokens
        self.positions += range(start, start + n)
        ends = range(start + 1, start + n + 1) if as_rows else [start + n]
        for (slots, tables), t in [((self.slots, self.tables), table), *zip(self.extra, extra_tables)]:
            slots += [t[p // bs] * bs + p % bs for p in range(start, start + n)]
            tables += [t] * len(ends)
        for end in ends:
            self.cu_seqlens.append(self.cu_seqlens[-1] + (1 if as_rows else n))
            self.context_lens.append(end)
        total = len(self.token_ids)
        self.logits_indices += range(total - sampled_rows, total)

    def build(self) -> StepInput:
        cu = self.cu_seqlens
        return StepInput(
            token_ids=torch.tensor(self.token_ids, dtype=torch.int64),
            positions=torch.tensor(self.positions, dtype=torch.int64),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            context_lens=torch.tensor(self.context_lens, dtype=torch.int32),
            block_tables=_table_tensor(self.tables),
            slot_mapping=torch.tensor(self.slots, dtype=torch.int64),
            max_query_len=max(b - a for a, b in zip(cu, cu[1:])),
            logits_indices=torch.tensor(self.logits_indices, dtype=torch.int64),
            extra_block_tables=tuple(_table_tensor(tables) for _, tables in self.extra),
            extra_slot_mappings=tuple(torch.tensor(slots, dtype=torch.int64) for slots, _ in self.extra),
        )


def _table_tensor(tables: list[list[int]]) -> torch.Tensor:
    """[B, max_blocks] int32, padded with block 0; a windowed group's released entries (RELEASED) read block 0
    too: attention never reads before a window's start."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).clamp_(min=0)


def build_step_input(batch: ScheduledBatch, block_size: int, verify_as_rows: bool = True) -> StepInput:
    """CPU tensors for one step: each sequence's next `n` uncomputed tokens, their positions and
    cache slots, and the rows whose logits are sampled (the last token of a sequence that
    reaches its end; a prefill chunk that stops short of it needs none). A sequence with drafts
    brings its last token and the drafts, every one sampled (one row each unless not verify_as_rows)."""
    step = StepBuilder(block_size)
    for seq, n, samples, drafts in zip(batch.seqs, batch.num_new_tokens, batch.samples, batch.drafts):
        start = seq.num_computed_tokens
        tokens = seq.token_ids[start:start + n] + drafts
        step.add(tokens, start, seq.block_table, (len(drafts) + 1) if samples else 0,
                 as_rows=bool(drafts) and verify_as_rows, extra_tables=seq.extra_tables)
    return step.build()
