"""Point-to-point messages of pipeline-parallel serving, each kind on its own tag.

Rank 0 -> every rank: a command header (tp/comm.py's layout) and, for a STEP, its int64 payload (META).
Stage s, tensor rank t -> stage s + 1, tensor rank t: the residual stream [T, H] in the model's dtype (HIDDEN).
The last stage's tensor rank 0 -> rank 0: fp32 logits [R, vocab] (LOGITS), and at a STATS command its
clocks (STATS). Sends are asynchronous (`isend`); `Outbox` keeps each tensor alive until its send is done.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..batch import StepInput
from ..tp.comm import HEADER, INIT, NOOP, STEP, STOP, pack_step, payload_size, unpack_step

STATS = 4  # a command: every rank sends rank 0 its stage clocks
META, HIDDEN, LOGITS, CLOCKS = 11, 12, 13, 14  # tags
CLOCK_FIELDS = 4  # [steps, busy s, wait s, wall s]

__all__ = ["HEADER", "INIT", "NOOP", "STEP", "STOP", "STATS", "Outbox", "receive", "recv_tensor"]


class Outbox:
    """Asynchronous sends whose tensors must outlive them: finished ones are dropped as new ones go.
    device: the communication device ("cuda" under NCCL, which takes device tensors and no tags)."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.pending: list[tuple[object, torch.Tensor]] = []

    def send(self, tensor: torch.Tensor, dst: int, tag: int, group=None) -> None:
        tensor = tensor.to(self.device).contiguous()
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]
        self.pending.append((dist.isend(tensor, dst, group=group, **_tag(self.device, tag)), tensor))

    def command(self, dsts, command: int, arg0: int = 0, arg1: int = 0) -> None:
        header = torch.tensor([command, 0, 0, 0, 0, 0, arg0, arg1], dtype=torch.int64)
        for dst in dsts:
            self.send(header, dst, META)

    def step(self, dsts, step: StepInput) -> None:
        header, payload = pack_step(step)
        header = torch.tensor(header, dtype=torch.int64)
        for dst in dsts:
            self.send(header, dst, META)
            self.send(payload, dst, META)


def _tag(device: torch.device, tag: int) -> dict:
    return {} if device.type == "cuda" else {"tag": tag}


def recv_tensor(shape, dtype, src: int, tag: int, device="cpu", group=None) -> torch.Tensor:
    """A tensor from rank `src` (on the communication device `device`)."""
    device = torch.device(device)
    t = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(t, src, group=group, **_tag(device, tag))
    return t


def post_recv(shape, dtype, src: int, tag: int, device="cpu", group=None) -> tuple[object, torch.Tensor]:
    """(the pending receive, its tensor): the data lands while the caller works; `wait()` before reading it."""
    device = torch.device(device)
    t = torch.empty(shape, dtype=dtype, device=device)
    return dist.irecv(t, src, group=group, **_tag(device, tag)), t


def receive(device="cpu") -> tuple[int, object]:
    """(command, its StepInput for STEP, (arg0, arg1) for INIT and STATS, else None) from rank 0."""
    header = recv_tensor(HEADER, torch.int64, 0, META, device).tolist()
    command = header[0]
    if command in (INIT, STATS):
        return command, (header[6], header[7])
    if command != STEP:
        return command, None
    return command, unpack_step(header, recv_tensor(payload_size(header), torch.int64, 0, META, device).cpu())
