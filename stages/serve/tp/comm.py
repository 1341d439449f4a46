"""Rank 0 -> workers: each step's batch as two broadcasts (a fixed header, then one int64 payload)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..batch import StepInput

STOP, STEP, NOOP, INIT = 0, 1, 2, 3
HEADER = 8  # [command, T, B, max_blocks, R, max_query_len, arg0, arg1]; a STEP's args: layer groups 1.., their width


def _broadcast(t: torch.Tensor, device) -> torch.Tensor:
    t = t.to(device)
    dist.broadcast(t, src=0)
    return t.cpu()


def send_command(command: int, device, arg0: int = 0, arg1: int = 0) -> None:
    _broadcast(torch.tensor([command, 0, 0, 0, 0, 0, arg0, arg1], dtype=torch.int64), device)


def pack_step(step: StepInput) -> tuple[list[int], torch.Tensor]:
    """(the STEP header, the int64 payload) of a step: what rank 0 sends every other rank."""
    t, b = step.token_ids.shape[0], step.context_lens.shape[0]
    m, r = step.block_tables.shape[1], step.logits_indices.shape[0]
    extra = step.extra_block_tables  # KV layer groups 1.. (several: Gemma 3), padded to one width
    width = max((e.shape[1] for e in extra), default=0)
    header = [STEP, t, b, m, r, step.max_query_len, len(extra), width]
    parts = [step.token_ids, step.positions, step.cu_seqlens_q, step.context_lens, step.block_tables.flatten(),
             step.slot_mapping, step.logits_indices,
             *(torch.nn.functional.pad(e, (0, width - e.shape[1])).flatten() for e in extra), *step.extra_slot_mappings]
    return header, torch.cat([p.cpu().long() for p in parts])


def payload_size(header: list[int]) -> int:
    """Elements of the payload that follows a STEP header."""
    return sum(_sizes(header))


def _sizes(header: list[int]) -> list[int]:
    _, t, b, m, r, _, groups, width = header
    return [t, t, b + 1, b, b * m, t, r] + [b * width] * groups + [t] * groups


def unpack_step(header: list[int], payload: torch.Tensor) -> StepInput:
    """The StepInput a STEP header and its payload describe."""
    _, t, b, m, r, max_q, groups, width = header
    tok, pos, cu, ctx, tables, slots, idx, *extra = payload.split(_sizes(header))
    extra_tables = tuple(e.int().view(b, width) for e in extra[:groups])
    return StepInput(tok, pos, cu.int(), ctx.int(), tables.int().view(b, m), slots, max_q, idx,
                     extra_tables, tuple(extra[groups:]))


def send_step(step: StepInput, device) -> None:
    header, payload = pack_step(step)
    _broadcast(torch.tensor(header, dtype=torch.int64), device)
    _broadcast(payload, device)


def receive(device) -> tuple[int, StepInput | tuple[int, int] | None]:
    """(command, its StepInput for STEP, (arg0, arg1) for INIT, else None) from rank 0."""
    header = _broadcast(torch.empty(HEADER, dtype=torch.int64), device).tolist()
    command, arg0, arg1 = header[0], header[6], header[7]
    if command == INIT:
        return command, (arg0, arg1)
    if command != STEP:
        return command, None
    payload = _broadcast(torch.empty(payload_size(header), dtype=torch.int64), device)
    return command, unpack_step(header, payload)
