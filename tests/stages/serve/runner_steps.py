"""Test-side bookkeeping for the runner: sequences, shuffled block tables, StepInputs, HF references.

Deliberately minimal (no scheduler): a test says which sequences bring how many new tokens this
step, and gets the StepInput the engine would build, with blocks handed out in a scrambled order
so block tables are never contiguous.
"""
from __future__ import annotations

import torch

from llmopt.stages.serve.batch import StepInput


class Sequences:
    """Token lists, cached counts and block tables of a few sequences over a shuffled block pool."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0, groups: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=g).tolist()
        self.block_size = block_size
        self.tokens: list[list[int]] = []
        self.cached: list[int] = []
        self.tables: list[list[int]] = []
        # KV layer groups 1.. (a model with local and global layers): each sequence's tables of its own blocks
        self.group_tables: list[list[list[int]]] = [[] for _ in range(groups - 1)]

    def add(self, tokens: list[int]) -> int:
        self.tokens.append(list(tokens))
        self.cached.append(0)
        self.tables.append([])
        for tables in self.group_tables:
            tables.append([])
        return len(self.tokens) - 1

    def share_prefix(self, seq: int, blocks: int, tokens: list[int]) -> int:
        """A new sequence whose first `blocks` full blocks are `seq`'s (a cached shared prefix)."""
        shared = blocks * self.block_size
        assert self.cached[seq] >= shared
        new = self.add(self.tokens[seq][:shared] + list(tokens))
        self.tables[new], self.cached[new] = self.tables[seq][:blocks], shared
        for tables in self.group_tables:
            tables[new] = tables[seq][:blocks]
        return new

    def _slot(self, seq: int, pos: int, tables: list[list[int]] | None = None) -> int:
        table = (self.tables if tables is None else tables)[seq]
        while len(table) <= pos // self.block_size:
            table.append(self.free.pop())
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def step(self, work: list[tuple[int, int]]) -> StepInput:
        """StepInput for [(seq, new tokens)], in that batch order; advances the cached counts."""
        ids, pos, slots, cu, ctx = [], [], [], [0], []
        for seq, n in work:
            start = self.cached[seq]
            assert start + n <= len(self.tokens[seq]), "the test asked for tokens the sequence does not have"
            ids += self.tokens[seq][start:start + n]
            pos += list(range(start, start + n))
            slots += [self._slot(seq, p) for p in range(start, start + n)]
            cu.append(cu[-1] + n)
            ctx.append(start + n)
            self.cached[seq] += n
        extra = [[self._slot(s, p, tables) for s, n in work for p in range(self.cached[s] - n, self.cached[s])]
                 for tables in self.group_tables]
        return StepInput(
            token_ids=torch.tensor(ids, dtype=torch.long), positions=torch.tensor(pos, dtype=torch.long),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), context_lens=torch.tensor(ctx, dtype=torch.int32),
            block_tables=_padded([self.tables[s] for s, _ in work]), slot_mapping=torch.tensor(slots, dtype=torch.long),
            max_query_len=max(n for _, n in work), logits_indices=torch.tensor(cu[1:], dtype=torch.long) - 1,
            extra_block_tables=tuple(_padded([t[s] for s, _ in work]) for t in self.group_tables),
            extra_slot_mappings=tuple(torch.tensor(e, dtype=torch.long) for e in extra))


def _padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def hf_last_logits(model, tokens: list[int]) -> torch.Tensor:
    """fp32 logits [vocab] of the last position of `tokens` from a transformers model."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


def save_hf(model, path, tokenizer=None):
    """save_pretrained the model and a tokenizer (the tests' BPE unless given)."""
    from tests.helpers import make_tokenizer

    model.save_pretrained(path)
    (tokenizer or make_tokenizer()).save_pretrained(path)
    return path
