"""Tensor-parallel wrappers around any linear (dense or quantized) holding one rank's shard.

Megatron-style pairing: a ColumnParallelLinear holds a slice of the output features (each rank
computes its slice, no communication); the RowParallelLinear after it holds the matching slice
of the input features and all-reduces the partial sums. One all-reduce per pair (attention,
MLP). `group=None` or a world of one means no communication, so the same model code serves a
single process. The bias of a row-parallel layer is added once, after the reduction.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def world_size(group=None) -> int:
    """Ranks in `group` (1 when torch.distributed is not initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def shard(tensor: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous slice of `tensor` along `dim` (dim must divide evenly)."""
    if tensor.shape[dim] % world:
        raise ValueError(f"cannot split dim {dim} of size {tensor.shape[dim]} over {world} ranks")
    return tensor.chunk(world, dim=dim)[rank].contiguous()


class ColumnParallelLinear(nn.Module):
    """y[..., shard] = inner(x); with gather_output, all-gather the shards into the full y."""

    def __init__(self, inner: nn.Module, group=None, gather_output: bool = False):
        super().__init__()
        self.inner, self.group, self.gather_output = inner, group, gather_output

    def forward(self, x):
        y = self.inner(x)
        world = world_size(self.group)
        if not self.gather_output or world == 1:
            return y
        parts = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(parts, y.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


class RowParallelLinear(nn.Module):
    """y = all_reduce(inner(x_shard)) + bias; `inner` must have no bias of its own."""

    def __init__(self, inner: nn.Module, group=None, bias: torch.Tensor | None = None):
        super().__init__()
        if getattr(inner, "bias", None) is not None:
            raise ValueError("RowParallelLinear: give the bias to the wrapper, not the inner linear "
                             "(it would be added once per rank)")
        self.inner, self.group = inner, group
        self.register_buffer("bias", bias)

    def forward(self, x):
        y = self.inner(x)
        if world_size(self.group) > 1:
            dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def vocab_parallel_embedding(token_ids: torch.Tensor, weight: torch.Tensor, vocab_start: int, group=None,
                             lookup=None):
    """Rows of a vocabulary-sharded embedding: each rank looks up the ids in its own range
    [vocab_start, vocab_start + rows), zeros elsewhere; the all-reduce assembles every row.
    `lookup(local_ids)` gives the rows of this rank's `weight` where a plain F.embedding does not
    (an int8 table dequantizes the rows it looks up)."""
    rows = weight.shape[0]
    local = token_ids - vocab_start
    mine = (local >= 0) & (local < rows)  # [T]
    local = local.clamp(0, rows - 1)
    x = F.embedding(local, weight) if lookup is None else lookup(local)  # [T, H]
    x = x * mine.unsqueeze(-1).to(x.dtype)
    if world_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def gather_vocab(logits: torch.Tensor, sizes: list[int], group=None) -> torch.Tensor:
    """Full logits [R, sum(sizes)] from every rank's vocabulary slice [R, sizes[rank]] (all ranks get
    them; slices of unequal width are padded for the collective and trimmed after)."""
    if world_size(group) == 1:
        return logits
    width = max(sizes)
    padded = F.pad(logits, (0, width - logits.shape[-1])).contiguous()
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)
