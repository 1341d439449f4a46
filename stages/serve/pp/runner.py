"""Rank 0's pipeline runner (the engine submits micro-batches and collects their logits in order) and the
loop every other rank of a pipeline runs.

Each rank keeps a `StageClock`: the seconds it computed (busy) and the seconds it waited for its input
(rank 0: for the logits), which `llmopt profile` turns into each stage's bubble share.
"""
from __future__ import annotations

import time
from collections import deque

import torch

from ..batch import StepInput
from ..model import Runtime
from ..runner import ModelRunner
from ..tp.runner import RankFailure, RankLink
from . import comm
from .runtime import PipelineGroups, last_rank


class StageClock:
    """Steps run, seconds computing (busy) and waiting for input (wait) since the last reset."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.steps, self.busy, self.wait, self.start = 0, 0.0, 0.0, time.perf_counter()

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.steps, self.busy, self.wait, time.perf_counter() - self.start], dtype=torch.float64)


def stage_forward(runner: ModelRunner, step: StepInput, hidden: torch.Tensor | None, last: bool) -> torch.Tensor:
    """One step through a stage's layers: the residual stream to hand on, or on the last stage the logits."""
    x, residual = runner.run_layers(step, hidden=hidden)
    if last:
        return runner.runtime.compute_logits(x, residual, step.logits_indices)
    return Runtime.stream(x, residual)


class PipelineRunner(RankLink, ModelRunner):
    """ModelRunner on rank 0 of a pipeline: the engine `submit`s up to `pipeline_depth` steps, then `collect`s
    their logits in the order it submitted them. Rank 0 runs stage 0's layers itself, inside `submit`."""

    what = "pipeline"

    def __init__(self, runtime: Runtime, num_blocks: int, block_size: int, ranks, plan: dict,
                 groups: PipelineGroups, kv_dtype=None):
        ModelRunner.__init__(self, runtime, num_blocks, block_size, kv_dtype)
        self.plan, self.groups = plan, groups
        self.comm_device = ranks.comm_device
        self.others = list(range(1, plan["world_size"]))
        self.next_rank, self.last_rank = plan["tp"], last_rank(plan)
        self.outbox = comm.Outbox(self.comm_device)
        self.clock = StageClock()
        self._pending: deque = deque()  # each step in flight: (its logits' posted receive, their tensor), oldest first
        self.outbox.command(self.others, comm.INIT, num_blocks, block_size)
        self._link(ranks)

    def send_command(self, command: int) -> None:
        self.outbox.command(self.others, command)

    @property
    def pipeline_depth(self) -> int:
        """Micro-batches the engine keeps in flight: one per stage."""
        return self.plan["pp"]

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    @torch.inference_mode()
    def submit(self, step: StepInput) -> None:
        """Send `step` down the pipeline: its metadata to every rank, stage 0's output to stage 1."""
        with self._lock:
            self._check()
            start = time.perf_counter()
            try:
                self.outbox.step(self.others, step)
                stream = stage_forward(self, self.on_device(step), None, last=False)
                self.outbox.send(stream, self.next_rank, comm.HIDDEN)
                # the logits' receive is posted now: they arrive while this rank works on, not when it asks
                self._pending.append(comm.post_recv((int(step.logits_indices.shape[0]), self.vocab_size),
                                                    torch.float32, self.last_rank, comm.LOGITS, self.comm_device,
                                                    self.groups.returns))
            except RuntimeError as e:  # a send failed: name the rank if the monitor knows it
                raise self.ranks.explain(e) from e
            self.clock.steps += 1
            self.clock.busy += time.perf_counter() - start
            self._last = time.monotonic()

    @torch.inference_mode()
    def collect(self) -> torch.Tensor:
        """The fp32 logits [R, vocab] of the oldest step in flight (waits for the last stage)."""
        self._check()
        work, logits = self._pending.popleft()
        start = time.perf_counter()
        try:
            work.wait()
        except RuntimeError as e:
            raise self.ranks.explain(e) from e
        self.clock.wait += time.perf_counter() - start
        return logits.to(self.kv_cache.device)

    def execute(self, step: StepInput, fused: bool = True) -> torch.Tensor:
        """One step through the whole pipeline and back (nothing else in flight): warm-up and one-off callers."""
        if self._pending:
            raise RuntimeError("execute() with micro-batches in flight; collect them first")
        self.submit(step)
        return self.collect()

    def stage_clocks(self, reset: bool = False) -> list[dict]:
        """Every rank's clock ({rank, stage, steps, busy_s, wait_s, wall_s}), rank 0's first; nothing may be in
        flight. reset: start every clock again afterwards."""
        if self._pending:
            raise RuntimeError("stage_clocks() with micro-batches in flight")
        with self._lock:
            self._check()
            self.outbox.command(self.others, comm.STATS, int(reset))
            rows = [self.clock.as_tensor()]
            rows += [comm.recv_tensor(comm.CLOCK_FIELDS, torch.float64, r, comm.CLOCKS, self.comm_device)
                     for r in self.others]
            if reset:
                self.clock.reset()
        stage_of = {r: s["stage"] for s in self.plan["stages"] for r in s["ranks"]}
        return [{"rank": r, "stage": stage_of[r], "steps": int(c[0]), "busy_s": float(c[1]), "wait_s": float(c[2]),
                 "wall_s": float(c[3])} for r, c in enumerate(rows)]


def stage_loop(runtime: Runtime, plan: dict, rank: int, groups: PipelineGroups, comm_device) -> None:
    """A rank other than 0: build the KV cache rank 0 sized, then run every step it sends until STOP."""
    from ...shard.pipeline import stage_of_rank, tp_index

    command, args = comm.receive(comm_device)
    if command == comm.STOP:
        return
    if command != comm.INIT:
        raise RankFailure(f"protocol error: expected INIT from rank 0, got command {command}")
    runner = ModelRunner(runtime, *args)
    stage, tp = stage_of_rank(plan, rank), plan["tp"]
    first, last = stage["stage"] == 0, stage["stage"] == plan["pp"] - 1
    sends_logits = last and tp_index(plan, rank) == 0
    outbox, clock = comm.Outbox(comm_device), StageClock()
    hidden_size, dtype = runtime.spec.hidden_size, runtime.dtype
    with torch.inference_mode():
        while True:
            waited = time.perf_counter()
            command, step = comm.receive(comm_device)
            if command == comm.STOP:
                return
            if command == comm.STATS:
                outbox.send(clock.as_tensor(), 0, comm.CLOCKS)
                if step[0]:  # reset, in STATS's first argument
                    clock.reset()
                continue
            if command != comm.STEP:
                continue
            hidden = None if first else comm.recv_tensor((step.token_ids.shape[0], hidden_size), dtype, rank - tp,
                                                         comm.HIDDEN, comm_device)
            start = time.perf_counter()
            clock.wait += start - waited
            out = stage_forward(runner, runner.on_device(step), None if hidden is None else hidden.to(runtime.device),
                                last)
            if not last:
                outbox.send(out, rank + tp, comm.HIDDEN)
            elif sends_logits:
                outbox.send(out, 0, comm.LOGITS, groups.returns)
            clock.steps += 1
            clock.busy += time.perf_counter() - start
